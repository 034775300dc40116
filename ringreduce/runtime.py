"""Process-wide runtime state and the public functions of ``ringreduce``."""
from __future__ import annotations

import dataclasses
import os
import pickle
import sys
from typing import Any, Callable, Sequence

import numpy as np
from mpi4py import MPI

from mtrain.launcher.records.errors import supervised
from mtrain.launcher.records.phase import Phase, PhaseNote
from mtrain.launcher.records.steps import ENV_STRAGGLER_OFF, StepSample
from mtrain.launcher.stragglers import StragglerRow, straggler_table

from . import comm as comm_module
from . import cuda, exits, log, p2p, process_sets as _ps, recorder, ring
from .backend import is_device_array
from .collectives import Executor, Kind
from .engine import Engine, EngineStats
from .requests import AllreduceOp, Handle, Signature, host_allreduce_signature, make_refusal, make_request
from .errors import HorovodInternalError, InvalidArgumentError, Refusal
from .ops import Adasum, Average, ReduceOp, check_op, check_reducible, dtype_code
from .process_sets import ProcessSet, global_process_set
from .settings import AutotuneConfig, EngineConfig, env_number
from .steps import StepMeter
from .timeline import TraceLink


class NotInitializedError(ValueError, RuntimeError):
    """A collective was called before ``init()``: a ValueError, as Horovod's ``rank()`` raises, and a
    RuntimeError, as its collectives raise (horovod/torch/mpi_ops.py wraps them in HorovodInternalError)."""


_runtime: "_ps.Registry | None" = None


def _live_runtime() -> _ps.Registry:
    return _rt()


_ps._registry_of = _live_runtime


def _refuse_lone_srun_task(world_size: int, env: "dict[str, str] | os._Environ") -> None:
    """srun started this process as one task of several, but MPI sees it alone: srun gave it no
    PMIx (`--mpi=pmix`), so every task would train by itself, each an MPI job of one.  Leave at
    once with one line instead (exit status 2, a usage error)."""
    tasks = env.get("SLURM_STEP_NUM_TASKS", "")
    if (world_size != 1 or not tasks.isdigit() or int(tasks) < 2 or supervised()
            or "OMPI_COMM_WORLD_SIZE" in env or "PMIX_RANK" in env):
        return
    sys.stderr.write(f"mtrain: srun started this process as task {env.get('SLURM_PROCID', '?')} of {tasks}, but "
                     "MPI sees it alone (srun gave it no PMIx): start the ranks with `srun --mpi=pmix`, or run "
                     "`mtrain run` inside the allocation\n")
    sys.stderr.flush()
    raise SystemExit(2)


