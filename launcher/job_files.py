"""What a job keeps on each host, where, and how it goes: the one owner of those paths.

    /tmp/mtrain-job-<id>/               0700: the job's folder (hosts whose /tmp is shared share it)
        <host>.json                     the job's layout for the ranks (records.JobLayout)
        <host>.updates                  an elastic job's host-set version (records.HostUpdates)
        <host>.prted/                   Open MPI's daemon's session folder, on a remote host
        <host>.rank<N>/                 rank N's wrapper's scratch (its error file)
    /dev/shm/mtrain-job-<id>/<host>/    Open MPI's shared-memory segments (btl_sm_backing_directory)

$MTRAIN_JOB_FILE is the layout's path with "{host}" for the host's name; every other path
follows from it.  Everything is made private (launcher/private.py).  A host's entries go when
its part of a generation ends (the remote guard removes them, or the launcher on its own host)
and before a new part starts there (what a killed host left behind: Open MPI leaves its
segments when a rank is killed); each folder goes with its last entry.  An elastic job's
snapshots live elsewhere (/dev/shm/mtrain-elastic-<id>/), since they outlive generations.
"""
from __future__ import annotations

import os
import re
import sys

from mtrain.launcher.private import PrivatePathError, check_private, private_folder

JOB_FOLDER_PARENT = "/tmp"  # exists on every Linux host
SHARED_MEMORY_PARENT = "/dev/shm" if os.path.isdir("/dev/shm") else JOB_FOLDER_PARENT


def template(job_id: str) -> str:
    """The job's $MTRAIN_JOB_FILE."""
    return os.path.join(JOB_FOLDER_PARENT, f"mtrain-job-{job_id}", "{host}.json")


def _folder(job_file: str) -> str:
    return os.path.dirname(job_file)


def layout(job_file: str, host: str) -> str:
    return job_file.format(host=host)


def _entry(job_file: str, host: str, suffix: str) -> str:
    return os.path.join(_folder(job_file), f"{host}{suffix}")


def _shared_memory(job_file: str, host: str) -> str:
    return os.path.join(SHARED_MEMORY_PARENT, os.path.basename(_folder(job_file)), host)


def _fresh(path: str) -> str:
    """`path` as a new, empty private folder (what an earlier one left there removed first)."""
    private_folder(os.path.dirname(path))
    if os.path.lexists(path):  # inside a folder of ours: only we could have made it
        import shutil  # (not on every rank wrapper's start, where there is nothing to remove)
        shutil.rmtree(path, ignore_errors=True)
    return private_folder(path)


def daemon_session(job_file: str, host: str) -> str:
    """A new private folder for Open MPI's daemon on `host` (PRRTE opens its own one to all)."""
    return _fresh(_entry(job_file, host, ".prted"))


def rank_scratch(job_file: str, host: str, rank: int) -> str:
    """A new private folder for rank `rank`'s wrapper on `host`."""
    return _fresh(_entry(job_file, host, f".rank{rank}"))


def shared_memory_folder(job_file: str, host: str) -> str:
    """The private folder where Open MPI puts the shared-memory segments of the job's ranks on
    `host` (made if needed: every rank of the host asks for it)."""
    path = _shared_memory(job_file, host)
    private_folder(os.path.dirname(path))
    return private_folder(path)


def remove_host(job_file: str, host: str) -> None:
    """Remove what the job keeps on `host`, and each folder once it is empty; never what is not
    ours (a folder another user made at the job's path is left alone, as it was refused)."""
    folder = _folder(job_file)
    # This host's entries (and write_private's temporaries), not another host's in a shared /tmp.
    ours = re.compile(re.escape(host) + r"\.(json|updates|prted|rank\d+)(\.\d+\.tmp)?")
    for parent, entries in ((folder, None), (os.path.dirname(_shared_memory(job_file, host)), [host])):
        try:
            check_private(parent, os.lstat(parent), "folder")
        except (FileNotFoundError, PrivatePathError):
            continue
        for name in entries if entries is not None else os.listdir(parent):
            if entries is None and not ours.fullmatch(name):
                continue
            path = os.path.join(parent, name)
            if os.path.isdir(path) and not os.path.islink(path):
                import shutil
                shutil.rmtree(path, ignore_errors=True)
            else:
                try:
                    os.unlink(path)
                except FileNotFoundError:
                    pass
        try:
            os.rmdir(parent)
        except OSError:  # another host's or generation's entries are still there: theirs to remove
            pass


def remove_folder(template: str, host: str) -> None:
    """Remove `template`'s folder for `host` ("{host}" in it), if it is a folder of ours (a path
    another user made is left alone), then the folder above it once it is empty."""
    path = template.format(host=host)
    try:
        check_private(path, os.lstat(path), "folder")
    except (FileNotFoundError, PrivatePathError):
        pass
    else:
        import shutil
        shutil.rmtree(path, ignore_errors=True)
    try:
        os.rmdir(os.path.dirname(path))
    except OSError:  # another host's folder is still there (a shared /dev/shm), or it is not ours
        pass


def main(argv: "list[str]") -> int:
    """`python -m mtrain.launcher.job_files remove-folder TEMPLATE`: what the elastic driver runs on
    each host a job used, at the job's end, for the snapshots there ("{host}": this host's name)."""
    if len(argv) != 2 or argv[0] != "remove-folder" or "{host}" not in argv[1]:
        print("usage: python -m mtrain.launcher.job_files remove-folder TEMPLATE-WITH-{host}", file=sys.stderr)
        return 2
    remove_folder(argv[1], os.uname().nodename)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
