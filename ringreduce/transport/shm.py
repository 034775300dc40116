r"""All-reduce through shared memory among the ranks of one host, hierarchical across hosts.

Two transports (``transport``: auto takes the segment, and cma where the segment
cannot be mapped; each can be forced):

``cma``: each rank reads its peers' buffers directly, with Linux's cross-memory
attach (``process_vm_readv(2)``, through ctypes; the ranks are the same user, so
no setting is changed for it). The logical buffer (a ``ring.Layout``) is cut
into L chunks (``ring.even_bounds``); local rank j owns chunk j::

    allgather      every rank: the addresses of its buffer's pieces (also the start barrier)
    for each stripe of L blocks of ``cma_block_bytes`` (chunk j of a stripe: rank j's block)
      reduce       rank j: chunk j: each peer's block is read into a scratch block that
                   stays in cache and is reduced into the rank's own buffer, in local rank
                   order (((x0 op x1) op x2) …); finish (Average, postscale)
      barrier      the stripe's chunks are final; nobody reads the stripe's inputs any more
      copy out     rank j: every other chunk of the stripe, from its owner's buffer straight
                   into its own (one system call per chunk), while the owner's cache holds it
    barrier        nobody reads this rank's buffer any more: the caller may touch it

Memory traffic per rank: its chunk and the peers' inputs for it read once, the
result written once, every other chunk written once and read from its owner,
mostly out of the last-level cache the owner has just written it to: at L = 2
about what a memcpy of the buffer moves (1.5 reads and 1 write without the
stripes). No shared segment, no copies into scratch regions, no point-to-point
messages.

Cross-memory attach pins the peer's pages one at a time, so it is fast on huge
pages (NumPy's large buffers) and slow on ordinary 4 KiB pages, which is where
PyTorch's and TensorFlow's tensors live. The segment's speed does not depend on
the pages, and nothing cheap tells a buffer's page size (a trial of both on a
job's first calls does not predict its steady state: pages are still being
faulted in and collapsed then), so auto takes the segment;
MTRAIN_SHM_TRANSPORT=cma is for buffers on huge pages.

``segment`` (auto, and every buffer where cross-memory attach is refused:
another user, a container's seccomp filter, Yama's ptrace_scope ≥ 1 without
CAP_SYS_PTRACE): the L ranks map one shared segment and go through it
in stripes of ``stripe_bytes``; each stripe is cut into L chunks and local rank
j owns chunk j. Every rank has a slot in the
segment, in two halves that alternate between stripes; a half holds one region
per chunk, at fixed byte offsets::

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

Several hosts (hierarchical), either transport: the reduction only sums chunk j
into the rank's own buffer; then one ``ring.allreduce`` over ``cross`` (the ranks
with local rank j on every host, all owning the same chunks) of all its chunks
at once, which finishes them; then the copy out (the segment transport
publishes and copies out in a second striped loop). Across hosts each rank
sends 2(H-1)/H of its chunks, n/L bytes, so a host sends 2(H-1)/H·n bytes in
all, where the flat ring sends that much per rank.

Every element is reduced by exactly one rank of its host, in one fixed order
(and across hosts by one ring reduction), so every rank ends with the same
bits; on one host they equal the reduction in rank order.

In the segment transport, stripes keep the shared regions hot in the host's
last-level cache: a rank's input is written into the segment and read by its
peer a moment later, so main memory sees little more than each rank reading its
buffer and writing the result back while the stripes fit the cache. Where the
cache is small or busy, the traffic is about twice a memcpy's (copy in, reduce,
publish, copy out); cma on huge pages does better there.

The segment (2·L·stripe_bytes) is a file in a private folder in /dev/shm that
local rank 0 creates and every rank maps once, when the Executor is made; rank 0
removes both as soon as everyone has it mapped, so nothing is left behind however
the job ends.
"""
from __future__ import annotations

import ctypes
import mmap
import os
import sys
import tempfile
from typing import Any, Callable, Iterator

import numpy as np

from mtrain.common.private import check_private, remove_private
from mtrain.common.settings import TextChoice
from mtrain.ringreduce.core.ops import ReduceOp, reducer
from mtrain.ringreduce.transport import mpi, ring
from mtrain.ringreduce.transport.backend import NumpyBackend, finishing_factor

MPI = mpi.deferred(__name__)  # mpi4py's MPI from init() on (importing the runtime starts no MPI)

