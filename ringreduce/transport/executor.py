"""Collectives on NumPy (or device) arrays, one at a time, once every rank has agreed to run them.

Nothing here checks arguments. ``engine/submit.py`` validates each one once, in the
caller's thread (dtype, op, root, splits; objects are pickled there, unpickled in api.py), and the engine's
negotiation (``negotiation/``) runs an op only once every rank has
submitted it under the same name with the same collective, dtype, shape, op,
root and scaling, so a mismatch is an error on every rank, never a hang. The
only metadata that still moves here is data the collective needs: allgather's
per-rank first dimensions and alltoall's per-rank splits.
"""
from __future__ import annotations

import enum
import math
import os
import sys
from typing import Sequence

import numpy as np

from mtrain.common import settings
from mtrain.ringreduce.core.ops import ReduceOp
from mtrain.ringreduce.transport import library, mpi, ring, shm, size_table
from mtrain.ringreduce.transport.adasum import AdasumRunner
from mtrain.ringreduce.transport.backend import NumpyBackend, backend_for, finishing_factor

MPI = mpi.deferred(__name__)  # mpi4py's MPI from init() on (importing the runtime starts no MPI)


class Algorithm(settings.TextChoice):
    """The all-reduce algorithm asked for (MTRAIN_ALLREDUCE_ALGORITHM), and what an Executor
    runs (``Executor.allreduce_path``: RING, SHM or HIERARCHICAL, never AUTO). Its text is
    the setting's (``settings.TextChoice``)."""

    AUTO = "auto"                  # per size, the path measured fastest here (size_table.py)
    RING = "ring"                  # ring.allreduce over the whole communicator
    SHM = "shm"                    # shared memory on each host (hierarchical on several)
    HIERARCHICAL = "hierarchical"  # the same path as SHM, under Horovod's name
    MPI = "mpi"                    # the MPI library's own MPI_Allreduce (library.py)

    @classmethod
    def noun(cls) -> str:
        return "all-reduce algorithm"


ALGORITHM_VARIABLE = settings.ALLREDUCE_ALGORITHM.ours
STRIPE_VARIABLE = settings.SHM_STRIPE_BYTES.ours  # the shared-memory path's stripe (shm.py); tuning and tests
TRANSPORT_VARIABLE = settings.SHM_TRANSPORT.ours  # a shm.Transport's text
# settings.py spells the choices (and the stripe's default, for its message) out for the launcher,
# which reads the table without the runtime.
if (tuple(a.value for a in Algorithm) != settings.ALLREDUCE_ALGORITHMS
        or tuple(t.value for t in shm.Transport) != settings.SHM_TRANSPORTS
        or shm.DEFAULT_STRIPE_BYTES != settings.DEFAULT_SHM_STRIPE_BYTES):  # pragma: no cover
    raise ImportError("settings.py's all-reduce algorithms, shared-memory transports or stripe default differ "
                      "from collectives.Algorithm's, shm.Transport's or shm.DEFAULT_STRIPE_BYTES")


def algorithm_from_environment(environ: "dict[str, str] | None" = None) -> Algorithm:
    """The all-reduce algorithm asked for: MTRAIN_ALLREDUCE_ALGORITHM, else Horovod's
    HOROVOD_HIERARCHICAL_ALLREDUCE=1 (hierarchical), else auto."""
    environ = os.environ if environ is None else environ
    text = settings.ALLREDUCE_ALGORITHM.read(environ)
    if text is None:
        # Horovod's flag (parsed as Horovod does): on is hierarchical; off is Horovod's default, so ours.
        return Algorithm.HIERARCHICAL if settings.HIERARCHICAL_ALLREDUCE.read(environ) else Algorithm.AUTO
    return Algorithm(text)


def transport_from_environment(environ: "dict[str, str] | None" = None) -> shm.Transport:
    """The shared-memory transport asked for: MTRAIN_SHM_TRANSPORT, else auto."""
    text = settings.SHM_TRANSPORT.read(environ)
    return shm.Transport.AUTO if text is None else shm.Transport(text)


def _stripe_from_environment() -> "int | None":
    return settings.SHM_STRIPE_BYTES.read()


