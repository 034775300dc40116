"""`mtrain timeline-summary` on synthetic timelines, and the timeline's clock and step records (no MPI)."""
from __future__ import annotations

import json
import sys

import pytest

from mtrain.launcher.cli.main import main
from mtrain.launcher.cli import timeline_summary as ts
from mtrain.ringreduce.observe.timeline import ClockSample, Timeline, best_offset


def _meta(pid: int, tid: int, name: str) -> dict:
    return {"name": "thread_name", "ph": "M", "pid": pid, "tid": tid, "args": {"name": name}}


def _span(pid: int, tid: int, phase: str, ts_us: float, dur_us: float) -> dict:
    return {"name": phase, "ph": "X", "pid": pid, "tid": tid, "ts": ts_us, "dur": dur_us, "args": {}}


def _step(pid: int, index: int, compute_s: float, wait_s: float) -> dict:
    return {"name": "STEP", "ph": "X", "pid": pid, "tid": 9, "ts": index * 1e4, "dur": (compute_s + wait_s) * 1e6,
            "args": {"step": index, "compute_s": compute_s, "wait_s": wait_s}}


def two_rank_events() -> "list[dict]":
    """Two ranks; on each, "grad.big" (3 runs of NEGOTIATE 1 ms + ALLREDUCE 4 ms) and "grad.small"
    (3 runs of 0.5 ms); rank 1 waits 3 ms a step, rank 0 1 ms."""
    events: "list[dict]" = []
    for pid in (0, 1):
        events += [_meta(pid, 1, "grad.big"), _meta(pid, 2, "grad.small"), _meta(pid, 9, "STEP")]
        for run in range(3):
            events += [_span(pid, 1, "NEGOTIATE", run * 1e4, 1000), _span(pid, 1, "ALLREDUCE", run * 1e4 + 1000, 4000),
                       _span(pid, 2, "ALLREDUCE", run * 1e4 + 5000, 500)]
            events.append(_step(pid, run, 0.010, 0.001 if pid == 0 else 0.003))
    return events


def write(tmp_path, events: "list[dict]", closed: bool = True) -> str:
    path = tmp_path / "timeline.json"
    body = "[\n" + "".join(json.dumps(e) + ",\n" for e in events)
    path.write_text(body + ('{"name": "end", "ph": "i", "pid": 0, "tid": 0, "ts": 1}\n]\n' if closed else ""))
    return str(path)


def test_the_summary_lists_ops_by_time_with_their_phases_and_each_ranks_steps():
    summary = ts.summarize(two_rank_events())
    assert summary.ranks == [0, 1]
    assert [(o.name, o.runs, o.total_us) for o in summary.ops] == [("grad.big", 6, 30000.0),
                                                                   ("grad.small", 6, 3000.0)]
    assert summary.ops[0].phases == {"NEGOTIATE": 6000.0, "ALLREDUCE": 24000.0}
    per_rank = ts.rank_steps(summary.steps)
    assert [(r.rank, r.steps, r.compute_s, r.wait_s) for r in per_rank] == [(0, 3, 0.010, 0.001), (1, 3, 0.010, 0.003)]
    text = ts.report(summary, top=1)
    assert "top 1 of 2 ops" in text and "grad.small" not in text
    assert "grad.big" in text and "ALLREDUCE 80%, NEGOTIATE 20%" in text and "90.9%" in text


