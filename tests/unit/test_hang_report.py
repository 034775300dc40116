"""The flight recorder's hang report from synthetic dumps: each hang shape, no records, silent ranks."""
from __future__ import annotations

import json

from mtrain.launcher.supervise.hang_report import Collector, ranks_text, report
from mtrain.common.records.flight_recorder import OpRecord, OpState, RecorderDump, SetRecord

W, D = OpState.WAITING, OpState.DONE


def op(seq, name, state, kind="allreduce", ago=5.0):
    return OpRecord(seq, name, kind, "float32[8]", state, ago, -1.0 if state is W else ago - 0.1,
                    -1.0 if state is W else ago - 0.2)


def dump(rank, ops, blocked=1, idle=5.0, frame="", sets=None, members=(0, 1, 2, 3)):
    records = sets if sets is not None else (SetRecord(0, tuple(members), tuple(ops), blocked, idle),)
    return RecorderDump(rank, "mtr-a" if rank < 2 else "mtr-b", "SIGUSR1", 0.0, records, frame)


METRICS = op(11, "metrics", D, kind="allgather", ago=41.5)


def test_rank_in_user_code_is_named_with_its_line_and_last_op():
    dumps = [dump(r, [METRICS, op(12, "layer4.grad", W)]) for r in range(3)]
    dumps.append(dump(3, [METRICS], blocked=0, idle=41.0, frame="train.py:17 in main"))
    hang = report(dumps, 4, "stall warning")
    assert hang.diagnosis == ("ranks 0-2 wait in allreduce 'layer4.grad' (seq 12); rank 3 has not submitted it and "
                              "has been in user code for 41 s at train.py:17 in main "
                              "(last op: allgather 'metrics', seq 11)")
    assert hang.lines[0] == "mtrain: flight recorder (stall warning): where each rank is"
    assert all(line.startswith(("mtrain: ", "    ")) for line in hang.lines)
    assert "    rank 0 (mtr-a): waiting in allreduce 'layer4.grad' (seq 12) for 5.0 s" in hang.lines
    assert hang.lines[-1] == "mtrain: diagnosis: " + hang.diagnosis


def test_rank_that_skipped_an_op_waits_in_the_next_one():
    dumps = [dump(r, [METRICS, op(12, "layer4.grad", W)]) for r in range(3)]
    dumps.append(dump(3, [METRICS, op(12, "layer5.grad", W)]))
    assert report(dumps, 4, "x").diagnosis == (
        "ranks 0-2 wait in allreduce 'layer4.grad' (seq 12); rank 3 has not submitted it: it waits in "
        "allreduce 'layer5.grad' (seq 12) instead, which ranks 0-2 have not submitted")


def test_two_ranks_in_different_collectives():
    dumps = [dump(0, [op(3, "a", W)], members=(0, 1)), dump(1, [op(3, "b", W, kind="allgather")], members=(0, 1))]
    assert report(dumps, 2, "x").diagnosis == (
        "rank 0 waits in allreduce 'a' (seq 3); rank 1 has not submitted it: it waits in allgather 'b' (seq 3) "
        "instead, which rank 0 has not submitted")


def test_process_set_op_one_member_never_calls():
    def sets(rank, ops, blocked):
        return (SetRecord(0, (0, 1, 2, 3), (METRICS,), 0, 6.0), SetRecord(1, (0, 2), tuple(ops), blocked, 6.0))
    dumps = [dump(0, None, sets=sets(0, [op(1, "ps.grad", W)], 1)),
             dump(1, None, sets=(SetRecord(0, (0, 1, 2, 3), (METRICS,), 0, 6.0),), frame="t.py:3 in f"),
             dump(2, None, sets=sets(2, [], 0), frame="t.py:9 in g"),
             dump(3, None, sets=(SetRecord(0, (0, 1, 2, 3), (METRICS,), 0, 6.0),))]
    diagnosis = report(dumps, 4, "x").diagnosis
    assert diagnosis == ("process set 1 (ranks 0, 2): rank 0 waits in allreduce 'ps.grad' (seq 1); rank 2 has not "
                         "submitted it and has been in user code for 6.0 s at t.py:9 in g (last op: allgather "
                         "'metrics', seq 11)"), diagnosis
    assert "rank 1" not in diagnosis and "rank 3" not in diagnosis  # not members: not waited for


def test_rank_with_an_op_pending_but_not_blocked_on_it():
    dumps = [dump(0, [op(2, "x", W)], members=(0, 1)),
             dump(1, [op(2, "y", W)], blocked=0, idle=3.0, frame="t.py:5 in loop", members=(0, 1))]
    assert "rank 1 has not submitted it (it has allreduce 'y' (seq 2) pending, which rank 0 has not submitted) " \
           "and has been in user code for 3.0 s at t.py:5 in loop" in report(dumps, 2, "x").diagnosis


