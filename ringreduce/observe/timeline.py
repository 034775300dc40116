"""Chrome-trace timeline of every op on every rank (``MTRAIN_TIMELINE=path``, or
``start_timeline(path)`` and ``stop_timeline()`` at run time, called on every rank).

The file is Horovod's (horovod/common/timeline.cc), so tools that read Horovod
timelines read ours; open it in chrome://tracing or ui.perfetto.dev:

- pid 0 opens the file: ``process_name`` with ``start_time_since_epoch_in_micros``
  and ``process_sort_index``; each op name (tensor) is a process of its own, pid
  1, 2, ... in order of first sight, named by a ``process_name`` metadata event
  (``args.name``) with its ``process_sort_index``;
- in it, per run of the op, ``NEGOTIATE_<TYPE>`` (B ... E) from submit to the
  cycle that runs it, with a rank-ready tick (X, dur 0, named by the rank, as
  Horovod's ``NegotiateRankReady``); then ``<TYPE>`` (ALLREDUCE, ALLGATHER,
  BROADCAST, REDUCESCATTER, ALLTOALL, BARRIER; B ... E, the E with ``dtype`` and
  ``shape`` args) around its activities: MEMCPY_IN_FUSION_BUFFER, MPI_ALLREDUCE
  (our ring, shared-memory or hierarchical all-reduce), MEMCPY_OUT_FUSION_BUFFER,
  MPI_ALLGATHER, MPI_BCAST, MPI_REDUCESCATTER, MPI_ALLTOALL;
- ``CYCLE_START`` instant markers (``mark_cycles``; rank 0's cycles, ph i, s g).

Ours beyond Horovod's, under names of our own: Horovod records rank 0 alone;
here every rank's events are in the file, each on the thread (``tid``) of its
rank, named ``rank N`` (rank 0's events are Horovod's own view); pid 0 holds
each rank's ``STEP`` complete events (``Timeline.step``: compute and wait per
training step), and an ``end`` instant closes the file. Rank 0 writes the one
file, events appended as they happen; it is a valid JSON array once ``close()``
runs (viewers, and ``mtrain timeline-summary``, also accept it without the
closing bracket, e.g. after a crash).

How the other ranks' events get there. The launcher does not merge per-rank files:
that would need a shared filesystem or a transport the launcher does not have, and a
program run under plain ``mpirun`` would get no merge. Instead every rank sends its events to rank 0 over MPI, which already connects every
rank to rank 0 on any set of hosts:

- at ``init`` (``TraceLink.measure``, before the engine thread owns MPI) each
  rank measures its monotonic clock against rank 0's, NTP-style: a few ping-pongs,
  offset = ((t1 - t0) + (t2 - t3)) / 2 of the one with the shortest round trip.
  A rank's events are put on rank 0's clock before they leave it.
- a rank other than 0 batches its events and posts each batch with a nonblocking
  send on the link's own communicator (a Dup), at most every ``BATCH_SECONDS`` or
  when ``BATCH_EVENTS`` are waiting, from whichever thread records (the engine's),
  so recording never blocks on rank 0. ``close()`` sends the rest and a "done".
- rank 0 runs a collector thread that receives the batches and writes them, and
  at ``close()`` waits for each sending rank's "done" for at most
  ``DONE_WAIT_SECONDS`` (and not at all for ranks known to have left), so a dead
  or stuck rank costs its own events, never rank 0's file or a hang.

Sending from two threads of a rank (the engine's and the collector or a user
calling ``stop_timeline``) needs MPI_THREAD_MULTIPLE, mpi4py's default; with less,
rank 0 records its own events only.
"""
from __future__ import annotations

import json
import threading
import time
from typing import Any, Iterable, NamedTuple

from mtrain.ringreduce.core.ops import Adasum

