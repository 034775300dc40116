"""Running a job from a test: in a session of its own, so that a job that outlives its time is
killed whole (mtrain or mpirun and whatever they started in it) and the test fails with the
job's last words, instead of leaving processes that would disturb the tests after it."""
from __future__ import annotations

import os
import signal
import subprocess
from typing import Any

import pytest


def run_job(argv: "list[str]", timeout: float, what: str = "", **popen: Any) -> subprocess.CompletedProcess:
    """``argv``'s output and status (text); past ``timeout`` seconds its session is killed and the
    test fails, naming ``what`` (default: the command)."""
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, **popen)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"{what or ' '.join(argv)} did not finish within {timeout}s (hang?)\n"
                    f"--- stdout ---\n{out[-4000:]}\n--- stderr ---\n{err[-4000:]}")
    return subprocess.CompletedProcess(argv, proc.returncode, out, err)
