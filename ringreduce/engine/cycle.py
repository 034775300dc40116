"""The background engine: one cycle at a time owns every MPI call of the runtime.

User threads submit named ops and get a Handle back at once. Each cycle the
engine thread

1. takes the newly submitted ops from the submit queue (``submit_queue.py``:
   once a burst of submissions is over, or at once when a thread waits on a handle),
2. negotiates with the other ranks which ops every rank has submitted
   (``negotiation/``: a response-cache bit vector in the steady state, a
   coordinator round trip for new names),
3. has the dispatcher (``dispatch.py``) run the ready ops in the same order on
   every rank and complete their handles.

The steady state is a training step that repeats the last one's ops. A batch
that ran whole (every op cached, all of it taken in one cycle) is kept as a
steady batch (``negotiation.steady.SteadyBatch``). When the same ops come again in
the same order, the cycle sends the kept vector, and if every rank sent the
same (nothing more, nothing missing, no news) it runs the batch as it is, with
no per-op work before the rings. Otherwise the ops become pending ops like any
other and the cycle goes on from the vectors it already has, so either path
gives every rank the same decisions.

A cycle runs under the engine's cycle lock, in the engine thread or, when a thread is about
to block on a handle while the engine thread is between cycles and the work is small, in
that thread (``Engine.assist``): a lone op then costs no switch to the engine thread and
back. Submitting does not wake the engine thread; it finds new ops at its next tick (one
cycle time, as Horovod's background loop), or at once when a thread waits.

Errors are delivered to the handles of every rank (``synchronize`` raises
them; the classes live in ``core/errors.py``): mismatched submissions, stalls past
MTRAIN_STALL_SHUTDOWN_SECONDS, and shutdown with ops in flight. Nothing waits
forever on a rank that has left.
"""
from __future__ import annotations

import sys
import threading
import time
import traceback
from typing import Any, NamedTuple

from mtrain.common.records.error_report import FailureCause, report_error
from mtrain.common.settings import DEFAULT_CACHE_CAPACITY, EngineConfig
from mtrain.ringreduce.core.errors import EngineError, ShutdownError, Verdict
from mtrain.ringreduce.core.ops import ReduceOp
from mtrain.ringreduce.core.requests import AllreduceOp, Completion, Handle, Request, RequestState, Signature
from mtrain.ringreduce.engine import join
from mtrain.ringreduce.engine.dispatch import Dispatcher
from mtrain.ringreduce.engine.fusion import PLAN_CACHE_SIZE
from mtrain.ringreduce.engine.submit_queue import SubmitQueue, Taken
from mtrain.ringreduce.negotiation.cache import ResponseCache
from mtrain.ringreduce.negotiation.coordinator import Coordinator
from mtrain.ringreduce.negotiation.messages import Gathered, Report
from mtrain.ringreduce.negotiation.steady import SteadyBatch
from mtrain.ringreduce.negotiation.vector import Agreement, Control, Negotiator
from mtrain.ringreduce.observe import autotune, recorder
from mtrain.ringreduce.observe.autotune import Knobs, Tuner
from mtrain.ringreduce.observe.steps import StepMeter
from mtrain.ringreduce.observe.timeline import TimelineSwitch, TraceLink
from mtrain.ringreduce.transport import cuda, mpi
from mtrain.ringreduce.transport.executor import Executor

MPI = mpi.deferred(__name__)  # mpi4py's MPI from init() on (importing the runtime starts no MPI)


# A thread that waits on a handle runs the cycle itself (Engine.assist) for at most this many
# cycles, and only while the work is at most this many ops of at most this many bytes in all.
ASSIST_CYCLES = 2
ASSIST_MAX_OPS = 16
ASSIST_MAX_BYTES = 1 << 20


