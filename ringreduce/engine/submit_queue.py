"""The submit queue: everything of an engine that the user's threads touch.

User threads submit named ops here and wait on their handles; the engine thread waits until a
burst of submissions is over (``SubmitQueue.wait_for_cycle``), then the cycle takes what was
submitted (``take``), keeps the ops it has not run yet (``pending``), and says which have ended
(``done``, ``end``, ``close``). Every change happens under the queue's one lock, so ``snapshot``
(the flight recorder's view of the ops not run yet, and of who waits) is consistent without
retries. Whoever runs a cycle (the engine thread, or a waiting thread: ``Engine.assist``) holds
the engine's cycle lock, and reads ``pending`` without the queue's: only a cycle changes it.

Names are in flight from submit until their op ended on this rank. A name in flight as a
refusal (``errors.Refusal``: this rank refused the op's arguments, and the name goes through
the negotiation anyway) holds the ops submitted under that name since, in order, each held back
until the one before has ended on every rank (refusals, then at most one op that runs). A retry
right after an argument error is no "already in flight" error, and meets the other ranks' retries.
"""
from __future__ import annotations

import itertools
import threading
import time
from typing import Any, Callable, NamedTuple

from mtrain.ringreduce.core.errors import InvalidArgumentError, Refusal, ShutdownError
from mtrain.ringreduce.core.requests import UNNAMED_PREFIX, Handle, Request

# A burst of submissions is over (the engine starts its cycle) once none came for this
# long, or after HOLD_CYCLES cycle times in all (SubmitQueue.wait_for_cycle). A burst that repeats the
# last batch but lacks part of it: once none came for a cycle time, or after
# EXPECT_HOLD_CYCLES cycle times in all.
QUIET_SECONDS = 200e-6
HOLD_CYCLES = 10
EXPECT_HOLD_CYCLES = 100


class QueueSnapshot(NamedTuple):
    """The queue as of one moment (taken under its lock), for the flight recorder."""

    waiting: "list[Any]"   # the requests not run yet: pending ones, then those not taken yet
    waiters: int           # threads blocked on a handle of this engine now
    last_active: float     # when the program last submitted or came back from a wait (0: never)


class Taken(NamedTuple):
    """What the engine thread takes at the start of a cycle."""

    closing: bool
    incoming: "list[Request]"


