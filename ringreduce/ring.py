r"""Ring collectives on one contiguous 1-D buffer, over MPI point-to-point.

The N ranks form a ring; every rank sends only to its right neighbour and
receives only from its left one::

          +--------> rank 1 ---------+
          |                          v
       rank 0                      rank 2
          ^                          |
          +--------- rank 3 <--------+

The buffer is cut into N chunks (``segment_bounds``: balanced, the first
``count % N`` chunks one element longer; chunks may be empty when count < N).

Reduce-scatter, N-1 steps. At step s rank r sends chunk (r-s-1) mod N to the
right and receives chunk (r-s-2) mod N from the left, reducing it into its own
copy. For N = 4 (entries: which chunk rank r sends at step s)::

    step | r=0 r=1 r=2 r=3
    -----+----------------
      0  |  3   0   1   2
      1  |  2   3   0   1
      2  |  1   2   3   0

After the last step rank r holds chunk r reduced over all ranks: exactly once,
by one rank, so the all-gather below hands every rank identical bits.

All-gather, N-1 steps. At step s rank r sends chunk (r-s) mod N and receives
chunk (r-s-1) mod N straight into place.

Cost for n bytes: 2(N-1) steps of n/N bytes each, so every rank sends and
receives 2(N-1)/N·n bytes (independent of N: bandwidth-optimal) and reduces
(N-1)/N·n; latency 2(N-1)·α. Within a reduce-scatter step the chunk moves in
segments of ``segment_bytes`` through a few scratch buffers, so each segment
is reduced while it is still in cache and while the next ones are in flight.

For tiny buffers latency dominates: ``allreduce`` then gathers every rank's
whole buffer (one MPI_Allgather) and each rank reduces the N copies in rank
order, the same operations in the same order everywhere, so results are still
bitwise identical across ranks.

Every byte moves through the backend (``isend``, ``irecv``, ``wait_all``,
``allgather``) and every reduction is ``backend.reduce_into``, so this file
never asks where the buffer lives: host views go straight to MPI, device
buffers go to a CUDA-aware MPI or through pinned staging buffers
(``backend.py``). A receive names its ``lane`` (the scratch slot) so a staging
backend can give receives in flight together their own pinned buffers.
"""
from __future__ import annotations

import collections
from typing import Any

from mpi4py import MPI

from .backend import Backend
from .ops import Average, ReduceOp

Buffer = Any  # a 1-D contiguous NumPy or CuPy array, owned by the backend passed with it

# Tuned on a 2-core VM with Open MPI 5 shared memory (see benchmarks/allreduce.py).
DEFAULT_SEGMENT_BYTES = 1 << 20
SCRATCH_DEPTH = 3
# Below N·nbytes of this, gather-and-reduce beats the 2(N-1)-step ring.
DEFAULT_SMALL_BYTES = 16 << 10

_TAG = 17


def segment_bounds(count: int, parts: int, index: int) -> "tuple[int, int]":
    """[start, end) of piece ``index`` when ``count`` elements are cut into ``parts``."""
    base, extra = divmod(count, parts)
    start = index * base + min(index, extra)
    return start, start + base + (1 if index < extra else 0)


def allreduce(comm: MPI.Comm, buf: Buffer, op: ReduceOp, backend: Backend,
              segment_bytes: int = DEFAULT_SEGMENT_BYTES,
              small_bytes: int = DEFAULT_SMALL_BYTES) -> None:
    """Reduce ``buf`` (1-D, contiguous) in place across ``comm``; Average divides by N."""
    size = comm.Get_size()
    if size == 1 or buf.size == 0:
        return
    if buf.nbytes * size <= small_bytes:
        _gather_reduce(comm, buf, op, backend)
    else:
        bounds = even_bounds(buf.size, size)
        reduce_scatter(comm, buf, op, backend, segment_bytes, bounds)
        lo, hi = bounds[comm.Get_rank()]
        if op == Average:
            backend.divide(buf[lo:hi], size)
        allgather(comm, buf, bounds, backend)
        return
    if op == Average:
        backend.divide(buf, size)


