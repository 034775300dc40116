"""The flight recorder: each engine's last K collectives, dumped when a job seems stuck.

Per engine (one per process set) a ``FlightRecorder`` keeps the ops that ended, about the
last K of them: one entry per batch the engine ran ``(names, signatures, started, ended)``
(a steady step's names and signatures are the same lists every step: nothing is done per
op), and one per group of ops that failed. The ops not run yet are not recorded at all:
the engine's own pending requests carry their name, kind, signature and submit time, and a
dump reads them in one snapshot of the engine's submit queue (``SubmitQueue.snapshot``).
So submitting an op costs the recorder nothing.

Besides the ops, each set says whether a user thread is blocked on it now and how long ago
the program last submitted to it or came back from waiting on it, and the dump says where the
main thread is in the program's own code (``records.frames.frame_line``).

A dump is one ``records.flight_recorder.RecorderDump`` marker line on stderr, for ``mtrain run``'s
supervisor (launcher/supervise/hang_report.py assembles every rank's into one table). It is made by a
daemon thread, woken through a pipe that is also the interpreter's signal wake-up fd: a
SIGUSR1 wakes it even while the main thread is stuck in C code. The handler is installed by
``init()`` under ``mtrain run`` only, from the main thread, and never over a program's own.

MTRAIN_FLIGHT_RECORDER_SIZE (settings.FLIGHT_RECORDER_SIZE, default 256) is K; 0 turns the recorder off.
"""
from __future__ import annotations

import collections
import operator
import os
import signal
import sys
import threading
import time
from typing import Any, Callable, Iterable, NamedTuple

from mtrain.common import settings
from mtrain.common.records.error_report import supervised
from mtrain.common.records.flight_recorder import (
    DumpRequest,
    OpRecord,
    OpState,
    RecorderDump,
    SetRecord,
)
from mtrain.common.records.user_frames import frame_line
from mtrain.ringreduce.core.errors import Refusal
from mtrain.ringreduce.core.ops import Kind, dtype_from_code


def size_from_environment() -> int:
    """K, the ops kept per process set (0: the recorder is off); a bad value is the default, said on stderr."""
    refused = settings.FLIGHT_RECORDER_SIZE.refused()
    if refused is not None:
        sys.stderr.write(f"mtrain: {refused}\n")
    return settings.FLIGHT_RECORDER_SIZE.read()


class FlightRecorder:
    """One engine's recent ops (see the module docstring). The engine thread writes it; the
    dumper thread reads it, copying each part first (one C call under the GIL)."""

    __slots__ = ("size", "ended", "kept", "count", "running", "_signatures")

    def __init__(self, size: int) -> None:
        self.size = size
        # (names, signatures, started, ended, failed) per batch run (or op failed), oldest first.
        self.ended: "collections.deque[tuple]" = collections.deque()
        self.kept = 0    # ops in ``ended``: about ``size`` (whole batches are kept or dropped)
        self.count = 0   # ops ended since the engine started: the last one's sequence number
        # (names, signatures, started) of the batch running now, else None.
        self.running: "tuple[list[str], list[Any], float] | None" = None
        # A steady batch's signatures in its run order, by its (kept) list of names.
        self._signatures: "dict[int, tuple[list[str], list[Any]]]" = {}

    def start(self, ready: "list[Any]", names: "list[str]", kept: bool, now: float) -> None:
        """A batch starts: ``ready`` (requests, in run order) named ``names``; ``kept``: ``names``
        is a steady batch's own list, the same object every step (its signatures are looked up
        once, so a steady step costs nothing per op here)."""
        signatures = None
        if kept:
            known = self._signatures.get(id(names))
            if known is not None and known[0] is names:
                signatures = known[1]
        if signatures is None:
            signatures = list(map(_SIGNATURE, ready))
            if kept:
                if len(self._signatures) >= 256:
                    self._signatures.clear()
                self._signatures[id(names)] = (names, signatures)
        self.running = (names, signatures, now)

    def finish(self, now: float) -> None:
        """The running batch has ended."""
        running = self.running
        if running is not None:
            self.running = None
            self._add((running[0], running[1], running[2], now, False))

    def failed(self, requests: "Iterable[Any]", now: float) -> None:
        """Ops that ended with an error (not run)."""
        requests = list(requests)
        if requests:
            self._add(([r.name for r in requests], [r.signature for r in requests], -1.0, now, True))

    def _add(self, entry: tuple) -> None:
        ended = self.ended
        ended.append(entry)
        self.count += len(entry[0])
        self.kept += len(entry[0])
        while self.kept - len(ended[0][0]) >= self.size:
            self.kept -= len(ended.popleft()[0])

    def records(self, pending: "list[Any]", now: float) -> "list[OpRecord]":
        """The last ``size`` ops ended, the running ones, then ``pending`` (the engine's requests
        not yet run, in the order submitted), with their state as of ``now``. Sequence numbers
        count this rank's ops of the set: in the order they ran, then the order submitted."""
        ended, count, running = list(self.ended), self.count, self.running
        out = []
        seq = count - sum(len(entry[0]) for entry in ended)
        for names, signatures, started, finished, failed in ended:
            state = OpState.FAILED if failed else OpState.DONE
            for name, signature in zip(names, signatures):
                seq += 1
                out.append(_op(seq, name, signature, state, -1.0, started, finished, now))
        out = out[-self.size:]
        if running is not None:
            for name, signature in zip(running[0], running[1]):
                seq += 1
                out.append(_op(seq, name, signature, OpState.RUNNING, -1.0, running[2], -1.0, now))
        for request in sorted(pending, key=_SUBMITTED):
            seq += 1
            out.append(_op(seq, request.name, request.signature, OpState.WAITING, request.submitted, -1.0, -1.0,
                           now))
        return out


