"""Process sets: subsets of the ranks that run collectives among themselves.

A ``ProcessSet`` names its ranks (global ranks, sorted) or an mpi4py
communicator. ``init(process_sets=[...])`` registers sets at start-up;
``add_process_set`` and ``remove_process_set`` change them later; every rank
makes the same calls in the same order, members or not. Each registered set
has an id (0 is ``global_process_set``, every rank) and, on its members, its
own communicators and its own engine (``engine/cycle.py``): its own background
thread and negotiation, so ops on different sets never wait for each other.

Ops take ``process_set=``; a ``root_rank`` stays a global rank (as in Horovod),
while results such as an allgather's are ordered by rank within the set
(``ProcessSet.rank()``).

A *private* set (``Registry.private_set``) is made by its members alone, for a
binding that runs its own groups on the runtime (the torch.distributed backend's
``new_group``). It has its communicators and engine like a registered set, but no
id that ``process_set_by_id`` finds, and ``join()`` does not join it.

``Registry`` is this rank's runtime state behind ``runtime.py``: the job's
communicators, the global engine, and the registered and private sets (``SetState``).
``runtime.init()`` installs it here (``install``), where ``current()`` finds it: for
``ProcessSet``'s own queries, and for the runtime's callers (``runtime.current()``).
"""
from __future__ import annotations

import dataclasses
import sys
import time
import weakref
import zlib
from typing import TYPE_CHECKING, Any, Optional, Sequence

from mtrain.ringreduce.core.errors import InvalidArgumentError, NotInitializedError
from mtrain.ringreduce.transport import comm as comm_module
from mtrain.ringreduce.transport import mpi, p2p

MPI = mpi.deferred(__name__)  # mpi4py's MPI from init() on (importing the runtime starts no MPI)

if TYPE_CHECKING:
    from mtrain.ringreduce.engine.cycle import Engine


class ProcessSet:
    """A set of ranks that run collectives together (Horovod's ``hvd.ProcessSet``).

    ``ProcessSet([0, 2])`` or ``ProcessSet(comm)`` for an mpi4py communicator; pass it to
    ``init(process_sets=[...])`` or ``add_process_set``, then as ``process_set=`` to ops.
    """

    process_set_id: "int | None" = None
    ranks: "list[int] | None" = None
    mpi_comm: "MPI.Comm | None" = None

    def __init__(self, ranks_or_comm: "Sequence[int] | MPI.Comm") -> None:
        started = sys.modules.get("mpi4py.MPI")  # a communicator means mpi4py was imported: never start MPI here
        if started is not None and isinstance(ranks_or_comm, started.Comm):
            self.mpi_comm = ranks_or_comm
            return
        try:
            ranks = list(ranks_or_comm)
        except TypeError:
            raise ValueError("ProcessSet takes a list of ranks or an mpi4py communicator, got "
                             f"{type(ranks_or_comm).__name__}") from None
        if any(isinstance(r, bool) or not isinstance(r, int) for r in ranks):
            raise ValueError(f"ProcessSet takes a list of integer ranks, got {ranks!r}")
        if len(set(ranks)) != len(ranks):
            raise ValueError(f"ProcessSet ranks must be distinct, got {ranks!r}")
        self.ranks = sorted(ranks)

    def _invalidate(self) -> None:
        self.process_set_id = None

    def size(self) -> Optional[int]:
        """Number of ranks in the set, or None before the set is registered."""
        if self.process_set_id is None:
            return None
        return current().state(self).size

    def rank(self) -> Optional[int]:
        """This process's rank within the set, or None before the set is registered.

        Ops still take global ranks (``root_rank``); this rank orders results such as an
        allgather's. Raises ValueError on a rank outside the set."""
        if self.process_set_id is None:
            return None
        state = current().state(self)
        if state.rank < 0:
            raise ValueError(f"this process (rank {state.global_rank}) is not part of {self}")
        return state.rank

    def included(self) -> Optional[bool]:
        """Whether this process belongs to the set, or None before the set is registered."""
        if self.ranks is None or self.process_set_id is None:
            return None
        return current().state(self).rank >= 0

    def __str__(self) -> str:
        return f"ProcessSet(process_set_id={self.process_set_id}, ranks={self.ranks}, mpi_comm={self.mpi_comm})"

    __repr__ = __str__


global_process_set = ProcessSet([])
global_process_set.process_set_id = 0



