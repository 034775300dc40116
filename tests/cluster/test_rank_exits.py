"""Every way a rank can end ends the job, with that rank's own status and name, and nothing left.

One rank (3, on host mtr-b) ends while the other three are in a collective, outside
MPI, in a barrier, or blocked on a handle: the cells of the exit matrix.
"""
from __future__ import annotations

import time
from pathlib import Path

import pytest

from tests.cluster.conftest import PYTHON, assert_no_leftovers, run_mtrain
from tests.launcher.report_check import assert_only_mtrain_output

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(120)]
HERE = Path(__file__).resolve().parent
OTHERS = ["collective", "sleep", "barrier", "synchronize", "finish", "remove_process_set"]
# How rank 3 ends -> (mtrain's exit status, what the report says of rank 3).
FAILURES = {
    "exit7": (7, "first failure: rank 3 on mtr-b: exit code 7 (rank 3 ending on purpose: exit7)"),
    "raise": (1, "first failure: rank 3 on mtr-b: exit code 1 (RuntimeError: rank 3 raised on purpose)"),
    "osexit": (7, "first failure: rank 3 on mtr-b: exit code 7 (rank 3 ending on purpose: osexit)"),
    "sigkill": (137, "first failure: rank 3 on mtr-b: killed by SIGKILL"),
    "sigsegv": (139, "first failure: rank 3 on mtr-b: killed by SIGSEGV"),
    # Ways of leaving that no wrapped function sees: the runner that starts the program knows.
    "systemexit": (3, "first failure: rank 3 on mtr-b: exit code 3 (rank 3 ending on purpose: systemexit)"),
    "thread_exit": (3, "first failure: rank 3 on mtr-b: exit code 3 (rank 3 ending on purpose: thread_exit)"),
    "thread_error": (4, "first failure: rank 3 on mtr-b: exit code 4 (rank 3 ending on purpose: thread_error)"),
}


def run_cell(cluster, tmp_path, token, how: str, others: str):
    done = run_mtrain(cluster, "-np", "4", "-H", "mtr-a:2,mtr-b:2", PYTHON, str(HERE / "exit_rank.py"),
                      how, others, token, cwd=tmp_path, timeout=90)
    return done, after_leaving(done.stdout)


def after_leaving(stdout: str) -> float:
    """Seconds from rank 3's leaving (the time it printed) to the end of the job."""
    ended = time.time()
    left = [float(line.rsplit(" ", 1)[1]) for line in stdout.splitlines() if "leaving at " in line]
    assert len(left) == 1, stdout
    return ended - left[0]


@pytest.mark.parametrize("others", OTHERS)
@pytest.mark.parametrize("how", list(FAILURES))
def test_failing_rank_ends_the_job_with_its_own_status(cluster, tmp_path, token, how, others):
    done, elapsed = run_cell(cluster, tmp_path, token, how, others)
    status, line = FAILURES[how]
    assert done.returncode == status, done.stderr
    assert line in done.stderr, done.stderr
    assert elapsed < 10, elapsed  # the job follows rank 3 within seconds, whatever the others do
    assert_only_mtrain_output(done.stderr)
    assert_no_leftovers(cluster, token, within=10)


@pytest.mark.parametrize("others", [o for o in OTHERS if o != "finish"])  # finish: no one needs rank 3
@pytest.mark.parametrize("how", ["exit0", "return"])
def test_rank_finishing_early_is_named_not_a_hang(cluster, tmp_path, token, how, others):
    # Status 0 on one rank while the others still need it: a user error, named, never a hang.
    done, elapsed = run_cell(cluster, tmp_path, token, how, others)
    assert done.returncode != 0, done.stderr
    report = done.stderr[done.stderr.index("mtrain: job failed; first failure:"):]
    assert "rank 3 left the job" in report or "rank(s) [3] left the job" in report, done.stderr
    assert elapsed < 10, elapsed
    assert_only_mtrain_output(done.stderr)
    assert_no_leftovers(cluster, token, within=10)


def test_every_rank_ending_normally_exits_zero_quickly(cluster, tmp_path, token):
    code = ("import sys, numpy as np, mtrain.ringreduce as rr\n"
            "rr.init()\n"
            "total = rr.allreduce(np.full(3, rr.rank() + 1.0), op=rr.Sum)\n"
            "print('total', total.tolist())\n"
            "if rr.rank() == 2:\n    sys.exit(0)\n")
    started = time.monotonic()
    done = run_mtrain(cluster, "-np", "4", "-H", "mtr-a:2,mtr-b:2", PYTHON, "-c", code, token, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout.count("total [10.0, 10.0, 10.0]") == 4
    assert time.monotonic() - started < 20
    assert "mtrain:" not in done.stderr, done.stderr
    assert_no_leftovers(cluster, token, within=10)
