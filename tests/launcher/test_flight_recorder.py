"""The flight recorder's signal path on this machine: SIGUSR1 reaches only ranks that catch it."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time

import pytest

from mtrain.launcher.rank import forward_if_caught
from tests.launcher.report_check import assert_only_mtrain_output

pytestmark = pytest.mark.timeout(120)
PYTHON = sys.executable


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PATH"] = os.path.dirname(PYTHON) + os.pathsep + env.get("PATH", "")
    return env


def _wait_for(lines: list, fragment: str, proc: subprocess.Popen, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not any(fragment in line for line in lines):
        assert proc.poll() is None and time.monotonic() < deadline, f"no {fragment!r} in {''.join(lines)}"
        time.sleep(0.05)


def test_forwarding_skips_a_process_that_does_not_catch_sigusr1():
    # The child catches SIGUSR2 alone, and says so when it comes (the evidence below).
    child = subprocess.Popen([PYTHON, "-c", "import signal, sys, time\n"
                              "signal.signal(signal.SIGUSR2, lambda *a: print('usr2', flush=True))\n"
                              "print('up', flush=True)\ntime.sleep(60)\n"],
                             stdout=subprocess.PIPE, text=True)
    catcher = subprocess.Popen([PYTHON, "-c", "import signal, sys\n"
                                "signal.signal(signal.SIGUSR1, lambda *a: sys.exit(7))\n"
                                "print('up', flush=True)\nsignal.pause()\n"],
                               stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline() == "up\n" and catcher.stdout.readline() == "up\n"
        assert not forward_if_caught(child.pid, signal.SIGUSR1)
        assert forward_if_caught(catcher.pid, signal.SIGUSR1)
        assert catcher.wait(timeout=20) == 7  # it got the signal
        # And this one was left alone. Evidence, not a look right after: kill() makes a signal
        # pending before it returns, and Linux delivers the lower-numbered of two pending signals
        # first, so had SIGUSR1 been sent, the child would die of it before it handled SIGUSR2.
        os.kill(child.pid, signal.SIGUSR2)
        assert child.stdout.readline() == "usr2\n"
        assert child.poll() is None
    finally:
        child.kill()
        catcher.kill()
        child.wait()
        catcher.wait()


def test_sigusr1_before_init_does_not_kill_the_program(tmp_path):
    release = tmp_path / "release"
    code = ("import os, time\nprint('ready', flush=True)\n"
            f"while not os.path.exists({str(release)!r}):\n    time.sleep(0.05)\nprint('finished', flush=True)\n")
    proc = subprocess.Popen([PYTHON, "-m", "mtrain.launcher.cli.main", "run", "-np", "2", PYTHON, "-c", code],
                            env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out: list = []
    err: list = []
    readers = [threading.Thread(target=lambda s=s, into=into: into.extend(iter(s.readline, "")), daemon=True)
               for s, into in ((proc.stdout, out), (proc.stderr, err))]
    for reader in readers:
        reader.start()
    try:
        deadline = time.monotonic() + 60
        while sum("ready" in line for line in out) < 2:
            assert proc.poll() is None and time.monotonic() < deadline, "".join(err)
            time.sleep(0.05)
        proc.send_signal(signal.SIGUSR1)
        _wait_for(err, "mtrain: diagnosis:", proc, timeout=30)  # nobody answers: after the collection's wait
        release.touch()
        assert proc.wait(timeout=60) == 0, "".join(err)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for reader in readers:
            reader.join(timeout=10)
    stderr = "".join(err)
    assert_only_mtrain_output(stderr)
    assert "".join(out).count("finished") == 2
    assert "mtrain: diagnosis: no rank answered; rank 0 did not answer" in stderr, stderr


def test_sigusr1_before_the_job_runs_does_not_end_mtrain():
    # The hang report's SIGUSR1 may come before a job runs (or between elastic generations), where
    # the supervisor's handler is not installed yet: its default action would end mtrain at once.
    code = ("import os, signal, sys\n"
            "import mtrain.launcher.job.launch as launch\n"
            "def launched(config, dry_run=False):\n"
            "    os.kill(os.getpid(), signal.SIGUSR1)\n"
            "    print('still here')\n"
            "    return 0\n"
            "launch.launch = launched\n"
            "from mtrain.launcher.cli.main import main\n"
            "sys.exit(main(['run', '-np', '1', 'true']))\n")
    done = subprocess.run([PYTHON, "-c", code], capture_output=True, text=True, timeout=60, env=_env())
    assert done.returncode == 0 and "still here" in done.stdout, (done.returncode, done.stderr)


def test_marker_lines_go_to_the_wrappers_pipe_only_while_it_is_still_that_pipe(tmp_path):
    from mtrain.common.records.marker import ENV_MARKER_FD, marker_channel, marker_fd
    read, write = os.pipe()
    other = os.open(tmp_path / "file", os.O_WRONLY | os.O_CREAT)
    try:
        assert marker_fd({ENV_MARKER_FD: marker_channel(write)}) == write
        fd, dev, ino = marker_channel(write).split(":")
        # The number taken by another file (a grandchild that inherited the variable, not the fd).
        assert marker_fd({ENV_MARKER_FD: f"{other}:{dev}:{ino}"}) == 2
        assert marker_fd({ENV_MARKER_FD: f"{fd}:{dev}:{int(ino) + 1}"}) == 2
        assert marker_fd({ENV_MARKER_FD: "nonsense"}) == 2
        assert marker_fd({}) == 2
        os.close(write)
        assert marker_fd({ENV_MARKER_FD: f"{fd}:{dev}:{ino}"}) == 2  # closed
    finally:
        os.close(read)
        os.close(other)


# A rank program run by pytest, whose default capture (--capture=fd) points fd 2 at a temporary
# file for the whole test: the two ranks submit different ops and wait for each other.
_DIVERGING_TEST = '''
import numpy as np
import mtrain.ringreduce as rr


def test_ranks_diverge():
    rr.init()
    name = "diverge.a" if rr.rank() == 0 else "diverge.b"
    rr.allreduce(np.ones(5, np.float32), name=name)
'''


def test_stall_report_names_each_ranks_op_when_pytest_captures_stderr(tmp_path):
    """A hang inside a test run by pytest under mtrain run (Horovod's test/parallel/test_tensorflow.py
    reducescatter scaling tests hung this way when ranks diverged): the stall warning's report
    must reach mtrain run and name the op each rank waits in. Before the marker channel, pytest's
    capture swallowed the stall request and every rank's dump ("rank 0: no answer")."""
    script = tmp_path / "test_diverge.py"
    script.write_text(_DIVERGING_TEST)
    env = {**_env(), "MTRAIN_STALL_WARNING_SECONDS": "2", "MTRAIN_STALL_SHUTDOWN_SECONDS": "8",
           "PYTHONPATH": os.getcwd()}
    done = subprocess.run([PYTHON, "-m", "mtrain.launcher.cli.main", "run", "-np", "2", PYTHON, "-m", "pytest", "-q",
                           "-p", "no:cacheprovider", str(script)],
                          env=env, cwd=tmp_path, capture_output=True, text=True, timeout=100)
    stderr = done.stderr
    assert done.returncode != 0, stderr  # the stall shutdown ends it
    assert "mtrain: flight recorder (stall warning): where each rank is" in stderr, stderr
    assert re.search(r"rank 0 \([^)]*\): waiting in allreduce 'diverge\.a'", stderr), stderr
    assert re.search(r"rank 1 \([^)]*\): waiting in allreduce 'diverge\.b'", stderr), stderr
    assert "no answer" not in stderr, stderr
