"""The all-rank timeline in real mpirun jobs: one file from every rank, on rank 0's clock, that
`mtrain timeline-summary` reads; and a job that loses a rank still leaves rank 0's file."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile

import pytest

from mtrain.launcher import timeline_summary as ts
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
        assert sorted({e["pid"] for e in events}) == ranks
        names = {e["pid"]: e["args"]["name"] for e in events if e["name"] == "process_name"}
        assert names == {r: f"rank {r}" for r in ranks}
        for rank in ranks:
            rows = {e["tid"]: e["args"]["name"] for e in events if e["name"] == "thread_name" and e["pid"] == rank}
            mine = [e for e in events if e["pid"] == rank and e["ph"] == "X"]
            assert {rows[e["tid"]] for e in mine if e["name"] == "ALLREDUCE"} == {"grad.a", "grad.b"}, rank
            # The engine's own step timing (the first step has no compute to measure; the barrier
            # is the 7th): steps 2-7, each a compute then a wait, in order.
            steps = [e for e in mine if e["name"] == "STEP"]
            assert [e["args"]["step"] for e in steps] == list(range(2, 8)), rank
            for before, after in zip(steps, steps[1:]):
                assert before["ts"] + before["dur"] <= after["ts"] + 1, (before, after)
            assert all(e["args"]["compute_s"] >= 0 and e["args"]["wait_s"] >= 0 for e in steps), steps
        # On rank 0's clock: every event lies within rank 0's timeline (which ends at "end"),
        # and the barrier ends at the same moment on every rank (all leave once the last came).
        end = next(e["ts"] for e in events if e["name"] == "end")
        starts = [e["ts"] for e in events if e["ph"] == "X"]
        assert -0.5e6 < min(starts) and max(e["ts"] + e["dur"] for e in events if e["ph"] == "X") <= end
        barrier_ends = [e["ts"] + e["dur"] for e in events if e["name"] == "BARRIER"]
        assert len(barrier_ends) == nprocs
        assert max(barrier_ends) - min(barrier_ends) < 50e3, barrier_ends  # µs: well under the skews

        png = os.path.join(tmp, "steps.png")
        summary = subprocess.run([sys.executable, "-m", "mtrain.launcher.cli", "timeline-summary", path,
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
    ranks = {e["pid"] for e in events if e.get("ph") == "X" and e.get("name") == "ALLREDUCE"}
    assert 0 in ranks, events[-5:]
    assert ts.summarize(events).ops[0].name == "grad"
