"""The staged (pinned host buffer) device path, run on host arrays standing in for device arrays.

``StandInDevice`` is a ``backend.Device`` whose "device" memory is NumPy and
whose stream runs work at once but *counts*: each queued op gets a sequence
number, and the host only knows an op is done once it synchronized an event
recorded after it. ``CheckedComm`` wraps the communicator and fails the rank
when MPI is handed a staging range whose filling copy the host has not seen
complete, when MPI writes a range a queued copy may still read, when a copy
touches a range MPI is still sending from or receiving into, or when MPI is
handed memory that is not pinned. So these tests check the stream/event
discipline the GPU relies on, and the results bit for bit against the host path.
"""
from __future__ import annotations

import numpy as np
import pytest
from mpi4py import MPI

from mtrain.ringreduce.transport import ring
from mtrain.ringreduce.transport.backend import NumpyBackend, StagedBackend
from mtrain.ringreduce.core.ops import Kind
from mtrain.ringreduce.transport.executor import Executor
from mtrain.ringreduce.engine.cycle import Engine
from mtrain.common.settings import EngineConfig
from mtrain.ringreduce.core.requests import Handle, make_request
from mtrain.ringreduce.core.ops import Average, Max, Min, Product, Sum
from tests.mpi.data import DTYPES, assert_matches, reference, values
from tests.mpi.harness import mpi_test

NPS = (2, 3)
SEGMENT = 4096          # small segments: many per chunk, so lanes are reused within a step
SMALL = 1024            # below this (N·bytes) the gather-and-reduce path runs
SIZES = [1, 2, 5, 127, 1000, 4099, 20011]


def _span(array: np.ndarray) -> "tuple[int, int]":
    start = array.__array_interface__["data"][0]
    return start, start + array.nbytes


def _overlap(a: "tuple[int, int]", b: "tuple[int, int]") -> bool:
    return a[0] < b[1] and b[0] < a[1] and a[0] < a[1]


class Ledger:
    """What the stand-in stream has queued and what MPI has in flight, by byte range."""

    def __init__(self) -> None:
        self.seq = 0
        self.seen_done = 0  # every op with seq <= this is known complete to the host
        self.copies: "list[tuple[int, tuple[int, int], str]]" = []  # (seq, pinned range, "fill"/"drain")
        self.mpi: "list[tuple[MPI.Request, tuple[int, int], str]]" = []
        self.pinned: "list[tuple[int, int]]" = []
        self.pinned_allocations = 0

    def queue_copy(self, pinned_range: "tuple[int, int]", kind: str) -> None:
        self.seq += 1
        self.mpi = [(r, span, mode) for r, span, mode in self.mpi if not r.Get_status()]
        for _, span, mode in self.mpi:
            # Filling a range MPI reads or writes, or draining one MPI is still writing: a race.
            if _overlap(span, pinned_range) and (kind == "fill" or mode == "write"):
                raise AssertionError(f"a device copy ({kind}) touches pinned bytes MPI is still using ({mode})")
        self.copies.append((self.seq, pinned_range, kind))

    def mpi_uses(self, buf: np.ndarray, mode: str, request: "MPI.Request | None" = None) -> None:
        span = _span(buf)
        if span[0] == span[1]:
            return
        if not any(lo <= span[0] and span[1] <= hi for lo, hi in self.pinned):
            raise AssertionError("MPI was handed memory that is not a pinned staging buffer")
        self.copies = [c for c in self.copies if c[0] > self.seen_done]
        for seq, copy_range, kind in self.copies:
            if _overlap(copy_range, span) and (kind == "fill" or mode == "write"):
                raise AssertionError(f"MPI {mode}s pinned bytes before the host synchronized copy #{seq} "
                                     f"({kind}) on them")
        if request is not None:
            self.mpi.append((request, span, mode))


class StandInEvent:
    def __init__(self, ledger: Ledger, seq: int) -> None:
        self.ledger, self.seq = ledger, seq

    def synchronize(self) -> None:
        self.ledger.seen_done = max(self.ledger.seen_done, self.seq)


