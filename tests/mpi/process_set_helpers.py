"""What the process-set tests share: the sets each job size uses, their registration, and
bounded waits (a deadlock fails a test instead of hanging the suite)."""
import threading
import time

from mpi4py import MPI

import mtrain.ringreduce as rr

WAIT_S = 60.0  # no single op of these tests may take this long: past it, it is a deadlock


def set_lists(n: int) -> "list[list[int]]":
    return {1: [[0]], 2: [[0], [1]], 3: [[0, 2], [1]]}[n]


def register_sets() -> "list[rr.ProcessSet]":
    """The job's sets, registered through init() (the harness has already called init())."""
    sets = [rr.ProcessSet(ranks) for ranks in set_lists(rr.size())]
    rr.init(process_sets=sets)
    return sets


def wait_op(handle, what: str = "op"):
    """synchronize(), but an op that does not finish in WAIT_S fails the test (a deadlock)."""
    deadline = time.monotonic() + WAIT_S
    while not rr.poll(handle):
        if time.monotonic() > deadline:
            raise AssertionError(f"rank {rr.rank()}: {what} did not finish within {WAIT_S:g}s (deadlock?)")
        time.sleep(0.002)
    return rr.synchronize(handle)


def same_everywhere(value, what: str) -> None:
    seen = MPI.COMM_WORLD.allgather(value)
    assert all(v == seen[0] for v in seen), f"{what} differs across ranks: {seen}"


def engine_threads() -> int:
    return sum(1 for t in threading.enumerate() if t.name == "mtrain-engine" and t.is_alive())


def threads_seen() -> str:
    """This rank's live threads, for an engine count that differs from the expected one."""
    return ", ".join(f"{t.name}#{t.ident}" for t in threading.enumerate() if t.is_alive())