# A rank other than 0 posts a batch this often at most, or when this many events wait.
BATCH_SECONDS = 0.1
BATCH_EVENTS = 2000
# How long rank 0's close() waits for the other ranks' last batches, and how long a rank's
# close() waits for its sends to be taken before it gives them up.
DONE_WAIT_SECONDS = 10.0
SEND_WAIT_SECONDS = 5.0
HELLO_WAIT_SECONDS = 1.0
# How long rank 0's close() still waits for ranks known to have left (a rank that called
# shutdown() before the others: its last batch, with its last step, is sent as it leaves).
GONE_WAIT_SECONDS = 2.0
# How often rank 0's collector looks for batches (and flushes the file).
COLLECT_SECONDS = 0.02
PING_ROUNDS = 5
_TAG_PING, _TAG_BATCH = 1, 2
STEP = "STEP"
# An event's op name until rank 0's writer gives the op its pid (pids are the file's, not a rank's).
_TENSOR = "_tensor"
# Horovod's request and response types by our op kinds (message.cc); the object collectives are
# Horovod's broadcast and allgather of a byte tensor (horovod/torch/functions.py).
ADASUM = "ADASUM"  # an all-reduce with op=Adasum: a request type of its own in Horovod
_TYPES = {"BROADCAST_OBJECT": "BROADCAST", "ALLGATHER_OBJECT": "ALLGATHER"}
# Horovod's activity for each type's data movement on the CPU (common.h; mpi_operations.cc).
ACTIVITIES = {"ALLREDUCE": "MPI_ALLREDUCE", "ALLGATHER": "MPI_ALLGATHER", "BROADCAST": "MPI_BCAST",
              "REDUCESCATTER": "MPI_REDUCESCATTER", "ALLTOALL": "MPI_ALLTOALL"}


def op_type(kind_name: str) -> str:
    """Horovod's name for an op kind (``Kind.name``): NEGOTIATE_<it> and the op's top-level span."""
    return _TYPES.get(kind_name, kind_name)


def request_type(request: Any) -> str:
    """Horovod's name for one request's type: an all-reduce with op=Adasum is its own, ADASUM
    (horovod/common/message.cc), the others their kind's (``op_type``)."""
    if request.op is Adasum:
        return ADASUM
    return op_type(request.kind.name)


def _reduction_names(request: Any) -> "tuple[str, str]":
    """An all-reduce's top-level span and its data-movement activity, as Horovod names them."""
    if request.op is Adasum:
        return ADASUM, "MPI_ADASUM_ALLREDUCE"
    return "ALLREDUCE", "MPI_ALLREDUCE"


def _output_args(array: Any) -> "dict[str, str]":
    """Horovod's args on an op's end: the output's dtype and shape ("[2, 3]"); none without an array."""
    dtype, shape = getattr(array, "dtype", None), getattr(array, "shape", None)
    if dtype is None or shape is None:
        return {}
    return {"dtype": str(dtype), "shape": "[" + ", ".join(str(int(d)) for d in shape) + "]"}


class ClockSample(NamedTuple):
    """One ping-pong with rank 0: this rank's send (t0) and receive (t3) times, rank 0's time (t1 = t2)."""

    t0: float
    t1: float
    t3: float

    @property
    def round_trip(self) -> float:
        return self.t3 - self.t0

    @property
    def offset(self) -> float:
        """Rank 0's clock minus this rank's: ((t1 - t0) + (t2 - t3)) / 2 with t2 = t1."""
        return ((self.t1 - self.t0) + (self.t1 - self.t3)) / 2


def best_offset(samples: "Iterable[ClockSample]") -> float:
    """The offset of the sample with the shortest round trip (the least queueing in it)."""
    return min(samples, key=lambda s: s.round_trip).offset


class TraceLink:
    """This rank's line to rank 0 for timelines: a communicator of its own, the clock offset,
    and whether threads may share MPI (MPI_THREAD_MULTIPLE)."""

    def __init__(self, comm: Any, offset: float, multiple: bool) -> None:
        self.comm = comm
        self.rank, self.size = comm.Get_rank(), comm.Get_size()
        self.offset = offset   # add to this rank's time.monotonic() for rank 0's
        self.sends = multiple and self.size > 1  # whether the other ranks' events reach rank 0
        self.started = 0       # timelines started on this rank: batches carry the count
        self._freed = False

    @classmethod
    def measure(cls, parent: Any) -> "TraceLink":
        """Collective over ``parent``: Dup it and measure each rank's clock against rank 0's.
        Rank 0 serves the ranks in turn, ``PING_ROUNDS`` round trips each (microseconds apiece)."""
        from mpi4py import MPI
        comm = parent.Dup()
        rank, size = comm.Get_rank(), comm.Get_size()
        offset = 0.0
        if rank == 0:
            for peer in range(1, size):
                for _ in range(PING_ROUNDS):
                    comm.recv(source=peer, tag=_TAG_PING)
                    comm.send(time.monotonic(), dest=peer, tag=_TAG_PING)
        elif size > 1:
            samples = []
            for _ in range(PING_ROUNDS):
                t0 = time.monotonic()
                comm.send(None, dest=0, tag=_TAG_PING)
                t1 = comm.recv(source=0, tag=_TAG_PING)
                samples.append(ClockSample(t0, t1, time.monotonic()))
            offset = best_offset(samples)
        return cls(comm, offset, MPI.Query_thread() >= MPI.THREAD_MULTIPLE)

    def free(self) -> None:
        if not self._freed:
            self._freed = True
            self.comm.Free()


