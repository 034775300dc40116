"""Where a job is stuck: every rank's flight recorder, assembled into one table and a diagnosis.

Each rank's runtime keeps its last collectives (ringreduce/observe/recorder.py) and dumps them as a
``records.flight_recorder.RecorderDump`` when it gets SIGUSR1. The supervisor opens a *collection*
(``Collector``) when `mtrain run` gets SIGUSR1, when a coordinator warns of a stall or gives
up on one (``records.flight_recorder.DumpRequest``), when a rank dumps on its own, and when a rank fails; it
sends SIGUSR1 to mpirun (which forwards it to every rank) and waits until every live rank has
answered, or COLLECT_SECONDS. Then ``report`` turns the dumps into lines like

    mtrain: flight recorder (stall warning): where each rank is
        rank 0 (mtr-a): waits in allreduce 'grad' (seq 7) for 3.1 s
        rank 3 (mtr-b): in user code for 3.4 s at train.py:17 in main (last op: allgather 'metrics', seq 6)
    mtrain: diagnosis: ranks 0-2 wait in allreduce 'grad' (seq 7); rank 3 has not submitted it and has
        been in user code for 3.4 s at train.py:17 in main (last op: allgather 'metrics', seq 6)

Pure functions of the dumps (``report``), so that the diagnosis is tested without MPI.
Standard library only, like everything the launcher imports.
"""
from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path
from typing import Callable, NamedTuple, Sequence

from mtrain.common.records.flight_recorder import OpRecord, OpState, RecorderDump

COLLECT_SECONDS = 3.0       # how long a collection waits for the ranks' dumps
FAILURE_QUIET_SECONDS = 10.0  # a failure right after a collection asks for no new one
_PENDING = (OpState.WAITING, OpState.RUNNING)


class HangReport(NamedTuple):
    """What the supervisor prints (``lines``, each 'mtrain: ' or indented) and keeps (``data``)."""

    lines: "list[str]"
    diagnosis: str
    data: dict


def ranks_text(ranks: Sequence[int]) -> str:
    """'rank 3', 'ranks 0-2', 'ranks 0, 2 and 5'."""
    ranks = sorted(ranks)
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    if ranks == list(range(ranks[0], ranks[-1] + 1)) and len(ranks) > 2:
        return f"ranks {ranks[0]}-{ranks[-1]}"
    return f"ranks {', '.join(map(str, ranks[:-1]))} and {ranks[-1]}"


def _op_text(op: OpRecord, set_id: int) -> str:
    where = f" in process set {set_id}" if set_id else ""
    return f"{op.kind} {op.name!r}{where}"


def _seconds(value: float) -> str:
    return f"{value:.0f} s" if value >= 10 else f"{value:.1f} s"


class _Rank(NamedTuple):
    """One rank's whereabouts, from its dump."""

    dump: RecorderDump
    pending: "list[tuple[int, OpRecord]]"   # (set id, op) waiting or running
    blocked: bool                            # a user thread waits in mtrain now
    idle_s: float                            # since its last call into mtrain (-1: unknown)
    last: "tuple[int, OpRecord] | None"      # its last finished op

    def outside(self) -> str:
        """'in user code for 41 s at train.py:17 in main (last op: allgather 'metrics', seq 11)'."""
        text = "in user code"
        if self.idle_s >= 0:
            text += f" for {_seconds(self.idle_s)}"
        if self.dump.user_frame:
            text += f" at {self.dump.user_frame}"
        if self.last is not None:
            set_id, op = self.last
            text += f" (last op: {_op_text(op, set_id)}, seq {op.seq})"
        else:
            text += " (no collective recorded yet)"
        return text


def _whereabouts(dump: RecorderDump) -> _Rank:
    pending, done = [], []
    for record in dump.sets:
        for op in record.ops:
            (pending if op.state in _PENDING else done).append((record.set_id, op))
    idle = [s.idle_s for s in dump.sets if s.idle_s >= 0]
    last = min(done, key=lambda item: item[1].ended_ago if item[1].ended_ago >= 0 else item[1].submitted_ago,
               default=None)
    return _Rank(dump, pending, any(s.blocked for s in dump.sets), min(idle) if idle else -1.0, last)


