"""The background engine: one thread owns every MPI call of the runtime.

User threads submit named ops and get a Handle back at once. Each cycle the
engine thread

1. takes the newly submitted ops (once a burst of submissions is over, or at
   once when a thread waits on a handle: ``Engine._hold``),
2. negotiates with the other ranks which ops every rank has submitted
   (``negotiation.py``: a response-cache bit vector in the steady state, a
   coordinator round trip for new names),
3. runs the ready ops in the same order on every rank: all-reduces in the
   rings ``fusion.py`` plans (small tensors packed into one reusable fusion
   buffer, large ones reduced in place with no copy), other collectives one
   by one (``collectives.py``),
4. completes the handles.

The steady state is a training step that repeats the last one's ops. A batch
that ran whole (every op cached, all of it taken in one cycle) is kept as a
steady batch (``_Steady``): the names and signatures in submission order, the
negotiation vector they make, the agreed order and the plan. When the same
ops come again in the same order, two C-level list comparisons find it; the
cycle sends the kept vector, and if every rank sent the same (nothing more,
nothing missing, no news) it runs the batch as it is, with no per-op work
before the rings. Otherwise the ops become pending ops like any other and the
cycle goes on from the vectors it already has, so either path gives every
rank the same decisions. Packing is one NumPy call, unpacking and completing
one C-level loop each. Per op, only the submit (one object, its handle and its
request) and one copy out of the fusion buffer remain.

Errors are delivered to the handles of every rank (``synchronize`` raises
them; the classes live in ``errors.py``): mismatched submissions, stalls past
MTRAIN_STALL_SHUTDOWN_SECONDS, and shutdown with ops in flight. Nothing waits
forever on a rank that has left.
"""
from __future__ import annotations

import collections
import dataclasses
import itertools
import operator
import os
import sys
import threading
import time
import traceback
from typing import Any, Callable, Sequence

import numpy as np
from mpi4py import MPI

from mtrain.launcher.records import FailureCause, report_error

from . import cuda, fusion
from .backend import NumpyBackend, backend_for
from .collectives import Executor, Kind
from .errors import EngineError, InvalidArgumentError, JoinedError, ShutdownError, Verdict
from .negotiation import (CONTROL_SHUTDOWN, CONTROL_STALL_CHECK, CONTROL_UNREPORTED, Coordinator,
                          RequestState, ResponseCache, bits_of, set_bit)
from .ops import ReduceOp, dtype_code, dtype_from_code
from .requests import (HOST as _HOST, PLACEHOLDER as _PLACEHOLDER, UNNAMED_PREFIX, AllreduceOp, Completion, Handle,
                       Request, Signature, host_allreduce_signature)
from .timeline import Timeline

# Chosen by measurement on the 2-core development VM (benchmarks/fusion.py):
DEFAULT_CYCLE_TIME_MS = 1.0
DEFAULT_FUSION_THRESHOLD_BYTES = 8 << 20
# Tensors at least this big skip the fusion buffer: copying them in and out
# costs more than the per-ring overhead that fusing saves.
DEFAULT_INPLACE_MIN_BYTES = 1 << 20
# How long the negotiation spins on its all-reduce before it starts to sleep.
SPIN_SECONDS = 300e-6
# A burst of submissions is over (the engine starts its cycle) once none came for this
# long, or after HOLD_CYCLES cycle times in all (Engine._hold). A burst that repeats the
# last batch but lacks part of it: once none came for a cycle time, or after
# EXPECT_HOLD_CYCLES cycle times in all.
QUIET_SECONDS = 200e-6
HOLD_CYCLES = 10
EXPECT_HOLD_CYCLES = 100
# Distinct batches whose plan (rings, fusion-buffer views) the engine keeps.
PLAN_CACHE_SIZE = 64
# The most op names one learned step may hold (Engine._hold's expectation).
STEP_NAMES_MAX = 1 << 16


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    cycle_time_s: float = DEFAULT_CYCLE_TIME_MS / 1000
    fusion_threshold_bytes: int = DEFAULT_FUSION_THRESHOLD_BYTES
    inplace_min_bytes: int = DEFAULT_INPLACE_MIN_BYTES
    stall_warning_s: float = 60.0
    stall_shutdown_s: float = 0.0
    timeline_path: "str | None" = None

    @staticmethod
    def from_environment() -> "EngineConfig":
        return EngineConfig(
            cycle_time_s=env_number("MTRAIN_CYCLE_TIME_MS", DEFAULT_CYCLE_TIME_MS) / 1000,
            fusion_threshold_bytes=int(env_number("MTRAIN_FUSION_THRESHOLD_BYTES", DEFAULT_FUSION_THRESHOLD_BYTES)),
            inplace_min_bytes=int(env_number("MTRAIN_FUSION_INPLACE_MIN_BYTES", DEFAULT_INPLACE_MIN_BYTES)),
            stall_warning_s=env_number("MTRAIN_STALL_WARNING_SECONDS", 60.0),
            stall_shutdown_s=env_number("MTRAIN_STALL_SHUTDOWN_SECONDS", 0.0),
            timeline_path=os.environ.get("MTRAIN_TIMELINE") or None,
        )


def env_number(name: str, default: float) -> float:
    """A non-negative number from the environment, or ``default`` when unset or empty."""
    raw = os.environ.get(name, "")
    if raw == "":
        return default
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not a number; unset it or give a number") from None
    if value < 0:
        raise ValueError(f"{name}={raw!r} must not be negative")
    return value