class _Writer:
    """Rank 0's file: events appended as they come, times made relative to ``origin``, each op
    name given its pid (with Horovod's metadata) and each (pid, rank) its thread name."""

    def __init__(self, path: str, origin: float) -> None:
        self._file = open(path, "w", encoding="utf-8")
        self._file.write("[\n")
        self._origin = origin
        self.dirty = False
        self._pids: "dict[str, int]" = {}
        self._threads: "set[tuple[int, int]]" = set()
        # Horovod's opening lines (TimelineWriter::WriteAtFileStart): the wall clock at ts 0.
        epoch_us = int((time.time() - (time.monotonic() - origin)) * 1e6)
        self._line({"name": "process_name", "ph": "M", "pid": 0,
                    "args": {"start_time_since_epoch_in_micros": epoch_us}})
        self._line({"name": "process_sort_index", "ph": "M", "pid": 0, "args": {"sort_index": 0}})

    def _line(self, event: dict) -> None:
        self._file.write(json.dumps(event) + ",\n")

    @property
    def closed(self) -> bool:
        return self._file.closed

    def write(self, event: dict) -> None:
        """``event``'s "ts" is in seconds on rank 0's monotonic clock (µs in the file); an op's
        event names its op (``_TENSOR``), and gets that op's pid here."""
        tensor = event.pop(_TENSOR, None)
        if tensor is not None:
            pid = self._pids.get(tensor)
            if pid is None:  # Horovod's metadata for a new tensor "process"
                pid = self._pids[tensor] = len(self._pids) + 1
                self._line({"name": "process_name", "ph": "M", "pid": pid, "args": {"name": tensor}})
                self._line({"name": "process_sort_index", "ph": "M", "pid": pid, "args": {"sort_index": pid}})
            event["pid"] = pid
        tid = event.get("tid")
        if tid is not None and (event["pid"], tid) not in self._threads:
            self._threads.add((event["pid"], tid))
            if event.get("name") != "thread_name":
                self._line({"name": "thread_name", "ph": "M", "pid": event["pid"], "tid": tid,
                            "args": {"name": f"rank {tid}"}})
        if "ts" in event:
            event["ts"] = round((event["ts"] - self._origin) * 1e6, 1)
        self._line(event)
        self.dirty = True

    def flush(self) -> None:
        if self.dirty and not self._file.closed:
            self._file.flush()
            self.dirty = False

    def close(self, last: dict) -> None:
        last["ts"] = round((last["ts"] - self._origin) * 1e6, 1)
        self._file.write(json.dumps(last) + "\n]\n")
        self._file.close()


