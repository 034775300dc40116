"""CuPy device buffers: the GPU side of ``backend.py``, imported only when a CuPy array shows up.

* ``CupyDevice``: the ``backend.Device`` of one GPU. Its methods run on the
  engine thread, which they bind to that GPU (CUDA's current device is per
  thread, and a new thread starts on device 0) with CuPy's legacy default
  stream current. All work (reductions, device↔pinned copies, the engine's own
  copies) is queued on that one stream. The legacy stream waits for earlier
  work on every blocking stream (CuPy's default stream, ``cupy.cuda.Stream()``,
  the per-thread default stream) and blocking streams wait for it, so buffers
  produced on such a stream in the user's thread need no extra synchronization,
  and results can be read there once the op's handle is done. Work on a
  non-blocking stream (``Stream(non_blocking=True)``, a framework's side
  streams) is not ordered implicitly: a framework binding orders its current
  stream against the legacy stream explicitly; CuPy users synchronize such a
  stream before submitting.
* ``cuda_aware()``: whether MPI can read device memory (Open MPI's and MPICH's
  ``MPIX_Query_cuda_support``, which mpi4py does not wrap; MTRAIN_CUDA_AWARE=0/1
  overrides).
* ``backend()``: the process-wide device backend, direct for a CUDA-aware MPI,
  staged through pinned host memory otherwise.
* ``bind_device(local_rank)``: one rank per GPU, called by ``init()``;
  ``on_device_bound(hook)`` lets a framework binding make the same GPU current
  in its own runtime (the runtime knows no framework).
* ``gpu_count()``: the GPUs this process can use through CuPy.
* ``cupy_installed()``: whether this install has a GPU path at all.

Importing this module registers CuPy arrays with ``backend.backend_for``.
"""
from __future__ import annotations

import ctypes
import importlib.util
import os
import sys
import threading
from typing import Any, Callable

import numpy as np

from mtrain.common import settings
from mtrain.ringreduce.transport.backend import DeviceBackend, StagedBackend, register_device_arrays

CUDA_AWARE_ENV = settings.CUDA_AWARE.ours


class CupyDevice:
    """One GPU through CuPy: its legacy default stream, events, pinned memory."""

    def __init__(self, device_id: int) -> None:
        import cupy
        import cupyx
        self.xp = cupy
        self.id = device_id
        self._cupyx = cupyx
        self._cudart = cupy.cuda.runtime
        self._stream = cupy.cuda.Stream.null  # the legacy default stream (handle 0)

    def activate(self) -> None:
        """Make this GPU, and the legacy stream on it, current for the calling thread (it stays so).

        The engine thread is the only caller; binding it also puts the engine's own
        CuPy calls (result copies, ``out[...] = ...``) on this GPU and this stream.
        """
        if self._cudart.getDevice() != self.id:
            self._cudart.setDevice(self.id)
        if self.xp.cuda.get_current_stream().ptr != self._stream.ptr:
            self._stream.use()

    def empty(self, nbytes: int) -> Any:
        self.activate()
        return self.xp.empty(nbytes, dtype=np.uint8)

    def pinned(self, nbytes: int) -> np.ndarray:
        # Page-locked, so cudaMemcpyAsync to and from it is truly asynchronous.
        self.activate()
        return self._cupyx.empty_pinned(nbytes, dtype=np.uint8)

    def launch(self, fn: Callable, *args: Any) -> None:
        self.activate()
        fn(*args)  # CuPy kernels are queued on the current stream: ours, after activate()

    def to_host(self, dst: np.ndarray, src: Any) -> None:
        if dst.nbytes:
            self.activate()
            self._cudart.memcpyAsync(dst.ctypes.data, src.data.ptr, dst.nbytes,
                                      self._cudart.memcpyDeviceToHost, self._stream.ptr)

    def to_device(self, dst: Any, src: np.ndarray) -> None:
        if src.nbytes:
            self.activate()
            self._cudart.memcpyAsync(dst.data.ptr, src.ctypes.data, src.nbytes,
                                      self._cudart.memcpyHostToDevice, self._stream.ptr)

    def record(self) -> Any:
        self.activate()
        return self._stream.record(self.xp.cuda.Event(disable_timing=True))

    def synchronize(self) -> None:
        self.activate()
        self._stream.synchronize()


