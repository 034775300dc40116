"""The flight recorder's per-op states and sequence numbers (no MPI: a recorder filled by hand)."""
from __future__ import annotations

from types import SimpleNamespace

from mtrain.common.records.flight_recorder import OpState
from mtrain.ringreduce.core.ops import Kind
from mtrain.ringreduce.core.errors import Refusal
from mtrain.ringreduce.core.ops import dtype_code
from mtrain.ringreduce.observe.recorder import FlightRecorder
from mtrain.ringreduce.core.requests import Signature

F32 = dtype_code("float32")
SIG = Signature(int(Kind.ALLREDUCE), F32, (8,), 1, -1, 1.0, 1.0, "numpy")
GATHER = Signature(int(Kind.ALLGATHER), F32, (3,), -1, -1, 1.0, 1.0, "numpy")


def request(name, signature=SIG, submitted=0.0):
    return SimpleNamespace(name=name, signature=signature, submitted=submitted)


def test_states_and_sequence_numbers():
    recorder = FlightRecorder(8)
    recorder.start([request("a"), request("g", GATHER)], ["a", "g"], False, 1.0)
    recorder.finish(1.5)
    recorder.failed([request("b")], 2.0)
    recorder.start([request("c")], ["c"], False, 3.0)
    records = recorder.records([request("e", submitted=5.0), request("d", submitted=4.0)], 10.0)
    assert [(r.seq, r.name, r.state) for r in records] == [
        (1, "a", OpState.DONE), (2, "g", OpState.DONE), (3, "b", OpState.FAILED), (4, "c", OpState.RUNNING),
        (5, "d", OpState.WAITING), (6, "e", OpState.WAITING)]  # pending ones in the order submitted
    assert (records[0].started_ago, records[0].ended_ago) == (9.0, 8.5)
    assert records[2].ended_ago == 8.0 and records[3].started_ago == 7.0 and records[4].submitted_ago == 6.0
    assert (records[1].kind, records[1].what) == ("allgather", "float32[*, 3]")
    assert (records[0].kind, records[0].what) == ("allreduce", "float32[8]")


def test_only_about_the_last_k_ops_are_kept_and_numbered_on():
    recorder = FlightRecorder(4)
    for i in range(11):
        recorder.start([request(f"op{i}")], [f"op{i}"], False, float(i))
        recorder.finish(i + 0.5)
    records = recorder.records([], 20.0)
    assert [(r.seq, r.name) for r in records] == [(8, "op7"), (9, "op8"), (10, "op9"), (11, "op10")]


def test_a_steady_batch_looks_its_signatures_up_once():
    recorder = FlightRecorder(8)
    names = ["x", "y"]
    recorder.start([request("x"), request("y")], names, True, 1.0)
    recorder.finish(2.0)
    # The same kept list again: the requests are not read (these carry other signatures).
    recorder.start([request("x", GATHER), request("y", GATHER)], names, True, 3.0)
    recorder.finish(4.0)
    assert [r.kind for r in recorder.records([], 5.0)] == ["allreduce"] * 4


def test_refused_op_is_shown_as_refused():
    recorder = FlightRecorder(4)
    (record,) = recorder.records([request("r", Refusal(0, "TypeError: bad"), 1.0)], 2.0)
    assert (record.kind, record.what, record.state) == ("refused", "TypeError: bad", OpState.WAITING)