DEFAULT_STRIPE_BYTES = 2 << 20
# The largest stripe the autotuner tries (the segment leaves room for it: 2·L·this bytes of
# address space, of which only the regions' used parts are ever touched).
TUNABLE_MAX_STRIPE_BYTES = 8 << 20
# Elements reduced per step: the sources and the target of one block stay in L2 while
# the result is finished and published.
DEFAULT_BLOCK_BYTES = 256 << 10
# cma: bytes read from a peer per system call, and each rank's part of a stripe on one host.
# Each call pins the peer's pages first, so larger reads cost less per byte, while a smaller
# stripe's results are still in the owner's cache when the peers copy them out.
DEFAULT_CMA_BLOCK_BYTES = 1 << 20
_LINE = 64  # regions start on cache lines: no two ranks write the same line

def shm_folder() -> str:
    return "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


def map_shared(local: MPI.Comm, nbytes: int) -> "tuple[mmap.mmap | None, str | None]":
    """Collective over ``local``: ``nbytes`` of memory every rank maps; (map, None), or
    (None, why) on every rank of ``local`` when any rank could not."""
    path, error = None, None
    if local.Get_rank() == 0:
        try:
            # /dev/shm is shared by every user of the host: the file lives in a new 0700 folder of
            # ours (mkdtemp's), never straight in it (bindings/common/private.py says why).
            folder = tempfile.mkdtemp(prefix="mtrain-allreduce-", dir=shm_folder())
            path = os.path.join(folder, "segment")
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR | os.O_NOFOLLOW, 0o600)
            try:
                # Reserve the pages now: a full tmpfs is an error here, not a SIGBUS later.
                os.posix_fallocate(fd, 0, nbytes)
            finally:
                os.close(fd)
        except OSError as exc:
            error = f"cannot create a {nbytes}-byte shared-memory file in {shm_folder()}: {exc}"
    path, error = local.bcast((path, error), root=0)
    mapped = None
    if error is None:
        try:
            check_private(os.path.dirname(path), os.lstat(os.path.dirname(path)), "folder")
            fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW)
            try:
                check_private(path, os.fstat(fd), "file")
                mapped = mmap.mmap(fd, nbytes)
            finally:
                os.close(fd)
        except OSError as exc:
            error = f"cannot map shared-memory file {path}: {exc}"
    errors = [e for e in local.allgather(error) if e]
    if local.Get_rank() == 0 and path is not None:
        remove_private(path)  # mapped everywhere (or failed): the names are no longer needed
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


class Transport(TextChoice):
    """How the ranks of a host reach each other's buffers (MTRAIN_SHM_TRANSPORT). Its text is
    the setting's (``settings.TextChoice``)."""

    AUTO = "auto"        # the segment; cma only where the segment cannot be mapped
    CMA = "cma"          # cross-memory attach; the segment where the kernel refuses it
    SEGMENT = "segment"  # always the shared segment

    @classmethod
    def noun(cls) -> str:
        return "shared-memory transport"


_IOV_MAX = 1024  # iovecs per process_vm_readv call (Linux's UIO_MAXIOV)


class CrossMemory:
    """``process_vm_readv(2)`` through ctypes: copy ranges of another process's memory into
    this one's, in one system call per batch of ranges."""

    def __init__(self) -> None:
        if not sys.platform.startswith("linux"):
            raise OSError("cross-memory attach is Linux only")
        libc = ctypes.CDLL(None, use_errno=True)
        call = libc.process_vm_readv  # AttributeError on a libc without it
        call.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_ulong, ctypes.c_void_p, ctypes.c_ulong,
                         ctypes.c_ulong]
        call.restype = ctypes.c_ssize_t
        self._call = call

    def read(self, pid: int, local: np.ndarray, remote: np.ndarray, nbytes: int) -> None:
        """Fill the ranges ``local`` (an (m, 2) uint64 array of address, length) from the
        ranges ``remote`` of process ``pid``; ``nbytes`` is the total. Raises OSError."""
        done = 0
        for first in range(0, max(len(local), len(remote)), _IOV_MAX):
            lv, rv = local[first:first + _IOV_MAX], remote[first:first + _IOV_MAX]
            want = int(rv[:, 1].sum())
            got = self._call(pid, lv.ctypes.data, len(lv), rv.ctypes.data, len(rv), 0)
            if got < 0:
                err = ctypes.get_errno()
                raise OSError(err, f"process_vm_readv from process {pid}: {os.strerror(err)}")
            if got != want:
                raise OSError(f"process_vm_readv from process {pid} moved {got} of {want} bytes")
            done += got
        if done != nbytes:
            raise OSError(f"process_vm_readv from process {pid} moved {done} of {nbytes} bytes")

    def read_into(self, pid: int, target: np.ndarray, address: int) -> None:
        """Fill the contiguous array ``target`` from ``address`` in process ``pid``."""
        nbytes = target.nbytes
        if nbytes:
            self.read(pid, np.array([[target.ctypes.data, nbytes]], dtype=np.uint64),
                      np.array([[address, nbytes]], dtype=np.uint64), nbytes)