class Executor:
    """Runs collectives on a communicator. One instance per initialised runtime.

    Host-buffer all-reduces take one of three paths:

    * ``mpi``: the library's own ``MPI_Allreduce`` (``library.py``), for the dtypes and ops
      it reduces as we do;
    * ``ring``: ``ring.allreduce`` over ``comm`` (point-to-point messages);
    * shared memory (``shm.py``): the ranks of a host reduce their chunks straight
      from each other's buffers (cross-memory attach), or through one shared segment
      where the kernel refuses that; with several hosts, each rank then runs the ring
      over ``cross`` on its chunk only (hierarchical). Needs ``local`` with more than
      one rank and the same number of ranks on every host (``cross`` lines up equal
      chunks).

    MTRAIN_ALLREDUCE_ALGORITHM: ``ring`` forces the ring, ``mpi`` the library's;
    ``shm`` and ``hierarchical`` ask for the shared-memory path (which is hierarchical
    as soon as there are several hosts); ``auto`` (default) takes, for each size, the
    path measured fastest there (``choose_paths``: ``size_table.py``); until measured,
    shared memory where it can. Where it cannot (one rank per host, uneven hosts), the
    ring runs; device buffers always take the ring.
    MTRAIN_SHM_TRANSPORT (``shm_transport``): ``auto`` (default) goes through the shared
    segment, and reads the peers' buffers (cma) only where the segment cannot be mapped;
    ``cma`` reads them (fastest on huge pages; says so on stderr and takes the segment
    where the kernel refuses); ``segment`` always goes through the shared segment.
    """

    def __init__(self, comm: MPI.Comm, segment_bytes: int, small_bytes: int,
                 local: "MPI.Comm | None" = None, cross: "MPI.Comm | None" = None,
                 algorithm: "Algorithm | str | None" = None, shm_stripe_bytes: "int | None" = None,
                 shm_transport: "shm.Transport | str | None" = None, tunable: bool = False) -> None:
        self.comm = comm
        # ``comm`` split by host (``local``) and by local rank across hosts (``cross``); None
        # when the caller has no such split (then every collective runs on ``comm`` alone).
        # Any split works (a test may cut one host into fake ones) as long as ``cross``
        # groups the ranks with the same rank in ``local``.
        self.local = local
        self.cross = cross
        self.size = comm.Get_size()
        self.rank = comm.Get_rank()
        self.segment_bytes = segment_bytes
        self.small_bytes = small_bytes
        self.algorithm = algorithm_from_environment() if algorithm is None else Algorithm.of(algorithm)
        transport = transport_from_environment() if shm_transport is None else shm.Transport.of(shm_transport)
        # auto: buffers the ring reduces by one gather (N·bytes <= small_bytes) stay on the ring:
        # a single MPI_Allgather costs less than two shared-memory barriers and the copies
        # around them. From there up shared memory moves fewer bytes and wins.
        self.shm_min_bytes = self._shm_min_bytes(self.algorithm)
        self.shared: "shm.SharedMemoryAllreduce | None" = None
        self.adasum = AdasumRunner(comm, local, cross)
        # Which path each size takes under auto, once measured (``choose_paths``); the table
        # counts while ``use`` has not picked another algorithm.
        self.by_size: "size_table.SizeTable | None" = None
        self._chosen = self.algorithm
        self._local_sizes: "list[int] | None" = None
        if self.algorithm not in (Algorithm.RING, Algorithm.MPI) and local is not None and self.size > 1:
            # Collective over ``comm``: fine here, the engine thread has not started yet.
            local_sizes = self._local_sizes = comm.allgather(local.Get_size())
            one_host = local.Get_size() == self.size
            homogeneous = len(set(local_sizes)) == 1 and (one_host or cross is not None)
            if homogeneous and local.Get_size() > 1:
                if shm_stripe_bytes is None:
                    shm_stripe_bytes = _stripe_from_environment()
                shared = shm.SharedMemoryAllreduce(comm, local, None if one_host else cross,
                                                   segment_bytes, small_bytes, shm_stripe_bytes,
                                                   transport=transport, tunable=tunable)
                if transport is shm.Transport.CMA and not shared.cma and self.rank == 0:
                    sys.stderr.write(f"mtrain: {shared.notice}; shared memory uses the segment instead\n")
                if shared.error is None:
                    self.shared = shared
                elif self.rank == 0:
                    sys.stderr.write(f"mtrain: {shared.error}; all-reduces use the ring instead\n")

    def _shm_min_bytes(self, algorithm: Algorithm) -> float:
        """Host buffers of at least this many bytes take the shared-memory path (if there is one)."""
        if algorithm is Algorithm.AUTO:
            return self.small_bytes // self.size + 1
        return math.inf if algorithm in (Algorithm.RING, Algorithm.MPI) else 0

    def algorithms(self) -> "tuple[Algorithm, ...]":
        """The choices ``use`` takes here: AUTO, RING and SHM where there is a shared-memory
        path (SHM is hierarchical on several hosts), else RING alone."""
        return (Algorithm.AUTO, Algorithm.RING, Algorithm.SHM) if self.shared is not None else (Algorithm.RING,)

    def use(self, algorithm: Algorithm, segment_bytes: int) -> None:
        """Run the next all-reduces by ``algorithm`` (one of ``algorithms()``) with ring segments of
        ``segment_bytes``. Every rank must call it at the same point between collectives (the
        autotuner's decision): the ranks then take the same path for the same buffer."""
        if algorithm not in self.algorithms():
            raise ValueError(f"all-reduce algorithm {algorithm} is not available here")
        self.shm_min_bytes = self._shm_min_bytes(algorithm)
        self._chosen = algorithm
        self.segment_bytes = segment_bytes
        if self.shared is not None:
            self.shared.segment_bytes = segment_bytes

    @property
    def allreduce_path(self) -> Algorithm:
        """What host-buffer all-reduces run: RING, SHM (one host) or HIERARCHICAL."""
        if self.shared is None:
            return Algorithm.MPI if self.algorithm is Algorithm.MPI else Algorithm.RING
        return Algorithm.HIERARCHICAL if self.shared.cross is not None else Algorithm.SHM

    def runners(self) -> "dict[str, size_table.Runner]":
        """Each host path this executor has, as one in-place float32 Sum (what ``size_table``
        probes): the library's MPI_Allreduce, the ring, and shared memory where there is some."""
        backend = backend_for(np.empty(0, np.float32))
        runners: "dict[str, size_table.Runner]" = {
            Algorithm.MPI.value: lambda buf: library.allreduce(self.comm, [buf], ReduceOp.Sum, backend, 1.0),
            Algorithm.RING.value: lambda buf: ring.allreduce(self.comm, buf, ReduceOp.Sum, backend,
                                                             self.segment_bytes, self.small_bytes),
        }
        if self.shared is not None:
            shared = self.shared
            runners[self.allreduce_path.value] = lambda buf: shared.allreduce(buf, ReduceOp.Sum, backend, 1.0)
        return runners

    def choose_paths(self) -> None:
        """Under auto, with two ranks or more: which path each size of host buffer takes, from the
        table kept for this topology or measured now (``size_table.choose``; collective over
        ``comm``, before the engine thread starts)."""
        if self.algorithm is not Algorithm.AUTO or self.size < 2:
            return
        # Without a split by host (``local`` None) every rank counts as a host of its own.
        table = size_table.choose(self.comm, self._local_sizes or [1] * self.size, self.runners())
        self.by_size = table._replace(paths=tuple(map(Algorithm, table.paths)))  # looked up per op

    def path_for(self, nbytes: int, dtype: np.dtype, op: ReduceOp) -> Algorithm:
        """The path a host all-reduce of ``nbytes`` of ``dtype`` under ``op`` takes (every rank
        decides alike: the buffers were negotiated, the table and settings are the same)."""
        chosen = self._chosen
        if chosen is Algorithm.AUTO and self.by_size is not None:
            path = self.by_size.path_for(nbytes)
            if path is Algorithm.MPI:
                if library.supports(dtype, op):
                    return path
            elif path is Algorithm.RING or self.shared is not None:
                return path
        elif chosen is Algorithm.MPI and library.supports(dtype, op):
            return Algorithm.MPI
        if self.shared is not None and nbytes >= self.shm_min_bytes:
            return self.allreduce_path
        return Algorithm.RING

    # -- all-reduce ---------------------------------------------------------
    def allreduce_flat(self, flats: "list[np.ndarray]", op: ReduceOp, backend: NumpyBackend,
                       prescale_factor: float = 1.0, postscale_factor: float = 1.0) -> None:
        """One all-reduce over already-agreed contiguous buffers (as one logical buffer), with scaling."""
        for flat in flats:
            backend.scale(flat, prescale_factor)
        lone = len(flats) == 1
        buf = flats[0] if lone else ring.Layout(flats)
        # Every rank decides alike: same buffers (negotiated), same backend kind, same settings.
        if isinstance(backend, NumpyBackend):
            nbytes = buf.nbytes if lone else sum(flat.nbytes for flat in flats)
            path = self.path_for(nbytes, flats[0].dtype, op)
            if path is Algorithm.MPI:
                library.allreduce(self.comm, flats, op, backend, postscale_factor)
                return
            if path is not Algorithm.RING:
                self.shared.allreduce(buf, op, backend, postscale_factor)
                return
        ring.allreduce(self.comm, buf, op, backend, self.segment_bytes, self.small_bytes, postscale_factor)

    def adasum_flat(self, flats: "list[np.ndarray]", counts: "list[int]", backend: NumpyBackend,
                    prescale_factor: float = 1.0, postscale_factor: float = 1.0) -> None:
        """Adasum over already-agreed contiguous buffers (one logical buffer whose tensors hold
        ``counts`` elements each: each tensor gets its own coefficients), with scaling."""
        self.adasum.run(flats, counts, backend, prescale_factor, postscale_factor, self.segment_bytes,
                        self.small_bytes)

    def close(self) -> None:
        """Unmap the shared segment (local; nothing collective)."""
        if self.shared is not None:
            self.shared.close()

    # -- reduce-scatter -----------------------------------------------------
    def reducescatter(self, array: np.ndarray, op: ReduceOp, prescale_factor: float = 1.0,
                      postscale_factor: float = 1.0) -> np.ndarray:
        """Reduce across ranks, then rank r keeps rows r of the first dimension split N ways
        (the first ``rows % N`` ranks get one extra row). Scaling as for all-reduce."""
        backend = backend_for(array)
        work = array.copy(order="C").reshape(-1)
        backend.scale(work, prescale_factor)
        row = math.prod(array.shape[1:])
        # Chunks fall on row boundaries: rank r's chunk is its share of the rows.
        row_bounds = ring.even_bounds(array.shape[0], self.size)
        ring.reduce_scatter(self.comm, work, op, backend, self.segment_bytes,
                            [(lo * row, hi * row) for lo, hi in row_bounds])
        lo, hi = row_bounds[self.rank]
        result = work[lo * row:hi * row].reshape((hi - lo,) + array.shape[1:]).copy()
        backend.scale(result.reshape(-1), finishing_factor(op, postscale_factor, self.size))
        return result

    # -- all-gather ---------------------------------------------------------
    def allgather(self, array: np.ndarray) -> np.ndarray:
        """Concatenate every rank's array along the first dimension (which may differ)."""
        backend = backend_for(array)
        if array.ndim == 0:
            array = array.reshape(1)
        # The one thing ranks do not agree on in advance: each rank's first dimension.
        firsts_of = np.empty(self.size, dtype=np.int64)
        self.comm.Allgather(np.array([array.shape[0]], dtype=np.int64), firsts_of)
        firsts = firsts_of.tolist()
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
    def broadcast(self, array: np.ndarray, root_rank: int, out: "np.ndarray | None" = None) -> np.ndarray:
        """Every rank ends with root's values (into ``out``: new array when None, may be ``array``)."""
        backend = backend_for(array)
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
    def alltoall(self, array: np.ndarray, splits: Sequence[int]) -> "tuple[np.ndarray, np.ndarray]":
        """Send rows ``splits[r]`` of ``array`` to rank r; returns (received, received_splits)."""
        send_splits = np.asarray(splits, dtype=np.int64)
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
        """Nothing left to do: the negotiation runs an op only once every rank has submitted it,
        so by the time a barrier runs every rank has reached it."""

    def broadcast_bytes(self, payload: "bytes | None", root_rank: int) -> bytes:
        """Root's ``payload`` (ignored on the other ranks)."""
        return self.comm.bcast(payload, root=root_rank)

    def allgather_bytes(self, payload: bytes) -> "list[bytes]":
        """Every rank's ``payload``, in rank order."""
        return self.comm.allgather(payload)
