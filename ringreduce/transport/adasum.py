r"""Adasum: adaptive summation of gradients (Maleki et al., 2020), Horovod's ``op=Adasum``.

Two gradients ``a`` and ``b`` (one tensor each) combine as::

    a ⊕ b = (1 - a·b / (2‖a‖²)) a + (1 - a·b / (2‖b‖²)) b

Orthogonal gradients add (a·b = 0), identical ones average (a ⊕ a = a). A squared norm below
sqrt(DBL_MIN) leaves its coefficient at 1 (no division by a vanishing norm). Dot products
and norms are accumulated in float64, per tensor (a fused buffer holds many tensors, and
each tensor gets its own coefficients), and the weighted sum is computed in float64 and
rounded once to the buffer's dtype: the numerics of Horovod's
``horovod/common/ops/adasum/adasum.h``.

N ranks (a power of two) combine in a binary tree, run as vector halving, distance
doubling. At the level of distance d (1, 2, 4, ...) rank r pairs with r ^ d: the lower rank
keeps the first half of its current window, the upper one the second half; each sends
the half it gives up and combines the half it keeps with its partner's copy of that
half. The dot products and norms of a half are partial: they are summed (recursive
doubling, float64) over the 2d ranks that hold the pieces of the two vectors being
combined. For N = 4, each rank's vector v_r cut into quarters [A|B|C|D]::

    halving  d=1  pairs r0-r1, r2-r3   r0 keeps AB, r1 keeps CD of  v0 ⊕ v1
                                       r2 keeps AB, r3 keeps CD of  v2 ⊕ v3
             d=2  pairs r0-r2, r1-r3   r0 keeps A, r2 keeps B,
                                       r1 keeps C, r3 keeps D   of  (v0 ⊕ v1) ⊕ (v2 ⊕ v3)
    gather   d=2  r0 <-> r2 trade A and B, r1 <-> r3 trade C and D
             d=1  r0 <-> r1 trade AB and CD, r2 <-> r3 likewise: every rank holds the result

Cost for n bytes on N ranks: log2 N halving steps sending n/2, n/4, ... (n·(N-1)/N in all)
and as many gathering steps (the same bytes), like the ring's 2·(N-1)/N·n but in
2·log2 N messages; plus, per level, a recursive-doubling sum of 3 float64 per tensor over
the level's group (log2 N · (log2 N + 1) / 2 small messages in all). Compute: per level
one float64 pass over the kept half for the sums and one for the weighted sum, about
n·(N-1)/N elements in all per rank.

Hierarchical form (``hierarchical``, for device buffers: Horovod's ``AdasumGpuAllreduceOp``):
the ranks of a host sum their buffers (the ring over ``local``), then the hosts combine
those sums with Adasum over ``cross``; one host is a plain sum. Horovod's CPU op
(``AdasumMPIAllreduceOp``) runs the flat recursion over every rank, whatever the hosts:
host buffers take ``flat``.
"""
from __future__ import annotations

import math
import sys
from typing import Any, NamedTuple, Sequence

import numpy as np

from mtrain.ringreduce.core.ops import ReduceOp
from mtrain.ringreduce.transport import mpi, ring
from mtrain.ringreduce.transport.backend import NumpyBackend

MPI = mpi.deferred(__name__)  # mpi4py's MPI from init() on (importing the runtime starts no MPI)

# A squared norm below this leaves its coefficient at 1 (adasum.h: ``sqrt_double_min``).
SQRT_DBL_MIN = math.sqrt(sys.float_info.min)
# Elements per block of the float64 arithmetic: its three float64 rows (768 KiB) stay in L2.
BLOCK = 1 << 15
_DATA_TAG = 23
_SUMS_TAG = 24


def is_power_of_two(count: int) -> bool:
    return count > 0 and count & (count - 1) == 0