def _row(rank: _Rank) -> str:
    dump = rank.dump
    head = f"rank {dump.rank} ({dump.host}): "
    if not rank.pending:
        return head + rank.outside()
    ops = ", ".join(f"{op.state.value} in {_op_text(op, set_id)} (seq {op.seq}) for {_seconds(op.submitted_ago)}"
                    for set_id, op in rank.pending)
    if rank.blocked:
        return head + ops
    return head + ops + "; not blocked on it: " + rank.outside()


def report(dumps: Sequence[RecorderDump], size: int, reason: str, gone: Sequence[int] = ()) -> HangReport:
    """The table and the diagnosis for one collection: ``dumps`` from a job of ``size`` ranks,
    ``gone``: ranks known to have ended (not asked)."""
    by_rank = {d.rank: _whereabouts(d) for d in sorted(dumps, key=lambda d: d.rank)}
    silent = [r for r in range(size) if r not in by_rank and r not in gone]
    lines = [f"mtrain: flight recorder ({reason}): where each rank is"]
    for rank in by_rank.values():
        lines.append("    " + _row(rank))
    for r in silent:
        lines.append(f"    rank {r}: no answer")
    for r in sorted(gone):
        if r not in by_rank:
            lines.append(f"    rank {r}: ended")
    diagnosis = diagnose(by_rank, silent, gone)
    lines.append(f"mtrain: diagnosis: {diagnosis}")
    data = {"reason": reason, "time": time.time(), "size": size, "silent": silent, "gone": sorted(gone),
            "diagnosis": diagnosis,
            "dumps": [d.to_json() for d in sorted(dumps, key=lambda d: d.rank)]}
    return HangReport(lines, diagnosis, data)


def diagnose(by_rank: "dict[int, _Rank]", silent: Sequence[int], gone: Sequence[int] = ()) -> str:
    """One paragraph: which op waits for whom, and what the ranks it waits for are doing."""
    # Each pending op, by (set, name): who waits in it, and that set's members.
    waiting: "dict[tuple[int, str], dict[int, OpRecord]]" = {}
    members: "dict[int, tuple]" = {}
    for rank in by_rank.values():
        for record in rank.dump.sets:
            members[record.set_id] = record.members
        for set_id, op in rank.pending:
            waiting.setdefault((set_id, op.name), {})[rank.dump.rank] = op
    def lacking_of(key: "tuple[int, str]") -> "list[int]":
        return [r for r in members.get(key[0], ()) if r not in waiting[key]]

    clauses = []
    explained: "set[tuple[int, str]]" = set()  # ops already told as "waits in ... instead"
    for (set_id, name), ops in sorted(waiting.items(), key=lambda item: min(o.seq for o in item[1].values())):
        everyone = members.get(set_id, ())
        lacking = lacking_of((set_id, name))
        if not lacking or (set_id, name) in explained:
            continue  # every member is in it (running, or about to be decided): nothing waits for anyone
        first = next(iter(ops.values()))
        seqs = sorted({op.seq for op in ops.values()})
        seq = f"seq {seqs[0]}" if len(seqs) == 1 else "seq " + ", ".join(
            f"{op.seq} on rank {r}" for r, op in sorted(ops.items()))
        scope = f"process set {set_id} (ranks {', '.join(map(str, everyone))}): " if set_id else ""
        verb = "waits" if len(ops) == 1 else "wait"
        text = f"{scope}{ranks_text(list(ops))} {verb} in {first.kind} {name!r} ({seq})"
        for r in lacking:
            if r not in by_rank:
                text += f"; rank {r} has not submitted it: " + (
                    "its program has ended" if r in gone else "it did not answer")
                continue
            other = by_rank[r]
            elsewhere, which = [], ""
            for s, op in other.pending:
                elsewhere.append(f"{_op_text(op, s)} (seq {op.seq})")
                key = (s, op.name)
                # Two ranks in two different collectives, each waiting for the other: told once.
                if key not in explained and sorted(lacking_of(key)) == sorted(ops):
                    which = f", which {ranks_text(list(ops))} {'has' if len(ops) == 1 else 'have'} not submitted"
                    explained.add(key)
            if elsewhere and other.blocked:
                text += f"; rank {r} has not submitted it: it waits in {' and '.join(elsewhere)} instead{which}"
            elif elsewhere:
                text += (f"; rank {r} has not submitted it (it has {' and '.join(elsewhere)} pending{which}) and "
                         "has been " + other.outside())
            else:
                text += f"; rank {r} has not submitted it and has been " + other.outside()
        clauses.append(text)
    if not clauses:
        if waiting:
            clauses.append("every rank is inside the same collectives (running, not waiting for a peer): "
                           "a slow link or a long op, not a hang")
        elif by_rank:
            outside = [f"rank {r.dump.rank} {r.outside()}" for r in by_rank.values()]
            clauses.append("no rank waits in a collective: " + "; ".join(outside))
        else:
            clauses.append("no rank answered")
    for r in silent:
        clauses.append(f"rank {r} did not answer: stuck in C code without the GIL, not in mtrain's runtime "
                       "(before init()), or gone")
    return "; ".join(clauses)


