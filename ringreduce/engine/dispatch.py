"""The dispatcher: runs the ops a cycle made ready, and ends every op (engine thread).

All-reduces run in the rings ``fusion.py`` plans (small tensors packed into one reusable
fusion buffer, large ones reduced in place with no copy), other collectives one by one
(``transport/executor.py``). Then the handles are completed, or failed, and their names freed in
the submit queue (``submit_queue.py``); waiters are woken once per batch.

The dispatcher also keeps what the other instruments need from each batch: the timeline's
spans, the step meter's timings (``observe/steps.py``), the flight recorder's entries
(``observe/recorder.py``), the autotuner's byte counts (``observe/autotune.py``), and the names run since the
engine was last idle, from which the submit queue learns what a step submits.
"""
from __future__ import annotations

import operator
import time
from typing import Any

import numpy as np

from mtrain.common.settings import EngineConfig
from mtrain.ringreduce.core.ops import Adasum, Kind
from mtrain.ringreduce.core.requests import HOST, Completion, Request
from mtrain.ringreduce.engine.fusion import FusionBuffers, Plan, PlanCache, Ring
from mtrain.ringreduce.engine.submit_queue import SubmitQueue
from mtrain.ringreduce.observe.recorder import FlightRecorder
from mtrain.ringreduce.observe.steps import StepMeter
from mtrain.ringreduce.observe.timeline import TimelineSwitch
from mtrain.ringreduce.transport.backend import NumpyBackend
from mtrain.ringreduce.transport.executor import Executor

# The most op names one learned step may hold (``SubmitQueue.wait_for_cycle``'s expectation).
STEP_NAMES_MAX = 1 << 16

_NAME = operator.attrgetter("name")


