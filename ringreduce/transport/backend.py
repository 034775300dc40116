"""Array helpers and transfers the collectives need, one backend per kind of memory.

The ring (``ring.py``) is written once against this small interface. What
differs between host and device memory lives here:

* array helpers: how a buffer is created, reduced, scaled, copied;
* transfers: how a piece of a buffer reaches MPI (``isend``, ``irecv``,
  ``wait_all``, ``allgather``, ``bcast``).

``NumpyBackend`` hands host views straight to MPI. ``DeviceBackend`` does the
same with device buffers for a CUDA-aware MPI, synchronizing the stream first
(mpi4py does not). ``StagedBackend`` moves device buffers through reusable
pinned host buffers: each device-to-host copy is queued on the stream with an
event, and MPI touches a staging buffer only after the event of the copy that
fills (or empties) it has completed; later copies run while earlier segments
are on the wire. Both device backends take a ``Device`` (``cuda.CupyDevice``
on a GPU; a NumPy stand-in in the tests), so the staging logic is the same code
with or without a GPU.

``backend_for`` picks the backend of an array. Host arrays are known here;
device array types are registered by the module that drives the device
(``cuda.py`` registers CuPy's when it is imported, which the runtime always
does), so this module imports no device code and nothing imports it back.
"""
from __future__ import annotations

import threading
from typing import Any, Callable, Protocol, Sequence, Union

import numpy as np

from mtrain.ringreduce.core.ops import ReduceOp, reducer, reducers
from mtrain.ringreduce.transport import mpi

MPI = mpi.deferred(__name__)  # mpi4py's MPI from init() on (importing the runtime starts no MPI)


def _reduce(xp: Any, dst: Any, src: Any, op: ReduceOp) -> None:
    reducer(xp, op, dst.dtype)(dst, src, out=dst)


def scale_in_place(xp: Any, buf: Any, factor: float) -> None:
    """``buf *= factor`` in place by Horovod's CPU rule (horovod/common/ops/collective_operations.cc,
    ``HorovodOp::ScaleBuffer``, and ``ScaleBufferCPUImpl`` in collective_operations.h): float32 and
    float64 are multiplied in their own dtype by the factor cast to it (``(float)scale_factor`` for
    float32: 1/3 becomes float32's 1/3 before the product); 16-bit floats are widened to float32
    and multiplied by the factor rounded to float32; integers are multiplied in float64 and
    truncated toward zero on the way back (-37 * 0.5 -> -18, not the floor -19).

    Each wider type is asked for explicitly (``astype``): CuPy 13 promotes NumPy scalars by value
    (NumPy 1 rules), so ``int8_array * np.float64(f)`` would be computed in float16 there.
    """
    dtype = buf.dtype
    if dtype.kind in "iu":
        buf[...] = xp.trunc(buf.astype(np.float64) * np.float64(factor)).astype(dtype)
        return
    if not (dtype.name == "bfloat16" or dtype.kind == "f" and dtype.itemsize == 2):
        # float32 and float64 (and bool): the factor is rounded to the buffer's dtype
        # first, so the product is one rounding of buf * dtype(factor); taking it in float64 with
        # the exact factor can land one ulp away.
        xp.multiply(buf, dtype.type(factor), out=buf)
    elif xp is np and dtype.name != "bfloat16":
        # NumPy widens float16 block by block inside the ufunc: no temporaries the size of the
        # buffer (4x faster than astype at 16 MiB, the same bits).
        np.multiply(buf, np.float32(factor), out=buf, dtype=np.float32)
    else:
        buf[...] = (buf.astype(np.float32) * np.float32(factor)).astype(dtype)


def finishing_factor(op: ReduceOp, postscale: float, divisor: int) -> float:
    """The one scaling that ends a reduction over ``divisor`` ranks: Average is a sum scaled by
    ``postscale / divisor``, as Horovod's ``EnqueueTensorAllreduces`` turns it into Sum with the
    postscale factor divided by the set's size; every other op is scaled by ``postscale``."""
    return postscale / divisor if op == ReduceOp.Average else postscale


def _per_thread(local: threading.local, name: str) -> dict:
    """The calling thread's dict ``name`` in ``local``, created empty on first use."""
    found = getattr(local, name, None)
    if found is None:
        found = {}
        setattr(local, name, found)
    return found


_NUMPY_REDUCERS = reducers(np)


