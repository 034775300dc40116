"""The preflight through srun (launcher/job/slurm.py), against an `srun` stand-in that answers as Slurm
does: one JSON line per node that ran the probe, srun's and slurmstepd's error lines for the others.
(tests/cluster/test_slurm.py runs the real Slurm.)"""
from __future__ import annotations

import os
import stat
import sys

import pytest

import mtrain
from mtrain.launcher.job import slurm

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def fake_srun(tmp_path, monkeypatch):
    """An `srun` that runs the probe here as node mtr-a, and says node mtr-b has no such Python."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "srun").write_text(
        f"#!{sys.executable}\n"
        "import os, subprocess, sys\n"
        "argv = sys.argv[1:]\n"
        "with open(os.path.join(os.path.dirname(__file__), 'argv'), 'w') as out:\n"
        "    out.write('\\n'.join(argv))\n"
        "command = argv[next(i for i, word in enumerate(argv) if not word.startswith('--')):]\n"
        "subprocess.run(command, env=dict(os.environ, SLURMD_NODENAME='mtr-a'))\n"
        "print('slurmstepd-mtr-b: error: execve(): /nowhere/python: No such file or directory', file=sys.stderr)\n"
        "print('srun: error: mtr-b: task 1: Exited with exit code 2', file=sys.stderr)\n"
        "sys.exit(2)\n")
    (bin_dir / "srun").chmod(stat.S_IRWXU)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    return bin_dir


def test_one_step_one_task_per_node_and_a_line_per_failing_node(fake_srun):
    reports = slurm.preflight(("mtr-a", "mtr-b"), sys.executable, mtrain.__version__, 30.0, {"mtr-a": 3, "mtr-b": 2})
    argv = (fake_srun / "argv").read_text().splitlines()
    assert argv[:5] == ["--nodes=2", "--ntasks=2", "--ntasks-per-node=1", "--nodelist=mtr-a,mtr-b", "--overlap"]
    assert argv[argv.index(sys.executable):][-1] == "3"  # as many ports as the node that needs most
    good, bad = reports["mtr-a"], reports["mtr-b"]
    assert good.error is None and len(good.ports) == 3 and len(set(good.ports)) == 3 and good.addresses
    assert bad.error.startswith(f"host mtr-b: no Python at {sys.executable}"), bad.error
    assert "execve(): /nowhere/python: No such file or directory" in bad.error


def test_a_version_mismatch_is_named(fake_srun):
    reports = slurm.preflight(("mtr-a",), sys.executable, "0.0.0-other", 30.0, {"mtr-a": 1})
    assert reports["mtr-a"].error == (f"host mtr-a: mtrain {mtrain.__version__} there but 0.0.0-other here; "
                                      "install the same version on every host")


def test_no_answer_within_the_timeout(tmp_path, monkeypatch):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "srun").write_text("#!/bin/sh\nexec sleep 60\n")
    (bin_dir / "srun").chmod(stat.S_IRWXU)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    reports = slurm.preflight(("mtr-a",), sys.executable, mtrain.__version__, 0.5, {"mtr-a": 1})
    assert "no answer through srun within --start-timeout 0.5 s" in reports["mtr-a"].error