class Dispatcher:
    """Plans, packs, runs and completes the ready ops of one engine (engine thread only, apart
    from the instruments a user thread may swap: ``timelines``' timeline, ``steps``, ``flight``)."""

    def __init__(self, executor: Executor, config: EngineConfig, queue: SubmitQueue, done_cv: Completion,
                 timelines: TimelineSwitch, steps: "StepMeter | None", flight: "FlightRecorder | None") -> None:
        self.executor = executor
        self.config = config
        self.queue = queue
        self.done_cv = done_cv
        self.timelines = timelines
        self.steps = steps
        self.flight = flight
        self.tuner: Any = None  # autotune.Tuner while tuning
        self.plans = PlanCache()
        self._buffers = FusionBuffers()
        self._finished_any = False
        self._step_names: "list[str]" = []  # run since the engine was last idle
        self._step_waited = False  # whether a thread waited on any of them
        self.assisted = False  # a thread that waits runs this cycle (Engine.assist): it waited too
        # The batch ``execute`` runs now: out of the queue's pending ops already, so an engine that
        # fails in the middle of it fails these too (``fail_all``) instead of leaving them waiting.
        self._running: "list[Request]" = []
        self.lone_runs = 0  # batches ``execute_lone`` ran

    # -- steps -----------------------------------------------------------------------------------
    def step_ended(self) -> "frozenset[str] | None":
        """The engine is idle after a cycle (``SubmitQueue.idle_check``, under its lock). After a
        thread waited for results, what ran since the last such moment was one step: the names of
        its ops (if more than one), and the step meter and timeline record it. Idle without a
        wait may be a pause inside a step: None."""
        if not self._step_waited:
            return None
        names = self._step_names
        self._step_names, self._step_waited = [], False
        if self.steps is not None:
            self.end_step()
        return frozenset(names) if len(names) > 1 else None

    def end_step(self) -> None:
        """The ops since the last step's end were one step: the meter records it, and so does the
        timeline, if one runs."""
        steps = self.steps
        if steps.step_end() and self.timelines.current is not None:
            sample, start = steps.last(), steps.compute_start
            self.timelines.step(sample.step, start, start + sample.compute, sample.end, sample.wait)

    # -- running -----------------------------------------------------------------------------------
    def plan(self, ready: "list[Request]") -> Plan:
        config = self.config
        return self.plans.plan(ready, config.fusion_threshold_bytes, config.inplace_min_bytes)

    def keep_plan(self, plan: "Plan | None", ready: "list[Request]") -> Plan:
        """``plan``, kept with a steady batch, while it fits the fusion settings; else a new one."""
        config = self.config
        return self.plans.keep(plan, ready, config.fusion_threshold_bytes, config.inplace_min_bytes)

    def execute(self, ready: "list[Request]", cycle: int, plan: "Plan | None" = None,
                names: "list[str] | None" = None, first_submit: "float | None" = None,
                nbytes: "int | None" = None) -> None:
        """Run the ready ops (in the agreed order) by ``plan`` (the cached one if not given), in
        cycle number ``cycle``; ``names``: theirs, in that order, if known; ``first_submit``: the
        earliest submit among them, and ``nbytes``: their arrays' bytes, if known."""
        started = time.monotonic()
        timeline = self.timelines.current
        if timeline is not None:
            timeline.negotiated(ready, started, self.timelines.mark_cycles)
        steps = self.steps
        if steps is not None and ready:  # (a joined rank may be left with nothing to run)
            if first_submit is None:
                first_submit = min(request.submitted for request in ready)
            if nbytes is None:
                nbytes = sum(request.nbytes for request in ready)
            steps.batch(first_submit, started, nbytes, cycle)
        if plan is None:
            plan = self.plan(ready)
        kept = names is not None  # a steady batch's own list, the same every step
        if names is None:
            names = list(map(_NAME, ready))
        tuner = self.tuner
        if tuner is not None:
            tuner.note(names, sum(request.nbytes for request in ready) if nbytes is None else nbytes)
        flight = self.flight
        self._start(ready, names, kept, started, flight)
        for index in plan.one_by_one:
            self._run_one(ready[index])
        take = ready.__getitem__
        for ring in plan.rings:
            # The common batch is one ring that packs every op: no list to build.
            batch = ready if ring.packs_all else list(map(take, ring.packed))
            self._run_ring(ring, batch, list(map(take, ring.alone)))
        self._ran(steps, flight)

    def execute_lone(self, request: Request, cycle: int, names: "list[str]") -> bool:
        """``execute`` of a batch of one host all-reduce (a steady batch's ``names``, that op's
        name): the same bookkeeping, with the op reduced in its own memory (or its fresh copy),
        with no plan, no fusion buffer and no copies in and out of one. False, having done
        nothing: not for this path (another kind of op, device memory, Adasum, an empty array,
        or a timeline or the autotuner runs), and ``execute`` runs it."""
        array = request.array
        if (request.kind is not Kind.ALLREDUCE or request.backend is not HOST or request.op is Adasum
                or not array.size or self.tuner is not None or self.timelines.current is not None):
            return False
        started = time.monotonic()
        steps, flight = self.steps, self.flight
        if steps is not None:
            steps.batch(request.submitted, started, array.nbytes, cycle)
        self._start([request], names, True, started, flight)
        out = array if request.in_place else array.copy()
        if out.flags.c_contiguous:
            self.executor.allreduce_flat([out.reshape(-1)], request.op, HOST, request.prescale, request.postscale)
        else:  # a strided in-place array: reduced in a contiguous copy, then copied back
            flat = np.ascontiguousarray(out).reshape(-1)  # (reshape alone may give a strided view)
            self.executor.allreduce_flat([flat], request.op, HOST, request.prescale, request.postscale)
            out[...] = flat.reshape(out.shape)
        self._ran(steps, flight)
        self.queue.done(names)
        request.handle.complete(0, out)
        self._finished_any = True
        self.lone_runs += 1
        return True

    def _start(self, ready: "list[Request]", names: "list[str]", kept: bool, started: float,
               flight: "FlightRecorder | None") -> None:
        """The batch ``execute`` or ``execute_lone`` runs starts: it is running (``fail_all`` fails
        it if the engine breaks now), its names join the step's, a thread waited for it if one waits
        now or runs this cycle, and the flight recorder shows it (``kept``: ``names`` is a steady
        batch's own list)."""
        if len(self._step_names) > STEP_NAMES_MAX:  # nobody ever waits (only polls): no steps to learn
            self._step_names = []
        self._step_names.extend(names)
        if self.queue.waiters or self.assisted:
            self._step_waited = True
        self._running = ready
        if flight is not None:
            flight.start(ready, names, kept, started)

    def _ran(self, steps: "StepMeter | None", flight: "FlightRecorder | None") -> None:
        """The batch ``execute`` or ``execute_lone`` ran has ended: it is no longer running, and
        the step meter and the flight recorder it started with note when."""
        self._running = []
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
        timeline = self.timelines.current  # read once: stop_timeline() may clear it from a user thread
        if timeline is not None:
            timeline.span(request.name, kind.name, begin, time.monotonic(), result)
        self.finish(request, result)

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
        if first.op is Adasum:  # not elementwise: it needs each tensor's bounds in the buffer
            counts = [size for _, size in ring.pieces] if batch else []
            counts += [flat.size for flat in flats[1 if batch else 0:]]
            self.executor.adasum_flat(flats, counts, backend, first.prescale, first.postscale)
        else:
            self.executor.allreduce_flat(flats, first.op, backend, first.prescale, first.postscale)
        t2 = time.monotonic()
        results = ring.unpack(batch, arrays, backend, host) if batch else []
        t3 = time.monotonic()
        for out, flat, was_copied in zip(outs, flats[1 if batch else 0:], copied):
            if was_copied:
                backend.copy(out, flat.reshape(out.shape))
            results.append(out)
        timeline = self.timelines.current  # read once: stop_timeline() may clear it from a user thread
        if timeline is not None:
            timeline.ring(batch, alone, ring.packed_bytes, (t0, t1, t2, t3))
        self._complete_all(batch + alone, results)

    # -- completion --------------------------------------------------------------------------------
    def _complete_all(self, requests: "list[Request]", results: "list[Any]") -> None:
        """``finish`` for many successful ops at once: one lock acquisition for all of them."""
        self.queue.done(list(map(_NAME, requests)))
        for request, result in zip(requests, results):
            request.handle.complete(request.index, result)
        self._finished_any = True

    def finish(self, request: Request, result: Any = None, error: "BaseException | None" = None) -> None:
        """One op ended on this rank, with ``result`` or ``error``."""
        self.queue.end(request)
        if error is not None:
            if self.flight is not None:
                self.flight.failed((request,), time.monotonic())
            request.handle.fail(error)
        else:
            request.handle.complete(request.index, result)
        self._finished_any = True

    def complete_join(self, handle: Any, last: int) -> None:
        """Every rank has joined: the join handle's result is the job rank that joined last."""
        handle.complete(0, last)
        self._finished_any = True

    def wake_waiters(self) -> None:
        """Once per batch: wake the threads waiting on handles, if any op ended and any thread
        waits. A thread counts itself (``SubmitQueue.waiters``) before it looks at its handle under
        the condition's lock, and the handles were completed before this reads the count: a
        thread that is not counted yet will find its handle done without waiting."""
        if self._finished_any:
            self._finished_any = False
            if self.queue.waiters:
                with self.done_cv:
                    self.done_cv.notify_all()

    def fail_all(self, error: BaseException) -> None:
        """The engine stops: every op not ended fails with ``error``, and so does a join."""
        leftovers, join_handle = self.queue.close(error)
        leftovers += [request for request in self._running if not request.handle.done()]
        self._running = []
        if self.flight is not None:
            self.flight.failed(leftovers, time.monotonic())
        for request in leftovers:
            request.handle.fail(error)
        if join_handle is not None:
            join_handle.fail(error)
        with self.done_cv:
            self.done_cv.notify_all()
