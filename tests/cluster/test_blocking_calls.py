"""No call that waits outside the engine thread outlives a peer that left.

Rank 3 (on host mtr-b) leaves in a way only the program's runner can see, or politely
with status 0, while ranks 0-2 wait in a blocking call that needs it.  The job ends with
rank 3's own status, or, when it left with 0, with an error naming it (in init(), where
MPI cannot tell, the supervisor's); never a hang.
"""
from __future__ import annotations

import pytest

from tests.cluster.conftest import assert_followed_rank_3, run_leaving
from tests.cluster.leaving import FAILURES, UNSEEN

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(120)]
CALLS = ["init", "shutdown", "add_process_set", "remove_process_set", "barrier", "broadcast_object",
         "allgather_object", "join", "state_sync"]


def run_cell(cluster, tmp_path, token, call: str, how: str):
    return run_leaving(cluster, tmp_path, token, "blocking_rank.py", call, how)


@pytest.mark.parametrize("how", UNSEEN)
@pytest.mark.parametrize("call", CALLS)
def test_a_peer_leaving_with_an_error_status_ends_every_blocking_call(cluster, tmp_path, token, call, how):
    done, elapsed = run_cell(cluster, tmp_path, token, call, how)
    status, line = FAILURES[how]
    assert done.returncode == status, done.stderr
    assert line in done.stderr, done.stderr
    assert_followed_rank_3(cluster, token, done, elapsed)


@pytest.mark.parametrize("call", [c for c in CALLS if c not in ("init", "shutdown")])
def test_a_peer_leaving_politely_is_named_by_every_blocking_call_that_needs_it(cluster, tmp_path, token, call):
    done, elapsed = run_cell(cluster, tmp_path, token, call, "exit0")
    assert_followed_rank_3(cluster, token, done, elapsed, named_as_leaving=True)


def test_a_peer_that_ended_before_init_stops_the_others_waiting_in_init(cluster, tmp_path, token):
    # MPI cannot tell the ranks in init() that rank 3's program ended (it waits in MPI_Finalize
    # for them, they wait in init() for it); the supervisor hears it from both sides.
    done, elapsed = run_cell(cluster, tmp_path, token, "init", "exit0")
    assert done.returncode == 1, done.stderr
    assert ("mtrain: job stopped: it could never go on: rank 3 ended (exit code 0) without calling init(), while "
            "ranks 0, 1, 2 wait for it in init()") in done.stderr, done.stderr
    assert_followed_rank_3(cluster, token, done, elapsed)


def test_shutdown_needs_no_peer_that_left_politely(cluster, tmp_path, token):
    done, elapsed = run_cell(cluster, tmp_path, token, "shutdown", "exit0")
    assert done.returncode == 0, done.stderr
    assert_followed_rank_3(cluster, token, done, elapsed)
