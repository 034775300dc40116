"""Process-wide runtime state and the public functions of ``ringreduce``."""
from __future__ import annotations

import dataclasses
import pickle
from typing import Any, Sequence

import numpy as np
from mpi4py import MPI

from mtrain.launcher.records import Phase, PhaseNote

from . import comm as comm_module
from . import cuda, exits, process_sets as _ps, ring
from .backend import is_device_array
from .collectives import Executor, Kind
from .engine import Engine, EngineStats
from .requests import AllreduceOp, Handle, Signature, make_request
from .errors import InvalidArgumentError
from .ops import Adasum, Average, ReduceOp, check_op, check_reducible
from .process_sets import ProcessSet, global_process_set
from .settings import EngineConfig, env_number


class NotInitializedError(ValueError):
    """A collective was called before ``init()`` (a ValueError, as in Horovod)."""


_runtime: "_ps.Registry | None" = None


def _live_runtime() -> _ps.Registry:
    return _rt()


_ps._registry_of = _live_runtime


def init(comm: Any = None, process_sets: Any = None) -> None:
    """Start the runtime on ``comm`` (an mpi4py communicator; default COMM_WORLD).

    ``process_sets``: a list of ``ProcessSet`` to register (every rank passes the same list),
    or ``"dynamic"`` (accepted for Horovod; sets may always be added later).

    Safe to call more than once. Installs abort-on-uncaught-exception so one
    failing rank ends the job instead of blocking the others.
    """
    global _runtime
    wanted = _check_process_sets_argument(process_sets)
    if _runtime is not None:
        if _runtime.engine.alive():
            if wanted:
                _runtime.register(wanted)
            return
        shutdown()  # another rank shut the job's engine down: start afresh, together
    if not comm_module.threading_level_ok():
        raise RuntimeError("MPI was initialized without thread support; mtrain's background engine needs "
                           "MPI_THREAD_SERIALIZED or higher: leave mpi4py.rc.thread_level at its default")
    # Until every rank of the communicator comes, init() waits in MPI, where nothing can tell a
    # rank that is coming from one whose program ended: the supervisor can (records.PhaseNote).
    PhaseNote(Phase.INIT_WAITING, ranks=tuple(_job_ranks_of(comm))).emit()
    if isinstance(comm, (list, tuple)):  # Horovod also takes a list of ranks here
        comm = _comm_of_ranks(list(comm))
    segment = int(env_number("MTRAIN_RING_SEGMENT_BYTES", ring.DEFAULT_SEGMENT_BYTES)) or ring.DEFAULT_SEGMENT_BYTES
    small = int(env_number("MTRAIN_SMALL_ALLREDUCE_BYTES", ring.DEFAULT_SMALL_BYTES))
    config = EngineConfig.from_environment()
    comms = comm_module.create(comm)
    # One GPU per rank: local_rank % count; nothing at all without CuPy and a GPU.
    cuda.bind_device(comms.local.Get_rank())
    # Asked once here, before the engine thread owns MPI: ranks per host, on every host.
    homogeneous = len(set(comms.world.allgather(comms.local.Get_size()))) == 1
    world_ranks = list(range(comms.world.Get_size()))

    def make_engine(set_comms: comm_module.Communicators, ranks: "list[int] | None" = None) -> Engine:
        # A set's engine names global ranks in its messages, and only the global set keeps a timeline.
        set_config = config if set_comms is comms else dataclasses.replace(config, timeline_path=None)
        members = ranks
        if members is None:
            members = [int(r) for r in MPI.Group.Translate_ranks(
                set_comms.world.Get_group(), list(range(set_comms.world.Get_size())), comms.world.Get_group())]
        return Engine(Executor(set_comms.world, segment, small, set_comms.local, set_comms.cross),
                      set_comms.world.Dup(), set_config, members)

    admin = comms.world.Dup()  # made before any engine thread calls MPI
    engine = make_engine(comms, world_ranks)
    _runtime = _ps.Registry(comms, engine, make_engine, admin)
    _runtime.homogeneous = homogeneous
    global_process_set.ranks = world_ranks  # as Horovod fills in hvd.global_process_set.ranks
    comm_module.install_abort_on_exception()
    exits.install(shutdown)
    PhaseNote(Phase.INIT_DONE).emit()
    if wanted:
        _runtime.register(wanted)


