"""Collective operations on NumPy arrays: validation, agreement across ranks, execution.

Every collective starts with one tiny all-gather of a fixed-size metadata
record (which collective, dtype, op, root, shape). That is the cheap check the
house style asks for: a rank that passes a different size, dtype, op or even a
different collective gets an error on *every* rank naming what each one
passed, instead of a hang or garbage. It also hands allgather and alltoall the
per-rank sizes they need.
"""
from __future__ import annotations

import enum
import math
import pickle
import zlib
from typing import Any, Sequence

import numpy as np
from mpi4py import MPI

from . import ring
from .backend import NumpyBackend, backend_for
from .errors import MismatchError
from .ops import ReduceOp, check_op, check_reducible, dtype_code


class Kind(enum.IntEnum):
    ALLREDUCE = 1
    ALLGATHER = 2
    BROADCAST = 3
    REDUCESCATTER = 4
    ALLTOALL = 5
    BARRIER = 6
    BROADCAST_OBJECT = 7
    ALLGATHER_OBJECT = 8


# Fields of the metadata record.
_KIND, _DTYPE, _OP, _ROOT, _FIRST, _NDIM, _TRAIL, _SHAPE = range(8)
_FIELDS = 8
_NO_ARRAY = -1


def _shape_hash(shape: Sequence[int]) -> int:
    return zlib.crc32(np.asarray(shape, dtype=np.int64).tobytes())


def _record(kind: Kind, array: "np.ndarray | None", op: int = -1, root: int = -1) -> np.ndarray:
    rec = np.full(_FIELDS, _NO_ARRAY, dtype=np.int64)
    rec[_KIND], rec[_OP], rec[_ROOT] = int(kind), op, root
    if array is not None:
        rec[_DTYPE] = dtype_code(array.dtype)
        rec[_NDIM] = array.ndim
        rec[_FIRST] = array.shape[0] if array.ndim else 1
        rec[_TRAIL] = _shape_hash(array.shape[1:])
        rec[_SHAPE] = _shape_hash(array.shape)
    return rec


def _describe(kind: Kind, array: "np.ndarray | None", op: int, root: int, name: "str | None") -> str:
    text = kind.name.lower()
    if name:
        text += f" {name!r}"
    if array is not None:
        text += f" {array.dtype}{list(array.shape)}"
    if op >= 0:
        text += f" op={ReduceOp(op).name}"
    if root >= 0:
        text += f" root_rank={root}"
    return text


def agree(comm: MPI.Comm, kind: Kind, array: "np.ndarray | None" = None, op: int = -1,
          root: int = -1, name: "str | None" = None, same: Sequence[int] = ()) -> np.ndarray:
    """Exchange metadata records; raise MismatchError on every rank if any field in
    ``same`` (besides the collective kind) differs. Returns the (size, fields) records."""
    mine = _record(kind, array, op, root)
    records = np.empty((comm.Get_size(), _FIELDS), dtype=np.int64)
    comm.Allgather(mine, records)
    fields = [_KIND, *same]
    if np.all(records[:, fields] == records[0, fields]):
        return records
    # Every rank saw the same records, so every rank takes this path together.
    descriptions = comm.allgather(_describe(kind, array, op, root, name))
    lines = "; ".join(f"rank {r}: {d}" for r, d in enumerate(descriptions))
    raise MismatchError(f"ranks disagree on a collective call ({lines}); every rank must make the "
                        f"same call with the same dtype, op, root and shape")


