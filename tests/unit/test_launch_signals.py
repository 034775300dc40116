"""The launch's own signal handling outside the job's run (launcher/job/launch.py's Termination),
and a launch whose SSH connection master cannot serve: it goes on without sharing."""
from __future__ import annotations

import os
import subprocess
import sys

from mtrain.launcher.cli.config import SshOptions


def _in_child(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)


def test_signal_outside_the_job_ends_the_launch_through_its_cleanup():
    # SIGTERM while a launch sets up: SystemExit(143) from where it was, so every finally runs.
    done = _in_child(
        "import os, signal\n"
        "from mtrain.launcher.job.launch import Termination\n"
        "try:\n"
        "    with Termination():\n"
        "        try:\n"
        "            os.kill(os.getpid(), signal.SIGTERM)\n"
        "            print('not reached')\n"
        "        finally:\n"
        "            print('cleaned')\n"
        "except SystemExit as done:\n"
        "    print('exit', done.code)\n"
        "print(signal.getsignal(signal.SIGTERM) is signal.SIG_DFL)\n")
    assert done.stdout.split() == ["cleaned", "exit", "143", "True"], done.stderr


def test_signal_during_the_cleanup_waits_for_its_end():
    done = _in_child(
        "import os, signal\n"
        "from mtrain.launcher.job.launch import Termination\n"
        "try:\n"
        "    with Termination() as termination:\n"
        "        with termination.cleaning():\n"
        "            os.kill(os.getpid(), signal.SIGINT)\n"
        "            os.kill(os.getpid(), signal.SIGTERM)\n"
        "            print('cleanup went on')\n"
        "except KeyboardInterrupt:\n"
        "    print('interrupted after it')\n")
    assert done.stdout.split("\n")[:2] == ["cleanup went on", "interrupted after it"], done.stderr


def test_launch_goes_on_without_sharing_where_no_socket_can_be_served(tmp_path, monkeypatch):
    from mtrain.launcher.job import launch as launchlib
    from mtrain.launcher.cli.config import LaunchConfig, MpiKind, MpiLauncher
    from mtrain.launcher.job.hosts import HostSlots
    config = LaunchConfig(plan=(HostSlots("a", 1),), command=("true",), remote_hosts=("a",), ssh=SshOptions(),
                          mpi=MpiLauncher("/bin/true", MpiKind.OPENMPI))
    not_private = tmp_path / "open"
    not_private.mkdir()
    os.chmod(not_private, 0o755)
    assert launchlib.start_master(config, str(not_private), "/tmp/job-{host}.json", None) is None
    assert os.listdir(not_private) == []