class NumpyBackend:
    """Host memory: NumPy arrays, reductions by NumPy ufuncs in place, MPI on the views."""

    name = "numpy"

    def __init__(self) -> None:
        # Reused scratch space, one byte buffer per slot, grown on demand so a
        # steady stream of collectives allocates nothing new. One set per thread: every
        # process set's engine runs its collectives in its own thread, at the same time.
        self._local = threading.local()

    @property
    def _scratch(self) -> dict:
        return _per_thread(self._local, "scratch")

    def owns(self, array: Any) -> bool:
        return isinstance(array, np.ndarray)

    def empty(self, count: int, dtype: np.dtype) -> np.ndarray:
        return np.empty(count, dtype=dtype)

    def flatten(self, array: np.ndarray) -> "tuple[np.ndarray, bool]":
        """A contiguous 1-D view of ``array``, or a copy when it is not contiguous.

        The flag says whether a copy was made (and so results must be copied back).
        """
        if array.flags.c_contiguous:
            return array.reshape(-1), False
        return np.ascontiguousarray(array).reshape(-1), True

    def scratch(self, slot: "int | str", count: int, dtype: np.dtype) -> np.ndarray:
        """A reusable buffer of ``count`` elements; contents undefined."""
        nbytes = count * dtype.itemsize
        buf = self._scratch.get(slot)
        if buf is None or buf.nbytes < nbytes:
            buf = np.empty(max(nbytes, 1), dtype=np.uint8)
            self._scratch[slot] = buf
        return buf[:nbytes].view(dtype)

    def reduce_into(self, dst: np.ndarray, src: np.ndarray, op: ReduceOp) -> None:
        """dst = op(dst, src), elementwise, in place."""
        _NUMPY_REDUCERS(op, dst.dtype)(dst, src, out=dst)

    def scale(self, buf: np.ndarray, factor: float) -> None:
        """buf *= factor in place, by Horovod's rule (``scale_in_place``)."""
        if factor == 1.0 or buf.size == 0:
            return
        scale_in_place(np, buf, factor)

    def copy(self, dst: np.ndarray, src: np.ndarray) -> None:
        np.copyto(dst, src)

    def as_bytes(self, buf: np.ndarray) -> np.ndarray:
        """The byte view MPI moves: every transfer is raw bytes, reductions are ours."""
        return buf.view(np.uint8)

    def ready_for_mpi(self) -> None:
        """Host memory is always ready; a device backend synchronizes its stream here."""

    # -- transfers: host views go to MPI as they are, no copies -------------
    def isend(self, comm: Any, views: "Sequence[np.ndarray]", dest: int, tag: int) -> list:
        """Start sending each view (in order) to ``dest``; returns what ``wait_all`` takes."""
        return [comm.Isend(view.view(np.uint8), dest, tag) for view in views]

    def irecv(self, comm: Any, view: np.ndarray, source: int, tag: int, lane: int = 0) -> Any:
        """Start receiving into ``view``. Receives in flight together use different ``lane``s."""
        return comm.Irecv(view.view(np.uint8), source, tag)

    def wait_all(self, pending: list) -> None:
        """Complete sends and receives; received data is then in place for the next backend call."""
        MPI.Request.Waitall(pending)

    def allgather(self, comm: Any, mine: np.ndarray, gathered: np.ndarray) -> None:
        comm.Allgather(mine.view(np.uint8), gathered.view(np.uint8))

    def bcast(self, comm: Any, buf: np.ndarray, root: int) -> None:
        comm.Bcast(buf.view(np.uint8), root=root)




# -- device memory ----------------------------------------------------------


class Event(Protocol):
    def synchronize(self) -> None: ...


class Device(Protocol):
    """What the device backends need from a device: its array module, one stream, pinned memory.

    Every method that queues work puts it on the same stream, in call order.
    ``activate`` makes the device (and that stream) current for the calling
    thread: the backends call it before they use ``xp`` directly.
    """

    xp: Any  # the array module of device arrays (cupy; numpy for the stand-in)

    def activate(self) -> None: ...                     # this device current for this thread
    def empty(self, nbytes: int) -> Any: ...            # device bytes
    def pinned(self, nbytes: int) -> np.ndarray: ...    # page-locked host bytes
    def launch(self, fn: Callable, *args: Any) -> None: ...  # device work, queued
    def to_host(self, dst: np.ndarray, src: Any) -> None: ...    # queue a byte copy
    def to_device(self, dst: Any, src: np.ndarray) -> None: ...  # queue a byte copy
    def record(self) -> Event: ...                      # an event after all work queued so far
    def synchronize(self) -> None: ...                  # wait for all queued work