def query_cuda_support() -> "bool | None":
    """MPIX_Query_cuda_support() of the loaded MPI library; None where it has no such function."""
    from mpi4py import MPI
    try:
        # dlsym on the extension module also searches the MPI library it links.
        query = getattr(ctypes.CDLL(MPI.__file__), "MPIX_Query_cuda_support", None)
    except OSError:
        return None
    if query is None:
        return None
    query.restype = ctypes.c_int
    return bool(query())


def cuda_aware() -> bool:
    """Whether device buffers may go to MPI directly: MTRAIN_CUDA_AWARE=0/1, else ask MPI."""
    forced = settings.CUDA_AWARE.read()
    if forced is not None:
        return forced
    return bool(query_cuda_support())


_backends: "dict[int, DeviceBackend]" = {}
_lock = threading.Lock()


def backend(array: Any = None) -> DeviceBackend:
    """The device backend for CuPy arrays on ``array``'s GPU (default: the current one).

    Created once per GPU (its scratch and pinned buffers persist); all of them
    are named "cupy", so ranks on different GPUs still agree on every op.
    """
    if array is not None:
        device_id = int(array.device.id)
    else:
        import cupy
        device_id = int(cupy.cuda.runtime.getDevice())
    with _lock:
        found = _backends.get(device_id)
        if found is None:
            device = CupyDevice(device_id)
            found = (DeviceBackend(device, "cupy") if cuda_aware()
                     else StagedBackend(device, "cupy"))
            _backends[device_id] = found
        return found


def current_device() -> "int | None":
    """The calling thread's current GPU when CuPy is already in use (never imports it), else None."""
    cupy = sys.modules.get("cupy")
    if cupy is None:
        return None
    try:
        return int(cupy.cuda.runtime.getDevice())
    except Exception:  # CuPy without a usable GPU
        return None


def use_device(device_id: int) -> None:
    """Make ``device_id`` the calling thread's current GPU (CUDA's current device is per thread)."""
    import cupy
    cupy.cuda.runtime.setDevice(device_id)


def cupy_installed() -> bool:
    """Whether CuPy, the runtime's GPU path, is installed (imports nothing)."""
    return importlib.util.find_spec("cupy") is not None


def gpu_count() -> int:
    """GPUs this process can use: 0 without CuPy or a working driver (never raises).

    Honours CUDA_VISIBLE_DEVICES, as every CUDA program does.
    """
    if not cupy_installed():
        return 0
    try:
        import cupy
        return int(cupy.cuda.runtime.getDeviceCount())
    except Exception:  # no driver, no device, a CUDA/CuPy mismatch: all mean "no GPU here"
        return 0


def choose_device(local_rank: int, count: int, environ: "dict[str, str]", already_current: bool) -> "int | None":
    """The GPU for this rank: ``local_rank % count``, or None when the user already chose one.

    The user chose when CUDA_VISIBLE_DEVICES names a single device (the launcher
    or the user gave each rank its own) or a device was made current before init().
    """
    if count == 0 or already_current:
        return None
    visible = environ.get("CUDA_VISIBLE_DEVICES", "")
    if visible and "," not in visible:
        return None
    return local_rank % count


_device_hooks: "list[Callable[[int], None]]" = []
_bound_device: "int | None" = None


def on_device_bound(hook: Callable[[int], None]) -> None:
    """Call ``hook(device_id)`` each time ``bind_device`` picks this process's GPU (at once if it has).

    A framework binding registers one so that the framework's own current device
    follows the runtime's choice; the runtime itself knows no framework.
    """
    _device_hooks.append(hook)
    if _bound_device is not None:
        hook(_bound_device)


def bind_device(local_rank: int) -> "int | None":
    """Make GPU ``local_rank % count`` current for this process; returns it (None: left as it was)."""
    global _bound_device
    count = gpu_count()
    if count == 0:
        return None
    import cupy
    chosen = choose_device(local_rank, count, dict(os.environ), _has_context())
    if chosen is not None:
        cupy.cuda.Device(chosen).use()
        _bound_device = chosen
        for hook in _device_hooks:
            hook(chosen)
    return chosen


def _has_context() -> bool:
    """Whether this thread already has a current CUDA context (a device was used before init())."""
    try:
        import cupy
        return int(cupy.cuda.driver.ctxGetCurrent()) != 0  # NULL until a device has been used
    except Exception:
        return False


register_device_arrays("cupy", backend)
