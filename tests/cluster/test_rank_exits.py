"""Every way a rank can end ends the job, with that rank's own status and name, and nothing left.

One rank (3, on host mtr-b) ends while the other three are in a collective, outside
MPI, in a barrier, or blocked on a handle: the cells of the exit matrix.
"""
from __future__ import annotations

import time

import pytest

from tests.cluster.conftest import PYTHON, assert_followed_rank_3, assert_no_leftovers, run_leaving, run_mtrain
from tests.cluster.leaving import FAILURES, POLITE

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(120)]
OTHERS = ["collective", "sleep", "barrier", "synchronize", "finish", "remove_process_set"]


def run_cell(cluster, tmp_path, token, how: str, others: str):
    return run_leaving(cluster, tmp_path, token, "exit_rank.py", how, others)


@pytest.mark.parametrize("others", OTHERS)
@pytest.mark.parametrize("how", list(FAILURES))
def test_failing_rank_ends_the_job_with_its_own_status(cluster, tmp_path, token, how, others):
    done, elapsed = run_cell(cluster, tmp_path, token, how, others)
    status, line = FAILURES[how]
    assert done.returncode == status, done.stderr
    assert line in done.stderr, done.stderr
    assert_followed_rank_3(cluster, token, done, elapsed)


@pytest.mark.parametrize("others", [o for o in OTHERS if o != "finish"])  # finish: no one needs rank 3
@pytest.mark.parametrize("how", POLITE)
def test_rank_finishing_early_is_named_not_a_hang(cluster, tmp_path, token, how, others):
    # Status 0 on one rank while the others still need it: a user error, named, never a hang.
    done, elapsed = run_cell(cluster, tmp_path, token, how, others)
    assert_followed_rank_3(cluster, token, done, elapsed, named_as_leaving=True)


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