def _job_ranks_of(comm: Any) -> "list[int]":
    """The ranks of COMM_WORLD that init(comm) needs (no communication)."""
    world = MPI.COMM_WORLD
    if comm is None:
        return list(range(world.Get_size()))
    if isinstance(comm, (list, tuple)):
        return sorted(int(r) for r in comm if isinstance(r, (int, np.integer)))
    group = comm.Get_group()
    try:
        ranks = MPI.Group.Translate_ranks(group, list(range(group.Get_size())), world.Get_group())
    finally:
        group.Free()
    return sorted(int(r) for r in ranks if r != MPI.UNDEFINED)


def _check_process_sets_argument(process_sets: Any) -> "list[ProcessSet]":
    if process_sets is None or process_sets == "dynamic":
        return []
    if isinstance(process_sets, ProcessSet):
        process_sets = [process_sets]
    try:
        wanted = list(process_sets)
    except TypeError:
        raise ValueError(f"process_sets must be a list of ProcessSet or 'dynamic', got {process_sets!r}") from None
    if not all(isinstance(p, ProcessSet) for p in wanted):
        raise ValueError(f"process_sets must be a list of ProcessSet or 'dynamic', got {process_sets!r}")
    return wanted


def _comm_of_ranks(ranks: "list[int]") -> MPI.Comm:
    world = MPI.COMM_WORLD
    if sorted(set(ranks)) != sorted(ranks) or any(not 0 <= r < world.Get_size() for r in ranks):
        raise ValueError(f"init(comm=[...]) takes distinct ranks of the job (0..{world.Get_size() - 1}); got {ranks}")
    if world.Get_rank() not in ranks:
        raise ValueError(f"rank {world.Get_rank()} is not in init(comm={ranks}): every rank that calls init() "
                         "must be in its list")
    group = world.Get_group().Incl(sorted(ranks))
    comm = world.Create_group(group, tag=9001)
    group.Free()
    return comm


def add_process_set(process_set: "ProcessSet | Sequence[int]") -> ProcessSet:
    """Register a process set after ``init()``; every rank makes the same call, member or not.
    Returns the registered ``ProcessSet``."""
    runtime = _rt()
    problem: "Exception | None" = None
    try:
        if not isinstance(process_set, ProcessSet):
            process_set = ProcessSet(process_set)
        if process_set.ranks is None:
            raise NotImplementedError("add_process_set takes a list of ranks; a communicator-based ProcessSet "
                                      "goes to init(process_sets=[...])")
    except (ValueError, NotImplementedError) as error:
        problem = error
    # Every rank's call is compared before any rank raises: a rank that raised alone would leave
    # the others waiting in the collective registration below.
    mine = None if problem is not None else list(process_set.ranks)  # type: ignore[union-attr]
    everyone = runtime.gather((mine, None if problem is None else f"{type(problem).__name__}: {problem}"))
    if problem is not None:
        raise problem
    failed = [f"rank {r}: {text}" for r, (_, text) in enumerate(everyone) if text is not None]
    if failed:
        raise InvalidArgumentError("add_process_set failed on other ranks (" + "; ".join(failed)
                                   + "); every rank must add the same set, in the same order")
    if any(ranks != mine for ranks, _ in everyone):
        raise InvalidArgumentError("add_process_set was called with different ranks on different ranks ("
                                   + "; ".join(f"rank {r}: {v}" for r, (v, _) in enumerate(everyone))
                                   + "); every rank must add the same set, in the same order")
    existing = [s for s in runtime.sets.values() if s.ranks == mine]
    if existing:  # the same on every rank: every rank holds the same sets
        raise ValueError(f"a process set with ranks {mine} exists already "
                         f"(process_set_id={existing[0].id}); add each set once")
    runtime.register([process_set])
    return process_set


def remove_process_set(process_set: ProcessSet) -> bool:
    """Unregister ``process_set`` (every rank makes the same call). Its ops still in flight
    end with an error. Returns False for the global set, which stays."""
    runtime = _rt()
    state = runtime.state(process_set)
    if state.id == 0:
        return False
    runtime.gate()  # every rank agrees before the members stop the set's engine
    state.stop()
    del runtime.sets[state.id]
    for holder in list(state.holders) + [process_set]:
        holder._invalidate()
    return True


