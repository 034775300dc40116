"""The background engine: one thread owns every MPI call of the runtime.

User threads submit named ops and get a Handle back at once. Each cycle the
engine thread

1. takes the newly submitted ops,
2. negotiates with the other ranks which ops every rank has submitted
   (``negotiation.py``: a response-cache bit vector in the steady state, a
   coordinator round trip for new names),
3. runs the ready ops in the same order on every rank: all-reduces in the
   rings ``fusion.py`` plans (small tensors packed into one reusable fusion
   buffer, large ones reduced in place with no copy), other collectives one
   by one (``collectives.py``),
4. completes the handles.

Errors are delivered to the handles of every rank (``synchronize`` raises
them; the classes live in ``errors.py``): mismatched submissions, stalls past
MTRAIN_STALL_SHUTDOWN_SECONDS, and shutdown with ops in flight. Nothing waits
forever on a rank that has left.
"""
from __future__ import annotations

import dataclasses
import itertools
import os
import sys
import threading
import time
import traceback
from typing import Any, Sequence

import numpy as np
from mpi4py import MPI

from mtrain.records import FailureCause, report_error

from . import cuda, fusion
from .backend import NumpyBackend, backend_for
from .collectives import Executor, Kind
from .errors import EngineError, InvalidArgumentError, JoinedError, ShutdownError, Verdict
from .negotiation import (CONTROL_SHUTDOWN, CONTROL_STALL_CHECK, CONTROL_UNREPORTED, Coordinator,
                          RequestState, ResponseCache, bits_of, set_bit)
from .ops import ReduceOp, dtype_code, dtype_from_code
from .timeline import Timeline

# Chosen by measurement on the 2-core development VM (benchmarks/fusion.py):
DEFAULT_CYCLE_TIME_MS = 1.0
DEFAULT_FUSION_THRESHOLD_BYTES = 8 << 20
# Tensors at least this big skip the fusion buffer: copying them in and out
# costs more than the per-ring overhead that fusing saves.
DEFAULT_INPLACE_MIN_BYTES = 1 << 20
FUSION_SLOT = "fusion"
# How long the negotiation spins on its all-reduce before it starts to sleep.
SPIN_SECONDS = 300e-6


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


class Handle:
    """The future of one submitted op (or of a group of all-reduces).

    Deliberately light: no Event or Lock per handle (creating those costs more
    than the rest of a submit). Only the engine thread writes a handle; waiters
    sleep on the engine's one completion condition, notified once per batch.
    """

    __slots__ = ("_results", "_remaining", "_grouped", "_error", "_done_cv")

    def __init__(self, parts: int, grouped: bool, done_cv: threading.Condition) -> None:
        self._results: "list[Any]" = [None] * parts
        self._remaining = parts
        self._grouped = grouped
        self._error: "BaseException | None" = None
        self._done_cv = done_cv

    def _complete(self, index: int, result: Any) -> None:
        self._results[index] = result
        self._remaining -= 1

    def _fail(self, error: BaseException) -> None:
        if self._error is None:
            self._error = error

    def done(self) -> bool:
        return self._remaining == 0 or self._error is not None

    def wait(self) -> Any:
        if not self.done():
            with self._done_cv:
                while not self.done():
                    self._done_cv.wait(0.1)  # short waits keep Ctrl-C responsive
        if self._error is not None:
            raise self._error
        return self._results if self._grouped else self._results[0]