class Executor:
    """Runs collectives on a communicator. One instance per initialised runtime."""

    def __init__(self, comm: MPI.Comm, segment_bytes: int, small_bytes: int) -> None:
        self.comm = comm
        self.size = comm.Get_size()
        self.rank = comm.Get_rank()
        self.segment_bytes = segment_bytes
        self.small_bytes = small_bytes

    # -- all-reduce ---------------------------------------------------------
    def allreduce_flat(self, flats: "list[np.ndarray]", op: ReduceOp, backend: NumpyBackend,
                       prescale_factor: float = 1.0, postscale_factor: float = 1.0) -> None:
        """One ring over already-agreed contiguous buffers (as one logical buffer), with scaling."""
        for flat in flats:
            backend.scale(flat, prescale_factor)
        ring.allreduce(self.comm, flats[0] if len(flats) == 1 else ring.Layout(flats), op, backend,
                       self.segment_bytes, self.small_bytes, postscale_factor)

    # -- reduce-scatter -----------------------------------------------------
    def reducescatter(self, array: np.ndarray, op: ReduceOp, name: "str | None" = None) -> np.ndarray:
        """Reduce across ranks, then rank r keeps rows r of the first dimension split N ways
        (the first ``rows % N`` ranks get one extra row)."""
        backend = backend_for(array)
        op = check_op(op)
        check_reducible(array.dtype, op)
        if array.ndim == 0:
            raise ValueError("reducescatter needs an array with at least one dimension to split")
        agree(self.comm, Kind.REDUCESCATTER, array, int(op), name=name,
              same=(_DTYPE, _OP, _SHAPE, _NDIM))
        work = array.copy(order="C").reshape(-1)
        row = math.prod(array.shape[1:])
        # Chunks fall on row boundaries: rank r's chunk is its share of the rows.
        row_bounds = ring.even_bounds(array.shape[0], self.size)
        ring.reduce_scatter(self.comm, work, op, backend, self.segment_bytes,
                            [(lo * row, hi * row) for lo, hi in row_bounds])
        lo, hi = row_bounds[self.rank]
        result = work[lo * row:hi * row].reshape((hi - lo,) + array.shape[1:]).copy()
        if op == ReduceOp.Average:
            backend.divide(result.reshape(-1), self.size)
        return result

    # -- all-gather ---------------------------------------------------------
    def allgather(self, array: np.ndarray, name: "str | None" = None) -> np.ndarray:
        """Concatenate every rank's array along the first dimension (which may differ)."""
        backend = backend_for(array)
        if array.ndim == 0:
            array = array.reshape(1)
        records = agree(self.comm, Kind.ALLGATHER, array, name=name, same=(_DTYPE, _NDIM, _TRAIL))
        firsts = [int(n) for n in records[:, _FIRST]]
        row = math.prod(array.shape[1:])
        offsets = np.concatenate([[0], np.cumsum(firsts)]).astype(int) * row
        out = backend.empty(sum(firsts) * row, array.dtype).reshape((sum(firsts),) + array.shape[1:])
        flat = out.reshape(-1)
        lo, hi = int(offsets[self.rank]), int(offsets[self.rank + 1])
        flat[lo:hi] = array.reshape(-1)
        bounds = [(int(offsets[r]), int(offsets[r + 1])) for r in range(self.size)]
        ring.allgather(self.comm, flat, bounds, backend)
        return out

    # -- broadcast ----------------------------------------------------------
    def broadcast(self, array: np.ndarray, root_rank: int, out: "np.ndarray | None" = None,
                  name: "str | None" = None) -> np.ndarray:
        """Every rank ends with root's values (into ``out``: new array when None, may be ``array``)."""
        backend = backend_for(array)
        self._check_root(root_rank)
        agree(self.comm, Kind.BROADCAST, array, root=root_rank, name=name,
              same=(_DTYPE, _SHAPE, _NDIM, _ROOT))
        if out is None:
            out = array.copy(order="C")
        elif out is not array:
            backend.copy(out, array)
        flat, copied = backend.flatten(out)
        if flat.size:
            backend.bcast(self.comm, flat, root_rank)
        if copied:
            backend.copy(out, flat.reshape(out.shape))
        return out

    # -- all-to-all ---------------------------------------------------------
    def alltoall(self, array: np.ndarray, splits: "Sequence[int] | None" = None,
                 name: "str | None" = None) -> "tuple[np.ndarray, np.ndarray]":
        """Send rows ``splits[r]`` of ``array`` to rank r; returns (received, received_splits)."""
        backend_for(array)
        if array.ndim == 0:
            raise ValueError("alltoall needs an array with at least one dimension to split")
        first = array.shape[0]
        if splits is None:
            if first % self.size:
                raise ValueError(f"alltoall without splits needs the first dimension ({first}) to be "
                                 f"divisible by the number of ranks ({self.size}); pass splits=")
            send_splits = np.full(self.size, first // self.size, dtype=np.int64)
        else:
            send_splits = np.asarray(splits, dtype=np.int64).reshape(-1)
            if send_splits.size != self.size or np.any(send_splits < 0) or send_splits.sum() != first:
                raise ValueError(f"alltoall splits must be {self.size} non-negative integers summing to "
                                 f"the first dimension ({first}); got {send_splits.tolist()}")
        agree(self.comm, Kind.ALLTOALL, array, name=name, same=(_DTYPE, _NDIM, _TRAIL))
        recv_splits = np.empty(self.size, dtype=np.int64)
        self.comm.Alltoall(send_splits, recv_splits)
        row_bytes = math.prod(array.shape[1:]) * array.itemsize
        out = np.empty((int(recv_splits.sum()),) + array.shape[1:], dtype=array.dtype)
        send = np.ascontiguousarray(array).reshape(-1).view(np.uint8)
        send_counts, recv_counts = send_splits * row_bytes, recv_splits * row_bytes
        send_displ = np.concatenate([[0], np.cumsum(send_counts)[:-1]])
        recv_displ = np.concatenate([[0], np.cumsum(recv_counts)[:-1]])
        self.comm.Alltoallv([send, (send_counts, send_displ), MPI.BYTE],
                            [out.reshape(-1).view(np.uint8), (recv_counts, recv_displ), MPI.BYTE])
        return out, recv_splits

    # -- control and objects ------------------------------------------------
    def barrier(self) -> None:
        # The metadata exchange is itself a barrier, and it catches a rank that
        # is in a different collective instead of deadlocking against it.
        agree(self.comm, Kind.BARRIER)

    def broadcast_object(self, obj: Any, root_rank: int = 0, name: "str | None" = None) -> Any:
        self._check_root(root_rank)
        agree(self.comm, Kind.BROADCAST_OBJECT, root=root_rank, name=name, same=(_ROOT,))
        payload = pickle.dumps(obj) if self.rank == root_rank else None
        return pickle.loads(self.comm.bcast(payload, root=root_rank))

    def allgather_object(self, obj: Any, name: "str | None" = None) -> list:
        agree(self.comm, Kind.ALLGATHER_OBJECT, name=name)
        return [pickle.loads(p) for p in self.comm.allgather(pickle.dumps(obj))]

    def _check_root(self, root_rank: int) -> None:
        if not isinstance(root_rank, (int, np.integer)) or not 0 <= root_rank < self.size:
            raise ValueError(f"root_rank must be an integer in [0, {self.size}); got {root_rank!r}")
