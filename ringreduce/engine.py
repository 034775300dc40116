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
steady batch (``negotiation.SteadyBatch``). When the same ops come again in
the same order, the cycle sends the kept vector, and if every rank sent the
same (nothing more, nothing missing, no news) it runs the batch as it is, with
no per-op work before the rings. Otherwise the ops become pending ops like any
other and the cycle goes on from the vectors it already has, so either path
gives every rank the same decisions.

Errors are delivered to the handles of every rank (``synchronize`` raises
them; the classes live in ``errors.py``): mismatched submissions, stalls past
MTRAIN_STALL_SHUTDOWN_SECONDS, and shutdown with ops in flight. Nothing waits
forever on a rank that has left.
"""
from __future__ import annotations

import dataclasses
import itertools
import operator
import sys
import threading
import time
import traceback
from typing import Any, NamedTuple

from mpi4py import MPI

from mtrain.launcher.records.errors import FailureCause, report_error

from . import cuda, join, log, recorder, shm
from .autotune import Decision, Knobs, Space, Tuner
from .backend import NumpyBackend
from .collectives import Algorithm, Executor, Kind
from .errors import EngineError, InvalidArgumentError, Refusal, ShutdownError, Verdict
from .fusion import PLAN_CACHE_SIZE, FusionBuffers, Plan, PlanCache, Ring
from .negotiation import (UNNAMED_PREFIX, Agreement, Control, Coordinator, Negotiator, Report, RequestState,
                          ResponseCache, SteadyBatch)
from .ops import ReduceOp
from .requests import AllreduceOp, Completion, Handle, Request, Signature
from .settings import DEFAULT_CACHE_CAPACITY, EngineConfig
from .steps import StepMeter
from .timeline import Timeline, TraceLink

# A burst of submissions is over (the engine starts its cycle) once none came for this
# long, or after HOLD_CYCLES cycle times in all (Engine._hold). A burst that repeats the
# last batch but lacks part of it: once none came for a cycle time, or after
# EXPECT_HOLD_CYCLES cycle times in all.
QUIET_SECONDS = 200e-6
HOLD_CYCLES = 10
EXPECT_HOLD_CYCLES = 100
# The most op names one learned step may hold (Engine._hold's expectation).
STEP_NAMES_MAX = 1 << 16

_NAME = operator.attrgetter("name")


class EngineStats(NamedTuple):
    """What an engine did so far: plans made and reused, and steady-batch cycles."""

    plans_built: int       # batches planned afresh
    plans_reused: int      # batches that ran by a kept plan
    steady_cycles: int     # cycles that ran a steady batch as learned, with no per-op work
    steady_fallbacks: int  # cycles that sent a steady batch, but another rank differed


class Engine:
    def __init__(self, executor: Executor, control: MPI.Comm, config: EngineConfig,
                 members: "list[int] | None" = None, steps: "StepMeter | None" = None,
                 trace_link: "TraceLink | None" = None) -> None:
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
        # Names in flight as a refusal (``errors.Refusal``: this rank refused the op's arguments, and
        # the name goes through the negotiation anyway) -> the ops submitted under that name since,
        # in order, each held back until the one before has ended on every rank (refusals, then at
        # most one op that runs). A retry right after an argument error is no "already in flight"
        # error, and meets the other ranks' retries.
        self._refusals: "dict[str, list[Request]]" = {}
        self._closing = False
        self._closed_error: "BaseException | None" = None
        # One counter for every kind of unnamed op: a rank calling a different
        # collective than the others then collides on the same name and gets a
        # mismatch error naming both calls, instead of a stall.
        self._unnamed = itertools.count()
        # Engine-thread state.
        self._pending: "dict[str, Request]" = {}
        self._cache = ResponseCache(config.cache_capacity)
        self._negotiator = Negotiator(control, self._rank, self._size)
        self._coordinator = (Coordinator(self._size, config.stall_warning_s, config.stall_shutdown_s,
                                         self._members) if self._rank == 0 else None)
        self._stall_check_next = False
        self._finished_any = False
        self._plans = PlanCache()
        self._buffers = FusionBuffers()
        # Whole batches seen before, to run again as they were, by their first op's name and length.
        self._steady: "dict[tuple[str, int], SteadyBatch]" = {}
        self._steady_cycles = self._steady_fallbacks = 0
        self._join = join.JoinState()
        self._shutdown_error = ShutdownError("mtrain shut down while this op was in flight")
        # Every rank records a timeline; rank 0 writes it, the others send theirs there (timeline.py).
        self._trace_link = trace_link
        self._timeline = self._new_timeline(config.timeline_path) if config.timeline_path else None
        self._mark_cycles = config.timeline_mark_cycles  # start_timeline() sets its own
        # The GPU init() bound in this thread; a new thread starts on GPU 0, so the engine
        # thread adopts it before its first device op (None: no CuPy in use).
        self._gpu = cuda.current_device()
        self._cache_capacity = config.cache_capacity or DEFAULT_CACHE_CAPACITY  # when the autotuner turns it on
        self._tuner = self._make_tuner() if config.autotune.enabled else None
        # Per-step timings for the straggler report (steps.py; the job's engine only), and the
        # number of cycles so far: each is one exchange, so it counts alike on every rank.
        self.steps = steps
        self._cycles = 0
        # -- flight recorder (recorder.py): the last ops, for a hang report --------------------
        size = recorder.size_from_environment()
        self._flight = recorder.FlightRecorder(size) if size else None
        self._waited_at = 0.0  # when a user thread last stopped blocking on a handle
        if self._coordinator is not None and self._flight is not None:
            self._coordinator.on_stall = recorder.request_dumps
        # --------------------------------------------------------------------------------------
        self._thread = threading.Thread(target=self._run, name="mtrain-engine", daemon=True)
        self._thread.start()

    # -- user side -----------------------------------------------------------
    def auto_name(self) -> str:
        return f"{UNNAMED_PREFIX}{next(self._unnamed)}"

    def stats(self) -> EngineStats:
        return EngineStats(self._plans.built, self._plans.reused, self._steady_cycles, self._steady_fallbacks)

    def submit(self, requests: "list[Request]") -> None:
        """Queue requests (all parts of one handle) for the engine thread: all or none."""
        now = time.monotonic()
        with self._lock:
            if self._closing or self._closed_error is not None:
                raise self._closed()
            if len(requests) > 1:
                names = [r.name for r in requests]
                taken = [n for n in names if n in self._in_flight and not self._may_hold(n)]
                if taken or len(set(names)) != len(names):
                    raise _already_in_flight(taken[0] if taken else next(n for n in names if names.count(n) > 1))
            for request in requests:
                if type(request.signature) is Refusal and request.name not in self._in_flight:
                    self._refusals[request.name] = []
                self._enqueue(request, now)

    def submit_allreduce(self, array: Any, name: "str | None", op: ReduceOp, in_place: bool, prescale: float,
                         postscale: float, op_class: "type[AllreduceOp] | None" = None,
                         signature: "Signature | None" = None) -> AllreduceOp:
        """Submit one all-reduce (arguments already checked) as one object, its request and its
        handle (``requests.AllreduceOp``, or ``op_class``): the per-tensor path of a training step.
        ``signature``: the op's signature from an earlier submit of the same host array."""
        request = (op_class or AllreduceOp)(self.done_cv, name or self.auto_name(), array, op, in_place,
                                            prescale, postscale, signature)
        now = time.monotonic()
        lock = self._lock
        lock.acquire()  # acquire/release rather than ``with``: half the cost, once per tensor
        try:
            if self._closing or self._closed_error is not None:  # checked inline: once per tensor
                raise self._closed()
            self._enqueue(request, now)
        finally:
            lock.release()
        return request

    def _closed(self) -> BaseException:
        """What a submit to a closed engine raises."""
        return self._closed_error or ShutdownError("mtrain was shut down; call init() again before submitting more ops")

    def _enqueue(self, request: Any, now: float) -> None:
        """The one submit core (under ``self._lock``): queue one request of a new name."""
        name = request.name
        in_flight = self._in_flight
        if name in in_flight:
            if self._may_hold(name):
                request.submitted = now
                self._refusals[name].append(request)  # queued by ``_finish`` once the refusal has ended
                return
            raise _already_in_flight(name)
        if not self._incoming:
            self._first_submit = now
            # A burst that begins with an op of the last batch is probably that batch
            # again: the engine holds on until all of it is here (Engine._hold).
            self._expect_left = len(self._last_batch) if name in self._last_batch else 0
            # Wake the engine only for the first op of a burst: a notify per op
            # would hand the GIL back and forth on every submit.
            self._wake.notify()
        request.submitted = now
        in_flight.add(name)
        if self._expect_left > 0 and name in self._last_batch:
            self._expect_left -= 1
            if not self._expect_left:
                self._expect_left = -1  # complete: the engine may start now
                self._wake.notify()
        self._last_submit = now
        self._incoming.append(request)

    def _may_hold(self, name: str) -> bool:
        """Whether an op under ``name``, which is in flight, can wait behind it (under ``self._lock``):
        when what is in flight, and whatever waits already, are refusals."""
        held = self._refusals.get(name)
        return held is not None and (not held or type(held[-1].signature) is Refusal)

    def _note_waiter(self, delta: int) -> None:
        """A user thread starts (+1) or stops (-1) blocking on one of this engine's handles."""
        with self._lock:
            self._waiters += delta
            if delta > 0:
                self._wake.notify()
            else:
                self._waited_at = time.monotonic()

    def submit_join(self) -> Handle:
        """This rank has no more data: it stands in for the other ranks' ops (``join.py``) until
        every rank has joined. The handle's result is the job rank that joined last."""
        handle = Handle(1, False, self.done_cv)
        with self._lock:
            if self._closing or self._closed_error is not None:
                raise self._closed_error or ShutdownError(
                    "mtrain was shut down; call init() again before join()")
            if self._join.handle is not None:
                raise InvalidArgumentError("join() is already in progress on this rank")
            self._join.handle = handle
            self._wake.notify()
        return handle

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
            # Rank 0 does not wait for the last events of ranks known to have left.
            timeline.close(gone=getattr(self._closed_error, "peers", None) or ())
        if not self._thread.is_alive():
            self._control.Free()
            if self._trace_link is not None:
                self._trace_link.free()

    # -- timeline ------------------------------------------------------------------
    def _new_timeline(self, path: str) -> "Timeline | None":
        if self._trace_link is not None:
            return Timeline(path, self._trace_link)
        return Timeline(path) if self._rank == 0 else None  # an engine made without a link

    def start_timeline(self, path: str, mark_cycles: bool) -> None:
        """Record the timeline from now on (every rank; rank 0 writes it to ``path``)."""
        old, self._timeline = self._timeline, self._new_timeline(path)
        self._mark_cycles = mark_cycles
        if old is not None:
            old.close()

    def stop_timeline(self) -> None:
        # The engine thread may still hold the old object for a moment: a closed timeline
        # ignores late events.
        old, self._timeline = self._timeline, None
        if old is not None:
            old.close()

    def _end_step(self) -> None:
        """The ops since the last step's end were one step: the meter records it, and so does the
        timeline, if one runs (engine thread)."""
        steps = self.steps
        sample = steps.step_end()
        if sample is not None:
            start = steps.compute_start
            self.record_step(sample.step, start, start + sample.compute, sample.end, sample.wait)

    def record_step(self, index: int, compute_start: float, compute_end: float, end: float, wait_s: float) -> None:
        """One training step on the timeline, if one runs (``Timeline.step``)."""
        timeline = self._timeline  # read once: stop_timeline() may clear it from a user thread
        if timeline is not None:
            timeline.step(index, compute_start, compute_end, end, wait_s)

    def departed(self) -> "BaseException | None":
        """Why this engine has stopped (a peer left, it failed, or it was shut down), else None: for
        the runtime's calls that wait outside the engine thread and must not outlive their peers."""
        if self._thread.is_alive():
            return None
        return self._closed()

    def alive(self) -> bool:
        return self._thread.is_alive()

    def running(self) -> bool:
        """Takes ops: its thread runs and nothing has stopped it. An engine that a peer's leaving
        stopped fails its ops before its thread ends, so ``alive()`` alone may still say True."""
        with self._lock:
            stopped = self._closing or self._closed_error is not None
        return not stopped and self._thread.is_alive()

    # -- engine thread: the cycle ----------------------------------------------
    def _run(self) -> None:
        try:
            if self._gpu is not None:
                cuda.use_device(self._gpu)
            while self._cycle():
                tuner = self._tuner
                if tuner is not None and tuner.due:
                    self._retune(tuner)
            self._fail_all(self._shutdown_error)
        except BaseException as exc:  # a bug or an MPI failure: fail loudly, never hang the user
            traceback.print_exc()
            self._fail_all(EngineError(f"mtrain's background engine failed: {exc!r}"))
        finally:
            if self.steps is not None:
                self._end_step()  # the last step, which no idle moment followed
                self.steps.send()

    def _take_incoming(self) -> "tuple[bool, list[Request]]":
        """The ops submitted since the last cycle, and whether we are closing."""
        with self._lock:
            self._hold()
            incoming, self._incoming = self._incoming, []
            self._expect_left = 0
            closing = self._closing
        steps = self.steps
        if steps is not None and steps.due():
            steps.send()  # outside the lock: submitters never wait for this write
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
            if self.steps is not None:
                self._end_step()
        cycle = self.config.cycle_time_s
        quiet = min(cycle, QUIET_SECONDS)
        tick = None
        while not self._closing:
            if self._waiters and (self._incoming or self._pending or self._join.handle is not None):
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
        """One negotiation round and what it makes ready. False: the job is shutting down."""
        closing, incoming = self._take_incoming()
        self._cycles += 1
        if self._join.handle is not None and not self._join.active:
            self._join.active = True  # from now on this rank stands in for every op
        if incoming and not closing and not self._pending and not self._join.active and not self._stall_check_next:
            steady = self._steady.get((incoming[0].name, len(incoming)))
            if steady is not None and steady.matches(incoming, self._cache.version):
                return self._cycle_steady(steady, incoming)
        pending = self._pending
        for request in incoming:
            pending[request.name] = request
        cached, unreported = self._cache.mark(pending.values())
        control = Control.UNREPORTED if unreported else Control.NONE
        if closing:
            control |= Control.SHUTDOWN
        if self._stall_check_next:
            control |= Control.STALL_CHECK
            self._stall_check_next = False
        layout = self._negotiator.layout(self._cache.words)
        mine_and, mine_or = self._negotiator.vector(layout, cached, control, leaving=closing, busy=bool(pending),
                                                    joined=self._join.active)
        everywhere, anywhere = self._negotiator.exchange(mine_and, mine_or)
        # A batch that ran whole, all of it submitted since the last cycle, is what the next
        # step will probably submit again: learn it.
        whole = len(pending) == len(incoming) and bool(incoming) and not closing and not self._join.active
        cache_version = self._cache.version
        alive = self._decide(self._negotiator.decode(layout, everywhere, anywhere))
        if alive and whole and not self._pending and self._cache.version == cache_version:
            self._learn(incoming)
        return alive

    def _learn(self, incoming: "list[Request]") -> None:
        layout = self._negotiator.layout(self._cache.words)
        steady = SteadyBatch.learn(incoming, self._cache.version, self._negotiator, layout)
        if steady is not None:
            steady.nbytes = sum(request.nbytes for request in incoming)
            key = (incoming[0].name, len(incoming))
            if key not in self._steady and len(self._steady) >= PLAN_CACHE_SIZE:
                del self._steady[next(iter(self._steady))]  # the oldest
            self._steady[key] = steady

    def _cycle_steady(self, steady: SteadyBatch, incoming: "list[Request]") -> bool:
        """A cycle whose ops are exactly the steady batch's, submitted in the same order: its
        vector, order and plan are known, so nothing is done per op before the rings. The
        vector is the one ``_cycle`` would build (every rank may take either way)."""
        everywhere, anywhere = self._negotiator.exchange(steady.vector, steady.vector)
        if not steady.agreed(everywhere, anywhere):
            # Another rank lacks some of them, or has more, or news (a shutdown, a join, a new
            # name): these ops are cached pending ops like any other, and the cycle goes on.
            self._steady_fallbacks += 1
            steady.place(incoming)
            pending = self._pending
            for request in incoming:
                pending[request.name] = request
            return self._decide(self._negotiator.decode(steady.layout, everywhere, anywhere))
        coordinator = self._coordinator
        if coordinator is not None:
            if coordinator.first_seen or coordinator.warned:
                for name in steady.names:
                    coordinator.forget(name)
            self._stall_check_next = coordinator.stall_check_due(time.monotonic())
        ready = list(map(incoming.__getitem__, steady.order))
        config = self.config
        if steady.plan is None or not steady.plan.fits(config.fusion_threshold_bytes, config.inplace_min_bytes):
            steady.plan = self._plans.plan(ready, config.fusion_threshold_bytes, config.inplace_min_bytes)
        else:
            self._plans.reused += 1
        self._steady_cycles += 1
        self._execute(ready, steady.plan, steady.ready_names, incoming[0].submitted, steady.nbytes)
        self._wake_waiters()
        return True

    def _decide(self, agreement: Agreement) -> bool:
        """The rest of a cycle, from what every rank agreed: who is leaving or joined, the
        coordinator round if anyone has news, then the ready ops. False: the job is shutting down."""
        control = agreement.control
        if control & Control.SHUTDOWN:
            self._note_shutdown(agreement.leaving, agreement.busy)
            return False
        joined = agreement.joined
        joined_changed = self._join.note(joined)
        names = self._cache.names
        ready = [names[b] for b in agreement.ready]
        partial = [names[b] for b in agreement.partial]
        responses: list = []
        # A rank that joins completes the ops the others reported but it never will: the
        # coordinator looks again in the cycle every rank sees the join.
        if control & (Control.UNREPORTED | Control.STALL_CHECK) or joined_changed:
            responses = self._coordinate(set(partial) | set(ready), bool(control & Control.STALL_CHECK), joined)
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
            else:  # MISMATCH, STALLED or REFUSED: the op ends with that error on every rank
                if verdict is Verdict.STALLED and self._flight is not None:
                    recorder.dump_now("stall shutdown")  # while the op still shows as waiting
                error = verdict.error(response.message, response.meta)
                self._finish(self._pending.pop(response.name), error=error)
        coordinator = self._coordinator
        if coordinator is not None:
            now = time.monotonic()
            if coordinator.first_seen or coordinator.warned:  # else forget() has nothing to do
                for name in ready:
                    coordinator.forget(name)
            coordinator.note_partial(partial, now)
            self._stall_check_next = coordinator.stall_check_due(now)
        if ready:
            if joined:
                self._execute(self._with_joined(ready, ready_meta, joined))
            else:
                self._execute([self._pending.pop(name) for name in ready])
        elif len(joined) == self._size and not agreement.busy:
            self._finish_join()
        self._wake_waiters()
        return True

    def _coordinate(self, cached_anywhere: "set[str]", stall_check: bool, joined: "list[int]") -> list:
        reports = []
        for request in self._pending.values():
            if request.state is RequestState.UNREPORTED:
                handle = request.handle
                group = id(handle) if len(handle._results) > 1 else 0  # the parts of one grouped op
                reports.append(Report(request.name, request.signature, request.describe(self._members), group))
                request.state = RequestState.REPORTED
        pending = sorted(self._pending) if stall_check else None
        gathered = self._control.gather((reports, pending), root=0)
        responses = None
        if self._coordinator is not None:
            responses = self._coordinator.decide(gathered, self._cache, cached_anywhere, time.monotonic(),
                                                 frozenset(joined))
        return self._control.bcast(responses, root=0)

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

    # -- join ---------------------------------------------------------------------
    def _finish_join(self) -> None:
        handle, last = self._join.finish()
        # Unnamed ops name themselves by a per-rank counter, which ranks that joined early did not
        # advance; nothing is in flight now, so every rank starts it afresh, together.
        self._unnamed = itertools.count()
        if handle is not None:
            handle._complete(0, self._members[last])
            self._finished_any = True

    def _with_joined(self, ready: "list[str]", ready_meta: "dict[str, Any]", joined: "list[int]") -> "list[Request]":
        """The ready ops as this rank runs them while ``joined`` ranks have joined."""
        runnable, refused = join.runnable(ready, self._pending, ready_meta, self._cache.entries,
                                          [self._members[r] for r in joined], self.done_cv)
        for request, error in refused:
            self._finish(request, error=error)
        return runnable

    # -- autotune (autotune.py) ----------------------------------------------------
    def _make_tuner(self) -> Tuner:
        ex, config = self.executor, self.config
        shared = ex.shared
        if shared is None:
            algorithm = Algorithm.RING
        else:
            algorithm = Algorithm.AUTO if ex.algorithm is Algorithm.AUTO else Algorithm.SHM
        start = Knobs(config.fusion_threshold_bytes, round(config.cycle_time_s * 1000, 6), ex.segment_bytes,
                      shared.stripe_bytes if shared is not None else 0, str(algorithm),
                      str(shared.transport) if shared is not None else "", config.cache_capacity > 0)
        space = Space([str(a) for a in ex.algorithms()],
                      [str(t) for t in shared.transports] if shared is not None else [],
                      stripes=shared is not None and shared.segment is not None)
        hosts = ex.cross.Get_size() if ex.cross is not None else 1
        return Tuner(config.autotune, space, start, self._rank, hosts)

    def _retune(self, tuner: Tuner) -> None:
        """The end of an autotune sample, reached by every rank after the same cycle: rank 0 takes
        every rank's score and says what runs next; every rank applies it before its next cycle."""
        scores = self._control.gather(tuner.score(), root=0)
        decision = None
        if self._rank == 0:
            try:
                decision = tuner.decide(scores)
            except Exception as error:  # never leave the other ranks waiting in the broadcast
                log.warning(f"autotune failed ({error!r}); keeping {tuner.current.describe()}")
                decision = Decision(tuner.current, False)
        decision = self._control.bcast(decision, root=0)
        self._apply(decision.knobs)
        tuner.follow(decision)
        if not decision.active:
            self._tuner = None

    def _apply(self, knobs: Knobs) -> None:
        """Run by ``knobs`` from the next cycle on (every rank at the same point of the op stream)."""
        self.config = dataclasses.replace(self.config, fusion_threshold_bytes=knobs.fusion_threshold_bytes,
                                          cycle_time_s=knobs.cycle_time_ms / 1000)
        self.executor.use(Algorithm(knobs.algorithm), knobs.segment_bytes)
        shared = self.executor.shared
        if shared is not None:
            shared.use(shm.Transport(knobs.transport), knobs.stripe_bytes)
        self._use_cache(knobs.cache_enabled)

    def _use_cache(self, enabled: bool) -> None:
        """Turn the response cache on or off. Off forgets every name: ops pending by their bit go to
        the coordinator again, and the steady batches (built from the bits) are dropped."""
        cache = self._cache
        if enabled == (cache.capacity > 0):
            return
        if enabled:
            cache.capacity = self._cache_capacity
            return
        cache.capacity = 0
        cache.entries.clear()
        cache.names.clear()
        cache.version += 1
        for request in self._pending.values():
            if request.state is RequestState.CACHED:
                request.state = RequestState.UNREPORTED
        self._steady.clear()

    # -- engine thread: dispatch ------------------------------------------------
    def _execute(self, ready: "list[Request]", plan: "Plan | None" = None,
                 names: "list[str] | None" = None, first_submit: "float | None" = None,
                 nbytes: "int | None" = None) -> None:
        """Run the ready ops (in the agreed order) by ``plan`` (the cached one if not given);
        ``names``: theirs, in that order, if known; ``first_submit``: the earliest submit among
        them, and ``nbytes``: their arrays' bytes, if known."""
        started = time.monotonic()
        timeline = self._timeline
        if timeline is not None:
            timeline.negotiated(ready, started, self._mark_cycles)
        steps = self.steps
        if steps is not None and ready:  # (a joined rank may be left with nothing to run)
            if first_submit is None:
                first_submit = min(request.submitted for request in ready)
            if nbytes is None:
                nbytes = sum(request.nbytes for request in ready)
            steps.batch(first_submit, started, nbytes, self._cycles)
        if plan is None:
            plan = self._plans.plan(ready, self.config.fusion_threshold_bytes, self.config.inplace_min_bytes)
        if len(self._step_names) > STEP_NAMES_MAX:  # nobody ever waits (only polls): no steps to learn
            self._step_names = []
        kept = names is not None  # a steady batch's own list, the same every step
        if names is None:
            names = list(map(_NAME, ready))
        self._step_names.extend(names)
        tuner = self._tuner
        if tuner is not None:
            tuner.note(names, sum(request.nbytes for request in ready) if nbytes is None else nbytes)
        if self._waiters:
            self._step_waited = True
        flight = self._flight
        if flight is not None:
            flight.start(ready, names, kept, started)
        for index in plan.one_by_one:
            self._run_one(ready[index])
        take = ready.__getitem__
        for ring in plan.rings:
            # The common batch is one ring that packs every op: no list to build.
            batch = ready if ring.packs_all else list(map(take, ring.packed))
            self._run_ring(ring, batch, list(map(take, ring.alone)))
        if steps is not None or flight is not None:
            now = time.monotonic()
            if steps is not None:
                steps.done(now)
            if flight is not None:
                flight.finish(now)

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

    def _run_ring(self, ring: Ring, batch: "list[Request]", alone: "list[Request]") -> None:
        """One ring over the fusion buffer (``batch`` packed into it, if any) followed by
        the ``alone`` tensors in their own memory (or fresh copies for out-of-place ops)."""
        first = (batch or alone)[0]
        backend = first.backend
        host = isinstance(backend, NumpyBackend)
        flats, outs, copied = [], [], []
        t0 = t1 = time.monotonic()
        arrays: "list[Any]" = []
        if batch:
            buffer = self._buffers.get(backend, ring.packed_bytes, self.config.fusion_threshold_bytes)
            arrays = ring.pack(batch, backend, host, buffer)
            flats.append(ring.fused)
            t1 = time.monotonic()
        for request in alone:
            out = request.array if request.in_place else request.array.copy(order="C")
            flat, was_copied = backend.flatten(out)
            outs.append(out)
            flats.append(flat)
            copied.append(was_copied)
        self.executor.allreduce_flat(flats, first.op, backend, first.prescale, first.postscale)
        t2 = time.monotonic()
        results = ring.unpack(batch, arrays, backend, host) if batch else []
        t3 = time.monotonic()
        for out, flat, was_copied in zip(outs, flats[1 if batch else 0:], copied):
            if was_copied:
                backend.copy(out, flat.reshape(out.shape))
            results.append(out)
        timeline = self._timeline  # read once: stop_timeline() may clear it from a user thread
        if timeline is not None:
            timeline.ring(batch, alone, ring.packed_bytes, (t0, t1, t2, t3))
        self._complete_all(batch + alone, results)

    # -- engine thread: completion ------------------------------------------------
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
            name = request.name
            if name in self._refusals and type(request.signature) is Refusal:
                held = self._refusals.pop(name)
                if held:  # the next op submitted under the refused op's name: its turn now
                    following = held.pop(0)
                    if type(following.signature) is Refusal:
                        self._refusals[name] = held
                    if not self._incoming:
                        self._first_submit = following.submitted
                    self._last_submit = following.submitted
                    self._incoming.append(following)
                    self._wake.notify()
                else:
                    self._in_flight.discard(name)
            else:
                self._in_flight.discard(name)
        if error is not None:
            if self._flight is not None:
                self._flight.failed((request,), time.monotonic())
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
            leftovers += [request for held in self._refusals.values() for request in held]
            self._refusals.clear()
            join_handle, self._join.handle = self._join.handle, None
            self._incoming = []
            self._in_flight.clear()
        self._pending.clear()
        if self._flight is not None:
            self._flight.failed(leftovers, time.monotonic())
        for request in leftovers:
            request.handle._fail(error)
        if join_handle is not None:
            join_handle._fail(error)
        with self.done_cv:
            self.done_cv.notify_all()


def _already_in_flight(name: str) -> InvalidArgumentError:
    return InvalidArgumentError(f"an op named {name!r} is already in flight on this rank; synchronize it "
                                f"before submitting that name again, or give the new op another name")
