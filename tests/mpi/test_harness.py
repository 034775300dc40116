"""The harness's own promises: a job it starts is not stopped by what earlier mpiruns left, and in
a pooled job one body's failure, hang or lost rank fails that test alone."""
from __future__ import annotations

import os
import sys
import tempfile
import time
from typing import Callable

import pytest

from tests import stale_mpi_folders
from tests.jobs import session_members
from tests.mpi import pool
from tests.mpi.harness import launch


def test_a_job_starts_where_killed_mpiruns_left_their_folders():
    # A whole-suite run kills mpiruns and goes through the pids more than once: the folder a
    # killed one left (named after its pid alone) stops the next mpirun with that pid.
    base = tempfile.gettempdir()
    with stale_mpi_folders.planted(base) as planted:
        done = launch(2, [sys.executable, "-c", stale_mpi_folders.PRINT_PID], timeout=60)
        assert done.returncode == 0, done.stderr
        stale_mpi_folders.assert_mpirun_met_them(done.stdout, 2, base, planted)


# Bodies for the pool to run: plain functions that ranks import by name (as mpi_test's are).
def _body(function: Callable[[], None]) -> Callable[[], None]:
    function.rank_body = function  # type: ignore[attr-defined]
    return function


def _rank() -> int:
    import mtrain.ringreduce as rr
    return rr.rank()


@_body
def passes() -> None:
    import numpy as np

    import mtrain.ringreduce as rr
    got = rr.allreduce(np.ones(4), op=rr.Sum)
    assert (got == rr.size()).all()


@_body
def fails_on_rank_1() -> None:
    print(f"output of rank {_rank()}", flush=True)
    sys.stderr.write(f"errors of rank {_rank()}\n")
    if _rank() == 1:
        raise AssertionError("a planted failure")


@_body
def hangs_on_rank_0() -> None:
    if _rank() == 0:
        time.sleep(3600)


@_body
def exits_1_on_rank_1() -> None:
    if _rank() == 1:
        sys.exit(1)


@_body
def out_of_step() -> None:
    # Rank 0 waits in a barrier that rank 1 never joins: rank 1 answers, rank 0 never does. (The
    # runtime's own ops would fail instead: a rank that shuts down fails the ops left in flight.)
    from mpi4py import MPI
    if _rank() == 0:
        MPI.COMM_WORLD.Barrier()


@_body
def loses_rank_1() -> None:
    if _rank() == 1:
        os._exit(3)


# A job of these tests' own: its environment sets it apart from every other test's pool.
KEY = pool.PoolKey(2, (("MTRAIN_TEST_HARNESS_POOL", "1"),))


def _run(function: Callable[[], None], timeout: float = 120) -> None:
    pool.run_pooled(KEY, pool.Body(__name__, function.__name__), timeout)


def _fails_alone(function: Callable[[], None], timeout: float, *expected: str) -> str:
    """``function`` fails with ``expected`` in its message (returned), its job is ended, and the
    next body passes on a fresh job."""
    _run(passes)  # a warm job: the bodies below run in one that already ran a body
    first = pool.job_pid(KEY)
    assert first is not None
    with pytest.raises(pytest.fail.Exception) as failed:
        _run(function, timeout)
    for text in expected:
        assert text in str(failed.value), str(failed.value)
    assert pool.job_pid(KEY) is None
    assert not session_members(first), "the failed body's job left processes running"
    _run(passes)
    assert pool.job_pid(KEY) not in (None, first)
    return str(failed.value)


def test_a_failing_body_fails_alone_with_every_ranks_output():
    _fails_alone(fails_on_rank_1, 120, "failed on rank(s) [1]", "AssertionError: a planted failure",
                 "output of rank 0", "output of rank 1", "errors of rank 0", "errors of rank 1")


def test_a_hanging_body_times_out_and_the_next_body_runs():
    _fails_alone(hangs_on_rank_0, 5, "did not finish within its time", "hangs_on_rank_0")


def test_a_body_that_exits_on_one_rank_fails():
    _fails_alone(exits_1_on_rank_1, 120, "failed on rank(s) [1]", "SystemExit: 1")


def test_ranks_out_of_step_fail_the_body_that_left_them_so():
    _fails_alone(out_of_step, 10, "did not finish within its time", "out_of_step")


def test_a_rank_that_dies_fails_the_body():
    message = _fails_alone(loses_rank_1, 30, "loses_rank_1")
    # Seen as a lost rank or a dead job, not waited out to the time limit.
    assert "did not finish within its time" not in message, message
    assert "lost rank" in message or "exited with" in message, message


def test_closing_the_pools_leaves_no_process():
    _run(passes)
    pid = pool.job_pid(KEY)
    assert pid is not None
    pool.close_all()
    assert pool.job_pid(KEY) is None
    assert not session_members(pid)


def test_a_shared_pools_job_outlives_its_file_and_ends_with_the_folder():
    # conftest.py ends a file's jobs when pytest leaves the file (close_file_jobs), and a shared
    # pool's (the TensorFlow files') only when it leaves the folder (close_all).
    shared = pool.PoolKey(KEY.nprocs, KEY.env, "harness-shared")
    _run(passes)
    pool.run_pooled(shared, pool.Body(__name__, passes.__name__), 120)
    plain, kept = pool.job_pid(KEY), pool.job_pid(shared)
    assert plain is not None and kept is not None and plain != kept
    pool.close_file_jobs()
    assert pool.job_pid(KEY) is None and pool.job_pid(shared) == kept
    assert not session_members(plain), "the file's job left processes running"
    pool.run_pooled(shared, pool.Body(__name__, passes.__name__), 120)
    assert pool.job_pid(shared) == kept  # the next file's body ran in the same job
    pool.close_all()
    assert pool.job_pid(shared) is None
    assert not session_members(kept), "the shared job left processes running"
