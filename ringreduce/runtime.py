"""Process-wide runtime state and the public functions of ``ringreduce``."""
from __future__ import annotations

import pickle
from typing import Any, Sequence

import numpy as np

from . import comm as comm_module
from . import cuda, exits, ring
from .backend import is_device_array
from .collectives import Executor, Kind
from .engine import Engine, EngineConfig, Handle, env_number, make_request
from .errors import InvalidArgumentError
from .ops import Average, ReduceOp, check_op, check_reducible


class NotInitializedError(ValueError):
    """A collective was called before ``init()`` (a ValueError, as in Horovod)."""


class _Runtime:
    def __init__(self, comms: comm_module.Communicators, engine: Engine) -> None:
        self.comms = comms
        self.engine = engine
        # Cached so that user threads never call into MPI while the engine thread does.
        self.rank, self.size = comms.world.Get_rank(), comms.world.Get_size()
        self.local_rank, self.local_size = comms.local.Get_rank(), comms.local.Get_size()
        self.cross_rank, self.cross_size = comms.cross.Get_rank(), comms.cross.Get_size()
        self.homogeneous = True  # every host runs the same number of ranks; set by init()


_runtime: "_Runtime | None" = None


def init(comm: Any = None) -> None:
    """Start the runtime on ``comm`` (an mpi4py communicator; default COMM_WORLD).

    Safe to call more than once. Installs abort-on-uncaught-exception so one
    failing rank ends the job instead of blocking the others.
    """
    global _runtime
    if _runtime is not None:
        if _runtime.engine.alive():
            return
        shutdown()  # another rank shut the job's engine down: start afresh, together
    if not comm_module.threading_level_ok():
        raise RuntimeError("MPI was initialized without thread support; mtrain's background engine needs "
                           "MPI_THREAD_SERIALIZED or higher: leave mpi4py.rc.thread_level at its default")
    segment = int(env_number("MTRAIN_RING_SEGMENT_BYTES", ring.DEFAULT_SEGMENT_BYTES)) or ring.DEFAULT_SEGMENT_BYTES
    small = int(env_number("MTRAIN_SMALL_ALLREDUCE_BYTES", ring.DEFAULT_SMALL_BYTES))
    config = EngineConfig.from_environment()
    comms = comm_module.create(comm)
    # One GPU per rank: local_rank % count; nothing at all without CuPy and a GPU.
    cuda.bind_device(comms.local.Get_rank())
    # Asked once here, before the engine thread owns MPI: ranks per host, on every host.
    homogeneous = len(set(comms.world.allgather(comms.local.Get_size()))) == 1
    engine = Engine(Executor(comms.world, segment, small, comms.local, comms.cross), comms.world.Dup(), config)
    _runtime = _Runtime(comms, engine)
    _runtime.homogeneous = homogeneous
    comm_module.install_abort_on_exception()
    exits.install(shutdown)


def shutdown() -> None:
    """Release the runtime's communicators. Idempotent; ``init()`` may be called again."""
    global _runtime
    runtime, _runtime = _runtime, None
    if runtime is not None:
        runtime.engine.shutdown()
        if not runtime.engine.alive():
            runtime.comms.free()


def is_initialized() -> bool:
    return _runtime is not None


def _rt() -> _Runtime:
    if _runtime is None:
        raise NotInitializedError("ringreduce is not initialized: call init() first "
                                  "(for example `import mtrain.ringreduce as rr; rr.init()`)")
    return _runtime


def rank() -> int:
    return _rt().rank


def size() -> int:
    return _rt().size


def local_rank() -> int:
    return _rt().local_rank


def local_size() -> int:
    return _rt().local_size


def cross_rank() -> int:
    return _rt().cross_rank


def cross_size() -> int:
    return _rt().cross_size


def is_homogeneous() -> bool:
    """True when every host runs the same number of ranks (Horovod's ``is_homogeneous``)."""
    return _rt().homogeneous


def start_timeline(file_path: str, mark_cycles: bool = False) -> None:
    """Start writing the Chrome-trace timeline to ``file_path`` (rank 0 writes it; the call
    is local, every rank may make it). Replaces a timeline already being written."""
    if not isinstance(file_path, str) or not file_path:
        raise ValueError(f"start_timeline needs a file path, got {file_path!r}")
    _rt().engine.start_timeline(file_path, bool(mark_cycles))


