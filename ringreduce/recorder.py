"""The flight recorder: each engine's last K collectives, dumped when a job seems stuck.

Per engine (one per process set) a ``FlightRecorder`` keeps, bounded,

* one small tuple per submitted op ``(name, signature, submitted)``, appended by
  ``Engine._enqueue`` to a list (the only per-op cost: a tuple and an append; the
  request itself is not kept, since it holds the user's arrays and results). The engine
  thread trims the list to the last K once a cycle, under the engine's lock, and counts
  what it dropped: an op's sequence number is its place in the list plus that count;
* one tuple per batch the engine ran ``(names, started, ended)``, and the batch running now;
* the ops that failed ``(name, when)``.

An op's state is worked out only when the recorder is dumped: running if the current
batch has it, waiting (for the other ranks) while its name is in flight, done or failed
after that. Besides the ops, each set says whether a user thread is blocked on it now and
how long ago the program last submitted to it or came back from waiting on it, and the dump
says where the main thread is in the program's own code (``records.frame_line``).

A dump is one ``records.RecorderDump`` marker line on stderr, for ``mtrain run``'s
supervisor (launcher/hang_report.py assembles every rank's into one table). It is made by a
daemon thread, woken through a pipe that is also the interpreter's signal wake-up fd: a
SIGUSR1 wakes it even while the main thread is stuck in C code. The handler is installed by
``init()`` under ``mtrain run`` only, from the main thread, and never over a program's own.

MTRAIN_FLIGHT_RECORDER_SIZE (default 256) is K; 0 turns the recorder off.
"""
from __future__ import annotations

import collections
import os
import signal
import sys
import threading
import time
from typing import Any, Callable, Iterable, NamedTuple

from mtrain.launcher.records import (ENV_ERROR_FILE, ENV_FLIGHT_RECORDER_SIZE, DumpRequest, OpRecord, OpState,
                                     RecorderDump, SetRecord, emit_marker, frame_line)

from .collectives import Kind
from .errors import Refusal
from .ops import dtype_from_code

DEFAULT_SIZE = 256


def size_from_environment() -> int:
    """K, the ops kept per process set (0: the recorder is off)."""
    text = os.environ.get(ENV_FLIGHT_RECORDER_SIZE, "").strip()
    try:
        return max(0, int(text)) if text else DEFAULT_SIZE
    except ValueError:
        sys.stderr.write(f"mtrain: {ENV_FLIGHT_RECORDER_SIZE}={text!r} is not a whole number; "
                         f"using {DEFAULT_SIZE} (set it to 0 to turn the flight recorder off)\n")
        return DEFAULT_SIZE


class FlightRecorder:
    """One engine's recent ops (see the module docstring); written by the engine's threads,
    read by the dumper thread, which copies them first."""

    __slots__ = ("size", "ops", "dropped", "batches", "failed", "running")

    def __init__(self, size: int) -> None:
        self.size = size
        self.ops: "list[tuple]" = []  # (name, signature, submitted), appended under the engine's lock
        self.dropped = 0              # ops trimmed from the front of ``ops`` so far
        self.batches: "collections.deque[tuple]" = collections.deque(maxlen=size)
        self.failed: "collections.deque[tuple]" = collections.deque(maxlen=size)
        # (names, started) of the batch the engine thread runs now, else None.
        self.running: "tuple[list[str], float] | None" = None

    def trim(self) -> None:
        """Keep the last ``size`` ops (under the engine's lock; amortized: a slice once per K ops)."""
        ops = self.ops
        if len(ops) > 2 * self.size:
            cut = len(ops) - self.size
            del ops[:cut]
            self.dropped += cut

    def note_failed(self, names: Iterable[str], now: float) -> None:
        self.failed.extend((name, now) for name in names)

    def records(self, ops: "list[tuple]", dropped: int, in_flight: "set[str]", now: float) -> "list[OpRecord]":
        """The last ``size`` of ``ops`` (a copy of ``self.ops`` and ``self.dropped`` taken together),
        oldest first, with their state as of ``now``."""
        batches, failed, running = list(self.batches), list(self.failed), self.running
        first = max(0, len(ops) - self.size)
        numbered = [(dropped + index + 1, *op) for index, op in enumerate(ops[first:], first)]
        ran: "dict[str, list[tuple[float, float]]]" = {}
        for names, started, ended in batches:
            for name in names:
                ran.setdefault(name, []).append((started, ended))
        failures: "dict[str, list[float]]" = {}
        for name, when in failed:
            failures.setdefault(name, []).append(when)
        running_names = set(running[0]) if running is not None else set()
        newer: "set[str]" = set()  # names of ops submitted later: an older op of that name has ended
        out = []
        for seq, name, signature, submitted in reversed(numbered):
            kind, what = _kind_and_what(signature)
            started = ended = -1.0
            spans = [span for span in ran.get(name, ()) if span[1] >= submitted]
            if name not in newer and running is not None and name in running_names and running[1] >= submitted:
                state, started = OpState.RUNNING, running[1]
            elif name not in newer and name in in_flight:
                state = OpState.WAITING
            elif any(when >= submitted for when in failures.get(name, ())):
                state, ended = OpState.FAILED, min(w for w in failures[name] if w >= submitted)
            else:
                state = OpState.DONE
                if spans:
                    started, ended = spans[0]
            newer.add(name)
            out.append(OpRecord(seq, name, kind, what, state, round(now - submitted, 3),
                                round(now - started, 3) if started >= 0 else -1.0,
                                round(now - ended, 3) if ended >= 0 else -1.0))
        out.reverse()
        return out


