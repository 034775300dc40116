"""The all-rank timeline in real mpirun jobs: one file from every rank, on rank 0's clock, that
`mtrain timeline-summary` reads; and a job that loses a rank still leaves rank 0's file."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile

import pytest

from mtrain.launcher.cli import timeline_summary as ts
from tests.mpi.harness import REPO, launch
from tests.mpi.test_engine import DYING_RANK_SCRIPT  # rank 1 killed (SIGKILL) at its 20th all-reduce

# Ranks 1 and 2 run with clocks far off rank 0's (their time.monotonic() shifted before the
# runtime is imported): only the offsets measured at init put their events back in place.
TRAINING = """
import os, time
rank = int(os.environ.get("OMPI_COMM_WORLD_RANK", os.environ.get("PMI_RANK", "0")))
_real = time.monotonic
_skew = {0: 0.0, 1: 1000.0, 2: -500.0}[rank]
time.monotonic = lambda: _real() + _skew
import numpy as np, mtrain.ringreduce as rr
rr.init()
for step in range(6):
    sum(range(20000 * (rank + 1)))  # the step's compute: longer on higher ranks
    handles = [rr.allreduce_async(np.ones(1000), name="grad.a"), rr.allreduce_async(np.ones(200_000), name="grad.b")]
    [rr.synchronize(h) for h in handles]
rr.barrier()
rr.shutdown()
"""


@pytest.mark.parametrize("nprocs", [2, 3], ids=lambda n: f"np{n}")
def test_every_rank_is_in_one_file_on_rank_0s_clock_and_the_summary_reads_it(nprocs):
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "timeline.json")
        result = launch(nprocs, [sys.executable, "-c", TRAINING], timeout=90, env={"HOROVOD_TIMELINE": path})
        assert result.returncode == 0, result.stderr[-3000:]
        with open(path) as f:
            events = json.load(f)  # closed: a whole JSON array
        ranks = list(range(nprocs))
        # Horovod's layout (timeline.cc): a process per op name; every rank on its own tid.
        ops = {e["pid"]: e["args"]["name"] for e in events if e.get("name") == "process_name" and "name" in e["args"]}
        assert {"grad.a", "grad.b"} <= set(ops.values())
        for rank in ranks:
            mine = [e for e in events if e.get("tid") == rank]
            assert {ops[e["pid"]] for e in mine if e.get("name") == "ALLREDUCE" and e["ph"] == "B"} == \
                {"grad.a", "grad.b"}, rank
            # The engine's own step timing (the first step has no compute to measure; the barrier
            # is the 7th): steps 2-7, each a compute then a wait, in order, on pid 0.
            steps = [e for e in mine if e.get("name") == "STEP"]
            assert [e["args"]["step"] for e in steps] == list(range(2, 8)), rank
            assert all(e["pid"] == 0 for e in steps)
            for before, after in zip(steps, steps[1:]):
                assert before["ts"] + before["dur"] <= after["ts"] + 1, (before, after)
            assert all(e["args"]["compute_s"] >= 0 and e["args"]["wait_s"] >= 0 for e in steps), steps
        # On rank 0's clock: every event lies within rank 0's timeline (which ends at "end"),
        # and the barrier ends at the same moment on every rank (all leave once the last came).
        end = next(e["ts"] for e in events if e.get("name") == "end")
        timed = [e["ts"] for e in events if e["ph"] in ("B", "E", "X")]
        assert -0.5e6 < min(timed) and max(timed) <= end
        barrier = next(e["pid"] for e in events if e.get("name") == "BARRIER")
        # Each rank's second end on the barrier's pid is the BARRIER's (the first, NEGOTIATE_BARRIER's).
        barrier_ends = [[e["ts"] for e in events if e.get("pid") == barrier and e.get("tid") == r and e["ph"] == "E"][1]
                        for r in ranks]
        assert len(barrier_ends) == nprocs
        assert max(barrier_ends) - min(barrier_ends) < 50e3, barrier_ends  # µs: well under the skews

        png = os.path.join(tmp, "steps.png")
        summary = subprocess.run([sys.executable, "-m", "mtrain.launcher.cli.main", "timeline-summary", path,
                                  "--png", png, "--top", "3"], capture_output=True, text=True, timeout=60, cwd=REPO)
        assert summary.returncode == 0, summary.stderr
        assert f"ranks: {nprocs} (0-{nprocs - 1})" in summary.stdout
        assert "grad.b" in summary.stdout and "grad.a" in summary.stdout and "ALLREDUCE" in summary.stdout
        assert "steps per rank" in summary.stdout
        with open(png, "rb") as f:
            data = f.read()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000


def test_a_killed_rank_leaves_rank_0s_file_with_what_every_rank_sent():
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "timeline.json")
        result = launch(3, [sys.executable, "-c", DYING_RANK_SCRIPT], timeout=90, env={"MTRAIN_TIMELINE": path})
        assert result.returncode != 0
        events = ts.load_events(path)  # ended by the abort: maybe without its closing bracket
    ranks = {e["tid"] for e in events if e.get("ph") == "B" and e.get("name") == "ALLREDUCE"}
    assert 0 in ranks, events[-5:]
    assert ts.summarize(events).ops[0].name == "grad"


# Three steps of four small fused all-reduces (float32, 2x3, distinct per rank and element), an
# allgather of rank+1 rows each, and a broadcast from the last rank; each result is checked too.
HOROVOD_OPS = """
import numpy as np, mtrain.ringreduce as rr
rr.init()
me, n = rr.rank(), rr.size()
def grad(r, k):
    return ((r + 1) * 100 + k * 10 + np.arange(6, dtype=np.float32)).reshape(2, 3)