def coefficients(dot: np.ndarray, mine_sq: np.ndarray, theirs_sq: np.ndarray) -> "tuple[np.ndarray, np.ndarray]":
    """Each tensor's weights of its own vector and its partner's (float64 arrays)."""
    mine_ok, theirs_ok = mine_sq >= SQRT_DBL_MIN, theirs_sq >= SQRT_DBL_MIN
    mine = 1.0 - 0.5 * np.divide(dot, mine_sq, out=np.zeros_like(dot), where=mine_ok)
    theirs = 1.0 - 0.5 * np.divide(dot, theirs_sq, out=np.zeros_like(dot), where=theirs_ok)
    return mine, theirs


class Block(NamedTuple):
    """At most ``BLOCK`` elements [lo, hi) of a window, cut where its tensors begin: segment i starts
    at ``starts[i]`` (relative to lo), holds ``counts[i]`` elements and belongs to tensor ``tensors[i]``
    (each tensor at most once in a block)."""

    lo: int
    hi: int
    starts: np.ndarray
    counts: np.ndarray
    tensors: np.ndarray


def _blocks(edges: np.ndarray) -> "list[Block]":
    """The window [0, edges[-1]) in blocks; ``edges``: where each tensor begins in it, then its end."""
    size = int(edges[-1])
    blocks = []
    for lo in range(0, size, BLOCK):
        hi = min(lo + BLOCK, size)
        inner = edges[(edges > lo) & (edges < hi)]
        cuts = np.unique(np.concatenate(([lo], inner, [hi])))
        starts = cuts[:-1]
        # The tensor holding each segment's first element: the last one to begin at or before it
        # (an empty tensor begins and ends at the same place, and holds none).
        tensors = np.searchsorted(edges, starts, side="right") - 1
        blocks.append(Block(lo, hi, starts - lo, np.diff(cuts), tensors))
    return blocks


def _wide(part: np.ndarray, into: np.ndarray) -> np.ndarray:
    """``part`` in float64: itself, or a copy in ``into`` (cache-sized scratch)."""
    if part.dtype == np.float64:
        return part
    wide = into[:part.size]
    np.copyto(wide, part)
    return wide


def _partial_sums(mine: np.ndarray, theirs: np.ndarray, blocks: "list[Block]", tensors: int,
                  wide: np.ndarray) -> np.ndarray:
    """Rows mine·theirs, ‖mine‖², ‖theirs‖² (float64; one column per tensor, zero where a tensor
    has no element in this window), block by block in float64 (``wide``: 3 x BLOCK scratch).
    Ufuncs, not BLAS dot products: a threaded BLAS on ranks that share cores is 10x slower."""
    sums = np.zeros((3, tensors))
    for block in blocks:
        a, b = _wide(mine[block.lo:block.hi], wide[0]), _wide(theirs[block.lo:block.hi], wide[1])
        product = wide[2, :block.hi - block.lo]
        for row, (x, y) in enumerate(((a, b), (a, a), (b, b))):
            np.multiply(x, y, out=product)
            sums[row, block.tensors] += np.add.reduceat(product, block.starts)
    return sums


def _weighted_sum(mine: np.ndarray, theirs: np.ndarray, blocks: "list[Block]",
                  mine_weight: np.ndarray, theirs_weight: np.ndarray, wide: np.ndarray) -> None:
    """``mine`` = mine_weight·mine + theirs_weight·theirs per tensor, computed in float64 and
    rounded once to ``mine``'s dtype (``theirs`` is scratch: it is overwritten)."""
    for block in blocks:
        a, b = _wide(mine[block.lo:block.hi], wide[0]), _wide(theirs[block.lo:block.hi], wide[1])
        a *= np.repeat(mine_weight[block.tensors], block.counts)
        b *= np.repeat(theirs_weight[block.tensors], block.counts)
        a += b
        if mine.dtype != np.float64:  # (float64: ``a`` is mine's own block, already written)
            np.copyto(mine[block.lo:block.hi], a, casting="same_kind")