def shutdown() -> None:
    """Release the runtime's communicators. Idempotent; ``init()`` may be called again."""
    global _runtime
    runtime, _runtime = _runtime, None
    if runtime is not None:
        runtime.stop_all()


def is_initialized() -> bool:
    return _runtime is not None


def _rt() -> _ps.Registry:
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


def process_set_by_id(process_set_id: int) -> ProcessSet:
    """A ``ProcessSet`` for the registered set ``process_set_id`` (0: the global set), for APIs
    that name sets by id (Horovod's TF ``*_op(process_set_id=...)``). InvalidArgumentError if none."""
    if int(process_set_id) == 0:
        return global_process_set
    state = _rt().sets.get(int(process_set_id))
    if state is None:
        raise InvalidArgumentError(f"no process set has process_set_id={process_set_id}: register it with "
                                   "hvd.init(process_sets=[...]) or hvd.add_process_set() first")
    handle = ProcessSet(list(state.ranks))
    handle.process_set_id = state.id
    return handle


def engine_stats(process_set: ProcessSet = global_process_set) -> EngineStats:
    """What this rank's engine for ``process_set`` did so far: batches planned afresh and by a
    kept plan, and cycles that ran a steady batch with no per-op work (or fell back)."""
    return _rt().member(process_set).engine.stats()


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
            process_set: ProcessSet = global_process_set, **fields: Any) -> Handle:
    engine = _rt().member(process_set).engine
    exits.forget_status()  # still submitting: any SystemExit noted before was caught, not an exit
    handle = Handle(len(arrays), grouped, engine.done_cv)
    if grouped:
        base = name or engine.auto_name()
        names: "list[str | None]" = [f"{base}.{i}" for i in range(len(arrays))]
    else:
        names = [name]
    requests = [make_request(kind, array, n or engine.auto_name(), handle, i, **fields)
                for i, (array, n) in enumerate(zip(arrays, names))]
    engine.submit(requests)
    return handle


def _submit_allreduce(arrays: "list[np.ndarray]", op: ReduceOp, name: "str | None", prescale_factor: float,
                      postscale_factor: float, in_place: bool, grouped: bool,
                      process_set: ProcessSet = global_process_set) -> Handle:
    if not grouped:  # one tensor, the per-gradient path: the same checks, in the same order, kept short
        return submit_allreduce(arrays[0], op, name, prescale_factor, postscale_factor, in_place, process_set)
    op = check_op(op)
    for array in arrays:
        check_reducible(array.dtype, op)
    return _submit(Kind.ALLREDUCE, arrays, name, grouped, process_set, op=op, in_place=in_place,
                   prescale=float(prescale_factor), postscale=float(postscale_factor))


def submit_allreduce(array: Any, op: Any, name: "str | None", prescale_factor: float, postscale_factor: float,
                     in_place: bool, process_set: ProcessSet = global_process_set,
                     op_class: "type[AllreduceOp] | None" = None,
                     signature: "Signature | None" = None) -> AllreduceOp:
    """Submit an all-reduce of one array and return its op (a Handle): the per-tensor entry
    point the framework bindings build on (``allreduce_async``/``allreduce_async_`` take it too).

    ``op_class``: a subclass of ``AllreduceOp`` to create, so that a binding's handle is the
    runtime's op itself; ``signature``: the op's ``signature`` from an earlier submit of the
    same host array with the same (checked) arguments, so the checks need not run again."""
    if signature is None:
        if type(op) is not ReduceOp or op is Adasum:  # a ReduceOp member passes as is (check_op's result)
            op = check_op(op)
        if array.dtype.kind == "b":  # only bool arrays restrict the op
            check_reducible(array.dtype, op)
        prescale_factor, postscale_factor = float(prescale_factor), float(postscale_factor)
    runtime = _runtime
    if runtime is not None and process_set is global_process_set and process_set.process_set_id == 0:
        engine = runtime.engine  # the global set's engine: what member() returns for it
    else:
        engine = _rt().member(process_set).engine
    exits.forget_status()  # still submitting: any SystemExit noted before was caught, not an exit
    return engine.submit_allreduce(array, name, op, in_place, prescale_factor, postscale_factor, op_class,
                                   signature)


