"""The driver's CallServer against real ranks: `mpirun -np N python -m mtrain.launcher.tasks.call_worker`.

What mtrain.spark.run and mtrain.ray build on: every rank's result comes back in rank order,
a raising function is reported naming its rank (and the ranks keep serving), stop ends
every rank with nothing left, and a process without the job's key is never served.
"""
from __future__ import annotations

import contextlib
import os
import re
import socket
import subprocess
import sys
import threading
import time
from typing import Iterator

import pytest

from mtrain.launcher.tasks.call_service import (
    CallServer,
    CallServerError,
    RankFailed,
    RanksMissing,
    client_handshake,
    new_key,
)
from tests.jobs import kill_session, session_members
from tests.mpi.mpirun import job_environment, mpirun_command

pytestmark = pytest.mark.timeout(120)


class Ranks:
    """`size` call workers under a real mpirun, in a session of their own."""

    def __init__(self, size: int, env: dict[str, str]) -> None:
        self.proc = subprocess.Popen(mpirun_command(size) + [sys.executable, "-m", "mtrain.launcher.tasks.call_worker"],
                                     env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                     start_new_session=True)

    def finish(self, timeout: float) -> tuple[int, str, str]:
        """mpirun's status and output once it ended (failing the test if it does not, in `timeout` s)."""
        try:
            out, err = self.proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            kill_session(self.proc.pid)
            out, err = self.proc.communicate()
            pytest.fail(f"the ranks did not end within {timeout} s\n{out[-2000:]}\n{err[-2000:]}")
        return self.proc.returncode, out, err


@pytest.fixture
def started() -> Iterator:
    """start(size, rank_size=..., rank_key=...): a started CallServer and its ranks; all ended afterwards."""
    made: list[tuple[CallServer, Ranks]] = []
    with contextlib.ExitStack() as folders:  # the jobs' folders outlive their mpiruns

        def start(size: int, rank_size: int | None = None,
                  rank_key: bytes | None = None) -> tuple[CallServer, Ranks]:
            server = CallServer(new_key(), size, bind="127.0.0.1")
            server.start()
            env = dict(server.env())
            if rank_key is not None:
                env["MTRAIN_CALL_KEY"] = rank_key.hex()
            ranks = Ranks(rank_size or size, folders.enter_context(job_environment(env)))
            made.append((server, ranks))
            return server, ranks

        yield start
        for server, ranks in made:
            server.stop()
            if ranks.proc.poll() is None:
                kill_session(ranks.proc.pid)
                ranks.proc.communicate()


def whoami(offset: int) -> tuple[int, str, int]:
    rank = int(os.environ["OMPI_COMM_WORLD_RANK"])
    return rank * 10 + offset, socket.gethostname(), os.getpid()


def fail_on(bad_rank: int) -> int:
    rank = int(os.environ["OMPI_COMM_WORLD_RANK"])
    if rank == bad_rank:
        raise ValueError(f"no good in rank {rank}")
    return rank


def stuck_or_fail(bad_rank: int) -> int:
    """`bad_rank` raises; the others wait as ranks do in a collective whose peer has gone."""
    if int(os.environ["OMPI_COMM_WORLD_RANK"]) == bad_rank:
        raise RuntimeError("rank gave up")
    time.sleep(600)
    return 0


def test_results_in_rank_order_and_errors_name_the_rank(started) -> None:
    server, ranks = started(3)
    server.wait_for_ranks(60)
    assert server.connected() == [0, 1, 2]
    results = server.call_all(whoami, args=(7,))
    assert [value for value, _, _ in results] == [7, 17, 27]
    assert len({pid for _, _, pid in results}) == 3  # three processes, not one answering thrice
    assert server.call_one(2, whoami, kwargs={"offset": 1})[0] == 21
    with pytest.raises(RankFailed) as failed:
        server.call_all(fail_on, args=(1,))
    assert failed.value.rank == 1 and failed.value.remote_type == "ValueError"
    assert "rank 1 failed: ValueError: no good in rank 1" in str(failed.value)
    assert "fail_on" in failed.value.remote_traceback
    # The ranks keep serving after a failed call.
    assert server.call_all(fail_on, args=(5,)) == [0, 1, 2]
    server.stop()
    status, _, err = ranks.finish(30)
    assert status == 0, err
    assert session_members(ranks.proc.pid) == []