class DeviceBackend:
    """Device memory, handed to a CUDA-aware MPI directly (after a stream synchronize)."""

    def __init__(self, device: Device, name: str) -> None:
        self.device = device
        self.xp = device.xp
        self.name = name
        self._local = threading.local()  # scratch per thread, as NumpyBackend's

    @property
    def _scratch(self) -> dict:
        return _per_thread(self._local, "scratch")

    def owns(self, array: Any) -> bool:
        return isinstance(array, self.xp.ndarray)

    def empty(self, count: int, dtype: np.dtype) -> Any:
        self.device.activate()  # CuPy allocates on the calling thread's current device
        return self.xp.empty(count, dtype=dtype)

    def flatten(self, array: Any) -> "tuple[Any, bool]":
        if array.flags.c_contiguous:
            return array.reshape(-1), False
        self.device.activate()
        return self.xp.ascontiguousarray(array).reshape(-1), True

    def scratch(self, slot: "int | str", count: int, dtype: np.dtype) -> Any:
        nbytes = count * np.dtype(dtype).itemsize
        buf = self._scratch.get(slot)
        if buf is None or buf.nbytes < nbytes:
            # Work still queued may read the old buffer; the device allocator
            # (CuPy's pool is stream-ordered) keeps it alive until then.
            buf = self.device.empty(max(nbytes, 1))
            self._scratch[slot] = buf
        return buf[:nbytes].view(dtype)

    def reduce_into(self, dst: Any, src: Any, op: ReduceOp) -> None:
        self.device.launch(_reduce, self.xp, dst, src, op)

    def scale(self, buf: Any, factor: float) -> None:
        if factor != 1.0 and buf.size:
            self.device.launch(scale_in_place, self.xp, buf, factor)

    def copy(self, dst: Any, src: Any) -> None:
        self.device.launch(self.xp.copyto, dst, src)

    def as_bytes(self, buf: Any) -> Any:
        return buf.view(np.uint8)

    def ready_for_mpi(self) -> None:
        """MPI reads device memory outside the stream: everything queued must be done first."""
        self.device.synchronize()

    # -- transfers: CUDA-aware MPI on device views ---------------------------
    def isend(self, comm: Any, views: Sequence[Any], dest: int, tag: int) -> list:
        self.ready_for_mpi()
        return [comm.Isend(view.view(np.uint8), dest, tag) for view in views]

    def irecv(self, comm: Any, view: Any, source: int, tag: int, lane: int = 0) -> Any:
        # A queued reduction may still read this buffer (a scratch lane reused).
        self.ready_for_mpi()
        return comm.Irecv(view.view(np.uint8), source, tag)

    def wait_all(self, pending: list) -> None:
        MPI.Request.Waitall(pending)

    def allgather(self, comm: Any, mine: Any, gathered: Any) -> None:
        self.ready_for_mpi()
        comm.Allgather(mine.view(np.uint8), gathered.view(np.uint8))

    def bcast(self, comm: Any, buf: Any, root: int) -> None:
        self.ready_for_mpi()
        comm.Bcast(buf.view(np.uint8), root=root)


class _StagedReceive:
    """An MPI receive into a pinned lane whose bytes still have to reach ``target`` on the device."""

    __slots__ = ("request", "lane", "staging", "target")

    def __init__(self, request: Any, lane: int, staging: np.ndarray, target: Any) -> None:
        self.request, self.lane, self.staging, self.target = request, lane, staging, target