class Timeline:
    """The timeline on one rank. Rank 0 (or no link) writes ``path``; another rank sends its
    events to rank 0 through ``link`` (and ``path`` is ignored there)."""

    def __init__(self, path: str, link: "TraceLink | None" = None) -> None:
        self._link = link
        self._rank = link.rank if link is not None else 0
        self._offset = link.offset if link is not None else 0.0
        self._lock = threading.Lock()
        self._closed = False
        self._writer: "_Writer | None" = None
        self._collector: "_Collector | None" = None
        self._outbox: "list[dict]" = []
        self._sends: "list[Any]" = []   # (request, buffer) of batches in flight
        self._next_send = 0.0
        self._session = 0
        if link is not None:
            link.started += 1
            self._session = link.started
        if self._rank == 0:
            self._writer = _Writer(path, time.monotonic())
        elif link is None or not link.sends:
            self._closed = True  # nowhere to send: record nothing
        # This rank's row on pid 0 (its steps); from a rank other than 0, also its first batch,
        # which tells rank 0 that this rank started this timeline (_Collector.finish).
        self._emit({"name": "thread_name", "ph": "M", "pid": 0, "tid": self._rank,
                    "args": {"name": f"rank {self._rank}"}})
        if self._writer is not None and link is not None and link.sends:
            # Started last: from here on its thread writes too (under the lock).
            self._collector = _Collector(link, self._session, self._writer, self._lock)

    @property
    def rank(self) -> int:
        return self._rank

    # -- recording (the engine thread) ---------------------------------------------
    def _emit(self, event: dict) -> None:
        """One event (under the lock, or from __init__); "ts" in this rank's seconds."""
        if self._closed:
            return
        if "ts" in event:
            event["ts"] += self._offset
        if self._writer is not None:
            self._writer.write(event)
            return
        self._outbox.append(event)
        now = time.monotonic()
        if len(self._outbox) >= BATCH_EVENTS or now >= self._next_send:
            self._post(done=False)
            self._next_send = now + BATCH_SECONDS

    def _post(self, done: bool) -> None:
        """Send the outbox to rank 0 (nonblocking); forget the sends rank 0 has taken."""
        from mpi4py import MPI
        link = self._link
        assert link is not None
        if not self._outbox and not done:
            return
        body = json.dumps({"rank": self._rank, "session": self._session, "done": done,
                           "events": self._outbox}).encode()
        self._outbox = []
        buffer = bytearray(body)
        self._sends.append((link.comm.Issend([buffer, MPI.BYTE], dest=0, tag=_TAG_BATCH), buffer))
        self._sends = [(request, held) for request, held in self._sends if not request.Test()]

    def _op_events(self, tensor: str, spans: "list[tuple[str, float, float, dict]]") -> None:
        """Nested spans of op ``tensor`` on this rank's row, as Horovod's B/E pairs: the first is the
        outer one, the others its activities, in order; ``(name, start, end, args)``, the outer
        span's args on its E (Horovod's dtype and shape), an activity's on its B (ours)."""
        with self._lock:
            if self._closed:  # stopped (stop_timeline) while the engine was mid-op
                return
            rank = self._rank
            outer, activities = spans[0], spans[1:]
            self._emit({"ph": "B", "name": outer[0], "ts": outer[1], "tid": rank, _TENSOR: tensor})
            for name, start, end, args in activities:
                begin = {"ph": "B", "name": name, "ts": start, "tid": rank, _TENSOR: tensor}
                if args:
                    begin["args"] = args
                self._emit(begin)
                self._emit({"ph": "E", "ts": max(end, start), "tid": rank, _TENSOR: tensor})
            last = {"ph": "E", "ts": max(outer[2], outer[1]), "tid": rank, _TENSOR: tensor}
            if outer[3]:
                last["args"] = outer[3]
            self._emit(last)

    def span(self, name: str, kind_name: str, start: float, end: float, output: Any = None) -> None:
        """One op ``name`` of kind ``kind_name`` (``Kind.name``) run alone, from ``start`` to ``end``
        (time.monotonic() seconds): Horovod's top-level span with its one data-movement activity
        (none for a barrier); ``output``: the result, for the dtype and shape args."""
        kind = op_type(kind_name)
        spans = [(kind, start, end, _output_args(output))]
        activity = ACTIVITIES.get(kind)
        if activity is not None:
            spans.append((activity, start, end, {}))
        self._op_events(name, spans)

    def step(self, index: int, compute_start: float, compute_end: float, end: float, wait_s: float) -> None:
        """One training step of this rank (time.monotonic() seconds): computing from
        ``compute_start`` to ``compute_end``, done at ``end``, of which ``wait_s`` waiting for
        the collectives. One complete event (ours: pid 0, this rank's tid); ``mtrain timeline-summary`` reads them."""
        with self._lock:
            if self._closed:
                return
            self._emit({"name": STEP, "ph": "X", "pid": 0, "tid": self._rank,
                        "ts": compute_start, "dur": round(max(end - compute_start, 0.0) * 1e6, 1),
                        "args": {"step": int(index), "compute_s": round(max(compute_end - compute_start, 0.0), 6),
                                 "wait_s": round(max(float(wait_s), 0.0), 6)}})

    def negotiated(self, requests: "list", start: float, mark_cycle: bool) -> None:
        """Each op's NEGOTIATE_<TYPE> span, from its submit to ``start`` (a cycle's execution), with
        this rank's ready tick at the submit (Horovod's NegotiateStart/RankReady/End)."""
        if mark_cycle:
            self.mark("CYCLE_START")
        label = str(self._rank)
        with self._lock:
            if self._closed:
                return
            rank = self._rank
            for request in requests:
                name, submitted = request.name, request.submitted
                self._emit({"ph": "B", "name": "NEGOTIATE_" + request_type(request), "ts": submitted,
                            "tid": rank, _TENSOR: name})
                self._emit({"ph": "X", "name": label, "ts": submitted, "dur": 0, "tid": rank, _TENSOR: name})
                self._emit({"ph": "E", "ts": max(start, submitted), "tid": rank, _TENSOR: name})

    def ring(self, packed: "list", alone: "list", packed_bytes: int, times: "tuple[float, float, float, float]") -> None:
        """One all-reduce's phases: packing (t0-t1), the reduction (t1-t2), unpacking (t2-t3): for
        a packed op MEMCPY_IN_FUSION_BUFFER, MPI_ALLREDUCE, MEMCPY_OUT_FUSION_BUFFER inside its
        ALLREDUCE; for one reduced in its own memory, MPI_ALLREDUCE alone."""
        t0, t1, t2, t3 = times
        ring_ops = len(packed) + len(alone)
        for request in packed:
            top, activity = _reduction_names(request)
            self._op_events(request.name, [
                (top, t0, t3, _output_args(request.array)),
                ("MEMCPY_IN_FUSION_BUFFER", t0, t1, {}),
                (activity, t1, t2, {"fused_bytes": packed_bytes, "ring_ops": ring_ops}),
                ("MEMCPY_OUT_FUSION_BUFFER", t2, t3, {})])
        for request in alone:
            top, activity = _reduction_names(request)
            self._op_events(request.name, [
                (top, t0, t3, _output_args(request.array)),
                (activity, t1, t2, {"bytes": request.nbytes, "ring_ops": ring_ops})])

    def mark(self, label: str) -> None:
        """Horovod's cycle marker (``mark_cycles``): an instant across the whole file, rank 0's cycles
        only, as Horovod's coordinator marks its own."""
        if self._rank != 0:
            return
        with self._lock:
            self._emit({"name": label, "ph": "i", "ts": time.monotonic(), "s": "g"})

    # -- ending (a user thread, or the engine's shutdown) ------------------------------
    def close(self, gone: "Iterable[int]" = ()) -> None:
        """End the timeline. Rank 0: wait (bounded) for the other ranks' last events, shorter for
        ``gone`` (ranks known to have left), then end the file. Others: send the rest."""
        with self._lock:
            if self._closed:
                return
            if self._writer is None:
                self._post(done=True)
                self._closed = True
                sends = self._sends
            else:
                sends = []
        if sends:
            _wait_sends(sends, SEND_WAIT_SECONDS)
            return
        if self._writer is None:
            return
        collector = self._collector
        if collector is not None:
            collector.finish(set(gone), DONE_WAIT_SECONDS)
        with self._lock:
            self._closed = True
            self._writer.close({"name": "end", "ph": "i", "pid": 0, "tid": 0, "ts": time.monotonic(), "s": "g"})