def even_bounds(count: int, parts: int) -> "list[tuple[int, int]]":
    return [segment_bounds(count, parts, i) for i in range(parts)]


def reduce_scatter(comm: MPI.Comm, buf: Buffer, op: ReduceOp, backend: Backend,
                   segment_bytes: int = DEFAULT_SEGMENT_BYTES,
                   bounds: "list[tuple[int, int]] | None" = None) -> None:
    """After this, buf[bounds[rank]] holds the reduction over all ranks.

    ``bounds`` (default: ``even_bounds``) gives each rank's chunk; other chunks
    end with partial results. No division for Average: the caller divides.
    """
    size, rank = comm.Get_size(), comm.Get_rank()
    if size == 1 or buf.size == 0:
        return
    bounds = bounds or even_bounds(buf.size, size)
    right, left = (rank + 1) % size, (rank - 1) % size
    seg = max(1, segment_bytes // buf.itemsize)
    scratch = [backend.scratch(slot, seg, buf.dtype) for slot in range(SCRATCH_DEPTH)]
    for step in range(size - 1):
        slo, shi = bounds[(rank - step - 1) % size]
        rlo, rhi = bounds[(rank - step - 2) % size]
        sends = backend.isend(comm, [buf[i:min(i + seg, shi)] for i in range(slo, shi, seg)], right, _TAG)
        _receive_and_reduce(comm, left, buf, rlo, rhi, seg, scratch, op, backend)
        backend.wait_all(sends)


def _receive_and_reduce(comm: MPI.Comm, left: int, buf: Buffer, lo: int, hi: int, seg: int,
                        scratch: list, op: ReduceOp, backend: Backend) -> None:
    """Receive buf[lo:hi] from ``left`` segment by segment, reducing each into place."""
    starts = list(range(lo, hi, seg))
    in_flight: collections.deque = collections.deque()

    def post(k: int) -> None:
        slot = k % len(scratch)
        n = min(seg, hi - starts[k])
        target = scratch[slot][:n]
        in_flight.append((backend.irecv(comm, target, left, _TAG, lane=slot), target))

    for k in range(min(len(scratch), len(starts))):
        post(k)
    for k, start in enumerate(starts):
        request, target = in_flight.popleft()
        backend.wait_all([request])
        backend.reduce_into(buf[start:start + target.size], target, op)
        if k + len(scratch) < len(starts):
            post(k + len(scratch))


def allgather(comm: MPI.Comm, buf: Buffer, bounds: "list[tuple[int, int]]",
              backend: Backend) -> None:
    """Ring all-gather in place: rank r starts owning buf[bounds[r]], ends owning all of buf.

    ``bounds`` may give ranks pieces of different (even zero) length.
    """
    size, rank = comm.Get_size(), comm.Get_rank()
    if size == 1:
        return
    right, left = (rank + 1) % size, (rank - 1) % size
    for step in range(size - 1):
        slo, shi = bounds[(rank - step) % size]
        rlo, rhi = bounds[(rank - step - 1) % size]
        pending = []
        if rhi > rlo:
            pending.append(backend.irecv(comm, buf[rlo:rhi], left, _TAG))
        if shi > slo:
            pending += backend.isend(comm, [buf[slo:shi]], right, _TAG)
        backend.wait_all(pending)


def _gather_reduce(comm: MPI.Comm, buf: Buffer, op: ReduceOp, backend: Backend) -> None:
    """Small-buffer all-reduce: one all-gather, then the same rank-ordered reduction everywhere."""
    size = comm.Get_size()
    gathered = backend.scratch(SCRATCH_DEPTH, buf.size * size, buf.dtype)
    backend.allgather(comm, buf, gathered)
    rows = gathered.reshape(size, buf.size)
    backend.copy(buf, rows[0])
    for i in range(1, size):
        backend.reduce_into(buf, rows[i], op)
