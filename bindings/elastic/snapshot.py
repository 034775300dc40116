"""A host's snapshot of the last committed elastic state: one file, written atomically.

Every rank holds the same committed state, so one file per host is enough: local rank 0
writes it (``state.commit()``), every rank of the next generation may read it.

    <folder>/state.snapshot

    mtrain-elastic-snapshot <MAC> {"commit": 12, "size": 4, "time": 1790000000.0, "sha256": "…"}\\n
    <pickle of the state's committed values>

The header line comes first so that a new generation can learn which commit each host
holds without unpickling a model; only the rank chosen as the source reads the rest.
A write goes to a temporary file beside it and is moved into place with
``os.replace``: a rank killed mid-write (its host lost) leaves the previous snapshot.

A snapshot is unpickled only when it is ours twice over: its folder and file belong to
this user and nobody else may use them (bindings/common/private.py), and its MAC, an HMAC-SHA256
of the header under the job's secret key (the header holds the payload's SHA-256), is
right.  The key is made by the launcher for each job and reaches the ranks only in their
environment ($MTRAIN_JOB_SECRET, never on a command line: see mtrain.common.records.elastic), so a
snapshot another job wrote, or one changed since, is refused with ``SnapshotRejected``.
"""
from __future__ import annotations

import dataclasses
import glob
import hashlib
import hmac
import json
import os
import pickle
import time
from typing import Any

from mtrain.common.private import check_private, open_private, private_folder, write_private

FILE_NAME = "state.snapshot"
MAGIC = b"mtrain-elastic-snapshot "
_HEADER_LIMIT = 4096


class SnapshotRejected(RuntimeError):
    """A snapshot whose MAC is wrong (another job's, or changed since it was written): never loaded."""


@dataclasses.dataclass(frozen=True)
class SnapshotHeader:
    commit: int   # the commit counter (0 for a state's first commit)
    size: int     # how many ranks the job had when it was committed
    time: float
    sha256: str = ""  # of the payload that follows the header


def path_in(folder: str) -> str:
    return os.path.join(folder, FILE_NAME)


def _mac(key: bytes, header: bytes) -> bytes:
    return hmac.new(key, header, hashlib.sha256).hexdigest().encode()


def write(folder: str, header: SnapshotHeader, payload: Any, key: bytes) -> str:
    """Write the snapshot into `folder` (it and its parent, the job's folder, made private if
    needed), signed with the job's `key`, replacing the previous one."""
    private_folder(folder, parents=1)
    target = path_in(folder)
    body = pickle.dumps(payload, protocol=pickle.HIGHEST_PROTOCOL)
    header = dataclasses.replace(header, sha256=hashlib.sha256(body).hexdigest())
    text = json.dumps(dataclasses.asdict(header)).encode()
    # Mode 0600 in a 0700 folder of ours; readers see the old snapshot or the new one, never half.
    write_private(target, MAGIC + _mac(key, text) + b" " + text + b"\n" + body, sync=True)
    return target


def _header_of(handle, key: bytes, path: str) -> "SnapshotHeader | None":
    """The header, None when the file is no snapshot (a writer's format from before, say);
    SnapshotRejected when its MAC is wrong."""
    line = handle.readline(_HEADER_LIMIT)
    if not line.startswith(MAGIC) or not line.endswith(b"\n"):
        return None
    mac, _, text = line[len(MAGIC):-1].partition(b" ")
    if not hmac.compare_digest(mac, _mac(key, text)):
        raise SnapshotRejected(f"mtrain: refusing the elastic snapshot {path}: it is not signed with this job's "
                               "key (another job wrote it, or it was changed since); it was not loaded: remove it")
    try:
        data = json.loads(text)
        return SnapshotHeader(commit=int(data["commit"]), size=int(data["size"]), time=float(data["time"]),
                              sha256=str(data["sha256"]))
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


def read_header(folder: str, key: bytes) -> "SnapshotHeader | None":
    """The header of the snapshot in `folder`, or None when there is none (SnapshotRejected, or
    PrivatePathError, when there is one that is not this job's)."""
    handle = _open(folder)
    if handle is None:
        return None
    with handle:
        return _header_of(handle, key, path_in(folder))


def read(folder: str, key: bytes) -> "tuple[SnapshotHeader, Any] | None":
    """The header and the committed values of the snapshot in `folder`, or None when there is none
    (SnapshotRejected, or PrivatePathError, when there is one that is not this job's)."""
    handle = _open(folder)
    if handle is None:
        return None
    with handle:
        header = _header_of(handle, key, path_in(folder))
        if header is None:
            return None
        body = handle.read()
    if not hmac.compare_digest(hashlib.sha256(body).hexdigest(), header.sha256):
        raise SnapshotRejected(f"mtrain: refusing the elastic snapshot {path_in(folder)}: its contents do not "
                               "match its signed header (changed since it was written); it was not loaded: remove it")
    return header, pickle.loads(body)


def remove_leftovers(folder: str) -> None:
    """Remove temporary files that writers killed mid-write left behind."""
    for leftover in glob.glob(path_in(folder) + ".*.tmp"):
        try:
            os.remove(leftover)
        except OSError:
            pass


def new_header(commit: int, size: int) -> SnapshotHeader:
    return SnapshotHeader(commit=commit, size=size, time=time.time())