def _kind_and_what(signature: Any) -> "tuple[str, str]":
    if type(signature) is Refusal:
        return "refused", signature.text
    kind = Kind(signature.kind).name.lower()
    if not signature.shape and kind in ("barrier", "broadcast_object", "allgather_object"):
        return kind, ""
    try:
        dtype = str(dtype_from_code(signature.dtype))
    except (IndexError, TypeError):
        dtype = "?"
    shape = list(signature.shape)
    return kind, f"{dtype}{shape}" if kind not in ("allgather", "alltoall") else f"{dtype}[*, {str(shape)[1:]}"


# A dump shows at most this many ended ops per set (the newest), and this many pending ones (the
# oldest): it travels as one line through mpirun, which may split a very long one.
DUMP_ENDED, DUMP_PENDING = 32, 64


def _shown(ops: "list[OpRecord]") -> "list[OpRecord]":
    pending = [op for op in ops if op.state in (OpState.WAITING, OpState.RUNNING)][:DUMP_PENDING]
    ended = [op for op in ops if op.state not in (OpState.WAITING, OpState.RUNNING)][-DUMP_ENDED:]
    keep = {id(op) for op in pending + ended}
    return [op for op in ops if id(op) in keep]


class SetView(NamedTuple):
    """One process set as the dumper sees it."""

    set_id: int
    members: "list[int]"
    engine: Any  # engine.Engine (not imported: the engine imports this module)


# -- the dumper ---------------------------------------------------------------------------------

_dumper: "Dumper | None" = None