for step in range(3):
    handles = [rr.allreduce_async(grad(me, k), op=rr.Sum, name=f"grad.{k}") for k in range(4)]
    for k, handle in enumerate(handles):
        assert np.array_equal(rr.synchronize(handle), sum(grad(r, k) for r in range(n))), (me, k)
rows = rr.allgather(np.full((me + 1, 2), me, dtype=np.int64), name="rows")
assert rows[:, 0].tolist() == [r for r in range(n) for _ in range(r + 1)], rows
got = rr.broadcast(np.arange(5.0) * (me + 1), root_rank=n - 1, name="weights")
assert got.tolist() == (np.arange(5.0) * n).tolist(), got
rr.shutdown()
"""

# Horovod's activities inside each op's span (horovod/common/ops/mpi_operations.cc on the CPU).
FUSED = ["MEMCPY_IN_FUSION_BUFFER", "MPI_ALLREDUCE", "MEMCPY_OUT_FUSION_BUFFER"]
ACTIVITIES = {"ALLREDUCE": [FUSED, ["MPI_ALLREDUCE"]], "ALLGATHER": [["MPI_ALLGATHER"]], "BROADCAST": [["MPI_BCAST"]]}


def _runs(sequence: "list[dict]", rank: int) -> "list[tuple[str, list[str], dict]]":
    """One (pid, tid) row's events as runs: (type, activities, args of the op's end), checking
    Horovod's nesting on the way: NEGOTIATE_<T> B, the rank's tick (X "rank"), E; <T> B, each
    activity B/E, E; times never going back."""
    runs, i = [], 0
    assert [e["ts"] for e in sequence] == sorted(e["ts"] for e in sequence), sequence
    while i < len(sequence):
        negotiate, tick, negotiated, top = sequence[i:i + 4]
        assert negotiate["ph"] == "B" and negotiate["name"].startswith("NEGOTIATE_"), negotiate
        kind = negotiate["name"][len("NEGOTIATE_"):]
        assert tick["ph"] == "X" and tick["name"] == str(rank) and tick["dur"] == 0, tick
        assert negotiated["ph"] == "E" and top == {**top, "ph": "B", "name": kind}, (negotiated, top)
        i += 4
        activities = []
        while sequence[i]["ph"] == "B":
            assert sequence[i + 1]["ph"] == "E", sequence[i + 1]
            activities.append(sequence[i]["name"])
            i += 2
        assert sequence[i]["ph"] == "E"
        runs.append((kind, activities, sequence[i].get("args", {})))
        i += 1
    return runs


@pytest.mark.parametrize("nprocs", [2, 3], ids=lambda n: f"np{n}")
def test_the_file_is_horovods_chrome_trace_with_every_rank_on_its_own_thread(nprocs):
    """horovod/common/timeline.cc and timeline.h: pid 0 opens the file (process_name with
    start_time_since_epoch_in_micros, process_sort_index 0); each tensor is a process (pid 1, 2,
    ..., process_name args.name, process_sort_index = pid); NEGOTIATE_<TYPE> B/E with each rank's
    X tick named by its rank; <TYPE> B/E around its activities, its E with dtype and shape
    (common.cc TensorShape::DebugString, "[2, 3]"); CYCLE_START instants with "s": "g"
    (HOROVOD_TIMELINE_MARK_CYCLES). Types and activities: message.cc, common.h. Horovod's file is
    rank 0's view; ours has every rank's events, on tid = rank."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "timeline.json")
        result = launch(nprocs, [sys.executable, "-c", HOROVOD_OPS], timeout=90,
                        env={"HOROVOD_TIMELINE": path, "HOROVOD_TIMELINE_MARK_CYCLES": "1",
                             "HOROVOD_CYCLE_TIME": "20"})  # a long cycle: the four all-reduces meet in one
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
        with open(path) as f:
            events = json.load(f)
    assert events[0]["name"] == "process_name" and events[0]["pid"] == 0
    assert isinstance(events[0]["args"]["start_time_since_epoch_in_micros"], int)
    assert events[1] == {"name": "process_sort_index", "ph": "M", "pid": 0, "args": {"sort_index": 0}}
    names = {e["pid"]: e["args"]["name"] for e in events if e.get("name") == "process_name" and e["pid"]}
    assert sorted(names.values()) == ["grad.0", "grad.1", "grad.2", "grad.3", "rows", "weights"]
    assert sorted(names) == list(range(1, 7))
    sort_index = {e["pid"]: e["args"]["sort_index"] for e in events if e.get("name") == "process_sort_index"}
    assert sort_index == {pid: pid for pid in range(7)}
    cycles = [e for e in events if e.get("name") == "CYCLE_START"]
    assert cycles and all(e["ph"] == "i" and e["s"] == "g" for e in cycles)
    want_type = {"rows": "ALLGATHER", "weights": "BROADCAST"}
    rows = sum(r + 1 for r in range(nprocs))
    want_args = {"rows": {"dtype": "int64", "shape": f"[{rows}, 2]"}, "weights": {"dtype": "float64", "shape": "[5]"}}
    fused_runs = 0
    for pid, tensor in names.items():
        for rank in range(nprocs):
            sequence = [e for e in events if e.get("pid") == pid and e.get("tid") == rank and e["ph"] in "BEX"]
            runs = _runs(sequence, rank)
            kind = want_type.get(tensor, "ALLREDUCE")
            assert len(runs) == (3 if kind == "ALLREDUCE" else 1), (tensor, rank, runs)
            for got_kind, activities, args in runs:
                assert got_kind == kind and activities in ACTIVITIES[kind], (tensor, rank, activities)
                assert args == want_args.get(tensor, {"dtype": "float32", "shape": "[2, 3]"}), (tensor, args)
                fused_runs += activities == FUSED
    assert fused_runs >= nprocs * 4, fused_runs  # at least one step's four ops went through the fusion buffer