class StagedBackend(DeviceBackend):
    """Device memory for an MPI that only reads host memory: staged through pinned buffers.

    Sends: all segments of a step are queued device→pinned at once, one event
    each; segment k is handed to MPI as soon as its event completes, while the
    copies of k+1… still run. Receives land in a pinned lane; ``wait_all``
    queues the lane's pinned→device copy and records an event that the next
    receive into that lane waits on. Pinned buffers grow on demand and are
    reused, so steady-state training allocates nothing.
    """

    def __init__(self, device: Device, name: str) -> None:
        super().__init__(device, name)

    # Pinned buffers and lane events per thread too: each engine thread stages its own transfers.
    @property
    def _pinned(self) -> "dict[Any, np.ndarray]":
        return _per_thread(self._local, "pinned")

    @property
    def lane_free(self) -> "dict[int, Event]":  # lane -> event after the copy that empties it
        return _per_thread(self._local, "lane_free")

    def staging(self, key: Any, nbytes: int) -> np.ndarray:
        """A reusable pinned byte buffer for ``key``; grown (never shrunk) on demand."""
        buf = self._pinned.get(key)
        if buf is None or buf.nbytes < nbytes:
            buf = self.device.pinned(max(nbytes, 1))
            self._pinned[key] = buf
        return buf[:nbytes]

    def ready_for_mpi(self) -> None:
        """Staged: MPI never sees device memory; each transfer waits for its own copy event."""

    def isend(self, comm: Any, views: Sequence[Any], dest: int, tag: int) -> list:
        # The previous step's sends from this buffer were waited on by the ring
        # (wait_all) before it asked for new ones, so the buffer is free.
        staging = self.staging("send", sum(v.nbytes for v in views))
        queued = []
        offset = 0
        for view in views:
            piece = staging[offset:offset + view.nbytes]
            self.device.to_host(piece, view.view(np.uint8))
            queued.append((piece, self.device.record()))
            offset += view.nbytes
        requests = []
        for piece, copied in queued:
            copied.synchronize()  # this segment is in pinned memory; later copies keep running
            requests.append(comm.Isend(piece, dest, tag))
        return requests

    def irecv(self, comm: Any, view: Any, source: int, tag: int, lane: int = 0) -> _StagedReceive:
        emptied = self.lane_free.pop(lane, None)
        if emptied is not None:
            emptied.synchronize()  # the lane's last pinned→device copy has read its bytes
        staging = self.staging(("recv", lane), view.nbytes)
        return _StagedReceive(comm.Irecv(staging, source, tag), lane, staging, view)

    def wait_all(self, pending: list) -> None:
        MPI.Request.Waitall([p.request if isinstance(p, _StagedReceive) else p for p in pending])
        for p in pending:
            if isinstance(p, _StagedReceive):
                self.device.to_device(p.target.view(np.uint8), p.staging)
                self.lane_free[p.lane] = self.device.record()

    def allgather(self, comm: Any, mine: Any, gathered: Any) -> None:
        send = self.staging("send", mine.nbytes)
        self.device.to_host(send, mine.view(np.uint8))
        self.device.record().synchronize()
        received = self.staging("gather", gathered.nbytes)
        comm.Allgather(send, received)
        self.device.to_device(gathered.view(np.uint8), received)
        # The next use of the "gather" buffer is by MPI on this thread: be done with it.
        self.device.record().synchronize()

    def bcast(self, comm: Any, buf: Any, root: int) -> None:
        staging = self.staging("send", buf.nbytes)
        if comm.Get_rank() == root:
            self.device.to_host(staging, buf.view(np.uint8))
            self.device.record().synchronize()
        comm.Bcast(staging, root=root)
        if comm.Get_rank() != root:
            self.device.to_device(buf.view(np.uint8), staging)
            self.device.record().synchronize()


# What the collectives accept as a backend.
Backend = Union[NumpyBackend, DeviceBackend]

_NUMPY = NumpyBackend()
# Device arrays by the top-level module of their type ("cupy") -> the backend of one such array.
DEVICE_BACKENDS: "dict[str, Callable[[Any], Backend]]" = {}


def register_device_arrays(module: str, backend_of: Callable[[Any], Backend]) -> None:
    """Arrays whose type comes from package ``module`` are reduced by ``backend_of(array)``."""
    DEVICE_BACKENDS[module] = backend_of


def is_device_array(array: Any) -> bool:
    return type(array).__module__.partition(".")[0] in DEVICE_BACKENDS


def backend_for(array: Any) -> Backend:
    """The backend that owns ``array``; TypeError for anything that is not an array we know."""
    if isinstance(array, np.ndarray):
        return _NUMPY
    backend_of = DEVICE_BACKENDS.get(type(array).__module__.partition(".")[0])
    if backend_of is not None:
        return backend_of(array)
    raise TypeError(f"expected a numpy.ndarray or cupy.ndarray, got {type(array).__name__}; "
                    "wrap Python data with numpy.asarray() first")