def _wait_sends(sends: "list[Any]", seconds: float) -> None:
    """Wait for rank 0 to take this rank's last batches, for ``seconds`` at most; then give
    them up (rank 0 has stopped collecting or left: its file ends without them)."""
    deadline = time.monotonic() + seconds
    pause = 1e-4
    while sends:
        sends = [(request, held) for request, held in sends if not request.Test()]
        if not sends:
            return
        if time.monotonic() > deadline:
            for request, _ in sends:
                try:
                    request.Cancel()
                    request.Free()
                except Exception:  # noqa: BLE001 - an MPI that cannot cancel: leave the request be
                    pass
            return
        time.sleep(pause)
        pause = min(pause * 2, 0.01)


class _Collector:
    """Rank 0's thread that receives the other ranks' batches and writes them to the file."""

    def __init__(self, link: TraceLink, session: int, writer: _Writer, lock: threading.Lock) -> None:
        self._link, self._session, self._writer, self._lock = link, session, writer, lock
        self.heard: "set[int]" = set()   # ranks that sent a batch of this timeline
        self.done: "set[int]" = set()    # ranks that sent their last
        self._stop = threading.Event()
        self._changed = threading.Condition()
        self._thread = threading.Thread(target=self._run, name="mtrain-timeline", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        from mpi4py import MPI
        comm = self._link.comm
        status = MPI.Status()
        while True:
            got = False
            while comm.Iprobe(source=MPI.ANY_SOURCE, tag=_TAG_BATCH, status=status):
                got = True
                buffer = bytearray(status.Get_count(MPI.BYTE))
                comm.Recv([buffer, MPI.BYTE], source=status.Get_source(), tag=_TAG_BATCH)
                self._take(buffer)
            with self._lock:
                self._writer.flush()
            if self._stop.is_set() and not got:
                return
            self._stop.wait(COLLECT_SECONDS)

    def _take(self, buffer: bytearray) -> None:
        try:
            batch = json.loads(buffer)
        except ValueError:
            return
        if batch.get("session") != self._session:  # a batch of an earlier timeline, late
            return
        rank = int(batch["rank"])
        with self._lock:
            if not self._writer.closed:
                for event in batch["events"]:
                    self._writer.write(event)
        with self._changed:
            self.heard.add(rank)
            if batch.get("done"):
                self.done.add(rank)
            self._changed.notify_all()

    def finish(self, gone: "set[int]", seconds: float) -> None:
        """Wait until every other rank has sent its last batch (``seconds`` at most: a rank that
        stopped its timeline late or not at all loses its tail; ``GONE_WAIT_SECONDS`` for a rank
        in ``gone``, known to have left), then stop."""
        expected = set(range(1, self._link.size))
        start = time.monotonic()
        deadline = start + seconds
        with self._changed:
            while not expected <= self.done:
                now = time.monotonic()
                if gone and now > start + GONE_WAIT_SECONDS:
                    # A rank that left cleanly sent its last batch as it left: it is here by now,
                    # or the rank died without one.
                    expected -= gone
                    if expected <= self.done:
                        break
                if now > start + HELLO_WAIT_SECONDS:
                    # A rank never heard from did not start this timeline (start_timeline on
                    # rank 0 alone): nothing to wait for. A rank that did has said so by now,
                    # its first batch being posted when its timeline starts.
                    expected &= self.heard
                    if expected <= self.done:
                        break
                if now >= deadline or not self._thread.is_alive():
                    break
                self._changed.wait(min(deadline - now, 0.05))
        self._stop.set()
        self._thread.join(timeout=5.0)


class TimelineSwitch:
    """An engine's timeline, if one runs: started and stopped at run time by a user thread,
    read by the engine thread (``current``, read once per use: a stop may clear it meanwhile;
    a closed timeline ignores late events). Every rank records; rank 0 writes, the others send
    theirs there through ``link``."""

    def __init__(self, rank: int, link: "TraceLink | None", path: "str | None", mark_cycles: bool) -> None:
        self._rank, self._link = rank, link
        self.mark_cycles = mark_cycles
        self.current: "Timeline | None" = self._new(path) if path else None

    def _new(self, path: str) -> "Timeline | None":
        if self._link is not None:
            return Timeline(path, self._link)
        return Timeline(path) if self._rank == 0 else None  # an engine made without a link

    def start(self, path: str, mark_cycles: bool) -> None:
        """Record the timeline from now on (every rank; rank 0 writes it to ``path``)."""
        old, self.current = self.current, self._new(path)
        self.mark_cycles = mark_cycles
        if old is not None:
            old.close()

    def stop(self) -> None:
        old, self.current = self.current, None
        if old is not None:
            old.close()

    def step(self, index: int, compute_start: float, compute_end: float, end: float, wait_s: float) -> None:
        """One training step on the timeline, if one runs (``Timeline.step``)."""
        timeline = self.current
        if timeline is not None:
            timeline.step(index, compute_start, compute_end, end, wait_s)

    def close(self, gone: "Iterable[int]" = ()) -> None:
        """The engine ends: close the timeline (it stays set, for late events to be
        ignored) and free the link once the engine thread has ended (``free_link``)."""
        timeline = self.current
        if timeline is not None:
            timeline.close(gone=gone)

    def free_link(self) -> None:
        if self._link is not None:
            self._link.free()
