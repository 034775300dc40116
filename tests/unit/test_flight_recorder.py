"""The flight recorder's per-op states and sequence numbers (no MPI: a recorder filled by hand)."""
from __future__ import annotations

from mtrain.launcher.records import OpState
from mtrain.ringreduce.collectives import Kind
from mtrain.ringreduce.errors import Refusal
from mtrain.ringreduce.recorder import FlightRecorder
from mtrain.ringreduce.requests import Signature

SIG = Signature(int(Kind.ALLREDUCE), 0, (8,), 1, -1, 1.0, 1.0, "numpy")


def test_states_from_batches_failures_and_what_is_in_flight():
    recorder = FlightRecorder(8)
    recorder.ops += [("a", SIG, 1.0), ("b", SIG, 2.0), ("c", SIG, 3.0), ("d", SIG, 4.0), ("a", SIG, 5.0)]
    recorder.batches.append((["a"], 1.5, 1.6))
    recorder.note_failed(["b"], 2.5)
    recorder.running = (["c"], 3.5)
    records = recorder.records(list(recorder.ops), 0, {"c", "d", "a"}, 10.0)
    assert [(r.seq, r.name, r.state) for r in records] == [
        (1, "a", OpState.DONE), (2, "b", OpState.FAILED), (3, "c", OpState.RUNNING), (4, "d", OpState.WAITING),
        (5, "a", OpState.WAITING)]  # the first 'a' ended; the one in flight is the second
    assert (records[0].submitted_ago, records[0].started_ago, records[0].ended_ago) == (9.0, 8.5, 8.4)
    assert records[1].ended_ago == 7.5 and records[2].started_ago == 6.5 and records[3].started_ago == -1.0
    assert records[0].kind == "allreduce" and records[0].what.endswith("[8]")


def test_trim_keeps_the_last_k_and_their_sequence_numbers():
    recorder = FlightRecorder(4)
    for i in range(11):
        recorder.ops.append((f"op{i}", SIG, float(i)))
        recorder.trim()
    assert len(recorder.ops) <= 8
    records = recorder.records(list(recorder.ops), recorder.dropped, set(), 20.0)
    assert [(r.seq, r.name) for r in records] == [(8, "op7"), (9, "op8"), (10, "op9"), (11, "op10")]


def test_refused_op_is_shown_as_refused():
    recorder = FlightRecorder(4)
    recorder.ops.append(("r", Refusal(0, "TypeError: bad"), 1.0))
    (record,) = recorder.records(list(recorder.ops), 0, {"r"}, 2.0)
    assert (record.kind, record.what, record.state) == ("refused", "TypeError: bad", OpState.WAITING)