def init(comm: Any = None, process_sets: Any = None) -> None:
    """Start the runtime on ``comm`` (an mpi4py communicator; default COMM_WORLD).

    ``process_sets``: a list of ``ProcessSet`` to register (every rank passes the same list),
    or ``"dynamic"`` (accepted for Horovod; sets may always be added later).

    Safe to call more than once. Installs abort-on-uncaught-exception so one
    failing rank ends the job instead of blocking the others.
    """
    global _runtime
    wanted = _check_process_sets_argument(process_sets)
    if comm is None:
        _refuse_lone_srun_task(MPI.COMM_WORLD.Get_size(), os.environ)
    if _runtime is not None:
        if _runtime.engine.running():
            if wanted:
                _runtime.register(wanted)
            return
        shutdown()  # another rank shut the job's engine down: start afresh, together
    if not comm_module.threading_level_ok():
        raise RuntimeError("MPI was initialized without thread support; mtrain's background engine needs "
                           "MPI_THREAD_SERIALIZED or higher: leave mpi4py.rc.thread_level at its default")
    # Until every rank of the communicator comes, init() waits in MPI, where nothing can tell a
    # rank that is coming from one whose program ended: the supervisor can (records.phase.PhaseNote).
    PhaseNote(Phase.INIT_WAITING, ranks=tuple(_job_ranks_of(comm))).emit()
    if isinstance(comm, (list, tuple)):  # Horovod also takes a list of ranks here
        comm = _comm_of_ranks(list(comm))
    segment = int(env_number("MTRAIN_RING_SEGMENT_BYTES", ring.DEFAULT_SEGMENT_BYTES)) or ring.DEFAULT_SEGMENT_BYTES
    small = int(env_number("MTRAIN_SMALL_ALLREDUCE_BYTES", ring.DEFAULT_SMALL_BYTES))
    config = EngineConfig.from_environment()
    comms = comm_module.create(comm)
    log.start(config, comms.world.Get_rank())  # the level, and rank 0's notes on the settings
    # One GPU per rank: local_rank % count; nothing at all without CuPy and a GPU.
    cuda.bind_device(comms.local.Get_rank())
    # Asked once here, before the engine thread owns MPI: ranks per host, on every host.
    homogeneous = len(set(comms.world.allgather(comms.local.Get_size()))) == 1
    world_ranks = list(range(comms.world.Get_size()))

    def make_engine(set_comms: comm_module.Communicators, ranks: "list[int] | None" = None) -> Engine:
        # A set's engine names global ranks in its messages; only the global set keeps a timeline,
        # and only its engine is autotuned (Horovod tunes one set of parameters for the job).
        set_config = config if set_comms is comms else dataclasses.replace(
            config, timeline_path=None, autotune=AutotuneConfig())
        members = ranks
        if members is None:
            members = [int(r) for r in MPI.Group.Translate_ranks(
                set_comms.world.Get_group(), list(range(set_comms.world.Get_size())), comms.world.Get_group())]
        executor = Executor(set_comms.world, segment, small, set_comms.local, set_comms.cross,
                            tunable=set_config.autotune.enabled)
        # The straggler report measures the job's steps, which the job's engine runs.
        steps = StepMeter() if set_comms is comms and os.environ.get(ENV_STRAGGLER_OFF) != "1" else None
        return Engine(executor, set_comms.world.Dup(), set_config, members, steps,
                      trace_link=trace_link if set_comms is comms else None)

    admin = comms.world.Dup()  # made before any engine thread calls MPI
    private_parent = comms.world.Dup()  # where members alone make private sets (Registry.private_set)
    # The timeline's own communicator and this rank's clock against rank 0's, measured now,
    # while no engine thread calls MPI (timeline.py: every rank's events go to rank 0).
    trace_link = TraceLink.measure(comms.world)
    engine = make_engine(comms, world_ranks)
    _runtime = _ps.Registry(comms, engine, make_engine, admin, private_parent)
    _runtime.homogeneous = homogeneous
    global_process_set.ranks = world_ranks  # as Horovod fills in hvd.global_process_set.ranks
    comm_module.install_abort_on_exception()
    exits.install(shutdown)
    PhaseNote(Phase.INIT_DONE).emit()
    recorder.start(comms.world.Get_rank(), _recorded_sets)  # SIGUSR1 dumps (under mtrain run)
    if wanted:
        _runtime.register(wanted)


def _recorded_sets() -> "list[recorder.SetView]":
    """The process sets this rank runs an engine for, for the flight recorder's dumps."""
    runtime = _runtime
    if runtime is None:
        return []
    return [recorder.SetView(set_id, list(state.ranks), state.engine)
            for set_id, state in sorted({**runtime.sets, **runtime.private}.items()) if state.engine is not None]


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


def private_process_set(ranks: Sequence[int]) -> ProcessSet:
    """A process set that its members alone make: each rank in ``ranks`` (global ranks) calls this,
    in the same order as the other members make theirs; the other ranks take no part. Blocks until
    every member has come.

    For a binding that runs groups of its own on the runtime (the torch.distributed backend's
    ``new_group``, which torch creates on the members only). Ops take it as ``process_set=`` like
    a registered set; it has no ``process_set_id`` that ``process_set_by_id`` finds, and ``join()``
    does not join it. ``remove_process_set`` on its members releases it; ``shutdown()`` does too."""
    runtime = _rt()
    state = runtime.private_set(ranks)
    process_set = ProcessSet(list(state.ranks))
    process_set.process_set_id = state.id
    state.holders.add(process_set)
    return process_set