def stop_timeline() -> None:
    """Stop writing the timeline and close its file (a valid JSON array). No-op when none runs."""
    _rt().engine.stop_timeline()


def mpi_threads_supported() -> bool:
    _rt()
    return comm_module.threading_level_ok()


def _array(value: Any) -> np.ndarray:
    if isinstance(value, np.ndarray):
        return value
    if isinstance(value, np.generic):  # a NumPy scalar: treat as a 0-d array
        return np.asarray(value)
    if is_device_array(value):  # the engine picks its backend
        return value
    raise TypeError(f"expected a numpy.ndarray, got {type(value).__name__}; "
                    "wrap Python data with numpy.asarray() first")


def _submit(kind: Kind, arrays: "Sequence[np.ndarray | None]", name: "str | None", grouped: bool = False,
            **fields: Any) -> Handle:
    engine = _rt().engine
    exits.forget_status()  # still submitting: any SystemExit noted before was caught, not an exit
    handle = Handle(len(arrays), grouped, engine.done_cv)
    if grouped:
        base = name or engine.auto_name()
        names: "list[str | None]" = [f"{base}.{i}" for i in range(len(arrays))]
    else:
        names = [name]
    requests = [make_request(engine, kind, array, n, handle, i, **fields)
                for i, (array, n) in enumerate(zip(arrays, names))]
    engine.submit(requests)
    return handle


def _submit_allreduce(arrays: "list[np.ndarray]", op: ReduceOp, name: "str | None", prescale_factor: float,
                      postscale_factor: float, in_place: bool, grouped: bool) -> Handle:
    op = check_op(op)
    for array in arrays:
        check_reducible(array.dtype, op)
    return _submit(Kind.ALLREDUCE, arrays, name, grouped, op=op, in_place=in_place,
                   prescale=float(prescale_factor), postscale=float(postscale_factor))


def _check_root(root_rank: int) -> int:
    size_ = _rt().size
    if not isinstance(root_rank, (int, np.integer)) or not 0 <= int(root_rank) < size_:
        raise InvalidArgumentError(f"root_rank must be an integer in [0, {size_}); got {root_rank!r}")
    return int(root_rank)


# -- asynchronous API -------------------------------------------------------
# Every op returns a Handle at once; synchronize(handle) waits and returns the
# result or raises the op's error. Ops are matched across ranks by name, so
# ranks may submit in different orders; unnamed ops must come in the same order.


def poll(handle: Handle) -> bool:
    """True once ``handle``'s op has finished (successfully or not)."""
    return handle.done()


def synchronize(handle: Handle) -> Any:
    """Wait for ``handle``'s op; return its result or raise its error."""
    return handle.wait()


def allreduce_async(array: np.ndarray, op: ReduceOp = Average, name: "str | None" = None,
                    prescale_factor: float = 1.0, postscale_factor: float = 1.0) -> Handle:
    """Start an all-reduce into a new array; ``synchronize`` returns it."""
    return _submit_allreduce([_array(array)], op, name, prescale_factor, postscale_factor, False, False)


def allreduce_async_(array: np.ndarray, op: ReduceOp = Average, name: "str | None" = None,
                     prescale_factor: float = 1.0, postscale_factor: float = 1.0) -> Handle:
    """Start an in-place all-reduce of ``array``; ``synchronize`` returns ``array``."""
    return _submit_allreduce([_array(array)], op, name, prescale_factor, postscale_factor, True, False)


def grouped_allreduce_async(arrays: "Sequence[np.ndarray]", op: ReduceOp = Average, name: "str | None" = None,
                            prescale_factor: float = 1.0, postscale_factor: float = 1.0) -> Handle:
    """Start all-reduces of several arrays as one unit; ``synchronize`` returns a list of new arrays."""
    return _submit_allreduce([_array(a) for a in arrays], op, name, prescale_factor, postscale_factor,
                             False, True)


def grouped_allreduce_async_(arrays: "Sequence[np.ndarray]", op: ReduceOp = Average,
                             name: "str | None" = None, prescale_factor: float = 1.0,
                             postscale_factor: float = 1.0) -> Handle:
    """In-place grouped all-reduce; ``synchronize`` returns the list of the same arrays."""
    return _submit_allreduce([_array(a) for a in arrays], op, name, prescale_factor, postscale_factor,
                             True, True)