def test_no_records_and_nobody_waiting():
    dumps = [dump(r, [], blocked=0, idle=-1.0) for r in range(2)]
    hang = report(dumps, 2, "SIGUSR1 to mtrain run")
    assert hang.diagnosis == ("no rank waits in a collective: rank 0 in user code (no collective recorded yet); "
                              "rank 1 in user code (no collective recorded yet)")


def test_ranks_that_did_not_answer_and_ranks_that_ended():
    dumps = [dump(0, [op(4, "x", W)], members=(0, 1, 2)), dump(1, [op(4, "x", W)], members=(0, 1, 2))]
    hang = report(dumps, 4, "a rank failed", gone=[3])
    assert "    rank 2: no answer" in hang.lines and "    rank 3: ended" in hang.lines
    assert hang.diagnosis.endswith("rank 2 did not answer: stuck in C code without the GIL, not in mtrain's runtime "
                                   "(before init()), or gone")
    assert hang.data["silent"] == [2] and hang.data["gone"] == [3]
    assert [d["rank"] for d in json.loads(json.dumps(hang.data))["dumps"]] == [0, 1]


def test_every_rank_inside_the_same_op_is_no_hang():
    dumps = [dump(r, [op(4, "x", OpState.RUNNING)], members=(0, 1)) for r in range(2)]
    assert "not a hang" in report(dumps, 2, "x").diagnosis


def test_dump_record_round_trips():
    original = dump(2, [METRICS, op(12, "layer4.grad", W)], frame="a.py:1 in f")
    assert RecorderDump.decode(original.encode().partition(b" ")[2]) == original
    assert RecorderDump.decode(b"{not json") is None


def test_ranks_text():
    assert ranks_text([3]) == "rank 3"
    assert ranks_text([2, 0, 1]) == "ranks 0-2"
    assert ranks_text([0, 2]) == "ranks 0 and 2"
    assert ranks_text([0, 2, 5]) == "ranks 0, 2 and 5"


def test_collector_signals_once_reports_when_every_live_rank_answered(tmp_path):
    signals = []
    collector = Collector(2, lambda: signals.append(1), tmp_path)
    collector.request("SIGUSR1 to mtrain run")
    assert collector.poll({0, 1}) is None and signals == [1]
    collector.request("stall warning")  # one collection at a time
    collector.add(dump(0, [], members=(0, 1)))
    assert collector.poll({0, 1}) is None and signals == [1]
    collector.add(dump(1, [], members=(0, 1)))
    hang = collector.poll({0, 1})
    assert hang is not None and hang.lines[0].startswith("mtrain: flight recorder (SIGUSR1 to mtrain run)")
    path = tmp_path / "flight-recorder-1.json"
    assert json.loads(path.read_text())["reason"] == "SIGUSR1 to mtrain run"
    assert path.stat().st_mode & 0o077 == 0
    assert hang.lines[-1] == f"mtrain: flight recorder dumps kept in {path}"
    assert collector.poll({0, 1}) is None  # the stall request came while collecting: dropped
    collector.request("a rank failed", quiet_after=60)  # right after a collection: not again
    assert collector.poll({0, 1}) is None and signals == [1]


def test_an_unasked_dump_opens_a_collection_and_asks_the_others():
    signals = []
    collector = Collector(2, lambda: signals.append(1), None)
    collector.add(dump(1, [], members=(0, 1)).replace(reason="stall shutdown"))
    assert collector.poll({0, 1}) is None and signals == [1]
    hang = collector.finish({0, 1})
    assert hang.lines[0].startswith("mtrain: flight recorder (stall shutdown)")
    assert "    rank 0: no answer" in hang.lines


def test_a_rank_whose_program_ended_is_named_as_what_the_others_wait_for():
    dumps = [dump(r, [op(2, "x", W)], members=(0, 1, 2)) for r in (0, 2)]
    assert report(dumps, 3, "rank 1 failed", gone=[1]).diagnosis == (
        "ranks 0 and 2 wait in allreduce 'x' (seq 2); rank 1 has not submitted it: its program has ended")


def test_a_late_answer_to_the_last_signal_opens_no_collection():
    signals = []
    collector = Collector(2, lambda: signals.append(1), None)
    collector.add(dump(1, [], members=(0, 1)).replace(reason="stall shutdown"))  # a rank's own dump
    collector.poll({0, 1})
    collector.add(dump(0, [], members=(0, 1)).replace(reason="stall shutdown"))
    assert collector.poll({0, 1}) is not None and signals == [1]
    collector.add(dump(1, [], members=(0, 1)))  # its answer to that signal, after the report
    assert collector.poll({0, 1}) is None and signals == [1]
