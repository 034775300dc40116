"""The remote guard ends what it started even when its session's stderr is already gone.

When the launcher's connection drops, sshd closes the guard's stdin and its stderr at once: the
guard's notice then meets a broken pipe.  It must still end the daemon's tree (the ranks of a
host whose daemon died wait for exactly that), not die of the write or stop in it.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().rpartition(")")[2].split()[0] != "Z"
    except OSError:
        return False


def _wait_for_pid(path: Path, timeout: float = 20) -> int:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        text = path.read_text().strip() if path.exists() else ""
        if text.isdigit():
            return int(text)
        time.sleep(0.05)
    raise AssertionError(f"nothing wrote {path}")


def _wait_until_reaped(pid: int, timeout: float = 20) -> None:
    """Until ``pid`` is gone from /proc: its parent (the guard) has waited for it."""
    deadline = time.monotonic() + timeout
    while os.path.exists(f"/proc/{pid}"):
        assert time.monotonic() < deadline, f"{pid} was not reaped"
        time.sleep(0.02)


@pytest.fixture
def guard(tmp_path):
    """A guard running a 'daemon' shell that leaves one background child (a 'rank'), with its
    stderr a pipe whose reader the test closes; yields (guard, daemon pid, rank pid)."""
    command = (f"sleep 1000 & echo $! > {tmp_path}/rank; echo $$ > {tmp_path}/daemon; "
               f"exec sleep 1001")
    read_end, write_end = os.pipe()
    proc = subprocess.Popen([sys.executable, "-m", "mtrain.launcher.remote_guard", command],
                            stdin=subprocess.PIPE, stderr=write_end)
    os.close(write_end)
    try:
        rank, daemon = _wait_for_pid(tmp_path / "rank"), _wait_for_pid(tmp_path / "daemon")
        os.close(read_end)  # the session's end: nobody reads the guard's stderr any more
        read_end = -1
        yield proc, daemon, rank
    finally:
        if read_end >= 0:
            os.close(read_end)
        proc.kill()
        proc.wait(timeout=10)
        for path in ("rank", "daemon"):
            text = (tmp_path / path).read_text().strip() if (tmp_path / path).exists() else ""
            if text.isdigit() and _alive(int(text)):
                os.kill(int(text), signal.SIGKILL)


def test_the_end_of_the_session_ends_the_tree_though_stderr_is_gone(guard):
    proc, daemon, rank = guard
    proc.stdin.close()
    assert proc.wait(timeout=20) == 143  # its daemon was ended by SIGTERM
    assert not _alive(daemon) and not _alive(rank)


def test_a_daemon_killed_after_stderr_went_leaves_the_guard_guarding_its_ranks(guard):
    # The guard's word of the death cannot be delivered; it keeps its orphaned rank and ends
    # it when the session ends, instead of dying of the write and leaving the rank behind.
    proc, daemon, rank = guard
    os.kill(daemon, signal.SIGKILL)
    _wait_until_reaped(daemon)  # the guard has its word of the death to tell now (or told it)
    assert _alive(rank)
    proc.stdin.close()
    assert proc.wait(timeout=20) == 137
    assert not _alive(rank)