def allgather_async(array: np.ndarray, name: "str | None" = None) -> Handle:
    return _submit(Kind.ALLGATHER, [_array(array)], name)


def grouped_allgather_async(arrays: "Sequence[np.ndarray]", name: "str | None" = None) -> Handle:
    """Start all-gathers of several arrays as one unit; ``synchronize`` returns a list."""
    return _submit(Kind.ALLGATHER, [_array(a) for a in arrays], name, grouped=True)


def broadcast_async(array: np.ndarray, root_rank: int, name: "str | None" = None) -> Handle:
    return _submit(Kind.BROADCAST, [_array(array)], name, root=_check_root(root_rank))


def broadcast_async_(array: np.ndarray, root_rank: int, name: "str | None" = None) -> Handle:
    return _submit(Kind.BROADCAST, [_array(array)], name, root=_check_root(root_rank), in_place=True)


def reducescatter_async(array: np.ndarray, op: ReduceOp = Average, name: "str | None" = None,
                        prescale_factor: float = 1.0, postscale_factor: float = 1.0) -> Handle:
    """Start a reduce-scatter; ``synchronize`` returns this rank's rows of the reduction."""
    array = _array(array)
    op = check_op(op)
    check_reducible(array.dtype, op)
    if array.ndim == 0:
        raise InvalidArgumentError("reducescatter needs an array with at least one dimension to split; "
                                   "got a scalar (0-d): reshape it to (1,) or use allreduce")
    return _submit(Kind.REDUCESCATTER, [array], name, op=op,
                   prescale=float(prescale_factor), postscale=float(postscale_factor))


def grouped_reducescatter_async(arrays: "Sequence[np.ndarray]", op: ReduceOp = Average,
                                name: "str | None" = None, prescale_factor: float = 1.0,
                                postscale_factor: float = 1.0) -> Handle:
    """Start reduce-scatters of several arrays as one unit; ``synchronize`` returns a list."""
    op = check_op(op)
    arrays = [_array(a) for a in arrays]
    for index, array in enumerate(arrays):
        check_reducible(array.dtype, op)
        if array.ndim == 0:
            raise InvalidArgumentError(f"reducescatter needs arrays with at least one dimension to split; "
                                       f"arrays[{index}] is a scalar (0-d): reshape it to (1,)")
    return _submit(Kind.REDUCESCATTER, arrays, name, grouped=True, op=op,
                   prescale=float(prescale_factor), postscale=float(postscale_factor))


def alltoall_async(array: np.ndarray, splits: "Sequence[int] | None" = None,
                   name: "str | None" = None) -> Handle:
    """Start an all-to-all; ``synchronize`` returns ``(received, received_splits)``."""
    array = _array(array)
    if array.ndim == 0:
        raise ValueError("alltoall needs an array with at least one dimension to split")
    return _submit(Kind.ALLTOALL, [array], name, splits=_check_splits(splits, array.shape[0]))