_SIGNATURE = operator.attrgetter("signature")
_SUBMITTED = operator.attrgetter("submitted")


def _op(seq: int, name: str, signature: Any, state: OpState, submitted: float, started: float, ended: float,
        now: float) -> OpRecord:
    kind, what = _kind_and_what(signature)
    return OpRecord(seq, name, kind, what, state, round(now - submitted, 3) if submitted >= 0 else -1.0,
                    round(now - started, 3) if started >= 0 else -1.0,
                    round(now - ended, 3) if ended >= 0 else -1.0)


# Kinds that carry no array, and kinds whose first dimension may differ per rank.
_SHAPELESS = frozenset((Kind.BARRIER, Kind.BROADCAST_OBJECT, Kind.ALLGATHER_OBJECT))
_FIRST_DIMENSION_FREE = frozenset((Kind.ALLGATHER, Kind.ALLTOALL))
REFUSED = "refused"  # an OpRecord's kind for an op this rank refused (``errors.Refusal``)


def _kind_and_what(signature: Any) -> "tuple[str, str]":
    """An OpRecord's kind (the Kind's name in lower case, or REFUSED) and what the op moves."""
    if type(signature) is Refusal:
        return REFUSED, signature.text
    kind = Kind(signature.kind)
    text = kind.name.lower()
    if not signature.shape and kind in _SHAPELESS:
        return text, ""
    try:
        dtype = str(dtype_from_code(signature.dtype))
    except (IndexError, TypeError):
        dtype = "?"
    shape = list(signature.shape)
    return text, f"{dtype}{shape}" if kind not in _FIRST_DIMENSION_FREE else f"{dtype}[*, {str(shape)[1:]}"


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
    engine: Any  # engine.Engine (not imported: the engine imports this module): its flight_recorder, queue


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
        self._write_free = False  # no signal path writes to ``_write`` any more: it may be closed
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
                os.close(self._read)
                if self._write_free:
                    os.close(self._write)
                return
            # The wake-up fd carries every signal's number; only SIGUSR1 (or our 0: stop) counts.
            if signal.SIGUSR1 in data:
                self.dump("SIGUSR1")

    def dump(self, reason: str) -> None:
        """Write this rank's dump (any thread); never raises."""
        try:
            self.collect(reason).emit()
        except Exception as error:  # a dump is a diagnosis aid: never let it hurt the job
            sys.stderr.write(f"mtrain: the flight recorder could not dump ({error!r})\n")

    def collect(self, reason: str) -> RecorderDump:
        now = time.monotonic()
        sets = []
        for view in self.sets():
            engine = view.engine
            recorder = engine.flight_recorder
            if recorder is None:
                continue
            queue = engine.queue.snapshot()  # the ops not run yet, and who waits: one moment's
            ops = _shown(recorder.records(queue.waiting, now))
            active = queue.last_active
            sets.append(SetRecord(view.set_id, tuple(view.members), tuple(ops), queue.waiters,
                                  round(now - active, 3) if active > 0 else -1.0))
        frame = sys._current_frames().get(threading.main_thread().ident)
        return RecorderDump(self.rank, self.host, reason, time.time(), tuple(sets),
                            frame_line(frame) if frame is not None else "")

    def stop(self) -> None:
        """Give SIGUSR1 back, end the thread (main thread only for the signal parts)."""
        self._stopped = True
        if self._previous is None:  # never installed: nothing writes to the pipe but us
            self._write_free = True
        elif threading.current_thread() is threading.main_thread():
            try:
                if self._wakeup_was is not None:
                    current = signal.set_wakeup_fd(-1)
                    if current != self._write:  # not ours any more: leave the new owner's
                        signal.set_wakeup_fd(current)
                if signal.getsignal(signal.SIGUSR1) == self._on_signal:
                    signal.signal(signal.SIGUSR1, self._previous)
                    self._write_free = True  # neither the handler nor the wake-up fd writes there now
            except (ValueError, OSError):
                pass
        self._poke(b"\0")


def start(rank: int, sets: "Callable[[], list[SetView]]") -> None:
    """Under ``mtrain run`` (and with the recorder on): dump on SIGUSR1 from now on."""
    global _dumper
    if _dumper is not None or not supervised() or size_from_environment() == 0:
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
        DumpRequest(reason).emit()


def dump_now(reason: str) -> None:
    """Dump in this thread (the engine's, before it fails ops that stalled); at most once a second."""
    global _last_own_dump
    now = time.monotonic()
    if _dumper is not None and now - _last_own_dump > 1.0:
        _last_own_dump = now
        _dumper.dump(reason)


_last_own_dump = 0.0
