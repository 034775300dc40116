"""The runtime's life: ``init()`` and ``shutdown()``, and the process-set registry's public calls.

``init()`` builds this rank's state (``process_sets.Registry``: the job's communicators, the
global engine, the registered sets) and installs it; ``current()`` returns it; ``shutdown()``
stops it. The ops themselves are api.py's, their checks and submit path submit.py's."""
from __future__ import annotations

import dataclasses
import os
import sys
from typing import Any, Sequence

import numpy as np

from mtrain.common import settings
from mtrain.common.records.error_report import supervised
from mtrain.common.records.phase import Phase, PhaseNote
from mtrain.common.settings import AutotuneConfig, EngineConfig
from mtrain.ringreduce import exits
from mtrain.ringreduce import process_sets as _ps
from mtrain.ringreduce.core import log
from mtrain.ringreduce.core.errors import InvalidArgumentError
from mtrain.ringreduce.engine.cycle import Engine
from mtrain.ringreduce.observe import recorder
from mtrain.ringreduce.observe.steps import job_meter
from mtrain.ringreduce.observe.timeline import TraceLink
from mtrain.ringreduce.process_sets import ProcessSet, global_process_set
from mtrain.ringreduce.transport import comm as comm_module
from mtrain.ringreduce.transport import cuda, mpi, ring
from mtrain.ringreduce.transport.executor import Executor

MPI = mpi.deferred(__name__)  # mpi4py's MPI from init() on (importing the runtime starts no MPI)


def current() -> _ps.Registry:
    """This rank's live runtime state (the process-set registry: communicators, engines, sets), for
    tests and benchmarks that look inside; NotInitializedError before ``init()``."""
    return _ps.current()


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
    """Start the runtime on ``comm``, as Horovod's ``hvd.init(comm, process_sets)``
    (horovod/common/basics.py): None or ``[]`` for COMM_WORLD, a list of COMM_WORLD ranks (in
    the list's order: its first rank is rank 0), or an mpi4py communicator. Only the ranks in it
    call init(); ``rank()``, ``size()``, ``local_rank()`` and ``cross_rank()`` are then the
    communicator's, and so are the ranks that ``ProcessSet`` and ``root_rank`` name.

    ``process_sets``: a list of ``ProcessSet`` to register (every rank passes the same sets;
    one listed twice is a ValueError, as in Horovod), or ``"dynamic"``: sets may be added and
    removed later even under ``HOROVOD_DYNAMIC_PROCESS_SETS=0``.

    Safe to call more than once. Installs abort-on-uncaught-exception so one
    failing rank ends the job instead of blocking the others.
    """
    mpi.start()  # MPI starts here, not at import
    wanted = _check_process_sets_argument(process_sets)
    dynamic = _dynamic_process_sets(process_sets)
    comm = _check_comm_argument(comm)
    if comm is None:
        _refuse_lone_srun_task(MPI.COMM_WORLD.Get_size(), os.environ)
    live = _ps.installed()
    if live is not None:
        if live.engine.running():
            if dynamic:
                live.dynamic = True
            if wanted:
                live.register(wanted)
                _refuse_duplicates(wanted)
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
    segment = int(settings.number_or(settings.RING_SEGMENT_BYTES, ring.DEFAULT_SEGMENT_BYTES)) or ring.DEFAULT_SEGMENT_BYTES
    small = int(settings.number_or(settings.SMALL_ALLREDUCE_BYTES, ring.DEFAULT_SMALL_BYTES))
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
        executor.choose_paths()  # which path each size takes: kept for this topology, or measured now
        # The straggler report measures the job's steps, which the job's engine runs.
        steps = job_meter() if set_comms is comms else None
        return Engine(executor, set_comms.world.Dup(), set_config, members, steps,
                      trace_link=trace_link if set_comms is comms else None)

    admin = comms.world.Dup()  # made before any engine thread calls MPI
    private_parent = comms.world.Dup()  # where members alone make private sets (Registry.private_set)
    # The timeline's own communicator and this rank's clock against rank 0's, measured now,
    # while no engine thread calls MPI (timeline.py: every rank's events go to rank 0).
    trace_link = TraceLink.measure(comms.world)
    engine = make_engine(comms, world_ranks)
    registry = _ps.Registry(comms, engine, make_engine, admin, private_parent)
    registry.homogeneous = homogeneous
    registry.dynamic = dynamic
    _ps.install(registry)
    global_process_set.ranks = world_ranks  # as Horovod fills in hvd.global_process_set.ranks
    comm_module.install_abort_on_exception()
    exits.install(shutdown)
    PhaseNote(Phase.INIT_DONE).emit()
    recorder.start(comms.world.Get_rank(), _recorded_sets)  # SIGUSR1 dumps (under mtrain run)
    if wanted:
        registry.register(wanted)
        _refuse_duplicates(wanted)


def _recorded_sets() -> "list[recorder.SetView]":
    """The process sets this rank runs an engine for, for the flight recorder's dumps."""
    runtime = _ps.installed()
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