def remove_process_set(process_set: ProcessSet) -> bool:
    """Unregister ``process_set`` (every rank makes the same call; for a private set,
    ``private_process_set``, its members alone). Its ops still in flight end with an error.
    Returns False for the global set, which stays."""
    runtime = _rt()
    state = runtime.state(process_set)
    if state.id == 0:
        return False
    if state.id < 0:  # a private set: nothing to agree on with the ranks outside it
        runtime.drop_private(state)
        process_set._invalidate()
        return True
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
    recorder.stop()
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
    """Start recording the Chrome-trace timeline (call it on every rank: each records its own
    events, rank 0 writes them all to ``file_path``). Replaces a timeline already running."""
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


def straggler_stats() -> "list[StragglerRow]":
    """Which rank is slow: one row per rank over its newest measured steps (up to 4096): host,
    steps, median compute and wait per step, the share of steps it submitted last, and whether
    it is more than MTRAIN_STRAGGLER_THRESHOLD_PERCENT (default 20) slower than the median rank.

    A collective on the job's ranks: every rank must call it (each returns the same table). With
    MTRAIN_STRAGGLER_REPORT_DISABLE=1 (``mtrain run --no-straggler-report``) nothing is measured,
    and the table is empty."""
    meter = _rt().engine.steps
    mine = (meter.host, [sample._asdict() for sample in meter.recent()]) if meter is not None else ("", [])
    gathered = allgather_object(mine, name="mtrain.straggler_stats")
    hosts = {rank: host for rank, (host, _) in enumerate(gathered)}
    samples = {rank: [StepSample(**row) for row in rows] for rank, (_, rows) in enumerate(gathered)}
    return straggler_table(samples, hosts)


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


def _check_name(name: Any) -> None:
    """An op's name is a str, or None for an unnamed op (numbered by the engine)."""
    if name is not None and not isinstance(name, str):
        raise TypeError(f"an op's name must be a str, or None to leave it unnamed; got {type(name).__name__} "
                        f"{name!r}")


def _writable(array: Any, what: str) -> Any:
    """``array``, which an in-place op writes its result into."""
    if type(array) is np.ndarray and not array.flags.writeable:
        raise InvalidArgumentError(f"{what} writes its result into its input, which is read-only; pass a writable "
                                   "array, or use the out-of-place form")
    return array


def _listed(arrays: Any) -> list:
    """A grouped op's arrays as a list (something that is not a sequence is one array, refused by ``_array``)."""
    try:
        return list(arrays)
    except TypeError:
        return [arrays]


def _refuse(engine: Engine, kind: Kind, names: "list[str]", error: Exception) -> None:
    """Submit a refusal (``errors.Refusal``) under each of ``names``: what this rank takes part in the
    negotiation with when its own arguments were refused, so that the ranks that did submit the op raise
    the same class instead of waiting for this one, and unnamed ops stay numbered alike on every rank."""
    refusal = Refusal.of(error)
    handle = Handle(len(names), len(names) > 1, engine.done_cv)  # nobody waits on it
    try:
        engine.submit([make_refusal(kind, name, handle, index, refusal) for index, name in enumerate(names)])
    except (InvalidArgumentError, HorovodInternalError):
        pass  # shut down, or the name is in flight here already: the caller's own error is what it sees


def _submit(kind: Kind, name: "str | None", process_set: ProcessSet,
            checked: "Callable[[], tuple[list[Any], dict[str, Any]]]", parts: int = 1,
            grouped: bool = False) -> Handle:
    """Submit one op of ``parts`` arrays under one handle. ``checked`` runs the op's argument checks and
    returns its arrays (None: an op that carries none) and request fields. If it raises, this rank still
    takes the op's name(s) into the negotiation, as a refusal (``_refuse``), then raises."""
    engine = _rt().member(process_set).engine  # outside the set: there is nothing to take part in
    _check_name(name)
    exits.forget_status()  # still submitting: any SystemExit noted before was caught, not an exit
    handle = Handle(parts, grouped, engine.done_cv)
    base = name or engine.auto_name()
    names = [f"{base}.{i}" for i in range(parts)] if grouped else [base]
    try:
        arrays, fields = checked()
        requests = [make_request(kind, array, n, handle, i, **fields)
                    for i, (array, n) in enumerate(zip(arrays, names))]
    except Exception as error:
        _refuse(engine, kind, names, error)
        raise
    engine.submit(requests)
    return handle


