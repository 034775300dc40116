"""A host's snapshot of the last committed elastic state: one file, written atomically.

Every rank holds the same committed state, so one file per host is enough: local rank 0
writes it (``state.commit()``), every rank of the next generation may read it.

    <folder>/state.snapshot

    mtrain-elastic-snapshot {"commit": 12, "size": 4, "time": 1790000000.0}\\n   (one header line)
    <pickle of the state's committed values>                                   (the rest)

The header comes first so that a new generation can learn which commit each host
holds without unpickling a model; only the rank chosen as the source reads the rest.
A write goes to a temporary file beside it and is moved into place with
``os.replace``: a rank killed mid-write (its host lost) leaves the previous snapshot.
"""
from __future__ import annotations

import dataclasses
import glob
import json
import os
import pickle
import time
from typing import Any

from mtrain.launcher.private import check_private, open_private, private_folder, write_private

FILE_NAME = "state.snapshot"
MAGIC = b"mtrain-elastic-snapshot "
_HEADER_LIMIT = 4096


@dataclasses.dataclass(frozen=True)
class SnapshotHeader:
    commit: int   # the commit counter (0 for a state's first commit)
    size: int     # how many ranks the job had when it was committed
    time: float


def path_in(folder: str) -> str:
    return os.path.join(folder, FILE_NAME)


def write(folder: str, header: SnapshotHeader, payload: Any) -> str:
    """Write the snapshot into `folder` (it and its parent, the job's folder, made private if
    needed), replacing the previous one."""
    private_folder(os.path.dirname(folder))
    private_folder(folder)
    target = path_in(folder)
    data = MAGIC + json.dumps(dataclasses.asdict(header)).encode() + b"\n"
    data += pickle.dumps(payload, protocol=pickle.HIGHEST_PROTOCOL)
    # Mode 0600 in a 0700 folder of ours; readers see the old snapshot or the new one, never half.
    write_private(target, data, sync=True)
    return target


def _header_of(handle) -> "SnapshotHeader | None":
    line = handle.readline(_HEADER_LIMIT)
    if not line.startswith(MAGIC) or not line.endswith(b"\n"):
        return None
    try:
        data = json.loads(line[len(MAGIC):])
        return SnapshotHeader(commit=int(data["commit"]), size=int(data["size"]), time=float(data["time"]))
    except (ValueError, KeyError, TypeError):
        return None


def _open(folder: str):
    """The snapshot file, opened only from a folder and as a file that are ours and private (a
    planted one raises PrivatePathError, loud, rather than being unpickled); None when there is none."""
    try:
        check_private(folder, os.lstat(folder), "folder")
    except FileNotFoundError:
        return None
    try:
        return open_private(path_in(folder))
    except FileNotFoundError:
        return None


def read_header(folder: str) -> "SnapshotHeader | None":
    """The header of the snapshot in `folder`, or None when there is none (or not one of ours)."""
    handle = _open(folder)
    if handle is None:
        return None
    with handle:
        return _header_of(handle)


def read(folder: str) -> "tuple[SnapshotHeader, Any] | None":
    """The header and the committed values of the snapshot in `folder`, or None."""
    handle = _open(folder)
    if handle is None:
        return None
    with handle:
        header = _header_of(handle)
        if header is None:
            return None
        try:
            return header, pickle.load(handle)
        except (pickle.UnpicklingError, EOFError):
            return None


def remove_leftovers(folder: str) -> None:
    """Remove temporary files that writers killed mid-write left behind."""
    for leftover in glob.glob(path_in(folder) + ".*.tmp"):
        try:
            os.remove(leftover)
        except OSError:
            pass


def new_header(commit: int, size: int) -> SnapshotHeader:
    return SnapshotHeader(commit=commit, size=size, time=time.time())