class Collector:
    """The supervisor's collections of dumps, one at a time (any thread may call)."""

    def __init__(self, size: int, signal_job: Callable[[], None], output_dir: "Path | None") -> None:
        self.size, self.signal_job, self.output_dir = size, signal_job, output_dir
        self.lock = threading.Lock()
        self.reason: "str | None" = None      # the collection open now, if any
        self.asked = False                    # SIGUSR1 sent for it
        self.deadline = 0.0
        self.dumps: "dict[int, RecorderDump]" = {}
        self.wanted: "str | None" = None      # a collection asked for, to open at the next poll
        self.ended_at = -1e9
        self.count = 0

    def request(self, reason: str, quiet_after: float = 0.0) -> None:
        """Open a collection at the next ``poll`` (none while one is open, or within
        ``quiet_after`` seconds of the last)."""
        with self.lock:
            if self.reason is None and time.monotonic() - self.ended_at >= quiet_after:
                self.wanted = self.wanted or reason

    def add(self, dump: RecorderDump) -> None:
        """A rank's dump; one that comes unasked opens a collection (the others are asked too),
        unless it is a late answer to the last collection's signal."""
        with self.lock:
            if self.reason is None:
                if dump.reason == "SIGUSR1" and time.monotonic() - self.ended_at < COLLECT_SECONDS:
                    return  # a second signal now would be answered late again, and so on
                self.wanted = self.wanted or dump.reason
                self._open(self.wanted)
            self.dumps.setdefault(dump.rank, dump)

    def _open(self, reason: str) -> None:
        self.reason, self.asked, self.dumps, self.wanted = reason, False, {}, None
        self.deadline = time.monotonic() + COLLECT_SECONDS

    def poll(self, live: "set[int]") -> "HangReport | None":
        """Send what is due; the report once a collection is complete (every rank of ``live``
        answered) or out of time."""
        with self.lock:
            if self.reason is None and self.wanted is not None:
                self._open(self.wanted)
            if self.reason is None:
                return None
            if not self.asked:
                self.asked = True
                ask = True
            else:
                ask = False
            complete = live <= set(self.dumps) or time.monotonic() > self.deadline
        if ask:
            self.signal_job()
        return self.finish(live) if complete else None

    def finish(self, live: "set[int]") -> "HangReport | None":
        """End the open collection now (the job ended): its report, if one was open."""
        with self.lock:
            if self.reason is None:
                return None
            reason, dumps = self.reason, list(self.dumps.values())
            self.reason, self.ended_at = None, time.monotonic()
            self.count += 1
            count = self.count
        gone = [r for r in range(self.size) if r not in live and r not in {d.rank for d in dumps}]
        result = report(dumps, self.size, reason, gone)
        if self.output_dir is not None:
            path = self.output_dir / f"flight-recorder-{count}.json"
            try:
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
                with os.fdopen(fd, "w", encoding="utf-8") as handle:
                    json.dump(result.data, handle, indent=1)
                result.lines.append(f"mtrain: flight recorder dumps kept in {path}")
            except OSError as error:
                result.lines.append(f"mtrain: could not keep the flight recorder dumps in {path}: "
                                    f"{error.strerror}; check that folder")
        return result