@dataclasses.dataclass(eq=False)
class Request:
    kind: Kind
    name: str
    array: np.ndarray
    handle: Handle
    index: int
    backend: NumpyBackend
    op: "ReduceOp | None" = None
    root: int = -1
    splits: "Sequence[int] | None" = None
    in_place: bool = False
    prescale: float = 1.0
    postscale: float = 1.0
    obj: "bytes | None" = None  # a pickled object (the *_object collectives)
    submitted: float = 0.0
    state: RequestState = RequestState.UNREPORTED
    signature: tuple = ()  # what every rank must agree on; set once by make_request
    bit: int = -1  # response-cache bit while state is CACHED

    def meta(self) -> tuple:
        """What every rank must agree on for this name."""
        if self.kind in (Kind.ALLGATHER, Kind.ALLTOALL):
            shape: tuple = tuple(self.array.shape[1:])  # first dimension may differ per rank
        elif self.kind in (Kind.BARRIER, Kind.BROADCAST_OBJECT, Kind.ALLGATHER_OBJECT):
            shape = ()
        else:
            shape = tuple(self.array.shape)
        code = dtype_code(self.array.dtype)
        return (int(self.kind), code, shape, -1 if self.op is None else int(self.op), self.root,
                self.prescale, self.postscale, self.backend.name)

    def describe(self) -> str:
        text = self.kind.name.lower()
        if self.array is not None and self.kind not in (Kind.BARRIER, Kind.BROADCAST_OBJECT,
                                                        Kind.ALLGATHER_OBJECT):
            text += f" {self.array.dtype}{list(self.array.shape)}"
        if self.op is not None:
            text += f" op={ReduceOp(self.op).name}"
        if self.root >= 0:
            text += f" root_rank={self.root}"
        if (self.prescale, self.postscale) != (1.0, 1.0):
            text += f" prescale={self.prescale:g} postscale={self.postscale:g}"
        return text

    @property
    def nbytes(self) -> int:
        return self.array.nbytes