class SubmitQueue:
    """The user-thread side of one engine (see the module docstring)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self._wake = threading.Condition(self.lock)
        self.waiters = 0  # threads blocked on a handle of this engine
        self._first_submit = self._last_submit = 0.0  # of the ops in _incoming
        self._waited_at = 0.0  # when a user thread last stopped blocking on a handle
        # The names of the last step's ops (set by the engine thread when it learns a step), and
        # how many of them the current burst of submissions still lacks when it began with one
        # of them (0: it did not; -1: it has them all).
        self._last_batch: "frozenset[str]" = frozenset()
        self._expect_left = 0
        self._incoming: "list[Request]" = []
        self._in_flight: "set[str]" = set()
        self._refusals: "dict[str, list[Request]]" = {}
        self.closing = False
        self.closed_error: "BaseException | None" = None
        # This rank's join() handle while a join is in progress (join.py).
        self.join_handle: "Handle | None" = None
        # The ops negotiated but not run yet, by name (engine thread; changed under the lock).
        self.pending: "dict[str, Request]" = {}
        # One counter for every kind of unnamed op: a rank calling a different
        # collective than the others then collides on the same name and gets a
        # mismatch error naming both calls, instead of a stall.
        self._unnamed = itertools.count()

    # -- user threads ----------------------------------------------------------------------
    def auto_name(self) -> str:
        return f"{UNNAMED_PREFIX}{next(self._unnamed)}"

    def restart_names(self) -> None:
        """Number unnamed ops from 0 again (every rank together, with nothing in flight)."""
        self._unnamed = itertools.count()

    def closed(self) -> BaseException:
        """What a submit to a closed engine raises."""
        return self.closed_error or ShutdownError("mtrain was shut down; call init() again before submitting more ops")

    def submit(self, requests: "list[Request]") -> None:
        """Queue requests (all parts of one handle) for the engine thread: all or none."""
        now = time.monotonic()
        with self.lock:
            if self.closing or self.closed_error is not None:
                raise self.closed()
            if len(requests) > 1:
                names = [r.name for r in requests]
                taken = [n for n in names if n in self._in_flight and not self._may_hold(n)]
                if taken or len(set(names)) != len(names):
                    raise _already_in_flight(taken[0] if taken else next(n for n in names if names.count(n) > 1))
            for request in requests:
                if type(request.signature) is Refusal and request.name not in self._in_flight:
                    self._refusals[request.name] = []
                self._enqueue(request, now)

    def submit_one(self, request: Any) -> None:
        """Queue one all-reduce (``requests.AllreduceOp``): the per-tensor path of a training step."""
        now = time.monotonic()
        lock = self.lock
        lock.acquire()  # acquire/release rather than ``with``: half the cost, once per tensor
        try:
            if self.closing or self.closed_error is not None:  # checked inline: once per tensor
                raise self.closed()
            self._enqueue(request, now)
        finally:
            lock.release()

    def _enqueue(self, request: Any, now: float) -> None:
        """The one submit core (under the lock): queue one request of a new name."""
        name = request.name
        in_flight = self._in_flight
        if name in in_flight:
            if self._may_hold(name):
                request.submitted = now
                self._refusals[name].append(request)  # queued by ``end`` once the refusal has ended
                return
            raise _already_in_flight(name)
        if not self._incoming:
            self._first_submit = now
            # A burst that begins with an op of the last batch is probably that batch
            # again: the engine holds on until all of it is here (``wait_for_cycle``).
            self._expect_left = len(self._last_batch) if name in self._last_batch else 0
            # No wake-up here: the engine thread finds the burst at its next tick (as Horovod's
            # background loop does, once per cycle time), or at once when a thread waits on a
            # handle and cannot run the cycle itself (``note_waiter``; ``Engine.assist``). A
            # wake per burst cost a lone op two switches of the GIL to a thread with nothing to do.
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
        """Whether an op under ``name``, which is in flight, can wait behind it (under the lock):
        when what is in flight, and whatever waits already, are refusals."""
        held = self._refusals.get(name)
        return held is not None and (not held or type(held[-1].signature) is Refusal)

    def note_waiter(self, delta: int) -> None:
        """A user thread starts (+1) or stops (-1) blocking on one of this engine's handles."""
        with self.lock:
            self.waiters += delta
            if delta > 0:
                self._wake.notify()
            else:
                self._waited_at = time.monotonic()

    def offer_join(self, handle: Handle) -> None:
        """This rank's join() (``Engine.submit_join``)."""
        with self.lock:
            if self.closing or self.closed_error is not None:
                raise self.closed_error or ShutdownError("mtrain was shut down; call init() again before join()")
            if self.join_handle is not None:
                raise InvalidArgumentError("join() is already in progress on this rank")
            self.join_handle = handle
            self._wake.notify()

    def take_join(self) -> "Handle | None":
        """The join handle, which the join's end completes (engine thread)."""
        with self.lock:
            handle, self.join_handle = self.join_handle, None
        return handle

    def start_closing(self) -> None:
        with self.lock:
            self.closing = True
            self._wake.notify()

    def is_open(self) -> bool:
        with self.lock:
            return not (self.closing or self.closed_error is not None)

    def snapshot(self) -> QueueSnapshot:
        """The ops not run yet and who waits, all as of one moment (any thread)."""
        with self.lock:
            return QueueSnapshot(list(self.pending.values()) + self._incoming, self.waiters,
                                 max(self._last_submit, self._waited_at))

    # -- whoever runs the engine's cycle (its thread, or a thread that waits: Engine.assist) --
    def take(self) -> Taken:
        """The ops submitted since the last cycle, now, and whether we are closing."""
        with self.lock:
            return self._take()

    def _take(self) -> Taken:
        incoming, self._incoming = self._incoming, []
        self._expect_left = 0
        return Taken(self.closing, incoming)

    def _has_work(self) -> bool:
        return bool(self._incoming or self.pending or self.join_handle is not None or self.closing)

    def idle_check(self, idle: "Callable[[], frozenset[str] | None]") -> None:
        """After a cycle: if nothing is pending or submitted, call ``idle`` (under the lock); it
        returns the names of the step that has just ended, if one did (a burst that begins
        with one of them is held until all are here), else None."""
        with self.lock:
            if not self.pending and not self._incoming:
                batch = idle()
                if batch is not None:
                    self._last_batch = batch

    def has_work(self) -> bool:
        """Whether a cycle has anything to do beyond a tick: ops submitted or pending, a join, closing."""
        with self.lock:
            return self._has_work()

    def take_small(self, max_ops: int, max_bytes: int) -> "Taken | None":
        """``take``, if the work a cycle would have now is small: ops submitted or pending, at most
        ``max_ops`` of them holding at most ``max_bytes``, and no join or closing; else None
        (``Engine.assist``)."""
        with self.lock:
            incoming, pending = self._incoming, self.pending
            ops = len(incoming) + len(pending)
            if not ops or ops > max_ops or self.join_handle is not None or self.closing:
                return None
            total = 0
            for request in incoming:
                total += request.nbytes
            for request in pending.values():
                total += request.nbytes
            return None if total > max_bytes else self._take()

    # -- the engine thread ------------------------------------------------------------------
    def wait_for_cycle(self, cycle_s: float) -> bool:
        """Wait until the next cycle should start (the engine thread). True: for a reason that
        was work (ops, a join, closing); False: for the tick alone.

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
        and the other ranks' cycles need this one's); a submit does not wake this wait,
        so a burst is found at the next tick, unless a thread waits on a handle first."""
        with self.lock:
            self._hold(cycle_s)
            return self._has_work()

    def _hold(self, cycle: float) -> None:
        quiet = min(cycle, QUIET_SECONDS)
        tick = None
        while not self.closing:
            if self.waiters and (self._incoming or self.pending or self.join_handle is not None):
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

    def admit(self, requests: "list[Request]") -> None:
        """These taken ops are pending now (negotiated until every rank has them)."""
        with self.lock:
            pending = self.pending
            for request in requests:
                pending[request.name] = request

    def pop_pending(self, names: "list[str]", missing_ok: bool = False) -> "list[Request | None]":
        """Take the pending ops of ``names`` out (they run or fail now); with ``missing_ok``, None
        for a name this rank lacks (it has joined)."""
        with self.lock:
            pop = self.pending.pop
            return [pop(name, None) for name in names] if missing_ok else [pop(name) for name in names]

    def done(self, names: "list[str]") -> None:
        """These ops (none a refusal) ended on this rank: their names are free again."""
        with self.lock:
            self._in_flight.difference_update(names)

    def end(self, request: Request) -> None:
        """One op ended on this rank: its name is free again, or, behind a refusal, the next op
        submitted under it is taken in."""
        with self.lock:
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

    def close(self, error: BaseException) -> "tuple[list[Request], Handle | None]":
        """The engine stops with ``error``: every op not ended (pending, not taken yet, held behind
        a refusal) and the join handle, for the caller to fail; later submits raise."""
        with self.lock:
            if not isinstance(error, ShutdownError):
                self.closed_error = error
            elif error.peers:  # other ranks left: later ops must say who, not just "shut down"
                self.closed_error = ShutdownError(
                    f"rank(s) {error.peers} left the job (shutdown() or process exit); no collective "
                    "can run without them", peers=error.peers)
            else:
                self.closed_error = None
            self.closing = True
            self._wake.notify()  # an engine thread waiting for its next cycle stops now
            leftovers = list(self.pending.values()) + self._incoming
            leftovers += [request for held in self._refusals.values() for request in held]
            self._refusals.clear()
            join_handle, self.join_handle = self.join_handle, None
            self._incoming = []
            self._in_flight.clear()
            self.pending.clear()
        return leftovers, join_handle


def _already_in_flight(name: str) -> InvalidArgumentError:
    return InvalidArgumentError(f"an op named {name!r} is already in flight on this rank; synchronize it "
                                f"before submitting that name again, or give the new op another name")