def _check_splits(splits: "Sequence[int] | None", first: int) -> "list[int]":
    """Rows to send to each rank: ``splits``, or equal shares when None."""
    size_ = _rt().size
    if splits is None:
        if first % size_:
            raise ValueError(f"alltoall without splits needs the first dimension ({first}) to be "
                             f"divisible by the number of ranks ({size_}); pass splits=")
        return [first // size_] * size_
    send = np.asarray(splits).reshape(-1)
    if (send.size != size_ or send.dtype.kind not in "iu" or np.any(send < 0)
            or int(send.sum()) != first):
        raise ValueError(f"alltoall splits must be {size_} non-negative integers summing to "
                         f"the first dimension ({first}); got {send.tolist()}")
    return [int(n) for n in send]


# -- synchronous API: the asynchronous one, waited on ----------------------


def allreduce(array: np.ndarray, op: ReduceOp = Average, name: "str | None" = None,
              prescale_factor: float = 1.0, postscale_factor: float = 1.0) -> np.ndarray:
    """A new array: the elementwise reduction of ``array`` over all ranks (default Average)."""
    return synchronize(allreduce_async(array, op, name, prescale_factor, postscale_factor))


def allreduce_(array: np.ndarray, op: ReduceOp = Average, name: "str | None" = None,
               prescale_factor: float = 1.0, postscale_factor: float = 1.0) -> np.ndarray:
    """In-place all-reduce: ``array`` is overwritten with the result and returned."""
    return synchronize(allreduce_async_(array, op, name, prescale_factor, postscale_factor))


def grouped_allreduce(arrays: "Sequence[np.ndarray]", op: ReduceOp = Average, name: "str | None" = None,
                      prescale_factor: float = 1.0, postscale_factor: float = 1.0) -> list:
    return synchronize(grouped_allreduce_async(arrays, op, name, prescale_factor, postscale_factor))


def grouped_allreduce_(arrays: "Sequence[np.ndarray]", op: ReduceOp = Average, name: "str | None" = None,
                       prescale_factor: float = 1.0, postscale_factor: float = 1.0) -> list:
    return synchronize(grouped_allreduce_async_(arrays, op, name, prescale_factor, postscale_factor))


def allgather(array: np.ndarray, name: "str | None" = None) -> np.ndarray:
    """Every rank's array concatenated along the first dimension, in rank order."""
    return synchronize(allgather_async(array, name))


def grouped_allgather(arrays: "Sequence[np.ndarray]", name: "str | None" = None) -> list:
    return synchronize(grouped_allgather_async(arrays, name))


def grouped_reducescatter(arrays: "Sequence[np.ndarray]", op: ReduceOp = Average, name: "str | None" = None,
                          prescale_factor: float = 1.0, postscale_factor: float = 1.0) -> list:
    return synchronize(grouped_reducescatter_async(arrays, op, name, prescale_factor, postscale_factor))


def broadcast(array: np.ndarray, root_rank: int, name: "str | None" = None) -> np.ndarray:
    """A new array holding ``root_rank``'s values."""
    return synchronize(broadcast_async(array, root_rank, name))


def broadcast_(array: np.ndarray, root_rank: int, name: "str | None" = None) -> np.ndarray:
    """In-place broadcast: ``array`` is overwritten with ``root_rank``'s values."""
    return synchronize(broadcast_async_(array, root_rank, name))


def reducescatter(array: np.ndarray, op: ReduceOp = Average, name: "str | None" = None,
                  prescale_factor: float = 1.0, postscale_factor: float = 1.0) -> np.ndarray:
    """Reduce over ranks, then keep this rank's share of the first dimension."""
    return synchronize(reducescatter_async(array, op, name, prescale_factor, postscale_factor))


def alltoall(array: np.ndarray, splits: "Sequence[int] | None" = None, name: "str | None" = None):
    """Scatter rows to every rank and gather theirs. Returns the received array, or
    ``(received, received_splits)`` when ``splits`` is given (as Horovod does)."""
    received, received_splits = synchronize(alltoall_async(array, splits, name))
    return received if splits is None else (received, received_splits)


def barrier() -> None:
    synchronize(_submit(Kind.BARRIER, [None], None))


def broadcast_object(obj: Any, root_rank: int = 0, name: "str | None" = None) -> Any:
    """``root_rank``'s picklable object, on every rank."""
    root = _check_root(root_rank)
    # Pickled and unpickled here, in the caller's thread: the engine moves bytes only.  A root
    # that cannot pickle its object still takes part, sending word of its failure, so the
    # other ranks raise too instead of waiting for an op the root never submits.
    payload, failure = None, None
    if root == _rt().rank:
        try:
            payload = pickle.dumps(obj)
        except Exception as error:
            failure = error
            payload = pickle.dumps(_RootCannotPickle(f"{type(error).__name__}: {error}"))
    value = pickle.loads(synchronize(_submit(Kind.BROADCAST_OBJECT, [None], name, root=root, obj=payload)))
    if failure is not None:
        raise failure
    if isinstance(value, _RootCannotPickle):
        raise pickle.PicklingError(f"broadcast_object: root rank {root} could not pickle its object "
                                   f"({value.message}); broadcast only picklable objects")
    return value


class _RootCannotPickle:
    """What a broadcast_object root sends when its object cannot be pickled."""

    def __init__(self, message: str) -> None:
        self.message = message


def allgather_object(obj: Any, name: "str | None" = None) -> list:
    """A list of every rank's picklable object, in rank order."""
    payloads = synchronize(_submit(Kind.ALLGATHER_OBJECT, [None], name, obj=pickle.dumps(obj)))
    return [pickle.loads(payload) for payload in payloads]