def _group_sum(comm: MPI.Comm, rank: int, level: int, sums: np.ndarray) -> None:
    """Sum ``sums`` in place over the 2·level ranks that share rank's bits above ``level``
    (recursive doubling). Each step adds the partner's values to one's own, and the partner
    adds the same two: addition commutes, so every rank of the group ends with the same bits."""
    other = np.empty_like(sums)
    distance = 1
    while distance <= level:
        partner = rank ^ distance
        comm.Sendrecv(sums, partner, _SUMS_TAG, other, partner, _SUMS_TAG)
        sums += other
        distance <<= 1


def _combine(comm: MPI.Comm, rank: int, level: int, mine: np.ndarray, theirs: np.ndarray,
             offsets: np.ndarray, lo: int, hi: int, wide: np.ndarray) -> None:
    """``mine`` (the window [lo, hi) of this rank's vector) becomes its part of mine ⊕ theirs,
    tensor by tensor (``offsets``: where each tensor starts in the whole buffer)."""
    edges = np.clip(offsets, lo, hi) - lo
    blocks = _blocks(edges)
    sums = _partial_sums(mine, theirs, blocks, len(edges) - 1, wide)
    upper = bool(rank & level)
    if upper:  # the group sums the lower half-group's norm in row 1 and the upper's in row 2
        sums[[1, 2]] = sums[[2, 1]]
    _group_sum(comm, rank, level, sums)
    dot, lower_sq, upper_sq = sums
    mine_sq, theirs_sq = (upper_sq, lower_sq) if upper else (lower_sq, upper_sq)
    mine_weight, theirs_weight = coefficients(dot, mine_sq, theirs_sq)
    _weighted_sum(mine, theirs, blocks, mine_weight, theirs_weight, wide)


def flat(comm: MPI.Comm, buf: np.ndarray, counts: Sequence[int], scratch: np.ndarray,
         wide: "np.ndarray | None" = None) -> None:
    """Adasum of ``buf`` (host, 1-D, contiguous; ``counts``: its tensors' element counts, in
    order, summing to its size) over ``comm`` (a power-of-two number of ranks), in place.
    ``scratch``: at least half of ``buf``'s elements (rounded up), same dtype; ``wide``: float64
    scratch of shape (3, BLOCK) (made here when not given)."""
    if wide is None:
        wide = np.empty((3, BLOCK))
    size, rank = comm.Get_size(), comm.Get_rank()
    offsets = np.zeros(len(counts) + 1, dtype=np.int64)
    np.cumsum(counts, out=offsets[1:])
    if int(offsets[-1]) != buf.size:  # pragma: no cover - the dispatcher passes its own counts
        raise AssertionError(f"tensor counts sum to {int(offsets[-1])}, the buffer holds {buf.size}")
    lo, hi = 0, buf.size
    given: "list[tuple[int, int, int]]" = []  # (level, start, end) each halving gave away
    level = 1
    while level < size:
        partner = rank ^ level
        mid = lo + (hi - lo) // 2
        if rank & level:  # upper: keep the second half
            keep, give = (mid, hi), (lo, mid)
        else:
            keep, give = (lo, mid), (mid, hi)
        theirs = scratch[:keep[1] - keep[0]]
        comm.Sendrecv(buf[give[0]:give[1]], partner, _DATA_TAG, theirs, partner, _DATA_TAG)
        _combine(comm, rank, level, buf[keep[0]:keep[1]], theirs, offsets, keep[0], keep[1], wide)
        given.append((level, give[0], give[1]))
        lo, hi = keep
        level <<= 1
    for level, start, end in reversed(given):  # the all-gather: each gets back what it gave
        partner = rank ^ level
        comm.Sendrecv(buf[lo:hi], partner, _DATA_TAG, buf[start:end], partner, _DATA_TAG)
        lo, hi = min(lo, start), max(hi, end)


