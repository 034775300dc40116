"""Process-wide runtime state and the public functions of ``ringreduce``."""
from __future__ import annotations

import atexit
import os
from typing import Any, Sequence

import numpy as np

from . import comm as comm_module
from . import ring
from .collectives import Executor
from .ops import Average, ReduceOp


class NotInitializedError(ValueError):
    """A collective was called before ``init()`` (a ValueError, as in Horovod)."""


class _Runtime:
    def __init__(self, comms: comm_module.Communicators, executor: Executor) -> None:
        self.comms = comms
        self.executor = executor


_runtime: "_Runtime | None" = None


def _env_int(name: str, default: int) -> int:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not an integer; unset it or give a byte count") from None
    if value < 0:
        raise ValueError(f"{name}={raw!r} must not be negative")
    return value


def init(comm: Any = None) -> None:
    """Start the runtime on ``comm`` (an mpi4py communicator; default COMM_WORLD).

    Safe to call more than once. Installs abort-on-uncaught-exception so one
    failing rank ends the job instead of blocking the others.
    """
    global _runtime
    if _runtime is not None:
        return
    comms = comm_module.create(comm)
    segment = _env_int("MTRAIN_RING_SEGMENT_BYTES", ring.DEFAULT_SEGMENT_BYTES) or ring.DEFAULT_SEGMENT_BYTES
    small = _env_int("MTRAIN_SMALL_ALLREDUCE_BYTES", ring.DEFAULT_SMALL_BYTES)
    _runtime = _Runtime(comms, Executor(comms.world, segment, small))
    comm_module.install_abort_on_exception()
    atexit.register(shutdown)


def shutdown() -> None:
    """Release the runtime's communicators. Idempotent; ``init()`` may be called again."""
    global _runtime
    runtime, _runtime = _runtime, None
    if runtime is not None:
        runtime.comms.free()


def is_initialized() -> bool:
    return _runtime is not None


def _rt() -> _Runtime:
    if _runtime is None:
        raise NotInitializedError("ringreduce is not initialized: call init() first "
                                  "(for example `import ringreduce as rr; rr.init()`)")
    return _runtime


def rank() -> int:
    return _rt().comms.world.Get_rank()


def size() -> int:
    return _rt().comms.world.Get_size()


def local_rank() -> int:
    return _rt().comms.local.Get_rank()


def local_size() -> int:
    return _rt().comms.local.Get_size()


def cross_rank() -> int:
    return _rt().comms.cross.Get_rank()


def cross_size() -> int:
    return _rt().comms.cross.Get_size()


def mpi_threads_supported() -> bool:
    _rt()
    return comm_module.threading_level_ok()


def _array(value: Any) -> np.ndarray:
    if isinstance(value, np.ndarray):
        return value
    if isinstance(value, np.generic):  # a NumPy scalar: treat as a 0-d array
        return np.asarray(value)
    raise TypeError(f"expected a numpy.ndarray, got {type(value).__name__}; "
                    "wrap Python data with numpy.asarray() first")


def allreduce(array: np.ndarray, op: ReduceOp = Average, name: "str | None" = None,
              prescale_factor: float = 1.0, postscale_factor: float = 1.0) -> np.ndarray:
    """A new array: the elementwise reduction of ``array`` over all ranks (default Average)."""
    return _rt().executor.allreduce(_array(array), op, None, prescale_factor, postscale_factor, name)


def allreduce_(array: np.ndarray, op: ReduceOp = Average, name: "str | None" = None,
               prescale_factor: float = 1.0, postscale_factor: float = 1.0) -> np.ndarray:
    """In-place all-reduce: ``array`` is overwritten with the result and returned."""
    array = _array(array)
    return _rt().executor.allreduce(array, op, array, prescale_factor, postscale_factor, name)


def allgather(array: np.ndarray, name: "str | None" = None) -> np.ndarray:
    """Every rank's array concatenated along the first dimension, in rank order."""
    return _rt().executor.allgather(_array(array), name)


def broadcast(array: np.ndarray, root_rank: int, name: "str | None" = None) -> np.ndarray:
    """A new array holding ``root_rank``'s values."""
    return _rt().executor.broadcast(_array(array), root_rank, None, name)


def broadcast_(array: np.ndarray, root_rank: int, name: "str | None" = None) -> np.ndarray:
    """In-place broadcast: ``array`` is overwritten with ``root_rank``'s values."""
    array = _array(array)
    return _rt().executor.broadcast(array, root_rank, array, name)


def reducescatter(array: np.ndarray, op: ReduceOp = Average, name: "str | None" = None) -> np.ndarray:
    """Reduce over ranks, then keep this rank's share of the first dimension."""
    return _rt().executor.reducescatter(_array(array), op, name)


def alltoall(array: np.ndarray, splits: "Sequence[int] | None" = None, name: "str | None" = None):
    """Scatter rows to every rank and gather theirs. Returns the received array, or
    ``(received, received_splits)`` when ``splits`` is given (as Horovod does)."""
    received, received_splits = _rt().executor.alltoall(_array(array), splits, name)
    return received if splits is None else (received, received_splits)


def barrier() -> None:
    _rt().executor.barrier()


def broadcast_object(obj: Any, root_rank: int = 0, name: "str | None" = None) -> Any:
    """``root_rank``'s picklable object, on every rank."""
    return _rt().executor.broadcast_object(obj, root_rank, name)


def allgather_object(obj: Any, name: "str | None" = None) -> list:
    """A list of every rank's picklable object, in rank order."""
    return _rt().executor.allgather_object(obj, name)