class StandInDevice:
    """backend.Device on NumPy: runs work at once, but the host learns of it only through events."""

    xp = np

    def __init__(self) -> None:
        self.ledger = Ledger()

    def activate(self) -> None:
        """One "device", current everywhere: nothing to bind."""

    def empty(self, nbytes: int) -> np.ndarray:
        return np.empty(nbytes, dtype=np.uint8)

    def pinned(self, nbytes: int) -> np.ndarray:
        buf = np.empty(nbytes, dtype=np.uint8)
        self.ledger.pinned.append(_span(buf))
        self.ledger.pinned_allocations += 1
        return buf

    def launch(self, fn, *args) -> None:
        self.ledger.seq += 1
        fn(*args)

    def to_host(self, dst: np.ndarray, src: np.ndarray) -> None:
        self.ledger.queue_copy(_span(dst), "fill")
        np.copyto(dst, src)

    def to_device(self, dst: np.ndarray, src: np.ndarray) -> None:
        self.ledger.queue_copy(_span(src), "drain")
        np.copyto(dst, src)

    def record(self) -> StandInEvent:
        return StandInEvent(self.ledger, self.ledger.seq)

    def synchronize(self) -> None:
        self.ledger.seen_done = self.ledger.seq


class CheckedComm:
    """A communicator that checks every buffer it is handed against the ledger."""

    def __init__(self, comm: MPI.Comm, ledger: Ledger) -> None:
        self._comm, self._ledger = comm, ledger

    def Get_size(self) -> int:
        return self._comm.Get_size()

    def Get_rank(self) -> int:
        return self._comm.Get_rank()

    def Isend(self, buf: np.ndarray, dest: int, tag: int) -> MPI.Request:
        self._ledger.mpi_uses(buf, "read")
        request = self._comm.Isend(buf, dest, tag)
        self._ledger.mpi_uses(buf, "read", request)
        return request

    def Irecv(self, buf: np.ndarray, source: int, tag: int) -> MPI.Request:
        self._ledger.mpi_uses(buf, "write")
        request = self._comm.Irecv(buf, source, tag)
        self._ledger.mpi_uses(buf, "write", request)
        return request

    def Allgather(self, send: np.ndarray, recv: np.ndarray) -> None:
        self._ledger.mpi_uses(send, "read")
        self._ledger.mpi_uses(recv, "write")
        self._comm.Allgather(send, recv)

    def Bcast(self, buf: np.ndarray, root: int) -> None:
        self._ledger.mpi_uses(buf, "read" if self._comm.Get_rank() == root else "write")
        self._comm.Bcast(buf, root=root)


def _staged(comm: MPI.Comm) -> "tuple[StagedBackend, CheckedComm, Ledger]":
    device = StandInDevice()
    return StagedBackend(device, "standin"), CheckedComm(comm, device.ledger), device.ledger


def _same_bits(got: np.ndarray, want: np.ndarray, what: str) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape, what
    if not np.array_equal(got.view(np.uint8), want.view(np.uint8)):
        k = int(np.argmax(got != want)) if got.dtype != np.bool_ else 0
        raise AssertionError(f"{what}: staged result differs from the host path (first at element {k})")


@mpi_test(nps=NPS)
def test_staged_allreduce_equals_host_bit_for_bit():
    comm = MPI.COMM_WORLD.Dup()
    rank, size = comm.Get_rank(), comm.Get_size()
    staged, checked, _ = _staged(comm)
    host = NumpyBackend()
    for dtype in DTYPES:
        for op in (Sum, Average, Min, Max, Product):
            for count in SIZES:
                what = f"staged allreduce {np.dtype(dtype).name} op={op.name} count={count} np={size}"
                mine = values(rank, (count,), dtype, op).reshape(-1)
                on_device, on_host = mine.copy(), mine.copy()
                ring.allreduce(checked, on_device, op, staged, SEGMENT, SMALL)
                ring.allreduce(comm, on_host, op, host, SEGMENT, SMALL)
                _same_bits(on_device, on_host, what)
                everyone = [values(r, (count,), dtype, op).reshape(-1) for r in range(size)]
                assert_matches(on_device, reference(everyone, op), what)
    comm.Free()