def hierarchical(local: MPI.Comm, cross: MPI.Comm, buf: np.ndarray, counts: Sequence[int],
                 scratch: np.ndarray, host: NumpyBackend, segment_bytes: int = ring.DEFAULT_SEGMENT_BYTES,
                 small_bytes: int = ring.DEFAULT_SMALL_BYTES, wide: "np.ndarray | None" = None) -> None:
    """Sum ``buf`` over the ranks of this host (``local``), then Adasum those sums over the hosts
    (``cross``: one rank of each host, a power-of-two number of hosts), in place. The ring hands
    every rank of a host the same bits, so each host's ranks run identical cross recursions
    (Horovod splits that work among them; here each runs all of it)."""
    if local.Get_size() > 1:
        ring.allreduce(local, buf, ReduceOp.Sum, host, segment_bytes, small_bytes)
    flat(cross, buf, counts, scratch, wide)


class AdasumRunner:
    """One executor's Adasum: its buffers (kept from step to step: fresh pages of a 100 MiB
    buffer cost more than the arithmetic), and the choice between the flat recursion (host
    buffers) and the hierarchical form (device buffers), made alike on every rank."""

    def __init__(self, comm: MPI.Comm, local: "MPI.Comm | None", cross: "MPI.Comm | None") -> None:
        self.comm, self.local, self.cross = comm, local, cross
        self._host = NumpyBackend()  # the sums within a host run on host copies
        self._buffers: "dict[str, np.ndarray]" = {}

    def buffer(self, purpose: str, shape: "tuple[int, ...]", dtype: Any) -> np.ndarray:
        """A buffer for ``purpose`` (one each), grown when too small."""
        dtype = np.dtype(dtype)
        nbytes = max(int(np.prod(shape)), 1) * dtype.itemsize
        found = self._buffers.get(purpose)
        if found is None or found.nbytes < nbytes:
            found = self._buffers[purpose] = np.empty(nbytes, dtype=np.uint8)
        return found[:nbytes].view(dtype)[:int(np.prod(shape))].reshape(shape)

    def run(self, flats: "list[Any]", counts: Sequence[int], backend: Any, prescale: float, postscale: float,
            segment_bytes: int, small_bytes: int) -> None:
        """Adasum of the logical buffer ``flats`` (its tensors' element ``counts``), in place."""
        for buf in flats:
            backend.scale(buf, prescale)
        host = isinstance(backend, NumpyBackend)
        dtype, total = flats[0].dtype, sum(buf.size for buf in flats)
        copied = not host or len(flats) > 1
        if not copied:
            work = flats[0]
        else:  # one contiguous host buffer: the halving cuts it anywhere
            work = self.buffer("work", (total,), dtype)
            if host:
                np.concatenate(flats, out=work)
            else:
                backend.ready_for_mpi()  # the scaling above is done
                start = 0
                for buf in flats:
                    work[start:start + buf.size] = backend.xp.asnumpy(buf)
                    start += buf.size
        half = (total + 1) // 2
        scratch = self.buffer("received", (half,), dtype)
        wide = self.buffer("wide", (3, BLOCK), np.float64)
        several_hosts = self.cross is not None and self.cross.Get_size() > 1
        if host or self.local is None or self.cross is None:
            flat(self.comm, work, counts, scratch, wide)  # Horovod's CPU op: every rank, whatever the hosts
        elif several_hosts:
            hierarchical(self.local, self.cross, work, counts, scratch, self._host, segment_bytes, small_bytes, wide)
        else:  # Horovod's GPU op on one host: the sum within the host is all there is
            ring.allreduce(self.local, work, ReduceOp.Sum, self._host, segment_bytes, small_bytes)
        if copied:
            start = 0
            for buf in flats:
                part = work[start:start + buf.size]
                if host:
                    buf[...] = part
                else:
                    backend.copy(buf, backend.xp.asarray(part))
                start += buf.size
        for buf in flats:
            backend.scale(buf, postscale)