def test_cli_prints_the_summary_and_draws_a_png(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    png = tmp_path / "steps.png"
    assert main(["timeline-summary", write(tmp_path, two_rank_events()), "--png", str(png)]) == 0
    out = capsys.readouterr().out
    assert "grad.big" in out and "steps per rank" in out and f"wrote {png}" in out
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000


def test_a_file_cut_short_by_a_crash_is_read_up_to_its_last_whole_line(tmp_path, capsys):
    path = write(tmp_path, two_rank_events(), closed=False)
    with open(path, "a") as f:
        f.write('{"name": "ALLREDUCE", "ph": "X", "pi')  # the half line a killed writer leaves
    assert len(ts.load_events(path)) == len(two_rank_events())
    assert main(["timeline-summary", path]) == 0
    assert "grad.big" in capsys.readouterr().out


@pytest.mark.parametrize("content, why", [
    (None, "cannot read"), ("", "is not a timeline"), ("hello", "is not a timeline"),
    ('{"a": 1}', "is not a timeline"), ("[1, 2, 3]", "is not a timeline"), (b"\xff\xfe\x00", "is not a timeline"),
])
def test_bad_input_is_one_line_and_exit_2(tmp_path, capsys, content, why):
    path = tmp_path / "t.json"
    if isinstance(content, bytes):
        path.write_bytes(content)
    elif content is not None:
        path.write_text(content)
    assert main(["timeline-summary", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and why in err and "Traceback" not in err, err


def test_without_matplotlib_drawing_says_what_to_install(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib now raises ImportError
    assert main(["timeline-summary", write(tmp_path, two_rank_events()), "--png", str(tmp_path / "x.png")]) == 2
    assert "pip install matplotlib" in capsys.readouterr().err
    assert not (tmp_path / "x.png").exists()


def test_a_png_needs_step_events(tmp_path, capsys):
    events = [e for e in two_rank_events() if e["name"] != "STEP"]
    assert main(["timeline-summary", write(tmp_path, events), "--png", str(tmp_path / "x.png")]) == 1
    captured = capsys.readouterr()
    assert "grad.big" in captured.out and "no STEP events" in captured.err


def test_the_offset_is_the_one_of_the_shortest_round_trip():
    # This rank's clock is 100 s behind rank 0's; a ping with symmetric 1 ms legs says so exactly,
    # one held up 50 ms on the way back says 25 ms less, and the shortest round trip wins.
    exact = ClockSample(t0=10.0, t1=110.001, t3=10.002)
    delayed = ClockSample(t0=20.0, t1=120.001, t3=20.052)
    assert exact.offset == pytest.approx(100.0)
    assert delayed.offset == pytest.approx(99.975)
    assert best_offset([delayed, exact]) == pytest.approx(100.0)


def test_a_rank_0_timeline_records_steps_and_is_valid_json_after_close(tmp_path):
    path = tmp_path / "t.json"
    timeline = Timeline(str(path))
    timeline.span("w", "ALLREDUCE", 1.0, 1.5)
    timeline.step(7, 2.0, 2.25, 2.5, 0.25)
    timeline.close()
    timeline.step(8, 3.0, 3.1, 3.2, 0.1)  # after close: ignored
    events = json.loads(path.read_text())
    steps = [e for e in events if e.get("name") == "STEP"]
    assert len(steps) == 1 and steps[0]["pid"] == 0 and steps[0]["tid"] == 0 and steps[0]["dur"] == 500000.0
    assert steps[0]["args"] == {"step": 7, "compute_s": 0.25, "wait_s": 0.25}
    rows = {(e["pid"], e["tid"]): e["args"]["name"] for e in events if e.get("name") == "thread_name"}
    assert rows[(0, 0)] == "rank 0"
    assert [s.number for s in ts.summarize(events).steps] == [7]


def _horovod_op(pid: int, tid: "int | None", start_us: float, negotiate_us: float,
                phases: "list[tuple[str, float]]") -> "list[dict]":
    """One run of an op as Horovod's timeline.cc writes it: NEGOTIATE_ALLREDUCE B, a rank tick, E;
    ALLREDUCE B, its activities B/E one after another, E with dtype and shape."""
    where = {"pid": pid} if tid is None else {"pid": pid, "tid": tid}
    events = [{"ph": "B", "name": "NEGOTIATE_ALLREDUCE", "ts": start_us, **where},
              {"ph": "X", "name": "0", "ts": start_us, "dur": 0, **where},
              {"ph": "E", "ts": start_us + negotiate_us, **where},
              {"ph": "B", "name": "ALLREDUCE", "ts": start_us + negotiate_us, **where}]
    t = start_us + negotiate_us + 10  # 10 µs of the op's own before its first activity
    for name, took in phases:
        events += [{"ph": "B", "name": name, "ts": t, **where}, {"ph": "E", "ts": t + took, **where}]
        t += took
    events.append({"ph": "E", "ts": t, "args": {"dtype": "float32", "shape": "[3]"}, **where})
    return events


@pytest.mark.parametrize("tid", [None, 0, 2], ids=["horovod-file", "rank0", "rank2"])
def test_horovods_layout_sums_each_phase_less_its_nested_activities(tid):
    """horovod/common/timeline.cc: a pid per tensor named by process_name, B/E spans nested
    (ALLREDUCE around MEMCPY_IN_FUSION_BUFFER, MPI_ALLREDUCE, MEMCPY_OUT_FUSION_BUFFER); a Horovod
    file has no tid (rank 0's view), ours puts each rank on its tid."""
    events = [{"name": "process_name", "ph": "M", "pid": 0, "args": {"start_time_since_epoch_in_micros": 1}},
              {"name": "process_name", "ph": "M", "pid": 1, "args": {"name": "allreduce.g"}},
              {"name": "process_name", "ph": "M", "pid": 2, "args": {"name": "allreduce.h"}}]
    fused = [("MEMCPY_IN_FUSION_BUFFER", 30.0), ("MPI_ALLREDUCE", 400.0), ("MEMCPY_OUT_FUSION_BUFFER", 70.0)]
    for run in range(3):
        events += _horovod_op(1, tid, run * 1e4, 100.0 + run, fused)
        events += _horovod_op(2, tid, run * 1e4 + 5000, 7.0, [("MPI_ALLREDUCE", 20.0)])
    events.append({"name": "CYCLE_START", "ph": "i", "ts": 5.0, "s": "g"})
    summary = ts.summarize(events)
    assert summary.ranks == [0 if tid is None else tid]
    assert [(o.name, o.runs) for o in summary.ops] == [("allreduce.g", 3), ("allreduce.h", 3)]
    g = summary.ops[0]
    assert g.phases == pytest.approx({"NEGOTIATE_ALLREDUCE": 303.0, "ALLREDUCE": 30.0, "MEMCPY_IN_FUSION_BUFFER": 90.0,
                                      "MPI_ALLREDUCE": 1200.0, "MEMCPY_OUT_FUSION_BUFFER": 210.0})
    assert g.total_us == pytest.approx(303.0 + 3 * 510.0)
    assert summary.ops[1].phases == pytest.approx({"NEGOTIATE_ALLREDUCE": 21.0, "ALLREDUCE": 30.0,
                                                   "MPI_ALLREDUCE": 60.0})
