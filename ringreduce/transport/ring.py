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

import bisect
import collections
from typing import Any, Callable, Iterator, Sequence

from mtrain.ringreduce.core.ops import ReduceOp
from mtrain.ringreduce.transport import mpi
from mtrain.ringreduce.transport.backend import Backend, finishing_factor

MPI = mpi.deferred(__name__)  # mpi4py's MPI from init() on (importing the runtime starts no MPI)

Buffer = Any  # a 1-D contiguous NumPy or CuPy array, owned by the backend passed with it

# Large enough that per-message costs stay small, small enough that a received segment and
# the part of the buffer it is reduced into are still in L2 together.
DEFAULT_SEGMENT_BYTES = 512 << 10
SCRATCH_DEPTH = 3
# Below N·nbytes of this, gather-and-reduce beats the 2(N-1)-step ring.
DEFAULT_SMALL_BYTES = 16 << 10

_TAG = 17


def segment_bounds(count: int, parts: int, index: int) -> "tuple[int, int]":
    """[start, end) of piece ``index`` when ``count`` elements are cut into ``parts``."""
    base, extra = divmod(count, parts)
    start = index * base + min(index, extra)
    return start, start + base + (1 if index < extra else 0)


class Layout:
    """Several 1-D contiguous buffers of one dtype seen as one logical buffer: their
    concatenation, without copying anything.

    The ring works on logical element ranges; ``pieces`` cuts a range into views
    that never cross a buffer boundary, so large tensors are reduced in their own
    memory as one long ring, with no fusion-buffer copies. Every rank builds the
    same layout (the same shapes in the same order), so sender and receiver cut
    every range identically and their messages match one to one.
    """

    def __init__(self, bufs: "Sequence[Buffer]") -> None:
        self.bufs = [b for b in bufs if b.size]
        self.starts = [0]
        for b in self.bufs:
            self.starts.append(self.starts[-1] + b.size)
        self.size = self.starts[-1]
        first = bufs[0]
        self.dtype, self.itemsize = first.dtype, first.itemsize

    def pieces(self, lo: int, hi: int, seg: int) -> "list[Buffer]":
        """Views covering logical [lo, hi), each at most ``seg`` elements, each in one buffer."""
        return [view for _, _, view in self.spans(lo, hi, seg)]

    def spans(self, lo: int, hi: int, seg: int) -> "Iterator[tuple[int, int, Buffer]]":
        """``pieces`` with where each view is: (buffer index, element offset in it, view)."""
        index = max(bisect.bisect_right(self.starts, lo) - 1, 0)
        while lo < hi and index < len(self.bufs):
            base = self.starts[index]
            end = min(hi, self.starts[index + 1])
            buf = self.bufs[index]
            for start in range(lo, end, seg):
                yield index, start - base, buf[start - base:min(start + seg, end) - base]
            lo = end
            index += 1


def as_layout(buf: "Buffer | Layout") -> Layout:
    return buf if isinstance(buf, Layout) else Layout([buf])


def allreduce(comm: MPI.Comm, buf: "Buffer | Layout", op: ReduceOp, backend: Backend,
              segment_bytes: int = DEFAULT_SEGMENT_BYTES,
              small_bytes: int = DEFAULT_SMALL_BYTES, postscale: float = 1.0,
              average_over: "int | None" = None) -> None:
    """Reduce ``buf`` (1-D and contiguous, or a Layout of such) in place across ``comm``;
    the result is scaled once by ``postscale`` (by ``postscale / N`` for Average: ``finishing_factor``).
    ``average_over`` replaces N as Average's divisor (the hierarchical all-reduce runs this
    ring over one rank per host on sums that already cover every rank of each host).

    Both finishing steps run on each segment of the rank's own chunk right after its
    last reduction, while it is still in cache, instead of as extra passes over the
    whole buffer; the all-gather then hands the finished bits to everyone.
    """
    size = comm.Get_size()
    layout = as_layout(buf)
    if layout.size == 0:
        return

    factor = finishing_factor(op, postscale, size if average_over is None else average_over)

    def finish(piece: Buffer) -> None:
        backend.scale(piece, factor)

    if size == 1:
        for whole in layout.bufs:
            finish(whole)
        return
    if layout.size * layout.itemsize * size <= small_bytes:
        # Small: one gather, then a reduction in rank order. Several buffers are packed
        # first, so an element's result never depends on what it was grouped with.
        packed = layout.bufs[0]
        if len(layout.bufs) > 1:
            packed = backend.scratch(SCRATCH_DEPTH + 1, layout.size, layout.dtype)
            for buf, start in zip(layout.bufs, layout.starts):
                backend.copy(packed[start:start + buf.size], buf)
        _gather_reduce(comm, packed, op, backend)
        finish(packed)
        if len(layout.bufs) > 1:
            for buf, start in zip(layout.bufs, layout.starts):
                backend.copy(buf, packed[start:start + buf.size])
        return
    bounds = even_bounds(layout.size, size)
    reduce_scatter(comm, layout, op, backend, segment_bytes, bounds, finish)
    allgather(comm, layout, bounds, backend)