class Engine:
    def __init__(self, executor: Executor, control: MPI.Comm, config: EngineConfig,
                 members: "Sequence[int] | None" = None) -> None:
        self.executor = executor
        self.config = config
        self._control = control  # negotiation traffic only, apart from the data rings
        self._rank, self._size = control.Get_rank(), control.Get_size()
        # The job's rank of each rank of ``control`` (a process set's engine runs on a subset),
        # so that messages name the ranks users know.
        self._members = list(members) if members is not None else list(range(self._size))
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        # Handles wait here; notified after each batch. A waiter makes the next cycle start now.
        self.done_cv = Completion(self._note_waiter)
        self._waiters = 0  # threads blocked on a handle of this engine
        self._first_submit = self._last_submit = 0.0  # of the ops in _incoming
        # The names of the last step's ops (all that ran between two moments the engine had
        # nothing to do; set by the engine thread), and how many of them the
        # current burst of submissions still lacks when it began with one of them (0: it did
        # not; -1: it has them all).
        self._last_batch: "frozenset[str]" = frozenset()
        self._expect_left = 0
        self._step_names: "list[str]" = []  # run since the engine was last idle (engine thread)
        self._step_waited = False  # whether a thread waited on any of them
        self._incoming: "list[Request]" = []
        self._in_flight: "set[str]" = set()
        self._closing = False
        self._closed_error: "BaseException | None" = None
        # One counter for every kind of unnamed op: a rank calling a different
        # collective than the others then collides on the same name and gets a
        # mismatch error naming both calls, instead of a stall.
        self._unnamed = itertools.count()
        # Engine-thread state.
        self._pending: "dict[str, Request]" = {}
        self._cache = ResponseCache()
        self._coordinator = (Coordinator(self._size, config.stall_warning_s, config.stall_shutdown_s,
                                         self._members) if self._rank == 0 else None)
        self._stall_check_next = False
        self._finished_any = False
        # Batches seen before, by the identities of their ops' signatures: the rings and the
        # fusion-buffer views each needs (``_Plan``), so a repeated step plans nothing.
        self._plans: "dict[tuple, _Plan]" = {}
        # Whole batches seen before, to run again as they were (``_Steady``), by their first
        # op's name and their length.
        self._steady: "dict[tuple[str, int], _Steady]" = {}
        self.plans_built = self.plans_reused = 0  # for tests and benchmarks
        self.steady_cycles = 0  # cycles that ran the steady batch as learned (for tests)
        self.steady_fallbacks = 0  # cycles that sent a steady batch but another rank differed
        self._fusion: "dict[Any, Any]" = {}  # backend -> this engine's fusion buffer (bytes)
        # join(): set by the user thread; the rest is the engine thread's.
        self._join_handle: "Handle | None" = None
        self._joined = False
        self._joined_seen: "set[int]" = set()
        self._last_joined = -1
        self._shutdown_error = ShutdownError("mtrain shut down while this op was in flight")
        self._timeline = Timeline(config.timeline_path) if (config.timeline_path and self._rank == 0) else None
        self._mark_cycles = False
        # The GPU init() bound in this thread; a new thread starts on GPU 0, so the engine
        # thread adopts it before its first device op (None: no CuPy in use).
        self._gpu = cuda.current_device()
        self._thread = threading.Thread(target=self._run, name="mtrain-engine", daemon=True)
        self._thread.start()

    # -- user side -----------------------------------------------------------
    def auto_name(self) -> str:
        return f"{UNNAMED_PREFIX}{next(self._unnamed)}"

    def submit(self, requests: "list[Request]") -> None:
        """Queue requests (all parts of one handle) for the engine thread."""
        now = time.monotonic()
        with self._lock:
            if self._closing or self._closed_error is not None:
                raise self._closed_error or ShutdownError(
                    "mtrain was shut down; call init() again before submitting more ops")
            in_flight = self._in_flight
            if not self._incoming:
                self._first_submit = now
                # A burst that begins with an op of the last batch is probably that batch
                # again: the engine holds on until all of it is here (Engine._hold).
                last = self._last_batch
                self._expect_left = len(last) if requests[0].name in last else 0
                # Wake the engine only for the first op of a burst: a notify per op
                # would hand the GIL back and forth on every submit.
                self._wake.notify()
            if len(requests) == 1:  # the common case, kept short: it runs once per tensor
                request = requests[0]
                name = request.name
                if name in in_flight:
                    raise _already_in_flight(name)
                request.submitted = now
                in_flight.add(name)
                if self._expect_left > 0 and name in self._last_batch:
                    self._expect_left -= 1
                    if not self._expect_left:
                        self._expect_left = -1  # complete: the engine may start now
                        self._wake.notify()
            else:
                names = [r.name for r in requests]
                taken = [n for n in names if n in in_flight]
                if taken or len(set(names)) != len(names):
                    raise _already_in_flight(taken[0] if taken else next(n for n in names if names.count(n) > 1))
                for request in requests:
                    request.submitted = now
                in_flight.update(names)
                if self._expect_left > 0:
                    self._expect_left -= len(self._last_batch.intersection(names))
                    if self._expect_left <= 0:
                        self._expect_left = -1  # complete: the engine may start now
                        self._wake.notify()
            self._last_submit = now
            self._incoming.extend(requests)

    def submit_allreduce(self, array: Any, name: "str | None", op: ReduceOp, in_place: bool, prescale: float,
                         postscale: float, op_class: "type[AllreduceOp] | None" = None,
                         signature: "tuple | None" = None) -> AllreduceOp:
        """``make_request`` and ``submit`` for one all-reduce (arguments already checked), in
        one short call: the per-tensor path of a training step. Same checks, same result.
        ``op_class``: a subclass of AllreduceOp to create (a framework's handle), if not AllreduceOp.
        ``signature``: ``host_allreduce_signature`` of these arguments, if the caller kept it."""
        request = (op_class or AllreduceOp)(self.done_cv, name or self.auto_name(), array, op, in_place,
                                            prescale, postscale, signature)
        # ``submit`` for one request, inline (same checks, same order). Explicit acquire and
        # release: a ``with`` block costs twice as much, once per tensor.
        now = time.monotonic()
        lock = self._lock
        lock.acquire()
        try:
            if self._closing or self._closed_error is not None:
                raise self._closed_error or ShutdownError(
                    "mtrain was shut down; call init() again before submitting more ops")
            name = request.name
            incoming = self._incoming
            if not incoming:
                self._first_submit = now
                last = self._last_batch
                self._expect_left = len(last) if name in last else 0
                self._wake.notify()  # the first op of a burst only (see ``submit``)
            in_flight = self._in_flight
            if name in in_flight:
                raise _already_in_flight(name)
            request.submitted = now
            in_flight.add(name)
            if self._expect_left > 0 and name in self._last_batch:
                self._expect_left -= 1
                if not self._expect_left:
                    self._expect_left = -1  # complete: the engine may start now
                    self._wake.notify()
            self._last_submit = now
            incoming.append(request)
        finally:
            lock.release()
        return request

    def _note_waiter(self, delta: int) -> None:
        """A user thread starts (+1) or stops (-1) blocking on one of this engine's handles."""
        with self._lock:
            self._waiters += delta
            if delta > 0:
                self._wake.notify()

    def shutdown(self, timeout: float = 30.0) -> None:
        """Stop the engine: in-flight ops fail with ShutdownError on every rank."""
        with self._lock:
            self._closing = True
            self._wake.notify()
        self._thread.join(timeout)
        if self._thread.is_alive():
            sys.stderr.write("mtrain: the engine did not stop within "
                             f"{timeout:g}s (another rank may be frozen); exiting without it\n")
        timeline = self._timeline
        if timeline is not None:
            timeline.close()
        if not self._thread.is_alive():
            self._control.Free()

    def start_timeline(self, path: str, mark_cycles: bool) -> None:
        """Write the timeline to ``path`` from now on (rank 0 only; others ignore it)."""
        if self._rank != 0:
            return
        old, self._timeline = self._timeline, Timeline(path)
        self._mark_cycles = mark_cycles
        if old is not None:
            old.close()

    def stop_timeline(self) -> None:
        # The engine thread may still hold the old object for a moment: a closed timeline
        # ignores late events.
        old, self._timeline = self._timeline, None
        if old is not None:
            old.close()

    def alive(self) -> bool:
        return self._thread.is_alive()

    # -- engine thread --------------------------------------------------------
    def _run(self) -> None:
        try:
            if self._gpu is not None:
                cuda.use_device(self._gpu)
            while self._cycle():
                pass
            self._fail_all(self._shutdown_error)
        except BaseException as exc:  # a bug or an MPI failure: fail loudly, never hang the user
            traceback.print_exc()
            self._fail_all(EngineError(f"mtrain's background engine failed: {exc!r}"))

    def _take_incoming(self) -> "tuple[bool, list[Request]]":
        """The ops submitted since the last cycle, and whether we are closing."""
        with self._lock:
            self._hold()
            incoming, self._incoming = self._incoming, []
            self._expect_left = 0
            closing = self._closing
        return closing, incoming

    def _hold(self) -> None:
        """Wait (under ``self._lock``) until the next cycle should start.

        At once when closing, or when a thread blocks on a handle while there is work:
        then nothing is gained by waiting, and a small step never waits for a tick. While ops are
        still being submitted back to back, hold on until the submissions pause for
        ``QUIET_SECONDS`` (or ``HOLD_CYCLES`` cycle times have passed since the first
        one): a cycle started in the middle of a burst costs the submitting thread
        the GIL on every op and splits the step into batches that each need a
        negotiation round. Submissions that come with real work between them (a
        backward pass) pause long enough that their reduction overlaps that work.
        A burst that repeats the last batch (its first op was in it) is held until
        the whole batch is here (or submissions pause for a cycle time), so that a
        step that pauses briefly (a GC pass, a busy machine) is not split into
        batches whose plans were never cached.
        With nothing submitted, tick every cycle time (pending ops wait for peers,
        and the other ranks' cycles need this one's)."""
        if self._step_waited and not self._pending and not self._incoming:
            # Idle again after a thread waited for results: what ran since the last such
            # moment is one step's batch. (Idle without a wait may be a pause inside a step.)
            if len(self._step_names) > 1:
                self._last_batch = frozenset(self._step_names)
            self._step_names, self._step_waited = [], False
        cycle = self.config.cycle_time_s
        quiet = min(cycle, QUIET_SECONDS)
        tick = None
        while not self._closing:
            if self._waiters and (self._incoming or self._pending or self._join_handle is not None):
                return
            now = time.monotonic()
            if self._incoming:
                if self._expect_left < 0:  # the whole of the last batch is here again
                    return
                if self._expect_left:  # part of the last batch is here: hold on for the rest
                    left = min(self._last_submit + cycle, self._first_submit + EXPECT_HOLD_CYCLES * cycle) - now
                else:
                    left = min(self._last_submit + quiet, self._first_submit + HOLD_CYCLES * cycle) - now
            else:
                if tick is None:
                    tick = now + cycle
                left = tick - now
            if left <= 0:
                return
            self._wake.wait(left)

    def _cycle(self) -> bool:
        closing, incoming = self._take_incoming()
        if self._join_handle is not None and not self._joined:
            self._joined = True  # from now on this rank stands in for every op with zeros
        if incoming and not closing and not self._pending and not self._joined and not self._stall_check_next:
            steady = self._steady.get((incoming[0].name, len(incoming)))
            if steady is not None and steady.matches(incoming, self._cache.version):
                return self._cycle_steady(steady, incoming)
        pending = self._pending
        for request in incoming:
            pending[request.name] = request
        # The vector: cache bits | control word | "rank r is leaving" | "rank r has ops pending"
        # | "rank r has joined".
        words = self._cache.words
        mine = self._vector_for(words)
        control = 0
        cached: "list[int]" = []  # set in one NumPy call below, not one call per op
        entries = self._cache.entries
        unreported, cached_state = RequestState.UNREPORTED, RequestState.CACHED
        for request in pending.values():
            state = request.state
            if state is unreported:
                # ``ResponseCache.lookup``, inline: this loop runs once per op of every step.
                entry = entries.get(request.name)
                if entry is None or not entry[1] == request.signature:
                    request.bit = -1
                    control |= CONTROL_UNREPORTED
                    continue
                request.bit = bit = entry[0]
                request.state = cached_state
                cached.append(bit)
            elif state is cached_state:
                cached.append(request.bit)
        set_bits(mine, cached)
        if closing:
            control |= CONTROL_SHUTDOWN
        if self._stall_check_next:
            control |= CONTROL_STALL_CHECK
            self._stall_check_next = False
        mine[words] = np.uint64(control)
        leaving_at, busy_at, joined_at = self._offsets(words)
        if closing:
            set_bit(mine[leaving_at:busy_at], self._rank)
        if pending:
            set_bit(mine[busy_at:joined_at], self._rank)
        mine_and = mine
        if self._joined:
            set_bit(mine[joined_at:], self._rank)
            # A joined rank agrees to every cached op (the AND half), yet holds none (the OR half):
            # an op is ready once every rank that has not joined holds it.
            mine_and = mine.copy()
            mine_and[:words] = ~np.uint64(0)
        everywhere, anywhere = self._and_or(mine_and, mine)
        # A batch that ran whole, all of it submitted since the last cycle, is what the next
        # step will probably submit again: learn it (``_Steady``).
        whole = (len(pending) == len(incoming) and bool(incoming) and not closing and not self._joined)
        cache_version = self._cache.version
        alive = self._decide(everywhere, anywhere, words)
        if alive and whole and not self._pending and self._cache.version == cache_version:
            steady = _Steady.learn(incoming, self._cache.version, self._vector_for(words), words,
                                   self._offsets(words), self._rank)
            if steady is not None:
                key = (incoming[0].name, len(incoming))
                if key not in self._steady and len(self._steady) >= PLAN_CACHE_SIZE:
                    del self._steady[next(iter(self._steady))]  # the oldest
                self._steady[key] = steady
        return alive

    def _offsets(self, words: int) -> "tuple[int, int, int]":
        """Where the "leaving", "ranks with ops pending" and "joined" bits start in the vector
        of a cache of ``words`` words (after the cache bits and the control word)."""
        rank_words = (self._size + 63) // 64
        return words + 1, words + 1 + rank_words, words + 1 + 2 * rank_words

    def _vector_for(self, words: int) -> np.ndarray:
        """A zeroed negotiation vector for a cache of ``words`` words (see ``_cycle``)."""
        joined_at = self._offsets(words)[2]
        return np.zeros(joined_at + (self._size + 63) // 64, dtype=np.uint64)

    def _cycle_steady(self, steady: "_Steady", incoming: "list[Request]") -> bool:
        """A cycle whose ops are exactly the steady batch's, submitted in the same order: its
        vector, order and plan are known, so nothing is done per op before the rings. The
        vector is the one ``_cycle`` would build (every rank may take either way)."""
        mine = steady.vector.copy()
        everywhere, anywhere = self._and_or(mine, mine)
        words = steady.words
        if not steady.agreed(everywhere, anywhere):
            # Another rank lacks some of them, or has more, or news (a shutdown, a join, a new
            # name): these ops are cached pending ops like any other, and the cycle goes on.
            self.steady_fallbacks += 1
            pending = self._pending
            cached_state = RequestState.CACHED
            for request, bit in zip(incoming, steady.bits):
                request.state, request.bit = cached_state, bit
                pending[request.name] = request
            return self._decide(everywhere, anywhere, words)
        if self._coordinator is not None:
            coordinator = self._coordinator
            if coordinator.first_seen or coordinator.warned:
                for name in steady.names:
                    coordinator.forget(name)
            self._stall_check_next = coordinator.stall_check_due(time.monotonic())
        ready = list(map(incoming.__getitem__, steady.order))
        if steady.plan is None or not steady.plan.fits(self.config):
            steady.plan = self._plan_for(ready)
        else:
            self.plans_reused += 1
        self.steady_cycles += 1
        self._execute(ready, steady.plan, steady.ready_names)
        self._wake_waiters()
        return True

    def _decide(self, everywhere: np.ndarray, anywhere: np.ndarray, words: int) -> bool:
        """The rest of a cycle, from the negotiated vectors: who is leaving or joined, the
        coordinator round if anyone has news, then the ready ops. False: the job is shutting down."""
        leaving_at, busy_at, joined_at = self._offsets(words)
        agreed_control = int(anywhere[words])
        if agreed_control & CONTROL_SHUTDOWN:
            self._note_shutdown(bits_of(anywhere[leaving_at:busy_at]), bits_of(anywhere[busy_at:joined_at]))
            return False
        joined = bits_of(anywhere[joined_at:])
        joined_changed = self._note_joined(joined)
        ready_words = everywhere[:words] & anywhere[:words]
        ready = [self._cache.names[b] for b in bits_of(ready_words)]
        partial = [self._cache.names[b] for b in bits_of(anywhere[:words] & ~everywhere[:words])]
        responses: list = []
        # A rank that joins completes the ops the others reported but it never will: the
        # coordinator looks again in the cycle every rank sees the join.
        if agreed_control & (CONTROL_UNREPORTED | CONTROL_STALL_CHECK) or joined_changed:
            responses = self._coordinate(set(partial) | set(ready), bool(agreed_control & CONTROL_STALL_CHECK),
                                         joined)
        ready_meta: "dict[str, Any]" = {}
        for response in responses:
            self._cache.apply(response)
            verdict = response.verdict
            if verdict is Verdict.READY:
                ready.append(response.name)
                ready_meta[response.name] = response.meta
            elif response.name not in self._pending:
                continue
            elif verdict is Verdict.INVALIDATE:
                self._pending[response.name].state = RequestState.UNREPORTED
            else:  # MISMATCH or STALLED: the op ends with that error on every rank
                self._finish(self._pending.pop(response.name), error=verdict.error(response.message))
        if self._coordinator is not None:
            now = time.monotonic()
            if self._coordinator.first_seen or self._coordinator.warned:  # else forget() has nothing to do
                for name in ready:
                    self._coordinator.forget(name)
            self._coordinator.note_partial(partial, now)
            self._stall_check_next = self._coordinator.stall_check_due(now)
        if ready:
            if joined:
                self._execute(self._with_joined(ready, ready_meta, joined))
            else:
                self._execute([self._pending.pop(name) for name in ready])
        elif len(joined) == self._size and not bits_of(anywhere[busy_at:joined_at]):
            self._finish_join()
        self._wake_waiters()
        return True

    # -- join -------------------------------------------------------------------
    def submit_join(self) -> Handle:
        """This rank has no more data: it stands in for the other ranks' ops (with zeros) until
        every rank has joined. The handle's result is the job rank that joined last."""
        handle = Handle(1, False, self.done_cv)
        with self._lock:
            if self._closing or self._closed_error is not None:
                raise self._closed_error or ShutdownError(
                    "mtrain was shut down; call init() again before join()")
            if self._join_handle is not None:
                raise InvalidArgumentError("join() is already in progress on this rank")
            self._join_handle = handle
            self._wake.notify()
        return handle

    def _note_joined(self, joined: "list[int]") -> bool:
        """Track who has joined (seen alike by every rank); returns whether anyone new joined."""
        new = set(joined) - self._joined_seen
        if new:
            self._last_joined = max(new)  # ranks joining in the same cycle: the highest is "last"
        self._joined_seen = set(joined)
        return bool(new)

    def _finish_join(self) -> None:
        handle, last = self._join_handle, self._members[self._last_joined]
        self._join_handle, self._joined, self._joined_seen, self._last_joined = None, False, set(), -1
        # Unnamed ops name themselves by a per-rank counter, which ranks that joined early did not
        # advance; nothing is in flight now, so every rank starts it afresh, together.
        self._unnamed = itertools.count()
        if handle is not None:
            handle._complete(0, last)
            self._finished_any = True

    def _with_joined(self, ready: "list[str]", ready_meta: "dict[str, Any]", joined: "list[int]") -> "list[Request]":
        """The ready ops as this rank runs them while ``joined`` ranks have joined: a joined rank
        brings a stand-in with no data; an op that cannot run without a joined rank fails everywhere."""
        runnable = []
        for name in ready:
            request = self._pending.pop(name, None)
            meta = request.signature if request is not None else (
                ready_meta[name] if name in ready_meta else self._cache.entries[name][1])
            problem = _joined_problem(meta, [self._members[r] for r in joined], self._members)
            if problem:
                if request is not None:
                    self._finish(request, error=JoinedError(f"op {name!r} cannot run: {problem}"))
                continue
            runnable.append(request if request is not None else _stand_in(self, name, meta))
        return runnable

    def _note_shutdown(self, leaving: "list[int]", busy: "list[int]") -> None:
        """Say who left while whose ops were in flight: in errors, and to the launcher."""
        me = self._members[self._rank]
        leaving = [self._members[r] for r in leaving]
        busy = [self._members[r] for r in busy]
        stranded = [r for r in busy if r not in leaving]
        others = [r for r in leaving if r != me]
        if me in leaving:
            message = "mtrain shut down on this rank while this op was in flight; synchronize every op first"
            if stranded:
                report_error(f"rank {me} left the job (shutdown() or process exit) while "
                             f"rank(s) {stranded} still had ops in flight", FailureCause.OWN)
            self._shutdown_error = ShutdownError(message)
        else:
            self._shutdown_error = ShutdownError(
                f"rank(s) {others} left the job (shutdown() or process exit) while this op was in flight; "
                f"every rank must submit the same ops before leaving", peers=others)

    def _and_or(self, mine_and: np.ndarray, mine_or: np.ndarray) -> "tuple[np.ndarray, np.ndarray]":
        """Bitwise AND of every rank's ``mine_and`` and OR of every rank's ``mine_or``, from one
        BAND all-reduce of (x, ~y)."""
        send = np.concatenate([mine_and, ~mine_or])
        recv = np.empty_like(send)
        request = self._control.Iallreduce(send, recv, op=MPI.BAND)
        # Spin briefly (peers usually arrive within microseconds, and a sleep here
        # lasts 60 us or more), then poll with a growing sleep rather than blocking:
        # a blocked Open MPI rank busy-spins a core that belongs to the user's
        # training thread while the other ranks are still computing.
        spin_until = time.perf_counter() + SPIN_SECONDS
        naps = 0
        while not request.Test():
            if time.perf_counter() > spin_until:
                naps += 1
                time.sleep(min(1e-3, 2e-5 * naps))
        half = mine_and.size
        return recv[:half], ~recv[half:]

    def _coordinate(self, cached_anywhere: "set[str]", stall_check: bool, joined: "Sequence[int]" = ()) -> list:
        reports = []
        for request in self._pending.values():
            if request.state is RequestState.UNREPORTED:
                reports.append((request.name, request.signature, request.describe(self._members)))
                request.state = RequestState.REPORTED
        pending = sorted(self._pending) if stall_check else None
        gathered = self._control.gather((reports, pending), root=0)
        responses = None
        if self._coordinator is not None:
            responses = self._coordinator.decide(gathered, self._cache, cached_anywhere, time.monotonic(),
                                                 frozenset(joined))
        return self._control.bcast(responses, root=0)

    # -- execution ------------------------------------------------------------
    def _execute(self, ready: "list[Request]", plan: "_Plan | None" = None,
                 names: "list[str] | None" = None) -> None:
        """Run the ready ops (in the agreed order) by ``plan`` (the cached one if not given);
        ``names``: theirs, in that order, if known."""
        start = time.monotonic()
        timeline = self._timeline
        if timeline is not None and self._mark_cycles:
            timeline.mark("CYCLE_START")
        if timeline is not None:
            for request in ready:
                timeline.span(request.name, "NEGOTIATE", request.submitted, start)
        if plan is None:
            plan = self._plan_for(ready)
        if len(self._step_names) > STEP_NAMES_MAX:  # nobody ever waits (only polls): no steps to learn
            self._step_names = []
        self._step_names.extend(names if names is not None else list(map(_NAME, ready)))
        if self._waiters:
            self._step_waited = True
        for index in plan.one_by_one:
            self._run_one(ready[index])
        take = ready.__getitem__
        for ring in plan.rings:
            # The common batch is one ring that packs every op: no list to build.
            batch = ready if ring.packs_all else list(map(take, ring.packed))
            self._run_ring(ring, batch, list(map(take, ring.alone)))

    def _plan_for(self, ready: "list[Request]") -> "_Plan":
        """The cached plan of this batch, or a new one. Every rank plans the same batch
        identically: the plan depends only on the agreed signatures, in the agreed order."""
        signatures = [r.signature for r in ready]
        config = self.config
        # The fusion settings are part of the key: a job that switches between settings (a
        # benchmark, a sweep) keeps one plan per setting instead of replanning at each switch.
        key = (config.fusion_threshold_bytes, config.inplace_min_bytes, *map(id, signatures))
        plan = self._plans.get(key)
        # Identical signatures are the same objects (``Request.meta`` interns them), so this
        # comparison is one identity check per op; a reused id fails it and replans.
        if (plan is None or plan.signatures != signatures or plan.threshold != config.fusion_threshold_bytes
                or plan.inplace_min != config.inplace_min_bytes):
            plan = _Plan(ready, signatures, config.fusion_threshold_bytes, config.inplace_min_bytes)
            if key not in self._plans and len(self._plans) >= PLAN_CACHE_SIZE:
                del self._plans[next(iter(self._plans))]  # the oldest
            self._plans[key] = plan
            self.plans_built += 1
        else:
            self.plans_reused += 1
        return plan

    def _run_one(self, request: Request) -> None:
        # No argument checks and no error catching here: arguments were checked at submit and
        # agreed on by every rank, so an exception now is a failure of the engine itself.
        ex = self.executor
        kind = request.kind
        begin = time.monotonic()
        if kind is Kind.ALLGATHER:
            result: Any = ex.allgather(request.array)
        elif kind is Kind.BROADCAST:
            result = ex.broadcast(request.array, request.root, request.array if request.in_place else None)
        elif kind is Kind.REDUCESCATTER:
            result = ex.reducescatter(request.array, request.op, request.prescale, request.postscale)
        elif kind is Kind.ALLTOALL:
            result = ex.alltoall(request.array, request.splits)
        elif kind is Kind.BARRIER:
            result = ex.barrier()
        elif kind is Kind.BROADCAST_OBJECT:
            result = ex.broadcast_bytes(request.obj, request.root)
        elif kind is Kind.ALLGATHER_OBJECT:
            result = ex.allgather_bytes(request.obj)
        else:  # pragma: no cover - every kind is listed above
            raise AssertionError(kind)
        timeline = self._timeline  # read once: stop_timeline() may clear it from a user thread
        if timeline is not None:
            timeline.span(request.name, kind.name, begin, time.monotonic())
        self._finish(request, result)

    def _fusion_buffer(self, backend: Any, nbytes: int) -> Any:
        """This engine's reusable fusion buffer in ``backend``'s memory (host memory for host
        arrays, device memory for device arrays; never fused together: the ring key includes
        the backend). Grown to the threshold once, then reused every step."""
        buffer = self._fusion.get(backend)
        if buffer is None or buffer.nbytes < nbytes:
            buffer = backend.empty(max(nbytes, self.config.fusion_threshold_bytes, 1), np.dtype(np.uint8))
            self._fusion[backend] = buffer
        return buffer

    def _run_ring(self, ring: "_Ring", batch: "list[Request]", alone: "list[Request]") -> None:
        """One ring over the fusion buffer (``batch`` packed into it, if any) followed by
        the ``alone`` tensors in their own memory (or fresh copies for out-of-place ops)."""
        first = (batch or alone)[0]
        backend = first.backend
        host = isinstance(backend, NumpyBackend)
        flats, outs, copied = [], [], []
        t0 = t1 = time.monotonic()
        if batch:
            buffer = self._fusion_buffer(backend, ring.packed_bytes)
            if ring.buffer is not buffer:
                ring.bind(buffer)
            fused = ring.fused
            if host:  # one call packs every tensor, whatever its shape or strides
                arrays = list(map(_ARRAY, batch))
                np.concatenate(arrays, axis=None, out=fused)
            else:
                for request, view in zip(batch, ring.views):
                    backend.copy(view, request.array)
            flats.append(fused)
            t1 = time.monotonic()
        for request in alone:
            out = request.array if request.in_place else request.array.copy(order="C")
            flat, was_copied = backend.flatten(out)
            outs.append(out)
            flats.append(flat)
            copied.append(was_copied)
        self.executor.allreduce_flat(flats, first.op, backend, first.prescale, first.postscale)
        t2 = time.monotonic()
        results: "list[Any]"
        if host and batch and all(map(_IN_PLACE, batch)):
            # ``array[...] = view`` for every op, in one C-level loop: np.copyto's copy at half
            # its call cost (same dtype and shape: the view was cut to the op's own).
            _consume(map(operator.setitem, arrays, itertools.repeat(Ellipsis), ring.views))
            results = arrays
        elif host:
            results = []
            for request, view in zip(batch, ring.views):
                if request.in_place:
                    array = request.array
                    array[...] = view
                    results.append(array)
                else:
                    results.append(view.copy())
        else:
            results = []
            copy = backend.copy
            for request, view in zip(batch, ring.views):
                if request.in_place:
                    copy(request.array, view)
                    results.append(request.array)
                else:
                    results.append(view.copy())
        t3 = time.monotonic()
        for out, flat, was_copied in zip(outs, flats[1 if batch else 0:], copied):
            if was_copied:
                backend.copy(out, flat.reshape(out.shape))
            results.append(out)
        timeline = self._timeline  # read once: stop_timeline() may clear it from a user thread
        if timeline is not None:
            ring_ops = len(batch) + len(alone)
            for request in batch:
                timeline.span(request.name, "MEMCPY_IN_FUSION_BUFFER", t0, t1)
                timeline.span(request.name, "ALLREDUCE", t1, t2, fused_bytes=ring.packed_bytes, ring_ops=ring_ops)
                timeline.span(request.name, "MEMCPY_OUT_FUSION_BUFFER", t2, t3)
            for request in alone:
                timeline.span(request.name, "ALLREDUCE", t1, t2, bytes=request.nbytes, ring_ops=ring_ops)
        self._complete_all(batch + alone, results)

    def _complete_all(self, requests: "list[Request]", results: "list[Any]") -> None:
        """``_finish`` for many successful ops at once: one lock acquisition for all of them."""
        names = list(map(_NAME, requests))
        with self._lock:
            self._in_flight.difference_update(names)
        for request, result in zip(requests, results):
            handle = request.handle
            handle._results[request.index] = result
            handle._remaining -= 1
        self._finished_any = True

    def _finish(self, request: Request, result: Any = None, error: "BaseException | None" = None) -> None:
        with self._lock:
            self._in_flight.discard(request.name)
        if error is not None:
            request.handle._fail(error)
        else:
            request.handle._complete(request.index, result)
        self._finished_any = True

    def _wake_waiters(self) -> None:
        if self._finished_any:
            self._finished_any = False
            with self.done_cv:
                self.done_cv.notify_all()

    def _fail_all(self, error: BaseException) -> None:
        with self._lock:
            if not isinstance(error, ShutdownError):
                self._closed_error = error
            elif error.peers:  # other ranks left: later ops must say who, not just "shut down"
                self._closed_error = ShutdownError(
                    f"rank(s) {error.peers} left the job (shutdown() or process exit); no collective "
                    "can run without them", peers=error.peers)
            else:
                self._closed_error = None
            self._closing = True
            leftovers = list(self._pending.values()) + self._incoming
            join_handle, self._join_handle = self._join_handle, None
            self._incoming = []
            self._in_flight.clear()
        self._pending.clear()
        for request in leftovers:
            request.handle._fail(error)
        if join_handle is not None:
            join_handle._fail(error)
        with self.done_cv:
            self.done_cv.notify_all()


_NAME = operator.attrgetter("name")
_SIGNATURE = operator.attrgetter("signature")
_ARRAY = operator.attrgetter("array")
_IN_PLACE = operator.attrgetter("in_place")
_consume = collections.deque(maxlen=0).extend  # runs an iterator to its end, keeping nothing


class _Steady:
    """A batch that ran whole in the cycle that took it, every op cached: the names
    and signatures in the order they were submitted, and what a cycle derives from them
    (the negotiation vector, the agreed order of execution, the plan). A training step
    submits the same batch again, in the same order; ``matches`` checks that with two
    C-level list comparisons instead of a lookup per op.

    Valid only while the response cache stays as it was (``ResponseCache.version``): the
    bits, and so the vector and the order, come from it."""

    __slots__ = ("names", "signatures", "bits", "order", "ready_names", "vector", "words", "version",
                 "expected", "head", "joined_at", "plan")

    @staticmethod
    def learn(incoming: "list[Request]", version: int, vector: np.ndarray, words: int,
              offsets: "tuple[int, int, int]", rank: int) -> "_Steady | None":
        """``incoming`` as a steady batch, or None if not every op of it is cached. ``vector``:
        a zeroed vector for ``words`` cache words, ``offsets``: ``Engine._offsets`` of it."""
        cached_state = RequestState.CACHED
        if not all(request.state is cached_state for request in incoming):
            return None  # unnamed ops (never cached) go through the coordinator every time
        steady = _Steady()
        steady.names = list(map(_NAME, incoming))
        steady.signatures = list(map(_SIGNATURE, incoming))
        steady.bits = [request.bit for request in incoming]
        # The agreed order is ascending bit order (``_decide``), whatever the submission order.
        steady.order = sorted(range(len(incoming)), key=steady.bits.__getitem__)
        steady.ready_names = [steady.names[i] for i in steady.order]
        _, busy_at, joined_at = offsets
        set_bits(vector, steady.bits)
        set_bit(vector[busy_at:joined_at], rank)  # this rank has ops pending
        steady.vector, steady.words, steady.version = vector, words, version
        steady.expected = vector[:words].tobytes()
        # Cache bits, control word (no news) and "leaving" bits (none): what every rank must
        # have sent for the batch to run as it is; "joined" bits: none.
        steady.head = vector[:busy_at].tobytes()
        steady.joined_at = joined_at
        steady.plan = None
        return steady

    def matches(self, incoming: "list[Request]", version: int) -> bool:
        return (version == self.version and len(incoming) == len(self.names)
                and list(map(_NAME, incoming)) == self.names
                and list(map(_SIGNATURE, incoming)) == self.signatures)

    def agreed(self, everywhere: np.ndarray, anywhere: np.ndarray) -> bool:
        """Whether every rank sent this batch and nothing else: then it runs as learned."""
        return (everywhere[:self.words].tobytes() == self.expected
                and anywhere[:len(self.head) // 8].tobytes() == self.head
                and not anywhere[self.joined_at:].any())


class _Ring:
    """One ring of a plan: the batch positions it packs into the fusion buffer and those it
    reduces in their own memory, and views of the fusion buffer for each packed op (cut
    once per buffer, so a repeated step packs and unpacks without slicing)."""

    __slots__ = ("packed", "alone", "packs_all", "packed_bytes", "dtype", "pieces", "buffer", "fused", "views")

    def __init__(self, packed: "list[int]", alone: "list[int]", packed_bytes: int, dtype: np.dtype,
                 pieces: "list[tuple[tuple, int]]", batch_size: int) -> None:
        self.packed, self.alone, self.packed_bytes, self.dtype = packed, alone, packed_bytes, dtype
        self.packs_all = packed == list(range(batch_size))  # every op of the batch, in order
        self.pieces = pieces  # (shape, element count) of each packed op, in order
        self.buffer: Any = None
        self.fused: Any = None
        self.views: "list[Any]" = []

    def bind(self, buffer: Any) -> None:
        """Cut this ring's views out of ``buffer`` (a byte array at least packed_bytes long)."""
        fused = buffer[:self.packed_bytes].view(self.dtype)
        views = []
        offset = 0
        for shape, size in self.pieces:
            views.append(fused[offset:offset + size].reshape(shape))
            offset += size
        self.buffer, self.fused, self.views = buffer, fused, views


class _Plan:
    """How the engine runs one batch of ready ops: the non-all-reduces one by one, then the
    rings ``fusion.plan_batch`` plans for the all-reduces. Depends only on the ops' agreed
    signatures (kind, dtype, shape, op, scaling, backend) and the fusion settings."""

    __slots__ = ("signatures", "threshold", "inplace_min", "one_by_one", "rings")

    def __init__(self, ready: "list[Request]", signatures: "list[tuple]", threshold: int,
                 inplace_min: int) -> None:
        self.signatures, self.threshold, self.inplace_min = signatures, threshold, inplace_min
        allreduces = [i for i, r in enumerate(ready) if r.kind is Kind.ALLREDUCE]
        self.one_by_one = [i for i, r in enumerate(ready) if r.kind is not Kind.ALLREDUCE]
        # One ring reduces one dtype with one op and one scaling, in one kind of memory.
        keys = [(r.array.dtype, r.op, r.prescale, r.postscale, r.backend.name)
                for r in (ready[i] for i in allreduces)]
        self.rings = []
        for ring in fusion.plan_batch(keys, [ready[i].nbytes for i in allreduces], threshold, inplace_min):
            packed = [allreduces[j] for j in ring.packed]
            alone = [allreduces[j] for j in ring.in_place]
            dtype = ready[(packed or alone)[0]].array.dtype
            pieces = [(tuple(ready[i].array.shape), ready[i].array.size) for i in packed]
            self.rings.append(_Ring(packed, alone, ring.packed_bytes, dtype, pieces, len(ready)))

    def fits(self, config: EngineConfig) -> bool:
        """Planned with ``config``'s fusion settings."""
        return self.threshold == config.fusion_threshold_bytes and self.inplace_min == config.inplace_min_bytes


def set_bits(words: np.ndarray, bits: "list[int]") -> None:
    """``negotiation.set_bit`` for many bits at once (one NumPy call, not one per bit)."""
    if bits:
        flags = np.zeros(words.size * 64, dtype=np.bool_)
        flags[bits] = True
        words |= np.packbits(flags, bitorder="little").view(words.dtype)


def _already_in_flight(name: str) -> InvalidArgumentError:
    return InvalidArgumentError(f"an op named {name!r} is already in flight on this rank; synchronize it "
                                f"before submitting that name again, or give the new op another name")


def _joined_problem(meta: tuple, joined: "list[int]", members: "list[int]") -> str:
    """Why the op with this metadata cannot run while ``joined`` (job ranks) have joined; "" if it can."""
    kind, root = Kind(meta[0]), meta[4]
    if kind in (Kind.BROADCAST, Kind.BROADCAST_OBJECT) and members[root] in joined:
        return (f"its root rank {members[root]} has joined (hvd.join()); a rank that has joined has "
                "no data to broadcast")
    if kind is Kind.ALLGATHER_OBJECT:
        return f"rank(s) {joined} have joined (hvd.join()) and have no object to gather"
    return ""


def _stand_in(engine: Engine, name: str, meta: tuple) -> Request:
    """What a joined rank brings to an op the others submitted: zeros for an all-reduce or a
    reduce-scatter (the identity for Min, Max and Product), no rows for an allgather or an
    alltoall, a receive buffer for a broadcast. Its result is dropped."""
    kind, code, shape, op_code, root, prescale, postscale, backend_name = meta
    dtype = dtype_from_code(code)
    op = None if op_code < 0 else ReduceOp(op_code)
    fields: "dict[str, Any]" = {}
    if kind in (Kind.ALLGATHER, Kind.ALLTOALL):
        array = np.zeros((0,) + tuple(shape), dtype=dtype)
        if kind is Kind.ALLTOALL:
            fields["splits"] = [0] * engine._size
    elif kind in (Kind.BARRIER, Kind.BROADCAST_OBJECT):
        array = _PLACEHOLDER
    else:
        array = np.full(shape, _identity(op, dtype), dtype=dtype)
    if backend_name != backend_for(array).name:  # the others' arrays live on a GPU: so does this one
        import cupy
        array = cupy.asarray(array)
    handle = Handle(1, False, engine.done_cv)
    request = Request(Kind(kind), name, array, handle, 0, backend_for(array), op=op, root=root, in_place=True,
                      prescale=prescale, postscale=postscale, **fields)
    request.signature = meta
    return request


def _identity(op: "ReduceOp | None", dtype: np.dtype) -> Any:
    if op == ReduceOp.Min:
        return np.finfo(dtype).max if dtype.kind == "f" else (True if dtype.kind == "b" else np.iinfo(dtype).max)
    if op == ReduceOp.Max:
        return np.finfo(dtype).min if dtype.kind == "f" else (False if dtype.kind == "b" else np.iinfo(dtype).min)
    if op == ReduceOp.Product:
        return 1
    return 0