# The registry of the running runtime (None: not initialized). Kept here, beside the class, so that
# ProcessSet's queries find it without importing runtime.py, which installs it (init/shutdown).
_live: "Registry | None" = None


def install(registry: "Registry | None") -> "Registry | None":
    """Make ``registry`` the live one (None: the runtime is shut down); returns the one before."""
    global _live
    previous, _live = _live, registry
    return previous


def installed() -> "Registry | None":
    """The live registry, or None before ``init()`` and after ``shutdown()``."""
    return _live


def current() -> "Registry":
    """The live registry; NotInitializedError before ``init()``."""
    registry = _live
    if registry is None:
        raise NotInitializedError("ringreduce is not initialized: call init() first "
                                  "(for example `import mtrain.ringreduce as rr; rr.init()`)")
    return registry


@dataclasses.dataclass
class SetState:
    """One registered process set, as this rank sees it."""

    id: int
    ranks: "list[int]"  # global ranks, sorted
    global_rank: int
    comms: "comm_module.Communicators | None" = None  # None on ranks outside the set
    engine: "Engine | None" = None
    # The ProcessSet objects registered as this set: all are invalidated when it goes (as in Horovod).
    holders: "weakref.WeakSet[ProcessSet]" = dataclasses.field(default_factory=weakref.WeakSet)

    @property
    def rank(self) -> int:
        """Rank within the set; -1 outside it."""
        return self.ranks.index(self.global_rank) if self.global_rank in self.ranks else -1

    @property
    def size(self) -> int:
        return len(self.ranks)

    def set_rank_of(self, global_rank: int) -> int:
        return self.ranks.index(global_rank)

    def stop(self) -> None:
        if self.engine is not None:
            p2p.close_set(self)
            self.engine.shutdown()
            if not self.engine.alive():
                self.engine.executor.close()  # its shared-memory segment
                if self.comms is not None:
                    self.comms.free()
        self.engine, self.comms = None, None


