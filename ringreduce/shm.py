r"""All-reduce through shared memory among the ranks of one host, hierarchical across hosts.

The L ranks of a host (the ``local`` communicator) map one shared segment. The
logical buffer (a ``ring.Layout``) is processed in stripes of ``stripe_bytes``;
each stripe is cut into L chunks (``ring.even_bounds``) and local rank j owns
chunk j. Every rank has a slot in the segment, in two halves that alternate
between stripes; a half holds one region per chunk, at fixed byte offsets::

    slot k, half h:  | region 0 | region 1 | ... | region L-1 |
                       region c != k: rank k's input for chunk c
                       region k:      rank k's result for chunk k

One host, for stripe s (in half s mod 2)::

    copy in stripe 0                      each rank: its input for the chunks it does not own
    barrier
    for s in stripes:
        reduce s      rank j: chunk j from its own buffer and every slot, in local rank
                      order (((x0 op x1) op x2) …), in cache-sized blocks; finish (Average,
                      postscale); publish into its result region
        copy in s+1
        barrier
        copy out s    rank j: every other chunk's result from its owner's slot, into its buffer

One barrier per stripe: the halves alternate, so the copies into stripe s+2's
half never meet a slower rank still reading stripe s (inputs are read before the
barrier that follows them; results and inputs never share a region).

Several hosts (hierarchical): the same loop, but reduce only sums chunk j into
the rank's own buffer; then one ``ring.allreduce`` over ``cross`` (the ranks
with local rank j on every host, all owning the same chunks) of all its chunks
at once, which finishes them; then a second striped loop publishes and copies
out. Across hosts each rank sends 2(H-1)/H of its chunks, n/L bytes, so a host
sends 2(H-1)/H·n bytes in all, where the flat ring sends that much per rank.

Every element is reduced by exactly one rank of its host, in one fixed order
(and across hosts by one ring reduction), so every rank ends with the same
bits; on one host they equal the reduction in rank order.

Stripes keep the shared regions hot in the host's last-level cache: a rank's
input is written into the segment and read by its peer a moment later, so main
memory sees little more than each rank reading its buffer and writing the
result back, which is what a memcpy costs. No point-to-point messages and no
scratch copies.

The segment (2·L·stripe_bytes) is a file in /dev/shm that local rank 0 creates
and every rank maps once, when the Executor is made; rank 0 unlinks it as soon
as everyone has it mapped, so nothing is left behind however the job ends.
"""
from __future__ import annotations

import mmap
import os
import tempfile
import uuid
from typing import Any, Callable, Iterator

import numpy as np
from mpi4py import MPI

from . import ring
from .backend import NumpyBackend
from .ops import Average, Max, Min, ReduceOp

DEFAULT_STRIPE_BYTES = 2 << 20
# Elements reduced per step: the sources and the target of one block stay in L2 while
# the result is finished and published.
DEFAULT_BLOCK_BYTES = 256 << 10
_LINE = 64  # regions start on cache lines: no two ranks write the same line

_UFUNC_NAMES = {ReduceOp.Sum: "add", Average: "add", Min: "minimum", Max: "maximum",
                ReduceOp.Product: "multiply"}


def _ufunc(dtype: np.dtype, op: ReduceOp) -> Callable:
    if dtype == np.bool_ and op in (Min, Max):
        return np.logical_and if op == Min else np.logical_or
    return getattr(np, _UFUNC_NAMES[op])


def _shm_dir() -> str:
    return "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