@mpi_test(nps=NPS)
def test_staged_allgather_and_broadcast_equal_host():
    comm = MPI.COMM_WORLD.Dup()
    rank, size = comm.Get_rank(), comm.Get_size()
    staged, checked, _ = _staged(comm)
    for dtype in (np.float16, np.int32, np.uint8, np.float64, np.bool_):
        # Uneven pieces, one of them empty: rank r owns r*37 (+1 on rank 0) elements.
        lengths = [r * 37 + (1 if r == 0 else 0) for r in range(size)]
        offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(int)
        bounds = [(int(offsets[r]), int(offsets[r + 1])) for r in range(size)]
        full = np.concatenate([values(r, (n,), np.int64).astype(dtype) for r, n in enumerate(lengths)])
        buf = np.zeros_like(full)
        lo, hi = bounds[rank]
        buf[lo:hi] = full[lo:hi]
        ring.allgather(checked, buf, bounds, staged)
        _same_bits(buf, full, f"staged allgather {np.dtype(dtype).name} np={size}")
        for root in range(size):
            mine = values(rank, (1001,), np.int64).astype(dtype)
            staged.bcast(checked, mine, root)
            _same_bits(mine, values(root, (1001,), np.int64).astype(dtype),
                       f"staged broadcast {np.dtype(dtype).name} root={root}")
    comm.Free()


@mpi_test(nps=NPS)
def test_pinned_buffers_are_reused_in_steady_state():
    comm = MPI.COMM_WORLD.Dup()
    staged, checked, ledger = _staged(comm)
    buf = values(comm.Get_rank(), (50_000,), np.float32).reshape(-1)
    for _ in range(2):  # warm up: every staging buffer reaches its size
        ring.allreduce(checked, buf.copy(), Sum, staged, SEGMENT, SMALL)
    warm = ledger.pinned_allocations
    assert warm > 0
    for _ in range(5):
        ring.allreduce(checked, buf.copy(), Sum, staged, SEGMENT, SMALL)
    assert ledger.pinned_allocations == warm, f"{ledger.pinned_allocations - warm} pinned allocations after warm-up"
    comm.Free()


def _engine_allreduce(engine: Engine, arrays: "list[np.ndarray]", backend) -> list:
    handle = Handle(len(arrays), grouped=True, done_cv=engine.done_cv)
    requests = []
    for i, array in enumerate(arrays):
        request = make_request(Kind.ALLREDUCE, array, f"staged.{i}", handle, i, op=Sum)
        request.backend = backend  # route this host array through the stand-in device backend
        request.signature = request.meta()
        requests.append(request)
    engine.submit(requests)
    return handle.wait()


@mpi_test(nps=NPS)
def test_engine_fused_path_through_staged_backend():
    comm = MPI.COMM_WORLD.Dup()
    rank, size = comm.Get_rank(), comm.Get_size()
    staged, checked, _ = _staged(comm)
    config = EngineConfig(fusion_threshold_bytes=64 << 10, inplace_min_bytes=64 << 10)
    engine = Engine(Executor(checked, SEGMENT, SMALL), comm.Dup(), config)  # type: ignore[arg-type]
    try:
        shapes = [(3,), (17, 5), (1,), (2000,), (7, 7, 7), (40_000,)]  # the last one runs alone
        for dtype in (np.float32, np.int64, np.float16):
            arrays = [values(rank, shape, dtype) for shape in shapes]
            results = _engine_allreduce(engine, arrays, staged)
            for shape, got in zip(shapes, results):
                everyone = [values(r, shape, dtype) for r in range(size)]
                assert_matches(got, reference(everyone, Sum), f"engine staged {np.dtype(dtype).name}{shape}")
    finally:
        engine.shutdown()
    comm.Free()