class EngineStats(NamedTuple):
    """What an engine did so far: plans made and reused, steady-batch cycles, the cycles waiting
    threads ran, and the steady batches of one all-reduce run in the op's own memory."""

    plans_built: int       # batches planned afresh
    plans_reused: int      # batches that ran by a kept plan
    steady_cycles: int     # cycles that ran a steady batch as learned, with no per-op work
    steady_fallbacks: int  # cycles that sent a steady batch, but another rank differed
    assisted_cycles: int = 0  # cycles a thread that waited on a handle ran itself (Engine.assist)
    lone_runs: int = 0        # steady batches of one host all-reduce run in its own memory (execute_lone)


class Engine:
    def __init__(self, executor: Executor, control: MPI.Comm, config: EngineConfig,
                 members: "list[int] | None" = None, steps: "StepMeter | None" = None,
                 trace_link: "TraceLink | None" = None) -> None:
        self.executor = executor
        self._control = control  # negotiation traffic only, apart from the data rings
        self._rank, self._size = control.Get_rank(), control.Get_size()
        # The job's rank of each rank of ``control`` (a process set's engine runs on a subset),
        # so that messages name the ranks users know.
        self._members = list(members) if members is not None else list(range(self._size))
        # All that user threads touch: submitted ops, names in flight, waiters (submit_queue.py).
        self.queue = SubmitQueue()
        # Handles wait here; notified after each batch. A waiter makes the next cycle start now.
        self.done_cv = Completion(self.queue.note_waiter)
        # Every rank records a timeline; rank 0 writes it, the others send theirs there (timeline.py).
        self.timelines = TimelineSwitch(self._rank, trace_link, config.timeline_path, config.timeline_mark_cycles)
        # -- flight recorder (recorder.py): the last ops, for a hang report --------------------
        size = recorder.size_from_environment()
        flight = recorder.FlightRecorder(size) if size else None
        # Per-step timings for the straggler report (steps.py; the job's engine only).
        self._dispatch = Dispatcher(executor, config, self.queue, self.done_cv, self.timelines, steps, flight)
        # Engine-thread state.
        self.cache = ResponseCache(config.cache_capacity)
        self._negotiator = Negotiator(control, self._rank, self._size)
        self._coordinator = (Coordinator(self._size, config.stall_warning_s, config.stall_shutdown_s,
                                         self._members) if self._rank == 0 else None)
        if self._coordinator is not None and flight is not None:
            self._coordinator.stall.on_stall = recorder.request_dumps
        self._stall_check_next = False
        # Whole batches seen before, to run again as they were, by their first op's name and length.
        self._steady: "dict[tuple[str, int], SteadyBatch]" = {}
        self._steady_cycles = self._steady_fallbacks = 0
        self._join = join.JoinState()
        self._shutdown_error = ShutdownError("mtrain shut down while this op was in flight")
        # The GPU init() bound in this thread; a new thread starts on GPU 0, so the engine
        # thread adopts it before its first device op (None: no CuPy in use).
        self._gpu = cuda.current_device()
        self._cache_capacity = config.cache_capacity or DEFAULT_CACHE_CAPACITY  # when the autotuner turns it on
        if config.autotune.enabled:
            self._dispatch.tuner = autotune.start_tuner(executor, config, self._rank)
        # The number of cycles so far: each is one exchange, so it counts alike on every rank.
        self._cycles = 0
        # Held by whoever runs a cycle: the engine thread, or a thread that waits on a handle
        # (``assist``). Everything the cycle touches (the cache, the negotiator, the dispatcher,
        # the queue's ``pending``) is that holder's alone. Never taken under the queue's lock.
        self._cycle_lock = threading.Lock()
        self._stopped = False  # set under the cycle lock: no cycle runs any more
        self._assisted_cycles = 0
        if self._gpu is None:  # (a waiting thread may run on another device than the one bound)
            self.done_cv.assist = self.assist
        self._thread = threading.Thread(target=self._run, name="mtrain-engine", daemon=True)
        self._thread.start()

    # -- what the engine runs by, and its instruments (a benchmark may swap them) ----------
    @property
    def config(self) -> EngineConfig:
        return self._dispatch.config

    @config.setter
    def config(self, config: EngineConfig) -> None:
        self._dispatch.config = config

    @property
    def steps(self) -> "StepMeter | None":
        """The step meter (the job's engine only; None: off)."""
        return self._dispatch.steps

    @steps.setter
    def steps(self, meter: "StepMeter | None") -> None:
        self._dispatch.steps = meter

    @property
    def flight_recorder(self) -> "recorder.FlightRecorder | None":
        """This engine's flight recorder (None: off)."""
        return self._dispatch.flight

    @flight_recorder.setter
    def flight_recorder(self, flight: "recorder.FlightRecorder | None") -> None:
        self._dispatch.flight = flight

    @property
    def tuner(self) -> "Tuner | None":
        """The autotuner while tuning goes on, else None."""
        return self._dispatch.tuner

    # -- user side -----------------------------------------------------------
    def auto_name(self) -> str:
        return self.queue.auto_name()

    def stats(self) -> EngineStats:
        plans = self._dispatch.plans
        return EngineStats(plans.built, plans.reused, self._steady_cycles, self._steady_fallbacks,
                           self._assisted_cycles, self._dispatch.lone_runs)

    def submit(self, requests: "list[Request]") -> None:
        """Queue requests (all parts of one handle) for the engine thread: all or none."""
        self.queue.submit(requests)

    def submit_allreduce(self, array: Any, name: "str | None", op: ReduceOp, in_place: bool, prescale: float,
                         postscale: float, op_class: "type[AllreduceOp] | None" = None,
                         signature: "Signature | None" = None) -> AllreduceOp:
        """Submit one all-reduce (arguments already checked) as one object, its request and its
        handle (``requests.AllreduceOp``, or ``op_class``): the per-tensor path of a training step.
        ``signature``: the op's signature from an earlier submit of the same host array."""
        request = (op_class or AllreduceOp)(self.done_cv, name or self.queue.auto_name(), array, op, in_place,
                                            prescale, postscale, signature)
        self.queue.submit_one(request)
        return request

    def submit_join(self) -> Handle:
        """This rank has no more data: it stands in for the other ranks' ops (``join.py``) until
        every rank has joined. The handle's result is the job rank that joined last."""
        handle = Handle(1, False, self.done_cv)
        self.queue.offer_join(handle)
        return handle

    def shutdown(self, timeout: float = 30.0) -> None:
        """Stop the engine: in-flight ops fail with ShutdownError on every rank."""
        self.queue.start_closing()
        self._thread.join(timeout)
        if self._thread.is_alive():
            sys.stderr.write("mtrain: the engine did not stop within "
                             f"{timeout:g}s (another rank may be frozen); exiting without it\n")
        # Rank 0 waits only briefly for the last events of ranks known to have left.
        self.timelines.close(gone=getattr(self.queue.closed_error, "peers", None) or ())
        if not self._thread.is_alive():
            self._negotiator.close()
            self._control.Free()
            self.timelines.free_link()

    # -- timeline (timeline.py) --------------------------------------------------------
    def start_timeline(self, path: str, mark_cycles: bool) -> None:
        """Record the timeline from now on (every rank; rank 0 writes it to ``path``)."""
        self.timelines.start(path, mark_cycles)

    def stop_timeline(self) -> None:
        self.timelines.stop()

    def record_step(self, index: int, compute_start: float, compute_end: float, end: float, wait_s: float) -> None:
        """One training step on the timeline, if one runs (``Timeline.step``)."""
        self.timelines.step(index, compute_start, compute_end, end, wait_s)

    def departed(self) -> "BaseException | None":
        """Why this engine has stopped (a peer left, it failed, or it was shut down), else None: for
        the runtime's calls that wait outside the engine thread and must not outlive their peers."""
        if self._thread.is_alive():
            return None
        return self.queue.closed()

    def alive(self) -> bool:
        return self._thread.is_alive()

    def running(self) -> bool:
        """Takes ops: its thread runs and nothing has stopped it. An engine that a peer's leaving
        stopped fails its ops before its thread ends, so ``alive()`` alone may still say True."""
        return self.queue.is_open() and self._thread.is_alive()

    # -- autotune (autotune.py) ----------------------------------------------------
    def apply(self, knobs: Knobs) -> None:
        """Run by ``knobs`` from the next cycle on (every rank at the same point of the op stream)."""
        self.config = autotune.config_with(self.config, knobs)
        autotune.use_on_executor(self.executor, knobs)
        self._use_cache(knobs.cache_enabled)

    def _retune(self, tuner: Tuner) -> None:
        """The end of an autotune sample: every rank applies rank 0's decision before its next cycle."""
        decision = autotune.exchange(tuner, self._control, self._rank)
        self.apply(decision.knobs)
        tuner.follow(decision)
        if not decision.active:
            self._dispatch.tuner = None

    def _use_cache(self, enabled: bool) -> None:
        """Turn the response cache on or off. Off forgets every name: ops pending by their bit go to
        the coordinator again, and the steady batches (built from the bits) are dropped."""
        cache = self.cache
        if enabled == cache.enabled:
            return
        if enabled:
            cache.enable(self._cache_capacity)
            return
        cache.disable()
        for request in self.queue.pending.values():
            if request.state is RequestState.CACHED:
                request.uncache()
        self._steady.clear()

    # -- the cycle: in the engine thread, or in a thread that waits (assist) -------------
    def _run(self) -> None:
        dispatch, queue, lock = self._dispatch, self.queue, self._cycle_lock
        try:
            if self._gpu is not None:
                cuda.use_device(self._gpu)
            while True:
                work = queue.wait_for_cycle(self.config.cycle_time_s)
                with lock:
                    if self._stopped:
                        break
                    try:
                        steps = dispatch.steps
                        if steps is not None and steps.due():
                            steps.send()  # outside the queue's lock: submitters never wait for this write
                        # What woke this thread may have been run meanwhile by a thread that waited;
                        # a tick runs whatever it finds (the other ranks' cycles need this one's).
                        if work and not queue.has_work():
                            continue
                        if not self._turn():
                            break
                    except BaseException as exc:  # a bug or an MPI failure: fail loudly, never hang the user
                        self._fail(exc)  # (under the lock: no waiting thread runs a cycle of a failed engine)
                        break
        except BaseException as exc:  # before the first cycle (binding the GPU)
            self._fail(exc)
        finally:
            if dispatch.steps is not None:
                with lock:
                    dispatch.end_step()  # the last step, which no idle moment followed
                    dispatch.steps.send()

    def assist(self, handle: Handle) -> None:
        """A thread is about to block on ``handle`` (``Handle.wait``): if the engine thread is
        between cycles and the work at hand is small, run up to ASSIST_CYCLES cycles here
        instead, until the handle is done. A lone op then costs no thread switch to the engine
        and none back (two wake-ups of the other thread, each costing about as much as a small op). The cycle
        is the same code, under the same lock, so every guarantee holds; what the thread cannot
        finish here (the other ranks have not submitted yet, more work came) it waits for as
        before. Large work is left to the engine thread: a Ctrl-C that lands in the middle of
        a cycle run here stops this rank's engine (its ops fail; the KeyboardInterrupt goes on),
        and small work keeps that window to microseconds."""
        lock = self._cycle_lock
        if not lock.acquire(False):
            return  # the engine thread (or another waiting thread) is in a cycle: wait for it
        dispatch = self._dispatch
        try:
            if self._stopped:
                return
            dispatch.assisted = True
            for _ in range(ASSIST_CYCLES):
                if handle.done():
                    return
                taken = self.queue.take_small(ASSIST_MAX_OPS, ASSIST_MAX_BYTES)
                if taken is None:
                    return
                self._assisted_cycles += 1
                if not self._turn(taken):
                    return
        except BaseException as exc:
            self._fail(exc)
            if not isinstance(exc, Exception):
                raise  # KeyboardInterrupt, SystemExit: the program's own, after the engine stopped
        finally:
            dispatch.assisted = False
            lock.release()

    def _fail(self, exc: BaseException) -> None:
        """A cycle raised (a bug, an MPI failure, or an interrupt in a waiting thread's cycle):
        this rank's engine stops, and every op not ended fails, naming why."""
        if not isinstance(exc, KeyboardInterrupt):
            traceback.print_exc()
        self._stopped = True
        self._dispatch.fail_all(EngineError(f"mtrain's background engine failed: {exc!r}"))

    def _turn(self, taken: "Taken | None" = None) -> bool:
        """One cycle (of ``taken``, else of what the queue has now) and what follows it (under the
        cycle lock): an autotune decision that is due, and, if the engine is idle now, the end of
        a step. False: the engine stopped."""
        dispatch = self._dispatch
        closing, incoming = taken if taken is not None else self.queue.take()
        if not self._cycle(closing, incoming):
            self._stopped = True
            dispatch.fail_all(self._shutdown_error)
            return False
        tuner = dispatch.tuner
        if tuner is not None and tuner.due:
            self._retune(tuner)
        self.queue.idle_check(dispatch.step_ended)
        return True

    def _cycle(self, closing: bool, incoming: "list[Request]") -> bool:
        """One negotiation round and what it makes ready. False: the job is shutting down."""
        self._cycles += 1
        queue = self.queue
        if queue.join_handle is not None and not self._join.active:
            self._join.active = True  # from now on this rank stands in for every op
        pending = queue.pending
        if incoming and not closing and not pending and not self._join.active and not self._stall_check_next:
            steady = self._steady.get((incoming[0].name, len(incoming)))
            if steady is not None and steady.matches(incoming, self.cache.version):
                return self._cycle_steady(steady, incoming)
        if incoming:
            queue.admit(incoming)
        cached, unreported = self.cache.mark(pending.values())
        control = Control.UNREPORTED if unreported else Control.NONE
        if closing:
            control |= Control.SHUTDOWN
        if self._stall_check_next:
            control |= Control.STALL_CHECK
            self._stall_check_next = False
        layout = self._negotiator.layout(self.cache.words)
        mine_and, mine_or = self._negotiator.vector(layout, cached, control, leaving=closing, busy=bool(pending),
                                                    joined=self._join.active)
        everywhere, anywhere = self._negotiator.exchange(mine_and, mine_or)
        # A batch that ran whole, all of it submitted since the last cycle, is what the next
        # step will probably submit again: learn it.
        whole = len(pending) == len(incoming) and bool(incoming) and not closing and not self._join.active
        cache_version = self.cache.version
        alive = self._decide(self._negotiator.decode(layout, everywhere, anywhere))
        if alive and whole and not queue.pending and self.cache.version == cache_version:
            self._learn(incoming)
        return alive

    def _learn(self, incoming: "list[Request]") -> None:
        layout = self._negotiator.layout(self.cache.words)
        steady = SteadyBatch.learn(incoming, self.cache.version, self._negotiator, layout)
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
        everywhere, not_anywhere = self._negotiator.exchange_packed(steady.send)
        if not steady.agreed(everywhere, not_anywhere):
            # Another rank lacks some of them, or has more, or news (a shutdown, a join, a new
            # name): these ops are cached pending ops like any other, and the cycle goes on.
            self._steady_fallbacks += 1
            steady.place(incoming)
            self.queue.admit(incoming)
            anywhere = self._negotiator.anywhere(not_anywhere)
            return self._decide(self._negotiator.decode(steady.layout, everywhere, anywhere))
        if self._coordinator is not None:
            self._stall_check_next = self._coordinator.after_round(steady.names, (), time.monotonic())
        ready = list(map(incoming.__getitem__, steady.order))
        dispatch = self._dispatch
        self._steady_cycles += 1
        if len(ready) > 1 or not dispatch.execute_lone(ready[0], self._cycles, steady.ready_names):
            steady.plan = dispatch.keep_plan(steady.plan, ready)
            dispatch.execute(ready, self._cycles, steady.plan, steady.ready_names, incoming[0].submitted,
                             steady.nbytes)
        dispatch.wake_waiters()
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
        ready = self.cache.names_at(agreement.ready)
        partial = self.cache.names_at(agreement.partial)
        responses: list = []
        # A rank that joins completes the ops the others reported but it never will: the
        # coordinator looks again in the cycle every rank sees the join.
        if control & (Control.UNREPORTED | Control.STALL_CHECK) or joined_changed:
            responses = self._coordinate(set(partial) | set(ready), bool(control & Control.STALL_CHECK), joined)
        ready_meta: "dict[str, Any]" = {}
        pending, dispatch = self.queue.pending, self._dispatch
        for response in responses:
            self.cache.apply(response)
            verdict = response.verdict
            if verdict is Verdict.READY:
                ready.append(response.name)
                ready_meta[response.name] = response.meta
            elif response.name not in pending:
                continue
            elif verdict is Verdict.INVALIDATE:
                pending[response.name].uncache()
            else:  # MISMATCH, STALLED or REFUSED: the op ends with that error on every rank
                if verdict is Verdict.STALLED and dispatch.flight is not None:
                    recorder.dump_now("stall shutdown")  # while the op still shows as waiting
                error = verdict.error(response.message, response.meta)
                dispatch.finish(self.queue.pop_pending([response.name])[0], error=error)
        if self._coordinator is not None:
            self._stall_check_next = self._coordinator.after_round(ready, partial, time.monotonic())
        if ready:
            if joined:
                dispatch.execute(self._with_joined(ready, ready_meta, joined), self._cycles)
            else:
                dispatch.execute(self.queue.pop_pending(ready), self._cycles)
        elif len(joined) == self._size and not agreement.busy:
            self._finish_join()
        dispatch.wake_waiters()
        return True

    def _coordinate(self, cached_anywhere: "set[str]", stall_check: bool, joined: "list[int]") -> list:
        reports = []
        pending = self.queue.pending
        for request in pending.values():
            if request.state is RequestState.UNREPORTED:
                handle = request.handle
                group = id(handle) if handle.parts > 1 else 0  # the parts of one grouped op
                reports.append(Report(request.name, request.signature, request.describe(self._members), group))
                request.report()
        gathered = self._control.gather(Gathered(reports, sorted(pending) if stall_check else None), root=0)
        responses = None
        if self._coordinator is not None:
            responses = self._coordinator.decide(gathered, self.cache, cached_anywhere, time.monotonic(),
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
        last = self._join.finish()
        handle = self.queue.take_join()
        # Unnamed ops name themselves by a per-rank counter, which ranks that joined early did not
        # advance; nothing is in flight now, so every rank starts it afresh, together.
        self.queue.restart_names()
        if handle is not None:
            self._dispatch.complete_join(handle, self._members[last])

    def _with_joined(self, ready: "list[str]", ready_meta: "dict[str, Any]", joined: "list[int]") -> "list[Request]":
        """The ready ops as this rank runs them while ``joined`` ranks have joined."""
        own = self.queue.pop_pending(ready, missing_ok=True)
        runnable, refused = join.runnable(ready, own, ready_meta, self.cache.signature_of,
                                          [self._members[r] for r in joined], self.done_cv)
        for request, error in refused:
            self._dispatch.finish(request, error=error)
        return runnable

