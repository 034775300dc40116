"""What a job keeps on each host, where, and how it goes: the one owner of those paths.

    /tmp/mtrain-job-<id>/                0700: the job's folder (hosts whose /tmp is shared share it)
        <host>.g<N>.json                 generation N's layout for the ranks (records.job_layout.JobLayout)
        <host>.g<N>.updates              an elastic job's host-set version (records.elastic.HostUpdates)
        <host>.g<N>.prted/               Open MPI's daemon's session folder, on a remote host
        <host>.g<N>.rank<R>/             rank R's wrapper's scratch (its error file)
    /dev/shm/mtrain-job-<id>/<host>.g<N>/  Open MPI's shared-memory segments (btl_sm_backing_directory)

$MTRAIN_JOB_FILE is the layout's path with "{host}" for the host's name; every other path
follows from it.  Everything is made private (bindings/common/private.py).  Each generation of an
elastic job has its own names: the remote guard of the generation that ended may still be
stopping its daemon while the next generation's starts on the same host.  A host's entries
of a generation go when its part of that generation ends (the remote guard removes them, or
the launcher on its own host), and entries of earlier generations go when a later one starts
there (what a killed host left behind: Open MPI leaves its segments when a rank is killed);
each folder goes with its last entry.  An elastic job's snapshots live elsewhere
(/dev/shm/mtrain-elastic-<id>/), since they outlive generations.
"""
from __future__ import annotations

import os
import re
import sys

from mtrain.common.private import PrivatePathError, check_private, private_folder

JOB_FOLDER_PARENT = "/tmp"  # exists on every Linux host
SHARED_MEMORY_PARENT = "/dev/shm" if os.path.isdir("/dev/shm") else JOB_FOLDER_PARENT
_LAYOUT = re.compile(r"\{host\}\.g(\d+)\.json")


def template(job_id: str, generation: int = 0) -> str:
    """The job's $MTRAIN_JOB_FILE for one generation (0 for a job that is not elastic)."""
    return os.path.join(JOB_FOLDER_PARENT, f"mtrain-job-{job_id}", f"{{host}}.g{int(generation)}.json")


def _folder(job_file: str) -> str:
    return os.path.dirname(job_file)


def _generation(job_file: str) -> int:
    found = _LAYOUT.fullmatch(os.path.basename(job_file))
    if found is None:
        raise ValueError(f"not a job file template of mtrain's: {job_file!r}")
    return int(found.group(1))


def layout(job_file: str, host: str) -> str:
    return job_file.format(host=host)


def _entry(job_file: str, host: str, suffix: str) -> str:
    return os.path.join(_folder(job_file), f"{host}.g{_generation(job_file)}{suffix}")


def shared_memory_path(job_file: str, host: str) -> str:
    """Where `shared_memory_folder` makes its folder (nothing is made here)."""
    return os.path.join(SHARED_MEMORY_PARENT, os.path.basename(_folder(job_file)), f"{host}.g{_generation(job_file)}")


def _fresh(path: str) -> str:
    """`path` as a new, empty private folder (what an earlier one left there removed first)."""
    private_folder(os.path.dirname(path))
    if os.path.lexists(path):  # inside a folder of ours: only we could have made it
        import shutil  # (not on every rank wrapper's start, where there is nothing to remove)
        shutil.rmtree(path, ignore_errors=True)
    return private_folder(path, parents=1)  # (the job's folder made again if another host removed it)


def daemon_session(job_file: str, host: str) -> str:
    """A new private folder for Open MPI's daemon on `host` (PRRTE opens its own one to all)."""
    return _fresh(_entry(job_file, host, ".prted"))


def rank_scratch(job_file: str, host: str, rank: int) -> str:
    """A new private folder for rank `rank`'s wrapper on `host`."""
    return _fresh(_entry(job_file, host, f".rank{rank}"))


def shared_memory_folder(job_file: str, host: str) -> str:
    """The private folder where Open MPI puts the shared-memory segments of the job's ranks on
    `host` (made if needed: every rank of the host asks for it)."""
    return private_folder(shared_memory_path(job_file, host), parents=1)


def remove_host(job_file: str, host: str, earlier: bool = False) -> None:
    """Remove what this generation of the job keeps on `host` (with `earlier`, what earlier
    generations left there instead), and each folder once it is empty; never what is not ours
    (a folder another user made at the job's path is left alone, as it was refused)."""
    now = _generation(job_file)
    # This host's entries (and write_private's temporaries), not another host's in a shared /tmp.
    ours = re.compile(re.escape(host) + r"\.g(\d+)(\.(json|updates|prted|rank\d+)(\.\d+\.tmp)?)?")

    def wanted(name: str) -> bool:
        found = ours.fullmatch(name)
        return found is not None and (int(found.group(1)) < now if earlier else int(found.group(1)) == now)

    for parent in (_folder(job_file), os.path.dirname(shared_memory_path(job_file, host))):
        try:
            check_private(parent, os.lstat(parent), "folder")
            names = os.listdir(parent)
        except (FileNotFoundError, PrivatePathError):
            continue
        for name in filter(wanted, names):
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
    """`python -m mtrain.launcher.job.job_files remove-folder TEMPLATE`: what the elastic driver runs on
    each host a job used, at the job's end, for the snapshots there ("{host}": this host's name)."""
    if len(argv) != 2 or argv[0] != "remove-folder" or "{host}" not in argv[1]:
        print("usage: python -m mtrain.launcher.job.job_files remove-folder TEMPLATE-WITH-{host}", file=sys.stderr)
        return 2
    remove_folder(argv[1], os.uname().nodename)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