class Dumper:
    """The thread that writes dumps, and the SIGUSR1 handler that wakes it."""

    def __init__(self, rank: int, sets: "Callable[[], list[SetView]]") -> None:
        self.rank, self.sets = rank, sets
        self.host = os.uname().nodename
        self._read, self._write = os.pipe()
        os.set_blocking(self._write, False)  # the signal wake-up fd must never block
        self._previous: Any = None
        self._wakeup_was: "int | None" = None
        self._stopped = False
        self._thread = threading.Thread(target=self._run, name="mtrain-flight-recorder", daemon=True)
        self._thread.start()

    def install_signal(self) -> bool:
        """Dump on SIGUSR1 (main thread only; False: not installed, the program has its own)."""
        if threading.current_thread() is not threading.main_thread():
            return False
        current = signal.getsignal(signal.SIGUSR1)
        if current not in (signal.SIG_DFL, None):
            return False  # the program's own handler (or SIG_IGN): leave SIGUSR1 to it
        self._previous = current
        signal.signal(signal.SIGUSR1, self._on_signal)
        # The wake-up fd lets the dump happen while the main thread is stuck in C code (the
        # Python handler runs only between bytecodes). An event loop may own it already: then the
        # handler alone wakes the dumper.
        try:
            previous_fd = signal.set_wakeup_fd(self._write, warn_on_full_buffer=False)
        except (ValueError, OSError):
            previous_fd = -1
            self._wakeup_was = None
        else:
            if previous_fd != -1:
                signal.set_wakeup_fd(previous_fd)
                self._wakeup_was = None
            else:
                self._wakeup_was = -1
        return True

    def _on_signal(self, number: int, frame: Any) -> None:
        if self._wakeup_was is None:  # no wake-up fd of ours: wake the dumper here
            self._poke(bytes((signal.SIGUSR1,)))

    def _poke(self, byte: bytes) -> None:
        try:
            os.write(self._write, byte)
        except OSError:
            pass  # full: a dump is coming anyway

    def _run(self) -> None:
        while True:
            try:
                data = os.read(self._read, 512)
            except OSError:
                return
            if not data or self._stopped:
                return
            # The wake-up fd carries every signal's number; only SIGUSR1 (or our 0: stop) counts.
            if signal.SIGUSR1 in data:
                self.dump("SIGUSR1")

    def dump(self, reason: str) -> None:
        """Write this rank's dump (any thread); never raises."""
        try:
            emit_marker(self.collect(reason).encode())
        except Exception as error:  # a dump is a diagnosis aid: never let it hurt the job
            sys.stderr.write(f"mtrain: the flight recorder could not dump ({error!r})\n")

    def collect(self, reason: str) -> RecorderDump:
        now = time.monotonic()
        sets = []
        for view in self.sets():
            engine = view.engine
            recorder = engine._flight
            if recorder is None:
                continue
            ops: "list[OpRecord]" = []
            with engine._lock:  # a moment: the list's copy and its count must agree
                kept, dropped, in_flight = list(recorder.ops), recorder.dropped, set(engine._in_flight)
            for _ in range(3):  # a deque copied while the engine thread changed it: try again
                try:
                    ops = recorder.records(kept, dropped, in_flight, now)
                    break
                except RuntimeError:
                    continue
            ops = _shown(ops)
            active = max(engine._last_submit, engine._waited_at)
            sets.append(SetRecord(view.set_id, tuple(view.members), tuple(ops), engine._waiters,
                                  round(now - active, 3) if active > 0 else -1.0))
        frame = sys._current_frames().get(threading.main_thread().ident)
        return RecorderDump(self.rank, self.host, reason, time.time(), tuple(sets),
                            frame_line(frame) if frame is not None else "")

    def stop(self) -> None:
        """Give SIGUSR1 back, end the thread (main thread only for the signal parts)."""
        self._stopped = True
        if threading.current_thread() is threading.main_thread():
            try:
                if self._wakeup_was is not None:
                    current = signal.set_wakeup_fd(-1)
                    if current != self._write:  # not ours any more: leave the new owner's
                        signal.set_wakeup_fd(current)
                if self._previous is not None and signal.getsignal(signal.SIGUSR1) == self._on_signal:
                    signal.signal(signal.SIGUSR1, self._previous)
            except (ValueError, OSError):
                pass
        self._poke(b"\0")


def start(rank: int, sets: "Callable[[], list[SetView]]") -> None:
    """Under ``mtrain run`` (and with the recorder on): dump on SIGUSR1 from now on."""
    global _dumper
    if _dumper is not None or ENV_ERROR_FILE not in os.environ or size_from_environment() == 0:
        return
    dumper = Dumper(rank, sets)
    if not dumper.install_signal():
        dumper.stop()
        return
    _dumper = dumper


def stop() -> None:
    global _dumper
    dumper, _dumper = _dumper, None
    if dumper is not None:
        dumper.stop()


def request_dumps(reason: str) -> None:
    """Ask the supervisor to have every rank dump (a coordinator saw a stall)."""
    if _dumper is not None:
        emit_marker(DumpRequest(reason).encode())


def dump_now(reason: str) -> None:
    """Dump in this thread (the engine's, before it fails ops that stalled); at most once a second."""
    global _last_own_dump
    now = time.monotonic()
    if _dumper is not None and now - _last_own_dump > 1.0:
        _last_own_dump = now
        _dumper.dump(reason)


_last_own_dump = 0.0