def _submit_grouped_allreduce(arrays: Any, op: ReduceOp, name: "str | None", prescale_factor: float,
                              postscale_factor: float, in_place: bool,
                              process_set: ProcessSet = global_process_set) -> Handle:
    """Several all-reduces under one handle (one tensor alone takes ``submit_allreduce``)."""
    items = _listed(arrays)

    def checked() -> "tuple[list[Any], dict[str, Any]]":
        checked_op = check_op(op)
        group = [_array(a) for a in items]
        for array in group:
            check_reducible(array.dtype, checked_op)
            if in_place:
                _writable(array, "grouped_allreduce_")
        return group, dict(op=checked_op, in_place=in_place, prescale=float(prescale_factor),
                           postscale=float(postscale_factor))
    return _submit(Kind.ALLREDUCE, name, process_set, checked, len(items), True)


def submit_allreduce(array: Any, op: Any, name: "str | None", prescale_factor: float, postscale_factor: float,
                     in_place: bool, process_set: ProcessSet = global_process_set,
                     op_class: "type[AllreduceOp] | None" = None,
                     signature: "Signature | None" = None) -> AllreduceOp:
    """Submit an all-reduce of one array and return its op (a Handle): the per-tensor entry
    point the framework bindings build on (``allreduce_async``/``allreduce_async_`` take it too).

    ``op_class``: a subclass of ``AllreduceOp`` to create, so that a binding's handle is the
    runtime's op itself; ``signature``: the op's ``signature`` from an earlier submit of the
    same host array with the same (checked) arguments, so the checks need not run again.
    Arguments refused here are refused as by every other op (``_submit``)."""
    runtime = _runtime
    if runtime is not None and process_set is global_process_set and process_set.process_set_id == 0:
        engine = runtime.engine  # the global set's engine: what member() returns for it
    else:
        engine = _rt().member(process_set).engine
    if name is not None and type(name) is not str:
        _check_name(name)
    exits.forget_status()  # still submitting: any SystemExit noted before was caught, not an exit
    if signature is None:
        try:
            if type(op) is not ReduceOp or op is Adasum:  # a ReduceOp member passes as is (check_op's result)
                op = check_op(op)
            if type(array) is not np.ndarray:
                array = _array(array)
            if array.dtype.kind == "b":  # only bool arrays restrict the op
                check_reducible(array.dtype, op)
            prescale_factor, postscale_factor = float(prescale_factor), float(postscale_factor)
            if type(array) is np.ndarray:  # the signature checks the dtype (TypeError)
                if in_place and not array.flags.writeable:
                    _writable(array, "allreduce_")  # raises
                signature = host_allreduce_signature(array, op, prescale_factor, postscale_factor)
            else:
                dtype_code(array.dtype)
        except Exception as error:
            _refuse(engine, Kind.ALLREDUCE, [name or engine.auto_name()], error)
            raise
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
# An op whose arguments are refused here raises at once on this rank, and the
# ranks that submitted it raise the same class (``_submit``).


def poll(handle: Handle) -> bool:
    """True once ``handle``'s op has finished (successfully or not)."""
    return handle.done()


def synchronize(handle: Handle) -> Any:
    """Wait for ``handle``'s op; return its result or raise its error."""
    return handle.wait()


def allreduce_async(array: np.ndarray, op: ReduceOp = Average, name: "str | None" = None,
                    prescale_factor: float = 1.0, postscale_factor: float = 1.0, process_set: ProcessSet = global_process_set) -> Handle:
    """Start an all-reduce into a new array; ``synchronize`` returns it."""
    return submit_allreduce(array, op, name, prescale_factor, postscale_factor, False, process_set)