def test_a_stuck_rank_does_not_hide_the_failure_and_stop_ends_it(started) -> None:
    server, ranks = started(2)
    server.wait_for_ranks(60)
    began = time.monotonic()
    with pytest.raises(RankFailed) as failed:
        server.call_all(stuck_or_fail, args=(1,))
    assert failed.value.rank == 1 and "rank gave up" in str(failed.value)
    assert time.monotonic() - began < 30  # reported without waiting for rank 0
    server.stop()
    status, _, err = ranks.finish(30)
    assert status != 0
    # The failed rank is ended first, saying why; its traceback is in the job's output.
    assert "rank 1: ending with status 1: this rank's call failed" in err, err
    assert "rank 1: the call raised:" in err and "RuntimeError: rank gave up" in err, err
    assert session_members(ranks.proc.pid) == []


def test_missing_ranks_are_named(started) -> None:
    server, ranks = started(3, rank_size=2)
    with pytest.raises(RanksMissing, match=r"rank 2 of 3 did not connect to the driver within 3 s"):
        server.wait_for_ranks(3)
    with pytest.raises(CallServerError, match="rank 2 not connected"):
        server.call_all(whoami, args=(0,))
    server.stop()
    status, _, err = ranks.finish(30)
    assert status == 0, err


def test_a_wrong_key_is_refused(started) -> None:
    server, ranks = started(1, rank_key=new_key())
    status, _, err = ranks.finish(60)
    assert status != 0
    assert "refused this rank's key" in err
    assert server.connected() == []
    # The same by hand: the handshake fails and nothing is registered.
    host, port = server.env()["MTRAIN_CALL_ADDRESS"].split(":")
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        with pytest.raises(ConnectionError):
            client_handshake(sock, b"not the key")
    assert server.connected() == []


DRIVER = """
import sys, time
from mtrain.launcher.tasks.call_service import CallServer, new_key
server = CallServer(new_key(), 2, bind="127.0.0.1")
server.start()
print(" ".join(f"{name}={value}" for name, value in server.env().items()), flush=True)
server.wait_for_ranks(60)
print("connected", flush=True)
time.sleep(600)
"""


def test_ranks_end_when_the_driver_dies() -> None:
    driver = subprocess.Popen([sys.executable, "-c", DRIVER], stdout=subprocess.PIPE, text=True,
                              start_new_session=True)
    try:
        env = dict(item.split("=", 1) for item in driver.stdout.readline().split())
        with job_environment(env) as full:
            ranks = Ranks(2, full)
            assert driver.stdout.readline() == "connected\n"
            kill_session(driver.pid)  # the driver dies: no stop, its connections just drop
            status, _, err = ranks.finish(30)
    finally:
        kill_session(driver.pid)
        driver.wait()
    assert status != 0
    # Every rank notices the lost connection, but the first to leave with it ends the job (MPI_Abort):
    # a rank that had not yet said so is stopped without a word. At least one says it, and none is left.
    assert re.search(r"rank [01]: lost the connection to the driver", err), err
    assert session_members(ranks.proc.pid) == []


class _WatchedCondition(threading.Condition):
    """The server's condition, telling when a thread waits on it and how each wait ended."""

    def __init__(self) -> None:
        super().__init__()
        self.waiting = threading.Event()
        self.ends: list[bool] = []  # per wait: True when notified, False when it timed out

    def wait(self, timeout: float | None = None) -> bool:
        self.waiting.set()  # (under the lock: no notify can come before this wait has begun)
        notified = super().wait(timeout)
        self.ends.append(notified)
        return notified


class _WatchedServer(CallServer):
    """A CallServer whose condition is a ``_WatchedCondition`` (the one change a subclass makes)."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self._changed = self.watched = _WatchedCondition()


def test_fail_wakes_a_waiter() -> None:
    """A thread already waiting for the ranks is woken by fail() (notified, not by its wait's timeout
    of up to 0.5 s running out) and raises the reason."""
    server = _WatchedServer(new_key(), 2, bind="127.0.0.1")
    watched = server.watched
    server.start()
    raised: list[BaseException] = []

    def waiter() -> None:
        try:
            server.wait_for_ranks(60)
        except BaseException as error:  # noqa: B902  (whatever it is, the test names it)
            raised.append(error)

    thread = threading.Thread(target=waiter, daemon=True)
    thread.start()
    try:
        assert watched.waiting.wait(10), "the waiter never waited for the ranks"
        server.fail("mtrain: the job ended with status 1 before its ranks connected")
        thread.join(10)
        assert not thread.is_alive(), "fail() did not end the wait"
        assert len(raised) == 1 and isinstance(raised[0], CallServerError), raised
        assert "the job ended with status 1" in str(raised[0]), raised
        assert watched.ends and watched.ends[-1] is True, \
            f"the waiter's last wait timed out instead of being woken by fail(): {watched.ends}"
    finally:
        server.stop()
        thread.join(10)