def map_shared(local: MPI.Comm, nbytes: int) -> "tuple[mmap.mmap | None, str | None]":
    """Collective over ``local``: ``nbytes`` of memory every rank maps; (map, None), or
    (None, why) on every rank of ``local`` when any rank could not."""
    path, error = None, None
    if local.Get_rank() == 0:
        path = os.path.join(_shm_dir(), f"mtrain-allreduce-{os.getpid()}-{uuid.uuid4().hex[:12]}")
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
            try:
                # Reserve the pages now: a full tmpfs is an error here, not a SIGBUS later.
                os.posix_fallocate(fd, 0, nbytes)
            finally:
                os.close(fd)
        except OSError as exc:
            error = f"cannot create a {nbytes}-byte shared-memory file in {_shm_dir()}: {exc}"
    path, error = local.bcast((path, error), root=0)
    mapped = None
    if error is None:
        try:
            fd = os.open(path, os.O_RDWR)
            try:
                mapped = mmap.mmap(fd, nbytes)
            finally:
                os.close(fd)
        except OSError as exc:
            error = f"cannot map shared-memory file {path}: {exc}"
    errors = [e for e in local.allgather(error) if e]
    if local.Get_rank() == 0 and path is not None:
        try:
            os.unlink(path)  # mapped everywhere (or failed): the name is no longer needed
        except OSError:
            pass
    if errors:
        if mapped is not None:
            mapped.close()
        return None, errors[0]
    return mapped, None


def _ranges(layout: ring.Layout, lo: int, hi: int, block: int) -> "Iterator[tuple[int, Any]]":
    """(offset from ``lo``, view) pairs covering logical [lo, hi), views of at most ``block``."""
    offset = 0
    for view in layout.pieces(lo, hi, block):
        yield offset, view
        offset += view.size