class Registry:
    """This rank's runtime: the job's communicators, the global set's engine, and every registered
    process set (set 0 is every rank, on that engine). One per ``init()``."""

    def __init__(self, comms: comm_module.Communicators, engine: Engine, make_engine: Any, admin: MPI.Comm,
                 private_parent: "MPI.Comm | None" = None) -> None:
        self.comms = comms
        self.engine = engine
        # Cached so that user threads never call into MPI while the engine thread does.
        self.rank, self.size = comms.world.Get_rank(), comms.world.Get_size()
        self.local_rank, self.local_size = comms.local.Get_rank(), comms.local.Get_size()
        self.cross_rank, self.cross_size = comms.cross.Get_rank(), comms.cross.Get_size()
        self.homogeneous = True  # every host runs the same number of ranks; set by init()
        # Whether sets may be added and removed after init() (runtime._dynamic_process_sets):
        # None, unset, allows it; False is HOROVOD_DYNAMIC_PROCESS_SETS=0.
        self.dynamic: "bool | None" = None
        # Process sets: id -> state; set 0 is every rank, on the main engine.
        self.sets: "dict[int, SetState]" = {
            0: SetState(0, list(range(self.size)), self.rank, comms, engine)}
        self.next_set_id = 1
        self._make_engine = make_engine
        # Set management runs in user threads, on its own communicator: never the engines'.
        self.admin = admin
        # Private sets: negative ids, local to this rank (only members make them), made on their own
        # communicator, so that their members-only creation never meets the admin calls of all ranks.
        self.private: "dict[int, SetState]" = {}
        self.next_private_id = -1
        self.private_parent = private_parent

    # -- admin calls: every rank makes them, from its own thread ----------------
    def gate(self) -> None:
        """Wait until every rank has come to this admin call, in the caller's thread.

        The admin calls' collectives block in MPI, where nothing can tell that a peer left
        instead of coming. So they wait here first, on a non-blocking barrier: a rank that
        leaves the job meanwhile is heard of by the global engine within a cycle, and the wait
        ends with the engine's error, which names it. Past the gate every rank is in the same
        call, and its blocking collectives are safe (a rank that fails there aborts the job)."""
        request = self.admin.Ibarrier()
        delay = 1e-4
        while not request.Test():
            departed = self.engine.departed()
            if departed is not None:
                raise departed  # the runtime is over: init() again starts afresh, on new communicators
            time.sleep(delay)
            delay = min(2 * delay, 0.01)  # admin calls are rare: a short wait costs nothing

    def gather(self, value: Any) -> "list[Any]":
        """Every rank's ``value``, in rank order, once every rank has come (``gate``)."""
        self.gate()
        return self.admin.allgather(value)

    # -- process sets -------------------------------------------------------
    def state(self, process_set: ProcessSet) -> SetState:
        if not isinstance(process_set, ProcessSet):
            raise InvalidArgumentError(f"process_set must be an mtrain ProcessSet, got {type(process_set).__name__}")
        set_id = process_set.process_set_id
        state = None if set_id is None else self.private.get(set_id) if set_id < 0 else self.sets.get(set_id)
        if state is not None and state.id != 0 and process_set.ranks != state.ranks:
            state = None  # registered before a shutdown(): its id now names another set
        if state is None:
            raise InvalidArgumentError(f"{process_set} is not registered (never added, removed, or added before the "
                                       "last shutdown()): pass it to init(process_sets=[...]) or add_process_set() "
                                       "on every rank first")
        return state

    def member(self, process_set: ProcessSet) -> SetState:
        """The set's state on a rank that belongs to it; a clear error otherwise."""
        state = self.state(process_set)
        if state.engine is None:
            raise InvalidArgumentError(
                f"rank {self.rank} is not part of process set {state.id} (ranks {state.ranks}); only those "
                "ranks may call its ops: check process_set.included() first")
        return state

    def ranks_of(self, process_set: ProcessSet) -> "list[int]":
        if process_set.mpi_comm is None:
            return list(process_set.ranks or [])
        comm = process_set.mpi_comm
        if comm == MPI.COMM_NULL:
            return []
        world_group = self.comms.world.Get_group()
        ranks = MPI.Group.Translate_ranks(comm.Get_group(), list(range(comm.Get_size())), world_group)
        if any(r == MPI.UNDEFINED for r in ranks):
            raise InvalidArgumentError("a ProcessSet's communicator must hold only ranks of the job's communicator")
        return sorted(int(r) for r in ranks)

    def register(self, wanted: "list[ProcessSet]") -> "list[SetState]":
        """Register ``wanted`` on every rank at once (a collective of all ranks): each rank passes
        its own list, and the sets are the union, in rank order. Returns each one's state."""
        mine: "list[tuple[int, ...]]" = []
        problem = None
        try:
            for process_set in wanted:
                ranks = self.ranks_of(process_set)
                bad = [r for r in ranks if not 0 <= r < self.size]
                if bad:
                    raise InvalidArgumentError(f"ProcessSet ranks {bad} are out of range: the job has ranks "
                                               f"0..{self.size - 1}")
                if not ranks and process_set.mpi_comm is None:
                    raise InvalidArgumentError("a ProcessSet needs at least one rank")
                mine.append(tuple(ranks))
        except InvalidArgumentError as error:
            problem = str(error)
        # Gathered even when this rank's sets are bad, so that no rank waits here for one that raised.
        everyone = self.gather((mine, problem))
        if problem is not None:
            raise InvalidArgumentError(problem)
        failed = [f"rank {r}: {text}" for r, (_, text) in enumerate(everyone) if text is not None]
        if failed:
            raise InvalidArgumentError("process sets were not registered: " + "; ".join(failed))
        union: "list[tuple[int, ...]]" = []
        for lists, _ in everyone:
            for ranks in lists:
                if ranks and ranks not in union:
                    union.append(ranks)
        by_ranks = {tuple(s.ranks): s for s in self.sets.values()}
        new = [ranks for ranks in union if ranks not in by_ranks and len(ranks) != self.size]
        if new and MPI.Query_thread() < MPI.THREAD_MULTIPLE:
            # Each set's engine thread calls MPI while the others do: that needs MPI_THREAD_MULTIPLE.
            raise InvalidArgumentError("process sets need MPI initialized with MPI_THREAD_MULTIPLE (each set runs "
                                       "its own engine thread); leave mpi4py.rc.thread_level at its default")
        states: "dict[tuple[int, ...], SetState]" = {}
        for ranks in union:
            if ranks in by_ranks:
                states[ranks] = by_ranks[ranks]
                continue
            if len(ranks) == self.size:  # every rank: the global set itself
                states[ranks] = self.sets[0]
                continue
            state = SetState(self.next_set_id, list(ranks), self.rank)
            self.next_set_id += 1
            # Every rank takes part (registration is collective anyway), on the admin communicator:
            # comms.world carries the global engine's collectives.
            subcomm = self.admin.Split(0 if self.rank in ranks else MPI.UNDEFINED, key=self.rank)
            if self.rank in ranks:
                state.comms = comm_module.create(subcomm)
                subcomm.Free()
                state.engine = self._make_engine(state.comms)
            self.sets[state.id] = state
            states[ranks] = state
        result = []
        for process_set, ranks in zip(wanted, mine):
            state = states.get(ranks) if ranks else None
            if state is None:  # a communicator this rank is outside of (COMM_NULL)
                continue
            process_set.process_set_id = state.id
            process_set.ranks = list(state.ranks)
            if state.id != 0:
                state.holders.add(process_set)
            result.append(state)
        return result

    def private_set(self, ranks: "Sequence[int]") -> SetState:
        """Make a private set of ``ranks`` (global ranks; this rank among them). Only the members call
        it, each with the same ranks, in the same order as the other members make their private sets
        (ranks outside take no part). Blocks until every member has come.

        The set is kept out of the registered sets (``self.sets``): its id is negative and local to
        this rank; ``state()`` finds it, ``stop_all()`` stops it, ``drop_private()`` releases it."""
        ranks = list(ranks)
        if any(isinstance(r, bool) or not isinstance(r, int) for r in ranks) or len(set(ranks)) != len(ranks):
            raise InvalidArgumentError(f"a private process set takes distinct integer ranks, got {ranks!r}")
        ranks = sorted(ranks)
        bad = [r for r in ranks if not 0 <= r < self.size]
        if bad:
            raise InvalidArgumentError(f"ranks {bad} are out of range: the job has ranks 0..{self.size - 1}")
        if self.rank not in ranks:
            raise InvalidArgumentError(f"rank {self.rank} is not in the private process set {ranks}: only its "
                                       "members make it")
        if self.private_parent is None:  # pragma: no cover - init() always passes one
            raise InvalidArgumentError("this runtime makes no private process sets")
        if len(ranks) < self.size and MPI.Query_thread() < MPI.THREAD_MULTIPLE:
            raise InvalidArgumentError("process sets need MPI initialized with MPI_THREAD_MULTIPLE (each set runs "
                                       "its own engine thread); leave mpi4py.rc.thread_level at its default")
        group = self.private_parent.Get_group()
        members = group.Incl(ranks)
        group.Free()
        # MPI_Comm_create_group is collective over the members only. Concurrent creations on
        # overlapping member lists are told apart by their tag (the same on every member).
        tag = zlib.crc32(repr(ranks).encode()) % 32768  # MPI_TAG_UB is at least 32767
        try:
            subcomm = self.private_parent.Create_group(members, tag)
        finally:
            members.Free()
        state = SetState(self.next_private_id, ranks, self.rank)
        self.next_private_id -= 1
        state.comms = comm_module.create(subcomm)
        subcomm.Free()
        state.engine = self._make_engine(state.comms)
        self.private[state.id] = state
        return state

    def remove(self, process_set: ProcessSet) -> bool:
        """Unregister ``process_set`` (``runtime.remove_process_set``): every rank makes the call, for a
        private set its members alone. Returns False for the global set, which stays."""
        state = self.state(process_set)
        if state.id == 0:
            return False
        if state.id < 0:  # a private set: nothing to agree on with the ranks outside it
            self.drop_private(state)
            process_set._invalidate()
            return True
        self.gate()  # every rank agrees before the members stop the set's engine
        state.stop()
        del self.sets[state.id]
        for holder in list(state.holders) + [process_set]:
            holder._invalidate()
        return True

    def drop_private(self, state: SetState) -> None:
        """Stop a private set's engine (ops in flight fail on every member) and forget the set."""
        if self.private.pop(state.id, None) is None:
            return
        state.stop()
        for process_set in list(state.holders):
            process_set._invalidate()

    def stop_all(self) -> None:
        for state in list(self.private.values()):
            self.drop_private(state)
        for set_id in sorted(self.sets, reverse=True):
            if set_id != 0:
                self.sets[set_id].stop()
                for process_set in list(self.sets[set_id].holders):
                    process_set._invalidate()
        p2p.close_set(self.sets[0])
        p2p.stop()  # its thread calls MPI: gone before the communicators are
        self.engine.shutdown()
        if not self.engine.alive():
            self.engine.executor.close()
            self.admin.Free()
            if self.private_parent is not None:
                self.private_parent.Free()
            self.comms.free()