def even_bounds(count: int, parts: int) -> "list[tuple[int, int]]":
    return [segment_bounds(count, parts, i) for i in range(parts)]


def reduce_scatter(comm: MPI.Comm, buf: "Buffer | Layout", op: ReduceOp, backend: Backend,
                   segment_bytes: int = DEFAULT_SEGMENT_BYTES,
                   bounds: "list[tuple[int, int]] | None" = None,
                   finish: "Callable[[Buffer], None] | None" = None) -> None:
    """After this, logical range bounds[rank] of ``buf`` holds the reduction over all ranks.

    ``bounds`` (default: ``even_bounds``) gives each rank's chunk; other chunks
    end with partial results. No scaling for Average: the caller scales, or
    passes ``finish``, which is applied to each segment of the rank's own chunk
    just after its last reduction.
    """
    size, rank = comm.Get_size(), comm.Get_rank()
    layout = as_layout(buf)
    if size == 1 or layout.size == 0:
        return
    bounds = bounds or even_bounds(layout.size, size)
    right, left = (rank + 1) % size, (rank - 1) % size
    seg = max(1, segment_bytes // layout.itemsize)
    scratch = [backend.scratch(slot, seg, layout.dtype) for slot in range(SCRATCH_DEPTH)]
    for step in range(size - 1):
        slo, shi = bounds[(rank - step - 1) % size]
        rlo, rhi = bounds[(rank - step - 2) % size]
        sends = backend.isend(comm, layout.pieces(slo, shi, seg), right, _TAG)
        last = step == size - 2  # then the chunk received is this rank's own: done after this
        _receive_and_reduce(comm, left, layout.pieces(rlo, rhi, seg), scratch, op, backend,
                            finish if last else None)
        backend.wait_all(sends)


def _receive_and_reduce(comm: MPI.Comm, left: int, targets: "list[Buffer]", scratch: list,
                        op: ReduceOp, backend: Backend,
                        finish: "Callable[[Buffer], None] | None" = None) -> None:
    """Receive each target view from ``left`` into a scratch lane, then reduce it into place."""
    in_flight: collections.deque = collections.deque()

    def post(k: int) -> None:
        slot = k % len(scratch)
        landing = scratch[slot][:targets[k].size]
        in_flight.append((backend.irecv(comm, landing, left, _TAG, lane=slot), landing))

    for k in range(min(len(scratch), len(targets))):
        post(k)
    for k, target in enumerate(targets):
        request, landing = in_flight.popleft()
        backend.wait_all([request])
        backend.reduce_into(target, landing, op)
        if finish is not None:
            finish(target)
        if k + len(scratch) < len(targets):
            post(k + len(scratch))


def allgather(comm: MPI.Comm, buf: "Buffer | Layout", bounds: "list[tuple[int, int]]",
              backend: Backend) -> None:
    """Ring all-gather in place: rank r starts owning logical range bounds[r] of ``buf``,
    ends owning all of it. ``bounds`` may give ranks pieces of different (even zero) length.
    """
    size, rank = comm.Get_size(), comm.Get_rank()
    if size == 1:
        return
    layout = as_layout(buf)
    right, left = (rank + 1) % size, (rank - 1) % size
    whole = max(layout.size, 1)
    for step in range(size - 1):
        slo, shi = bounds[(rank - step) % size]
        rlo, rhi = bounds[(rank - step - 1) % size]
        # Straight into place: one receive per buffer the chunk touches, each in its own lane.
        pending = [backend.irecv(comm, view, left, _TAG, lane=lane)
                   for lane, view in enumerate(layout.pieces(rlo, rhi, whole))]
        pending += backend.isend(comm, layout.pieces(slo, shi, whole), right, _TAG)
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
