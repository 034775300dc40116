"""Files and folders that mtrain leaves in shared places (/tmp, /dev/shm), kept private.

Other users log in to the hosts our users train on, and the names mtrain uses there
can be read from `ps` (the job id is on mpirun's command line).  A name alone is no
protection, so:

* nothing is put straight into the shared place: every file goes into a folder of the
  job's own (`/tmp/mtrain-job-<id>/`, `/dev/shm/mtrain-elastic-<id>/<host>/`);
* a folder is made with `mkdir(path, 0o700)`; one that is already there is used only
  if it is a real folder (not a symlink), owned by this user, with no group or other
  permissions: anything else is refused, never followed, read or reused;
* a file is written, inside such a folder, to a temporary name opened with
  `O_CREAT | O_EXCL | O_NOFOLLOW`, mode 0600, then renamed over the target;
* a file is read only from such a folder, through `O_NOFOLLOW`, and only if what was
  opened is a regular file owned by this user that nobody else may write.

`PrivatePathError` is the one-line refusal: the path, its owner and mode, what to do.
"""
from __future__ import annotations

import os
import pwd
import stat

_CREATE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
_READ = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)


class PrivatePathError(OSError):
    """A path mtrain would use belongs to someone else, is a symlink, or is open to others."""


def _owner(uid: int) -> str:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return f"uid {uid}"


def _refusal(path: str, info: os.stat_result, problem: str) -> PrivatePathError:
    return PrivatePathError(
        f"mtrain: refusing {path}: {problem} (owner {_owner(info.st_uid)}, mode {stat.filemode(info.st_mode)}); "
        f"mtrain only uses what this user ({_owner(os.geteuid())}) made private; remove it or ask its owner to")


def _cannot_make(path: str) -> PrivatePathError:
    parent = os.path.dirname(path) or "."
    try:
        info = os.stat(parent)
        found = f"owner {_owner(info.st_uid)}, mode {stat.filemode(info.st_mode)}"
    except OSError as error:
        found = error.strerror or "cannot be read"
    return PrivatePathError(
        f"mtrain: cannot make {path}: this user ({_owner(os.geteuid())}) may not create folders in {parent} "
        f"({found}); make {parent} writable for this user (a shared temporary folder is mode drwxrwxrwt, "
        "with no ACL entry that narrows it), or ask the host's administrator")


def temporary_folder() -> str:
    """The folder `tempfile` makes this user's temporary files in; PrivatePathError in one line,
    saying what to do, when no candidate ($TMPDIR, /tmp, /var/tmp, ...) is writable."""
    import tempfile
    try:
        return tempfile.gettempdir()
    except FileNotFoundError:
        tried = os.environ.get("TMPDIR")
        raise PrivatePathError(
            f"mtrain: no folder for temporary files is writable for this user ({_owner(os.geteuid())}): "
            + (f"not TMPDIR={tried}, " if tried else "")
            + "not /tmp, /var/tmp or the current folder; set TMPDIR to a folder this user can write to") from None


def check_private(path: str, info: os.stat_result, kind: str) -> None:
    """Raise PrivatePathError unless `info` (an lstat/fstat of `path`) is ours, of `kind`, and closed to others."""
    wanted = stat.S_ISDIR if kind == "folder" else stat.S_ISREG
    if stat.S_ISLNK(info.st_mode):
        raise _refusal(path, info, "it is a symlink")
    if not wanted(info.st_mode):
        raise _refusal(path, info, f"it is not a {kind}")
    if info.st_uid != os.geteuid():
        raise _refusal(path, info, "it belongs to another user")
    if info.st_mode & (0o077 if kind == "folder" else 0o022):
        raise _refusal(path, info, "other users may use it")


# How many times a folder that went away while we were making it, or putting a file in it, is
# made again: on hosts that share /tmp (or /dev/shm), another host's part of the job removes the
# job's folder once it is empty, which it may be for a moment while this host starts.
REMADE = 20


def private_folder(path: str, parents: int = 0) -> str:
    """`path` as a folder only this user can use: made with mode 0700, or checked if it is there;
    with `parents`, that many folders above it are made (or checked) the same way first, and
    made again if another host's cleanup removes one, empty, in between."""
    for _ in range(REMADE):
        if parents:
            private_folder(os.path.dirname(path), parents - 1)
        try:
            os.mkdir(path, 0o700)
        except FileExistsError:
            pass  # another rank on this host, or an earlier generation, made it: checked below
        except FileNotFoundError:
            if not parents:
                raise
            continue  # the folder above went, empty, as we made this one: make both again
        except PermissionError:
            raise _cannot_make(path) from None
        try:
            info = os.lstat(path)
        except FileNotFoundError:
            continue  # removed, empty, by another host's cleanup as soon as it was made
        check_private(path, info, "folder")
        return path
    raise FileNotFoundError(f"mtrain: {path} was removed {REMADE} times as it was made")


def write_private(path: str, data: bytes, sync: bool = False) -> None:
    """Replace `path` with `data`, mode 0600, in a folder of ours (made if needed, and again if
    another host's cleanup removes it, empty, before the file is in it); readers see the old
    file or the new one, never half."""
    temporary = f"{path}.{os.getpid()}.tmp"
    for attempt in range(REMADE):
        private_folder(os.path.dirname(path))
        try:
            fd = os.open(temporary, _CREATE, 0o600)
            break
        except FileNotFoundError:
            if attempt == REMADE - 1:
                raise
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            if sync:
                handle.flush()
                os.fsync(handle.fileno())
        os.replace(temporary, path)
    except BaseException:
        try:
            os.unlink(temporary)
        except OSError:
            pass
        raise


def open_private(path: str):
    """`path` opened for reading (binary), only if it is our own regular file that others cannot
    write, in a folder of ours that others cannot use; FileNotFoundError when either is missing."""
    folder = os.path.dirname(path)
    check_private(folder, os.lstat(folder), "folder")
    fd = os.open(path, _READ)
    try:
        check_private(path, os.fstat(fd), "file")
    except BaseException:
        os.close(fd)
        raise
    return os.fdopen(fd, "rb")


def read_private(path: str) -> bytes:
    with open_private(path) as handle:
        return handle.read()


def remove_private(path: str) -> None:
    """Remove `path` (if there) and then its folder, once nothing else is left in it."""
    for remove, target in ((os.unlink, path), (os.rmdir, os.path.dirname(path))):
        try:
            remove(target)
        except FileNotFoundError:
            pass
        except OSError:  # a folder still holding another host's or rank's files: theirs to remove
            return