def _check_root(root_rank: int, process_set: ProcessSet = global_process_set) -> int:
    """``root_rank`` (a global rank, as in Horovod) as a rank within ``process_set``."""
    state = _rt().member(process_set)
    if not isinstance(root_rank, (int, np.integer)) or not 0 <= int(root_rank) < _rt().size:
        raise InvalidArgumentError(f"root_rank must be an integer in [0, {_rt().size}); got {root_rank!r}")
    if int(root_rank) not in state.ranks:
        raise InvalidArgumentError(f"root_rank {int(root_rank)} is not part of process set {state.id} "
                                   f"(ranks {state.ranks}); give a root from the set (a global rank)")
    return state.set_rank_of(int(root_rank))


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
                    prescale_factor: float = 1.0, postscale_factor: float = 1.0, process_set: ProcessSet = global_process_set) -> Handle:
    """Start an all-reduce into a new array; ``synchronize`` returns it."""
    return _submit_allreduce([_array(array)], op, name, prescale_factor, postscale_factor, False, False, process_set)


def allreduce_async_(array: np.ndarray, op: ReduceOp = Average, name: "str | None" = None,
                     prescale_factor: float = 1.0, postscale_factor: float = 1.0, process_set: ProcessSet = global_process_set) -> Handle:
    """Start an in-place all-reduce of ``array``; ``synchronize`` returns ``array``."""
    return _submit_allreduce([_array(array)], op, name, prescale_factor, postscale_factor, True, False, process_set)


def grouped_allreduce_async(arrays: "Sequence[np.ndarray]", op: ReduceOp = Average, name: "str | None" = None,
                            prescale_factor: float = 1.0, postscale_factor: float = 1.0, process_set: ProcessSet = global_process_set) -> Handle:
    """Start all-reduces of several arrays as one unit; ``synchronize`` returns a list of new arrays."""
    return _submit_allreduce([_array(a) for a in arrays], op, name, prescale_factor, postscale_factor,
                             False, True, process_set)


def grouped_allreduce_async_(arrays: "Sequence[np.ndarray]", op: ReduceOp = Average,
                             name: "str | None" = None, prescale_factor: float = 1.0,
                             postscale_factor: float = 1.0, process_set: ProcessSet = global_process_set) -> Handle:
    """In-place grouped all-reduce; ``synchronize`` returns the list of the same arrays."""
    return _submit_allreduce([_array(a) for a in arrays], op, name, prescale_factor, postscale_factor,
                             True, True, process_set)


def allgather_async(array: np.ndarray, name: "str | None" = None, process_set: ProcessSet = global_process_set) -> Handle:
    return _submit(Kind.ALLGATHER, [_array(array)], name, process_set=process_set)


def grouped_allgather_async(arrays: "Sequence[np.ndarray]", name: "str | None" = None, process_set: ProcessSet = global_process_set) -> Handle:
    """Start all-gathers of several arrays as one unit; ``synchronize`` returns a list."""
    return _submit(Kind.ALLGATHER, [_array(a) for a in arrays], name, grouped=True, process_set=process_set)


def broadcast_async(array: np.ndarray, root_rank: int, name: "str | None" = None, process_set: ProcessSet = global_process_set) -> Handle:
    return _submit(Kind.BROADCAST, [_array(array)], name, process_set=process_set,
                   root=_check_root(root_rank, process_set))


def broadcast_async_(array: np.ndarray, root_rank: int, name: "str | None" = None, process_set: ProcessSet = global_process_set) -> Handle:
    return _submit(Kind.BROADCAST, [_array(array)], name, process_set=process_set,
                   root=_check_root(root_rank, process_set), in_place=True)


def reducescatter_async(array: np.ndarray, op: ReduceOp = Average, name: "str | None" = None,
                        prescale_factor: float = 1.0, postscale_factor: float = 1.0, process_set: ProcessSet = global_process_set) -> Handle:
    """Start a reduce-scatter; ``synchronize`` returns this rank's rows of the reduction."""
    array = _array(array)
    op = check_op(op)
    check_reducible(array.dtype, op)
    if array.ndim == 0:
        raise InvalidArgumentError("reducescatter needs an array with at least one dimension to split; "
                                   "got a scalar (0-d): reshape it to (1,) or use allreduce")
    return _submit(Kind.REDUCESCATTER, [array], name, process_set=process_set, op=op,
                   prescale=float(prescale_factor), postscale=float(postscale_factor))