def allreduce_async_(array: np.ndarray, op: ReduceOp = Average, name: "str | None" = None,
                     prescale_factor: float = 1.0, postscale_factor: float = 1.0, process_set: ProcessSet = global_process_set) -> Handle:
    """Start an in-place all-reduce of ``array``; ``synchronize`` returns ``array``."""
    return submit_allreduce(array, op, name, prescale_factor, postscale_factor, True, process_set)


def grouped_allreduce_async(arrays: "Sequence[np.ndarray]", op: ReduceOp = Average, name: "str | None" = None,
                            prescale_factor: float = 1.0, postscale_factor: float = 1.0, process_set: ProcessSet = global_process_set) -> Handle:
    """Start all-reduces of several arrays as one unit; ``synchronize`` returns a list of new arrays."""
    return _submit_grouped_allreduce(arrays, op, name, prescale_factor, postscale_factor, False, process_set)


def grouped_allreduce_async_(arrays: "Sequence[np.ndarray]", op: ReduceOp = Average,
                             name: "str | None" = None, prescale_factor: float = 1.0,
                             postscale_factor: float = 1.0, process_set: ProcessSet = global_process_set) -> Handle:
    """In-place grouped all-reduce; ``synchronize`` returns the list of the same arrays."""
    return _submit_grouped_allreduce(arrays, op, name, prescale_factor, postscale_factor, True, process_set)


def allgather_async(array: np.ndarray, name: "str | None" = None, process_set: ProcessSet = global_process_set) -> Handle:
    return _submit(Kind.ALLGATHER, name, process_set, lambda: ([_array(array)], {}))


def grouped_allgather_async(arrays: "Sequence[np.ndarray]", name: "str | None" = None, process_set: ProcessSet = global_process_set) -> Handle:
    """Start all-gathers of several arrays as one unit; ``synchronize`` returns a list."""
    items = _listed(arrays)
    return _submit(Kind.ALLGATHER, name, process_set, lambda: ([_array(a) for a in items], {}), len(items), True)


def broadcast_async(array: np.ndarray, root_rank: int, name: "str | None" = None, process_set: ProcessSet = global_process_set) -> Handle:
    return _submit(Kind.BROADCAST, name, process_set,
                   lambda: ([_array(array)], dict(root=_check_root(root_rank, process_set))))


def broadcast_async_(array: np.ndarray, root_rank: int, name: "str | None" = None, process_set: ProcessSet = global_process_set) -> Handle:
    return _submit(Kind.BROADCAST, name, process_set,
                   lambda: ([_writable(_array(array), "broadcast_")],
                            dict(root=_check_root(root_rank, process_set), in_place=True)))


def reducescatter_async(array: np.ndarray, op: ReduceOp = Average, name: "str | None" = None,
                        prescale_factor: float = 1.0, postscale_factor: float = 1.0, process_set: ProcessSet = global_process_set) -> Handle:
    """Start a reduce-scatter; ``synchronize`` returns this rank's rows of the reduction."""
    def checked() -> "tuple[list[Any], dict[str, Any]]":
        checked_array = _array(array)
        checked_op = check_op(op)
        check_reducible(checked_array.dtype, checked_op)
        if checked_array.ndim == 0:
            raise InvalidArgumentError("reducescatter needs an array with at least one dimension to split; "
                                       "got a scalar (0-d): reshape it to (1,) or use allreduce")
        return [checked_array], dict(op=checked_op, prescale=float(prescale_factor), postscale=float(postscale_factor))
    return _submit(Kind.REDUCESCATTER, name, process_set, checked)


