"""Running a job from a test: in a session of its own, so that a job that outlives its time is
killed whole (mtrain or mpirun and whatever they started in it) and the test fails with the
job's last words, instead of leaving processes that would disturb the tests after it."""
from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from typing import Any

import pytest


def session_members(leader: int) -> "list[int]":
    """The live (not yet dead and unreaped) processes of the session ``leader`` started."""
    members = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as stat:
                # pid (comm) state ppid pgrp session ...: comm may hold spaces and parentheses.
                fields = stat.read().rsplit(b")", 1)[1].split()
        except (FileNotFoundError, ProcessLookupError):
            continue
        if int(fields[3]) == leader and fields[0] != b"Z":
            members.append(int(name))
    return members


def kill_session(leader: int) -> None:
    """SIGKILL every process in the session that ``leader`` started (``start_new_session``).

    Killing the leader's process group is not enough: Open MPI's daemon puts each rank in a
    process group of its own, and a rank that is not waiting in MPI (asleep, say) outlives its
    daemon. The session is what they all keep."""
    deadline = time.monotonic() + 10
    # Until every one is dead: one may fork while we look, and death takes a moment to show.
    while (members := session_members(leader)) and time.monotonic() < deadline:
        for pid in members:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.01)


def run_job(argv: "list[str]", timeout: float, what: str = "", **popen: Any) -> subprocess.CompletedProcess:
    """``argv``'s output and status (text); past ``timeout`` seconds its session is killed and the
    test fails, naming ``what`` (default: the command)."""
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, **popen)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_session(proc.pid)
        out, err = proc.communicate()
        pytest.fail(f"{what or ' '.join(argv)} did not finish within {timeout}s (hang?)\n"
                    f"--- stdout ---\n{out[-4000:]}\n--- stderr ---\n{err[-4000:]}")
    return subprocess.CompletedProcess(argv, proc.returncode, out, err)