def grouped_reducescatter_async(arrays: "Sequence[np.ndarray]", op: ReduceOp = Average,
                                name: "str | None" = None, prescale_factor: float = 1.0,
                                postscale_factor: float = 1.0, process_set: ProcessSet = global_process_set) -> Handle:
    """Start reduce-scatters of several arrays as one unit; ``synchronize`` returns a list."""
    op = check_op(op)
    arrays = [_array(a) for a in arrays]
    for index, array in enumerate(arrays):
        check_reducible(array.dtype, op)
        if array.ndim == 0:
            raise InvalidArgumentError(f"reducescatter needs arrays with at least one dimension to split; "
                                       f"arrays[{index}] is a scalar (0-d): reshape it to (1,)")
    return _submit(Kind.REDUCESCATTER, arrays, name, grouped=True, process_set=process_set, op=op,
                   prescale=float(prescale_factor), postscale=float(postscale_factor))


def alltoall_async(array: np.ndarray, splits: "Sequence[int] | None" = None,
                   name: "str | None" = None, process_set: ProcessSet = global_process_set) -> Handle:
    """Start an all-to-all; ``synchronize`` returns ``(received, received_splits)``."""
    array = _array(array)
    if array.ndim == 0:
        raise ValueError("alltoall needs an array with at least one dimension to split")
    return _submit(Kind.ALLTOALL, [array], name, process_set=process_set,
                   splits=_check_splits(splits, array.shape[0], process_set))


def _check_splits(splits: "Sequence[int] | None", first: int,
                  process_set: ProcessSet = global_process_set) -> "list[int]":
    """Rows to send to each rank of the set: ``splits``, or equal shares when None."""
    size_ = _rt().member(process_set).size
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
              prescale_factor: float = 1.0, postscale_factor: float = 1.0, process_set: ProcessSet = global_process_set) -> np.ndarray:
    """A new array: the elementwise reduction of ``array`` over all ranks (default Average)."""
    return synchronize(allreduce_async(array, op, name, prescale_factor, postscale_factor, process_set))


def allreduce_(array: np.ndarray, op: ReduceOp = Average, name: "str | None" = None,
               prescale_factor: float = 1.0, postscale_factor: float = 1.0, process_set: ProcessSet = global_process_set) -> np.ndarray:
    """In-place all-reduce: ``array`` is overwritten with the result and returned."""
    return synchronize(allreduce_async_(array, op, name, prescale_factor, postscale_factor, process_set))


def grouped_allreduce(arrays: "Sequence[np.ndarray]", op: ReduceOp = Average, name: "str | None" = None,
                      prescale_factor: float = 1.0, postscale_factor: float = 1.0, process_set: ProcessSet = global_process_set) -> list:
    return synchronize(grouped_allreduce_async(arrays, op, name, prescale_factor, postscale_factor, process_set))


def grouped_allreduce_(arrays: "Sequence[np.ndarray]", op: ReduceOp = Average, name: "str | None" = None,
                       prescale_factor: float = 1.0, postscale_factor: float = 1.0, process_set: ProcessSet = global_process_set) -> list:
    return synchronize(grouped_allreduce_async_(arrays, op, name, prescale_factor, postscale_factor, process_set))


def allgather(array: np.ndarray, name: "str | None" = None, process_set: ProcessSet = global_process_set) -> np.ndarray:
    """Every rank's array concatenated along the first dimension, in rank order."""
    return synchronize(allgather_async(array, name, process_set))


def grouped_allgather(arrays: "Sequence[np.ndarray]", name: "str | None" = None, process_set: ProcessSet = global_process_set) -> list:
    return synchronize(grouped_allgather_async(arrays, name, process_set))


def grouped_reducescatter(arrays: "Sequence[np.ndarray]", op: ReduceOp = Average, name: "str | None" = None,
                          prescale_factor: float = 1.0, postscale_factor: float = 1.0, process_set: ProcessSet = global_process_set) -> list:
    return synchronize(grouped_reducescatter_async(arrays, op, name, prescale_factor, postscale_factor, process_set))