def _dynamic_process_sets(process_sets: Any) -> "bool | None":
    """Whether sets may be added and removed after init(): True for ``process_sets="dynamic"``
    (any case, as Horovod reads it), else HOROVOD_DYNAMIC_PROCESS_SETS (None: unset, allowed)."""
    if isinstance(process_sets, str) and process_sets.lower() == "dynamic":
        return True
    return settings.DYNAMIC_PROCESS_SETS.read()


def _refuse_duplicates(wanted: "list[ProcessSet]") -> None:
    """Horovod's rule for init(process_sets=[...]) (basics.py): a set listed twice, with its ranks
    in any order, is a ValueError, raised after the others are registered (they stay usable)."""
    seen: "dict[int, int]" = {}
    for index, process_set in enumerate(wanted):
        set_id = process_set.process_set_id
        if set_id is None or set_id == 0:  # outside a communicator's set; or the global set
            continue
        if set_id in seen:
            process_set.process_set_id = None  # unregistered again, as Horovod's duplicate check leaves it
            raise ValueError(f"process_sets entry number {index} is a duplicate of entry number {seen[set_id]} "
                             f"({process_set.ranks}): list each process set once")
        seen[set_id] = index


def _check_comm_argument(comm: Any) -> Any:
    """``comm`` as init() uses it: None (COMM_WORLD), a list of ranks, or a communicator;
    Horovod's ValueError for anything else, and for a communicator this rank is outside of."""
    if comm is None or isinstance(comm, MPI.Comm):
        if comm is not None and comm == MPI.COMM_NULL:
            raise ValueError("init(comm=MPI.COMM_NULL): this rank is not in the communicator; only the "
                             "communicator's ranks call init()")
        return comm
    if isinstance(comm, (str, bytes)):
        ranks = None
    else:
        try:
            ranks = list(comm)
        except TypeError:
            ranks = None
    if ranks is None or any(isinstance(r, bool) or not isinstance(r, (int, np.integer)) for r in ranks):
        raise ValueError(f"init(comm={comm!r}): comm must be a list of integer ranks of COMM_WORLD or an "
                         "mpi4py communicator (MPI.Comm)")
    # Horovod takes an empty list for "every rank" (its comm=None becomes []).
    return [int(r) for r in ranks] or None


def _check_process_sets_argument(process_sets: Any) -> "list[ProcessSet]":
    if process_sets is None or (isinstance(process_sets, str) and process_sets.lower() == "dynamic"):
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
    # In the list's order, as Horovod's MPI_Group_incl: init(comm=[2, 0]) makes COMM_WORLD's rank 2 rank 0.
    group = world.Get_group().Incl(ranks)
    comm = world.Create_group(group, tag=9001)
    group.Free()
    return comm


def add_process_set(process_set: "ProcessSet | Sequence[int]") -> ProcessSet:
    """Register a process set after ``init()``; every rank makes the same call, member or not.
    Returns the registered ``ProcessSet``."""
    runtime = current()
    _refuse_static("adding", runtime)
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
    runtime = current()
    state = runtime.private_set(ranks)
    process_set = ProcessSet(list(state.ranks))
    process_set.process_set_id = state.id
    state.holders.add(process_set)
    return process_set


def remove_process_set(process_set: ProcessSet) -> bool:
    """Unregister ``process_set`` (every rank makes the same call; for a private set,
    ``private_process_set``, its members alone). Its ops still in flight end with an error.
    Returns False for the global set, which stays."""
    runtime = current()
    # As Horovod, the global set is not removed (False) whatever the setting; private sets are mtrain's own.
    if process_set.process_set_id is not None and process_set.process_set_id > 0:
        _refuse_static("removing", runtime)
    return runtime.remove(process_set)


def _refuse_static(doing: str, runtime: _ps.Registry) -> None:
    """Horovod's refusal (basics.py) when HOROVOD_DYNAMIC_PROCESS_SETS is 0 and init() was not
    given process_sets="dynamic": its ValueError, on every rank alike (no rank waits for another)."""
    if runtime.dynamic is False:
        raise ValueError(f"Set HOROVOD_DYNAMIC_PROCESS_SETS=1 (or call init(process_sets=\"dynamic\")) to allow "
                         f"{doing} process sets after initialization; HOROVOD_DYNAMIC_PROCESS_SETS=0 fixes the "
                         "sets given to init(process_sets=[...])")


def shutdown() -> None:
    """Release the runtime's communicators. Idempotent; ``init()`` may be called again."""
    runtime = _ps.install(None)
    recorder.stop()
    if runtime is not None:
        runtime.stop_all()


def is_initialized() -> bool:
    return _ps.installed() is not None


def process_set_by_id(process_set_id: int) -> ProcessSet:
    """A ``ProcessSet`` for the registered set ``process_set_id`` (0: the global set), for APIs
    that name sets by id (Horovod's TF ``*_op(process_set_id=...)``). InvalidArgumentError if none."""
    if int(process_set_id) == 0:
        return global_process_set
    state = current().sets.get(int(process_set_id))
    if state is None:
        raise InvalidArgumentError(f"no process set has process_set_id={process_set_id}: register it with "
                                   "hvd.init(process_sets=[...]) or hvd.add_process_set() first")
    handle = ProcessSet(list(state.ranks))
    handle.process_set_id = state.id
    return handle