def grouped_reducescatter_async(arrays: "Sequence[np.ndarray]", op: ReduceOp = Average,
                                name: "str | None" = None, prescale_factor: float = 1.0,
                                postscale_factor: float = 1.0, process_set: ProcessSet = global_process_set) -> Handle:
    """Start reduce-scatters of several arrays as one unit; ``synchronize`` returns a list."""
    items = _listed(arrays)

    def checked() -> "tuple[list[Any], dict[str, Any]]":
        checked_op = check_op(op)
        group = [_array(a) for a in items]
        for index, array in enumerate(group):
            check_reducible(array.dtype, checked_op)
            if array.ndim == 0:
                raise InvalidArgumentError(f"reducescatter needs arrays with at least one dimension to split; "
                                           f"arrays[{index}] is a scalar (0-d): reshape it to (1,)")
        return group, dict(op=checked_op, prescale=float(prescale_factor), postscale=float(postscale_factor))
    return _submit(Kind.REDUCESCATTER, name, process_set, checked, len(items), True)


def alltoall_async(array: np.ndarray, splits: "Sequence[int] | None" = None,
                   name: "str | None" = None, process_set: ProcessSet = global_process_set) -> Handle:
    """Start an all-to-all; ``synchronize`` returns ``(received, received_splits)``."""
    def checked() -> "tuple[list[Any], dict[str, Any]]":
        checked_array = _array(array)
        if checked_array.ndim == 0:
            raise InvalidArgumentError("alltoall needs an array with at least one dimension to split")
        return [checked_array], dict(splits=_check_splits(splits, checked_array.shape[0], process_set))
    return _submit(Kind.ALLTOALL, name, process_set, checked)


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
    synchronize(_submit(Kind.BARRIER, None, process_set, lambda: ([None], {})))


def broadcast_object(obj: Any, root_rank: int = 0, name: "str | None" = None, process_set: ProcessSet = global_process_set) -> Any:
    """``root_rank``'s picklable object, on every rank."""
    # Pickled and unpickled here, in the caller's thread: the engine moves bytes only. A root
    # that cannot pickle its object refuses the op (``_submit``): the others raise its class.
    def checked() -> "tuple[list[Any], dict[str, Any]]":
        root = _check_root(root_rank, process_set)
        payload = pickle.dumps(obj) if root == _rt().member(process_set).rank else None
        return [None], dict(root=root, obj=payload)
    return pickle.loads(synchronize(_submit(Kind.BROADCAST_OBJECT, name, process_set, checked)))


def allgather_object(obj: Any, name: "str | None" = None, process_set: ProcessSet = global_process_set) -> list:
    """A list of every rank's picklable object, in rank order."""
    payloads = synchronize(_submit(Kind.ALLGATHER_OBJECT, name, process_set,
                                   lambda: ([None], dict(obj=pickle.dumps(obj)))))
    return [pickle.loads(payload) for payload in payloads]


# -- point-to-point (p2p.py) ------------------------------------------------------
# Global ranks, as root_rank; matched in order per (source, dest, tag) within a process set.

def send_async(array: np.ndarray, dest: int, tag: int = 0, process_set: ProcessSet = global_process_set) -> p2p.Transfer:
    """Start sending ``array`` to rank ``dest``; ``synchronize`` waits until the array may be reused."""
    exits.forget_status()
    return p2p.start_send(_rt().member(process_set), array, dest, tag)


def recv_async(array: np.ndarray, source: int, tag: int = 0, process_set: ProcessSet = global_process_set) -> p2p.Transfer:
    """Start receiving rank ``source``'s send (same tag) into ``array``; ``synchronize`` returns ``array``.
    The send must have the same dtype and number of elements (else a ``MismatchError`` here)."""
    exits.forget_status()
    return p2p.start_recv(_rt().member(process_set), array, source, tag)


def send(array: np.ndarray, dest: int, tag: int = 0, process_set: ProcessSet = global_process_set) -> None:
    """Send ``array`` to rank ``dest`` and wait until it may be reused."""
    exits.forget_status()
    # The caller waits, so it drives the transfer itself: the mover thread is not woken.
    synchronize(p2p.start_send(_rt().member(process_set), array, dest, tag, wake=False))


def recv(array: np.ndarray, source: int, tag: int = 0, process_set: ProcessSet = global_process_set) -> np.ndarray:
    """Receive rank ``source``'s send into ``array``; returns ``array``."""
    exits.forget_status()
    return synchronize(p2p.start_recv(_rt().member(process_set), array, source, tag, wake=False))


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