def broadcast(array: np.ndarray, root_rank: int, name: "str | None" = None, process_set: ProcessSet = global_process_set) -> np.ndarray:
    """A new array holding ``root_rank``'s values."""
    return synchronize(broadcast_async(array, root_rank, name, process_set))


def broadcast_(array: np.ndarray, root_rank: int, name: "str | None" = None, process_set: ProcessSet = global_process_set) -> np.ndarray:
    """In-place broadcast: ``array`` is overwritten with ``root_rank``'s values."""
    return synchronize(broadcast_async_(array, root_rank, name, process_set))


def reducescatter(array: np.ndarray, op: ReduceOp = Average, name: "str | None" = None,
                  prescale_factor: float = 1.0, postscale_factor: float = 1.0, process_set: ProcessSet = global_process_set) -> np.ndarray:
    """Reduce over ranks, then keep this rank's share of the first dimension."""
    return synchronize(reducescatter_async(array, op, name, prescale_factor, postscale_factor, process_set))


def alltoall(array: np.ndarray, splits: "Sequence[int] | None" = None, name: "str | None" = None, process_set: ProcessSet = global_process_set):
    """Scatter rows to every rank and gather theirs. Returns the received array, or
    ``(received, received_splits)`` when ``splits`` is given (as Horovod does)."""
    received, received_splits = synchronize(alltoall_async(array, splits, name, process_set))
    return received if splits is None else (received, received_splits)


def barrier(process_set: ProcessSet = global_process_set) -> None:
    """Wait until every rank of ``process_set`` reaches the barrier."""
    synchronize(_submit(Kind.BARRIER, [None], None, process_set=process_set))


def broadcast_object(obj: Any, root_rank: int = 0, name: "str | None" = None, process_set: ProcessSet = global_process_set) -> Any:
    """``root_rank``'s picklable object, on every rank."""
    root = _check_root(root_rank, process_set)
    # Pickled and unpickled here, in the caller's thread: the engine moves bytes only.  A root
    # that cannot pickle its object still takes part, sending word of its failure, so the
    # other ranks raise too instead of waiting for an op the root never submits.
    payload, failure = None, None
    if root == _rt().member(process_set).rank:
        try:
            payload = pickle.dumps(obj)
        except Exception as error:
            failure = error
            payload = pickle.dumps(_RootCannotPickle(f"{type(error).__name__}: {error}"))
    value = pickle.loads(synchronize(_submit(Kind.BROADCAST_OBJECT, [None], name, process_set=process_set, root=root, obj=payload)))
    if failure is not None:
        raise failure
    if isinstance(value, _RootCannotPickle):
        raise pickle.PicklingError(f"broadcast_object: root rank {root_rank} could not pickle its object "
                                   f"({value.message}); broadcast only picklable objects")
    return value


class _RootCannotPickle:
    """What a broadcast_object root sends when its object cannot be pickled."""

    def __init__(self, message: str) -> None:
        self.message = message


def allgather_object(obj: Any, name: "str | None" = None, process_set: ProcessSet = global_process_set) -> list:
    """A list of every rank's picklable object, in rank order."""
    payloads = synchronize(_submit(Kind.ALLGATHER_OBJECT, [None], name, process_set=process_set, obj=pickle.dumps(obj)))
    return [pickle.loads(payload) for payload in payloads]


def join() -> int:
    """This rank has run out of data (Horovod's ``join``): until every rank has joined, it takes
    part in the ops the other ranks still submit: all-reduces and reduce-scatters count it as
    zeros (the identity for Min, Max and Product), allgathers and alltoalls get no rows from it,
    a broadcast from it raises on the ranks that submitted the broadcast. Blocks until every
    rank has joined; returns the rank that joined last.

    A rank joins every process set it belongs to at once, so a set's op that another member
    still runs completes with this rank standing in, as on the global set."""
    runtime = _rt()
    exits.forget_status()
    handles = [state.engine.submit_join() for set_id, state in sorted(runtime.sets.items())
               if set_id != 0 and state.engine is not None]
    last = synchronize(runtime.engine.submit_join())
    for handle in handles:
        synchronize(handle)
    return last