def probe_cross_memory(local: MPI.Comm) -> "tuple[CrossMemory | None, list[int], str | None]":
    """Collective over ``local``: can every rank read every peer's memory? Each rank reads a
    random token from each peer and checks it (a peer in another pid namespace, or a refusal,
    fails). Returns (reader, pids of the local ranks, None) or (None, [], why) on every rank."""
    token = np.frombuffer(os.urandom(16), dtype=np.uint8).copy()
    reader, error = None, None
    try:
        reader = CrossMemory()
    except (OSError, AttributeError) as exc:
        error = f"no cross-memory attach here ({exc})"
    mine = (os.getpid(), token.ctypes.data, token.tobytes())
    everyone = local.allgather(mine)
    if reader is not None:
        got = np.empty(16, dtype=np.uint8)
        for k, (pid, address, expected) in enumerate(everyone):
            if k == local.Get_rank():
                continue
            try:
                reader.read_into(pid, got, address)
            except OSError as exc:
                error = f"cannot read local rank {k}'s memory ({exc})"
                break
            if got.tobytes() != expected:
                error = f"local rank {k}'s process id names another process here (separate pid namespaces?)"
                break
    errors = [e for e in local.allgather(error) if e]  # also keeps ``token`` alive until all have read
    if errors:
        return None, [], errors[0]
    return reader, [pid for pid, _, _ in everyone], None