_PLACEHOLDER = np.empty(0, dtype=np.uint8)


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
        self.done_cv = threading.Condition()  # handles wait here; notified after each batch
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
        return f"noname.{next(self._unnamed)}"

    def submit(self, requests: "list[Request]") -> None:
        """Queue requests (all parts of one handle) for the engine thread."""
        now = time.monotonic()
        with self._lock:
            if self._closing or self._closed_error is not None:
                raise self._closed_error or ShutdownError(
                    "mtrain was shut down; call init() again before submitting more ops")
            names = [r.name for r in requests]
            taken = [n for n in names if n in self._in_flight]
            if taken or len(set(names)) != len(names):
                dup = taken[0] if taken else next(n for n in names if names.count(n) > 1)
                raise InvalidArgumentError(f"an op named {dup!r} is already in flight on this rank; synchronize it "
                                 f"before submitting that name again, or give the new op another name")
            for request in requests:
                request.submitted = now
            self._in_flight.update(names)
            # Wake the engine only for the first op of a burst: a notify per op
            # would hand the GIL back and forth on every submit.
            if not self._incoming:
                self._wake.notify()
            self._incoming.extend(requests)

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

    def _take_incoming(self) -> bool:
        """Move submitted ops into the pending table; returns whether we are closing."""
        with self._lock:
            if not self._incoming and not self._closing:
                self._wake.wait(self.config.cycle_time_s)
            incoming, self._incoming = self._incoming, []
            closing = self._closing
        for request in incoming:
            self._pending[request.name] = request
        return closing

    def _cycle(self) -> bool:
        closing = self._take_incoming()
        if self._join_handle is not None and not self._joined:
            self._joined = True  # from now on this rank stands in for every op with zeros
        # The vector: cache bits | control word | "rank r is leaving" | "rank r has ops pending"
        # | "rank r has joined".
        words = self._cache.words
        rank_words = (self._size + 63) // 64
        leaving_at, busy_at, joined_at = words + 1, words + 1 + rank_words, words + 1 + 2 * rank_words
        mine = np.zeros(words + 1 + 3 * rank_words, dtype=np.uint64)
        control = 0
        for request in self._pending.values():
            if request.state is RequestState.UNREPORTED:
                request.bit = self._cache.lookup(request.name, request.signature)
                if request.bit < 0:
                    control |= CONTROL_UNREPORTED
                    continue
                request.state = RequestState.CACHED
            if request.state is RequestState.CACHED:
                set_bit(mine, request.bit)
        if closing:
            control |= CONTROL_SHUTDOWN
        if self._stall_check_next:
            control |= CONTROL_STALL_CHECK
            self._stall_check_next = False
        mine[words] = np.uint64(control)
        if closing:
            set_bit(mine[leaving_at:busy_at], self._rank)
        if self._pending:
            set_bit(mine[busy_at:joined_at], self._rank)
        mine_and = mine
        if self._joined:
            set_bit(mine[joined_at:], self._rank)
            # A joined rank agrees to every cached op (the AND half), yet holds none (the OR half):
            # an op is ready once every rank that has not joined holds it.
            mine_and = mine.copy()
            mine_and[:words] = ~np.uint64(0)
        everywhere, anywhere = self._and_or(mine_and, mine)
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
                reports.append((request.name, request.signature, request.describe()))
                request.state = RequestState.REPORTED
        pending = sorted(self._pending) if stall_check else None
        gathered = self._control.gather((reports, pending), root=0)
        responses = None
        if self._coordinator is not None:
            responses = self._coordinator.decide(gathered, self._cache, cached_anywhere, time.monotonic(),
                                                 frozenset(joined))
        return self._control.bcast(responses, root=0)

    # -- execution ------------------------------------------------------------
    def _execute(self, ready: "list[Request]") -> None:
        start = time.monotonic()
        timeline = self._timeline
        if timeline is not None and self._mark_cycles:
            timeline.mark("CYCLE_START")
        if timeline is not None:
            for request in ready:
                timeline.span(request.name, "NEGOTIATE", request.submitted, start)
        allreduces = [r for r in ready if r.kind is Kind.ALLREDUCE]
        for request in ready:
            if request.kind is not Kind.ALLREDUCE:
                self._run_one(request)
        # One ring reduces one dtype with one op and one scaling, in one kind of memory.
        keys = [(r.array.dtype, r.op, r.prescale, r.postscale, r.backend.name) for r in allreduces]
        for group in fusion.group_by_key(keys):
            self._allreduce_group([allreduces[i] for i in group])

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

    def _allreduce_group(self, group: "list[Request]") -> None:
        """The rings ``fusion.plan_rings`` plans for one group of fusable all-reduces."""
        plans = fusion.plan_rings([r.nbytes for r in group], self.config.fusion_threshold_bytes,
                                  self.config.inplace_min_bytes)
        for plan in plans:
            self._allreduce_together([group[i] for i in plan.packed], plan.packed_bytes,
                                     [group[i] for i in plan.in_place])

    def _allreduce_together(self, batch: "list[Request]", nbytes: int, alone: "list[Request]") -> None:
        """One ring over the fusion buffer (``batch`` packed into it, if any) followed by
        the ``alone`` tensors in their own memory (or fresh copies for out-of-place ops)."""
        first = (batch or alone)[0]
        backend, dtype = first.backend, first.array.dtype
        flats, outs, copied = [], [], []
        t0 = t1 = time.monotonic()
        if batch:
            # The backend's reusable fusion buffer: host memory for host arrays, device
            # memory for device arrays (never fused together: the group key includes the
            # backend). Grown to the threshold once, then reused every step.
            backend.scratch(FUSION_SLOT, self.config.fusion_threshold_bytes, np.dtype(np.uint8))
            fused = backend.scratch(FUSION_SLOT, nbytes // dtype.itemsize, dtype)
            offset = 0
            for request in batch:
                size = request.array.size
                backend.copy(fused[offset:offset + size].reshape(request.array.shape), request.array)
                offset += size
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
        results = []
        offset = 0
        for request in batch:
            size = request.array.size
            piece = flats[0][offset:offset + size].reshape(request.array.shape)
            if request.in_place:
                backend.copy(request.array, piece)
                results.append(request.array)
            else:
                results.append(piece.copy())
            offset += size
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
                timeline.span(request.name, "ALLREDUCE", t1, t2, fused_bytes=nbytes, ring_ops=ring_ops)
                timeline.span(request.name, "MEMCPY_OUT_FUSION_BUFFER", t2, t3)
            for request in alone:
                timeline.span(request.name, "ALLREDUCE", t1, t2, bytes=request.nbytes, ring_ops=ring_ops)
        for request, result in zip(batch + alone, results):
            self._finish(request, result)

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


def make_request(engine: Engine, kind: Kind, array: "np.ndarray | None", name: "str | None", handle: Handle,
                 index: int = 0, **fields: Any) -> Request:
    backend = backend_for(array) if array is not None else backend_for(_PLACEHOLDER)
    request = Request(kind=kind, name=name or engine.auto_name(),
                      array=array if array is not None else _PLACEHOLDER,
                      handle=handle, index=index, backend=backend, **fields)
    request.signature = request.meta()  # validates the dtype here, in the caller's thread
    return request



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
    request = Request(kind=Kind(kind), name=name, array=array, handle=handle, index=0,
                      backend=backend_for(array), op=op, root=root, in_place=True,
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