class SharedMemoryAllreduce:
    """The algorithm above for one Executor; owns the shared segment of its ``local`` ranks.

    Construction is collective over ``comm`` (it maps the segment on every host);
    ``error`` is then None on every rank, or says on every rank why there is none.
    """

    def __init__(self, comm: MPI.Comm, local: MPI.Comm, cross: "MPI.Comm | None",
                 segment_bytes: int, small_bytes: int, stripe_bytes: "int | None" = None,
                 block_bytes: int = DEFAULT_BLOCK_BYTES) -> None:
        stripe_bytes = stripe_bytes or DEFAULT_STRIPE_BYTES
        self.comm = comm
        self.local = local
        self.cross = cross if cross is not None and cross.Get_size() > 1 else None
        self.local_size = local.Get_size()
        self.local_rank = local.Get_rank()
        self.world_size = comm.Get_size()
        self.segment_bytes = segment_bytes
        self.small_bytes = small_bytes
        self.block_bytes = block_bytes
        # One region per chunk of a stripe, in bytes, on a cache-line boundary.
        self.region_bytes = max(_LINE, -(-stripe_bytes // self.local_size // _LINE) * _LINE)
        self._stripes_done = 0  # halves alternate across calls too
        self._scratch = np.empty(0, dtype=np.uint8)
        mapped, error = map_shared(local, 2 * self.local_size * self.local_size * self.region_bytes)
        failed = comm.allreduce(1 if error else 0, op=MPI.MAX)
        self.error = error or ("another host could not map its shared memory" if failed else None)
        self._map = None if failed else mapped
        if failed and mapped is not None:
            mapped.close()
        self.segment = np.frombuffer(self._map, dtype=np.uint8) if self._map is not None else None

    def _temp(self, nbytes: int) -> np.ndarray:
        """This instance's own scratch (engines of different process sets run at once, so
        nothing is shared with the backend's scratch slots)."""
        if self._scratch.nbytes < nbytes:
            self._scratch = np.empty(nbytes, dtype=np.uint8)
        return self._scratch[:nbytes]

    def _region(self, half: int, slot: int, chunk: int, dtype: np.dtype, count: int) -> np.ndarray:
        start = ((half * self.local_size + slot) * self.local_size + chunk) * self.region_bytes
        return self.segment[start:start + count * dtype.itemsize].view(dtype)

    def allreduce(self, buf: "Any | ring.Layout", op: ReduceOp, backend: NumpyBackend,
                  postscale: float = 1.0) -> None:
        """Reduce in place across ``comm``: Average over all its ranks, then ``postscale``."""
        layout = ring.as_layout(buf)
        count = layout.size
        if count == 0:
            return
        size, me = self.local_size, self.local_rank
        dtype = layout.dtype
        chunk_cap = self.region_bytes // layout.itemsize
        stripe = chunk_cap * size
        starts = list(range(0, count, stripe))
        first_half = self._stripes_done
        self._stripes_done += len(starts)
        integer = dtype.kind in "iu"

        def finish(piece: Any) -> None:
            if op == Average and integer:
                backend.scale(piece, postscale / self.world_size)  # one scaling, as ring.allreduce
                return
            if op == Average:
                backend.divide(piece, self.world_size)
            backend.scale(piece, postscale)

        # [lo, hi) of every chunk of every stripe, logical offsets; all full stripes cut alike.
        full = ring.even_bounds(stripe, size)
        tail = ring.even_bounds(count - starts[-1], size)
        stripe_bounds = [[(start + lo, start + hi) for lo, hi in (full if start + stripe <= count else tail)]
                         for start in starts]
        bounds_of = stripe_bounds.__getitem__

        def copy_in(s: int) -> None:
            half = (first_half + s) % 2
            for c, (lo, hi) in enumerate(bounds_of(s)):
                if c == me or hi == lo:
                    continue
                region = self._region(half, me, c, dtype, hi - lo)
                for offset, view in _ranges(layout, lo, hi, count):
                    np.copyto(region[offset:offset + view.size], view)

        reduce = _ufunc(dtype, op)
        block = max(1, self.block_bytes // layout.itemsize)
        temp = self._temp(min(block, chunk_cap) * layout.itemsize).view(dtype) if me >= 2 else None

        def reduce_chunk(s: int, publish: bool) -> None:
            half = (first_half + s) % 2
            lo, hi = bounds_of(s)[me]
            if hi == lo:
                return
            inputs = [self._region(half, k, me, dtype, hi - lo) for k in range(size)]
            result = self._region(half, me, me, dtype, hi - lo)
            for offset, own in _ranges(layout, lo, hi, block):
                end = offset + own.size
                if me >= 2:
                    acc = temp[:own.size]
                    reduce(inputs[0][offset:end], inputs[1][offset:end], out=acc)
                    for k in range(2, me):
                        reduce(acc, inputs[k][offset:end], out=acc)
                    reduce(acc, own, out=own)
                else:
                    # x0 op x1 == x1 op x0 for every op here: the rank's own buffer accumulates.
                    reduce(own, inputs[1 - me][offset:end], out=own)
                for k in range(max(2, me + 1), size):
                    reduce(own, inputs[k][offset:end], out=own)
                if publish:
                    finish(own)
                    np.copyto(result[offset:end], own)

        def publish_chunk(s: int) -> None:
            half = (first_half + s) % 2
            lo, hi = bounds_of(s)[me]
            result = self._region(half, me, me, dtype, hi - lo)
            for offset, own in _ranges(layout, lo, hi, count):
                np.copyto(result[offset:offset + own.size], own)

        def copy_out(s: int) -> None:
            half = (first_half + s) % 2
            for k, (lo, hi) in enumerate(bounds_of(s)):
                if k == me or hi == lo:
                    continue
                result = self._region(half, k, k, dtype, hi - lo)
                for offset, view in _ranges(layout, lo, hi, count):
                    np.copyto(view, result[offset:offset + view.size])

        barrier = self.local.Barrier
        last = len(starts) - 1
        copy_in(0)
        barrier()
        if self.cross is None:
            for s in range(len(starts)):
                reduce_chunk(s, publish=True)
                if s < last:
                    copy_in(s + 1)
                barrier()
                copy_out(s)
            return
        # Hierarchical: reduce-scatter within the host, the ring across hosts, all-gather within.
        for s in range(len(starts)):
            reduce_chunk(s, publish=False)
            if s < last:
                copy_in(s + 1)
            barrier()
        mine = [view for s in range(len(starts)) for view in layout.pieces(*bounds_of(s)[me], count)]
        if mine:  # every rank of ``cross`` has the same local rank, so the same chunks
            ring.allreduce(self.cross, ring.Layout(mine), op, backend, self.segment_bytes,
                           self.small_bytes, postscale, average_over=self.world_size)
        publish_chunk(0)
        barrier()
        for s in range(len(starts)):
            copy_out(s)
            if s < last:
                publish_chunk(s + 1)
                barrier()

    def close(self) -> None:
        """Unmap (this rank only; the memory goes when the last rank unmaps it)."""
        self.segment = None
        if self._map is not None:
            try:
                self._map.close()
            except BufferError:  # a view still lives somewhere: the garbage collector frees it
                pass
            self._map = None