class SharedMemoryAllreduce:
    """The algorithm above for one Executor, through the shared segment of its ``local``
    ranks or cross-memory attach (``transport``: cma; else the segment, and for auto cma
    where the segment cannot be mapped).

    Construction is collective over ``comm`` (every host agrees on the transport);
    ``error`` is then None on every rank, or says on every rank why there is no
    shared-memory path at all. ``notice`` says why cma is not available, when it was
    asked for and is not.
    """

    def __init__(self, comm: MPI.Comm, local: MPI.Comm, cross: "MPI.Comm | None",
                 segment_bytes: int, small_bytes: int, stripe_bytes: "int | None" = None,
                 block_bytes: int = DEFAULT_BLOCK_BYTES, transport: "Transport | str" = Transport.AUTO,
                 cma_block_bytes: int = DEFAULT_CMA_BLOCK_BYTES, tunable: bool = False) -> None:
        transport = Transport.of(transport)
        stripe_bytes = stripe_bytes or DEFAULT_STRIPE_BYTES
        self.comm = comm
        self.local = local
        self.cross = cross if cross is not None and cross.Get_size() > 1 else None
        self.local_size = local.Get_size()
        self.local_rank = local.Get_rank()
        self.world_size = comm.Get_size()
        self.segment_bytes = segment_bytes
        self.small_bytes = small_bytes
        self.block_bytes = block_bytes  # the segment's reduction block
        self.cma_block_bytes = cma_block_bytes
        self.calls = 0  # all-reduces run (tests: what reached this path)
        self._scratch = np.empty(0, dtype=np.uint8)
        self._map: "mmap.mmap | None" = None
        self.segment: "np.ndarray | None" = None
        self.error: "str | None" = None
        self.notice: "str | None" = None
        self.cma = False
        # The transports this instance can switch between at an all-reduce boundary (the
        # autotuner's knob: ``tunable`` maps the segment and probes cma too, and leaves room in
        # each region for stripes up to TUNABLE_MAX_STRIPE_BYTES).
        self.transports: "tuple[Transport, ...]" = ()
        if transport is Transport.CMA and self._probe_cma():
            self.transports = (Transport.CMA,)
            return
        # One region per chunk of a stripe, in bytes, on a cache-line boundary. The regions lie
        # ``region_stride`` apart: a stripe size changed between calls moves no region.
        self.region_bytes = self._region_size(stripe_bytes)
        self.region_stride = self._region_size(max(stripe_bytes, TUNABLE_MAX_STRIPE_BYTES)) if tunable \
            else self.region_bytes
        self._stripes_done = 0  # halves alternate across calls too
        mapped, error = map_shared(local, 2 * self.local_size * self.local_size * self.region_stride)
        failed = comm.allreduce(1 if error else 0, op=MPI.MAX)
        if not failed:
            self._map = mapped
            self.segment = np.frombuffer(mapped, dtype=np.uint8)
            self.transports = (Transport.SEGMENT,)
            if tunable:  # collective over ``comm``, like the rest of the construction
                if self._probe_cma():
                    self.transports += (Transport.CMA,)
                self.cma = False
            return
        if mapped is not None:
            mapped.close()
        if transport is Transport.AUTO and self._probe_cma():
            self.transports = (Transport.CMA,)
            return  # no segment (a small /dev/shm, say): cma for every buffer
        self.error = error or "another host could not map its shared memory"

    def _probe_cma(self) -> bool:
        """Collective over ``comm``: can every rank read its local peers' memory? Sets
        ``cma``, or ``notice`` with why not."""
        self._reader, self._pids, why = probe_cross_memory(self.local)
        self._world_ranks = self.local.allgather(self.comm.Get_rank())  # names a peer in errors
        failed = self.comm.allreduce(1 if why else 0, op=MPI.MAX)
        self.cma = not failed
        if failed:
            self.notice = why or "another host cannot use cross-memory attach"
        return self.cma

    @property
    def transport(self) -> Transport:
        """What runs: CMA or SEGMENT."""
        return Transport.CMA if self.cma else Transport.SEGMENT

    def _region_size(self, stripe_bytes: int) -> int:
        return max(_LINE, -(-stripe_bytes // self.local_size // _LINE) * _LINE)

    def use(self, transport: Transport, stripe_bytes: int) -> None:
        """Run the next all-reduces through ``transport`` (one of ``transports``) in stripes of
        ``stripe_bytes`` (at most the room ``tunable`` left). Every rank of ``comm`` must call it
        at the same point between all-reduces (the autotuner's decision)."""
        if transport not in self.transports:
            raise ValueError(f"transport {transport} is not available here ({self.transports})")
        self.cma = transport is Transport.CMA
        if self.segment is not None:
            self.region_bytes = min(self._region_size(stripe_bytes), self.region_stride)

    @property
    def stripe_bytes(self) -> int:
        return self.region_bytes * self.local_size if self.segment is not None else 0

    def _temp(self, nbytes: int) -> np.ndarray:
        """This instance's own scratch (engines of different process sets run at once, so
        nothing is shared with the backend's scratch slots)."""
        if self._scratch.nbytes < nbytes:
            self._scratch = np.empty(nbytes, dtype=np.uint8)
        return self._scratch[:nbytes]

    def _region(self, half: int, slot: int, chunk: int, dtype: np.dtype, count: int) -> np.ndarray:
        start = ((half * self.local_size + slot) * self.local_size + chunk) * self.region_stride
        return self.segment[start:start + count * dtype.itemsize].view(dtype)

    def allreduce(self, buf: "Any | ring.Layout", op: ReduceOp, backend: NumpyBackend,
                  postscale: float = 1.0) -> None:
        """Reduce in place across ``comm``: Average over all its ranks, then ``postscale``."""
        layout = ring.as_layout(buf)
        if layout.size == 0:
            return
        self.calls += 1
        if self.cma:
            self._allreduce_cma(layout, op, backend, postscale)
        else:
            self._allreduce_segment(layout, op, backend, postscale)

    def _finisher(self, op: ReduceOp, dtype: np.dtype, backend: NumpyBackend,
                  postscale: float) -> Callable[[Any], None]:
        factor = finishing_factor(op, postscale, self.world_size)

        def finish(piece: Any) -> None:
            backend.scale(piece, factor)
        return finish

    def _allreduce_cma(self, layout: ring.Layout, op: ReduceOp, backend: NumpyBackend,
                       postscale: float) -> None:
        size, me = self.local_size, self.local_rank
        dtype, itemsize = layout.dtype, layout.itemsize
        read = self._read
        # Start: every rank's buffer is ready, and everyone learns where its pieces are.
        mine = np.fromiter((b.ctypes.data for b in layout.bufs), dtype=np.uint64, count=len(layout.bufs))
        bases = np.empty((size, len(mine)), dtype=np.uint64)
        self.local.Allgather(mine, bases)
        hierarchical = self.cross is not None
        finish = None if hierarchical else self._finisher(op, dtype, backend, postscale)
        reduce = reducer(np, op, dtype)
        block = max(1, self.cma_block_bytes // itemsize)
        scratch = self._temp(2 * block * itemsize).view(dtype)
        peer_block, acc_block = scratch[:block], scratch[block:]
        here = np.empty((1, 2), dtype=np.uint64)
        there = np.empty((1, 2), dtype=np.uint64)
        peer = (peer_block, peer_block.ctypes.data)
        accumulator = (acc_block, acc_block.ctypes.data)

        def fetch(k: int, index: int, offset: int, into: "tuple[np.ndarray, int]", n: int) -> np.ndarray:
            """Local rank k's elements [offset, offset + n) of buffer ``index``, into ``into``
            (a scratch block and its address)."""
            target, here[0, 0] = into
            here[0, 1] = there[0, 1] = n * itemsize
            there[0, 0] = int(bases[k, index]) + offset * itemsize
            read(k, here, there, n * itemsize)
            return target[:n]

        # On one host the buffer goes in stripes of one block per rank: each stripe's results
        # are copied out right after they are made, while their owners' caches still hold them.
        # Across hosts the whole buffer is one stripe (the ring runs once, on all of a chunk).
        stripe = layout.size if hierarchical else block * size
        barrier = self.local.Barrier
        for start in range(0, layout.size, stripe):
            bounds = [(start + lo, start + hi) for lo, hi in ring.even_bounds(min(stripe, layout.size - start), size)]
            lo, hi = bounds[me]
            for index, offset, own in layout.spans(lo, hi, block):
                n = own.size
                if me >= 2:
                    acc = fetch(0, index, offset, accumulator, n)
                    for k in range(1, me):
                        reduce(acc, fetch(k, index, offset, peer, n), out=acc)
                    reduce(acc, own, out=own)
                else:
                    # x0 op x1 == x1 op x0 for every op here: the rank's own buffer accumulates.
                    reduce(own, fetch(1 - me, index, offset, peer, n), out=own)
                for k in range(max(2, me + 1), size):
                    reduce(own, fetch(k, index, offset, peer, n), out=own)
                if finish is not None:
                    finish(own)
            if hierarchical:
                mine_views = layout.pieces(lo, hi, layout.size)
                if mine_views:  # every rank of ``cross`` has the same local rank, so the same chunks
                    ring.allreduce(self.cross, ring.Layout(mine_views), op, backend, self.segment_bytes,
                                   self.small_bytes, postscale, average_over=self.world_size)
            # Every chunk of this stripe is final; each rank has read its inputs in the stripe, so
            # copies into it overwrite nothing a peer still needs (later stripes are untouched).
            barrier()
            for k in range(size):
                lo, hi = bounds[k]
                if k == me or hi == lo:
                    continue
                spans = list(layout.spans(lo, hi, layout.size))
                targets = np.array([(view.ctypes.data, view.nbytes) for _, _, view in spans], dtype=np.uint64)
                sources = np.array([(int(bases[k, index]) + offset * itemsize, view.nbytes)
                                    for index, offset, view in spans], dtype=np.uint64)
                read(k, targets, sources, (hi - lo) * itemsize)
        barrier()  # nobody reads this rank's buffer any more: the caller may touch it

    def _read(self, k: int, here: np.ndarray, there: np.ndarray, nbytes: int) -> None:
        try:
            self._reader.read(self._pids[k], here, there, nbytes)
        except OSError as exc:
            raise OSError(f"shared-memory all-reduce: cannot read rank {self._world_ranks[k]}'s buffer "
                          f"({exc}); did that rank exit?") from None

    def _allreduce_segment(self, layout: ring.Layout, op: ReduceOp, backend: NumpyBackend,
                           postscale: float) -> None:
        count = layout.size
        size, me = self.local_size, self.local_rank
        dtype = layout.dtype
        chunk_cap = self.region_bytes // layout.itemsize
        stripe = chunk_cap * size
        starts = list(range(0, count, stripe))
        first_half = self._stripes_done
        self._stripes_done += len(starts)
        finish = self._finisher(op, dtype, backend, postscale)

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

        reduce = reducer(np, op, dtype)
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