class _SendsBeforeCopyDone(StagedBackend):
    """Broken on purpose: hands pinned bytes to MPI without waiting for the copy event."""

    def isend(self, comm, views, dest, tag):
        staging = self.staging("send", sum(v.nbytes for v in views))
        self.device.to_host(staging, views[0].view(np.uint8))
        return [comm.Isend(staging, dest, tag)]


class _ReusesLaneTooSoon(StagedBackend):
    """Broken on purpose: receives into a lane whose pinned→device copy the host never waited for."""

    def irecv(self, comm, view, source, tag, lane=0):
        self.lane_free.pop(lane, None)
        return super().irecv(comm, view, source, tag, lane)


@mpi_test(nps=(2,))
def test_checker_catches_broken_staging():
    comm = MPI.COMM_WORLD.Dup()
    rank, size = comm.Get_rank(), comm.Get_size()
    right, left = (rank + 1) % size, (rank - 1) % size
    data = np.arange(64, dtype=np.float32)

    device = StandInDevice()
    broken_send = _SendsBeforeCopyDone(device, "standin")
    with pytest.raises(AssertionError, match="before the host synchronized copy"):
        broken_send.isend(CheckedComm(comm, device.ledger), [data], right, 5)

    device = StandInDevice()
    broken_lane, checked = _ReusesLaneTooSoon(device, "standin"), CheckedComm(comm, device.ledger)
    target = np.empty_like(data)
    pending = [broken_lane.irecv(checked, target, left, 6, lane=0)]
    pending += broken_lane.isend(checked, [data], right, 6)
    broken_lane.wait_all(pending)  # queues the lane's pinned→device copy
    np.testing.assert_array_equal(target, data)
    with pytest.raises(AssertionError, match="MPI writes pinned bytes before"):
        broken_lane.irecv(checked, target, left, 7, lane=0)
    comm.Barrier()
    comm.Free()


# -- pure pieces of the GPU path (no MPI job, no GPU) -----------------------

def test_gpu_choice_respects_the_users_choice():
    from mtrain.ringreduce.transport.cuda import choose_device
    assert [choose_device(r, 2, {}, False) for r in range(4)] == [0, 1, 0, 1]
    assert choose_device(3, 0, {}, False) is None                                 # no GPU: nothing to bind
    assert choose_device(1, 1, {"CUDA_VISIBLE_DEVICES": "3"}, False) is None      # launcher gave one GPU
    assert choose_device(1, 4, {"CUDA_VISIBLE_DEVICES": "0,1,2,3"}, False) == 1
    assert choose_device(1, 4, {}, already_current=True) is None                 # user picked before init()


def test_device_scaling_matches_host_bit_for_bit():
    # The device backend runs the same rule through its device (every wider type asked for
    # explicitly: CuPy 13 would compute int8 * np.float64 in float16); on the NumPy stand-in
    # it must give the host's exact bits.
    host, (device, _, _) = NumpyBackend(), _staged(MPI.COMM_SELF)
    for dtype in (np.int8, np.uint8, np.int16, np.int32, np.int64, np.float16, np.float32, np.float64):
        for factor in (0.9, 0.3, 1.0 / 3.0, 2.5):
            mine = values(1, (4099,), dtype).reshape(-1)
            if np.dtype(dtype).kind in "iu":
                mine = mine // 4  # products stay inside the dtype's range
            want, got = mine.copy(), mine.copy()
            host.scale(want, factor)
            device.scale(got, factor)
            _same_bits(got, want, f"scale {np.dtype(dtype).name} by {factor}")


def test_cuda_aware_override(monkeypatch):
    from mtrain.ringreduce.transport import cuda
    monkeypatch.setenv(cuda.CUDA_AWARE_ENV, "1")
    assert cuda.cuda_aware() is True
    monkeypatch.setenv(cuda.CUDA_AWARE_ENV, "0")
    assert cuda.cuda_aware() is False
    monkeypatch.setenv(cuda.CUDA_AWARE_ENV, "maybe")
    with pytest.raises(ValueError, match="MTRAIN_CUDA_AWARE='maybe'"):
        cuda.cuda_aware()
