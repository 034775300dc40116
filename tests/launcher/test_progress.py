"""`mtrain run --progress` on a terminal (a pseudo-terminal here): the live line is drawn while
the ranks' output scrolls above it, and nothing of it is left at the end; usage errors exit 2."""
from __future__ import annotations

import os
import pty
import select
import subprocess
import sys
import time

import pytest

from tests.launcher.test_local_run import env, mtrain

pytestmark = pytest.mark.timeout(120)
PYTHON = sys.executable
PROGRAM = ("import time, numpy as np, mtrain.ringreduce as rr\n"
           "rr.init()\n"
           "for step in range(60):\n"
           "    time.sleep(0.05)\n"
           "    rr.allreduce(np.full(1000, rr.rank() + 1.0), name='grad', op=rr.Sum)\n"
           "    if step % 20 == 0:\n"
           "        print('step', step, 'rank', rr.rank(), flush=True)\n")


def run_in_terminal(argv: "list[str]", timeout: float) -> "tuple[int, bytes]":
    """Run ``argv`` with stdout and stderr on a pseudo-terminal; its status and all it wrote."""
    controller, terminal = pty.openpty()
    proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=terminal, stderr=terminal, env=env(),
                            close_fds=True)
    os.close(terminal)
    seen = b""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        ready, _, _ = select.select([controller], [], [], 0.5)
        if ready:
            try:
                chunk = os.read(controller, 65536)
            except OSError:  # the terminal's other end is closed: the job has ended
                break
            if not chunk:
                break
            seen += chunk
        elif proc.poll() is not None:
            break
    os.close(controller)
    try:
        status = proc.wait(timeout=max(deadline - time.monotonic(), 1))
    except subprocess.TimeoutExpired:
        proc.kill()
        raise AssertionError(f"mtrain run did not end: {seen[-3000:]!r}")
    return status, seen


def test_live_line_on_a_terminal_with_the_ranks_output_above_it():
    status, seen = run_in_terminal([PYTHON, "-m", "mtrain.launcher.cli.main", "run", "-np", "2", "--progress",
                                    "--no-straggler-report", PYTHON, "-c", PROGRAM], timeout=90)
    text = seen.decode(errors="replace")
    assert status == 0, text
    for rank in (0, 1):
        for step in (0, 20, 40):
            assert f"[{rank}]<stdout>:step {step} rank {rank}" in text, text
    # The live line, drawn by rich with cursor controls, once the ranks were up and had sent steps.
    assert "ranks 2/2 up" in text, text
    assert " · step " in text and "steps/s over 10 s" in text, text
    assert "\x1b[" in text  # drawn in place, not printed as lines
    assert "mtrain: progress:" not in text  # the plain line is for logs, not terminals
    assert "straggler report" not in text


def test_progress_and_straggler_options_are_checked():
    for args, fragment in ((["--straggler-report", "-3"], "--straggler-report"),
                           (["--progress-interval", "0"], "--progress-interval")):
        done = mtrain("-np", "1", *args, PYTHON, "-c", "pass")
        assert done.returncode == 2, done.stderr
        assert fragment in done.stderr and "Traceback" not in done.stderr, done.stderr
    bad = mtrain("-np", "1", PYTHON, "-c", "pass", extra_env={"MTRAIN_STRAGGLER_EVERY": "often"})
    assert bad.returncode == 2 and "--straggler-report" in bad.stderr, bad.stderr
    assert "Traceback" not in bad.stderr

