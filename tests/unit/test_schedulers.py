"""Inside a scheduler's allocation: which hosts, which launcher, and the one-line errors (no scheduler runs here;
tests/cluster/test_slurm.py runs the real one)."""
from __future__ import annotations

import os
import stat
import subprocess
import sys

import pytest

from mtrain.launcher.job.hosts import HostSlots, HostSpecError, pbs_hosts, scheduler_allocation
from mtrain.launcher.job.netif import shared_subnets

pytestmark = pytest.mark.timeout(60)
SLURM = {"SLURM_JOB_ID": "41", "SLURM_JOB_NODELIST": "gpu[07-08]", "SLURM_TASKS_PER_NODE": "2(x2)"}


def mtrain(*args: str, env: dict, path_dir=None) -> subprocess.CompletedProcess:
    full = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "PBS_"))}
    full.update(env)
    if path_dir is not None:
        full["PATH"] = f"{path_dir}{os.pathsep}{full['PATH']}"
    return subprocess.run([sys.executable, "-m", "mtrain.launcher.cli.main", "run", *args], capture_output=True,
                          text=True, timeout=30, env=full)


@pytest.fixture
def fake_srun(tmp_path):
    """A folder with an `srun` on it (never run: --dry-run starts nothing), so the choice does not
    depend on whether this machine has Slurm's tools."""
    folder = tmp_path / "bin"
    folder.mkdir()
    srun = folder / "srun"
    srun.write_text("#!/bin/sh\necho 'not to be run' >&2\nexit 99\n")
    srun.chmod(stat.S_IRWXU)
    return folder


def test_pbs_nodefile_lists_one_line_per_slot(tmp_path):
    nodefile = tmp_path / "nodes"
    nodefile.write_text("n2\nn2\nn1\nn2\n\nn1\n")
    env = {"PBS_JOBID": "77.server", "PBS_NODEFILE": str(nodefile)}
    assert pbs_hosts(env) == [HostSlots("n2", 3), HostSlots("n1", 2)]
    assert pbs_hosts({"PBS_NODEFILE": str(nodefile)}) is None  # not inside a PBS job
    allocation = scheduler_allocation(env)
    assert (allocation.scheduler, allocation.job_id, allocation.slots) == ("PBS", "77.server", 5)
    with pytest.raises(HostSpecError, match="cannot read it"):
        pbs_hosts({"PBS_JOBID": "1", "PBS_NODEFILE": str(tmp_path / "absent")})
    nodefile.write_text("n1\nbad;name\n")
    with pytest.raises(HostSpecError, match=":2"):
        pbs_hosts(env)


def test_slurm_comes_before_pbs():
    allocation = scheduler_allocation({**SLURM, "PBS_JOBID": "1", "PBS_NODEFILE": "/nonexistent"})
    assert allocation.scheduler == "Slurm" and allocation.hosts == (HostSlots("gpu07", 2), HostSlots("gpu08", 2))


def test_shared_subnets_are_those_of_every_host():
    a = {"lo": "127.0.0.1/8", "eth0": "10.1.0.5/16", "ib0": "192.168.7.1/24", "docker0": "172.17.0.1/16"}
    b = {"lo": "127.0.0.1/8", "eno1": "10.1.3.9/16", "docker0": "172.17.0.1/16"}
    assert shared_subnets([a, b], skip=("docker0",)) == ("10.1.0.0/16",)
    assert shared_subnets([a], skip=("docker0",)) == ("10.1.0.0/16", "192.168.7.0/24")
    assert shared_subnets([a, {"eth0": "10.2.0.1/16"}]) == ()


def test_inside_slurm_the_ranks_start_through_slurm(fake_srun):
    done = mtrain("--dry-run", "python", "train.py", env=SLURM, path_dir=fake_srun)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[:3] == ["host gpu07: ranks 0-1 (slurm)", "host gpu08: ranks 2-3 (slurm)",
                         "launcher: slurm (inside Slurm job 41: srun starts the MPI daemons, no SSH)"]
    argv = lines[-1]
    assert "-np 4 --host gpu07:2,gpu08:2" in argv and "--prtemca plm slurm" in argv
    assert "mtrain.launcher.remote_guard --slurm" in argv and "plm_ssh_agent" not in argv


def test_np_takes_the_first_slots_of_the_allocation(fake_srun):
    done = mtrain("-np", "3", "--dry-run", "python", "train.py", env=SLURM, path_dir=fake_srun)
    assert done.stdout.splitlines()[:2] == ["host gpu07: ranks 0-1 (slurm)", "host gpu08: rank 2 (slurm)"]


@pytest.mark.parametrize("args, expected", [
    (["--launcher", "ssh"], "launcher: ssh"),
    (["-H", "gpu07:1,gpu09:1"], "launcher: ssh"),
])
def test_ssh_when_asked_for_inside_slurm(fake_srun, args, expected):
    done = mtrain(*args, "--dry-run", "python", "train.py", env=SLURM, path_dir=fake_srun)
    assert done.returncode == 0, done.stderr
    assert expected in done.stdout.splitlines() and "plm_ssh_agent" in done.stdout


def test_pbs_hosts_go_over_ssh(tmp_path):
    nodefile = tmp_path / "nodes"
    nodefile.write_text("pa\npa\npb\n")
    done = mtrain("--dry-run", "python", "train.py", env={"PBS_JOBID": "9", "PBS_NODEFILE": str(nodefile)})
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[:3] == ["host pa: ranks 0-1 (ssh)", "host pb: rank 2 (ssh)", "launcher: ssh"]


@pytest.mark.parametrize("args, env, fragment", [
    (["-np", "5"], SLURM, "-np 5 is more than the 4 slots of Slurm job 41 (gpu07:2,gpu08:2)"),
    (["--launcher", "slurm", "-H", "a:1"], SLURM, "drop -H / --hostfile"),
    (["--launcher", "slurm", "-np", "2"], {}, "not inside a Slurm allocation"),
    (["--launcher", "slurm"], dict(SLURM, PATH="/nonexistent"), "no srun on PATH"),
])
def test_usage_errors_inside_and_outside_slurm(args, env, fragment):
    done = mtrain(*args, sys.executable, "train.py", env=env)
    assert done.returncode == 2, done.stderr
    assert len(done.stderr.strip().splitlines()) == 1 and fragment in done.stderr, done.stderr


def test_auto_without_srun_goes_over_ssh():
    done = mtrain("--dry-run", sys.executable, "train.py", env=dict(SLURM, PATH="/nonexistent"))
    assert done.returncode == 0, done.stderr
    assert "launcher: ssh" in done.stdout.splitlines()


@pytest.mark.parametrize("fields, expected", [
    ({"JobState": "RUNNING", "RunTime": "00:10:00", "TimeLimit": "00:05:00"}, None),
    ({"JobState": "COMPLETING", "RunTime": "00:05:00", "TimeLimit": "00:05:00"}, "reached its time limit (00:05:00)"),
    ({"JobState": "COMPLETING", "RunTime": "1-00:00:03", "TimeLimit": "1-00:00:00"}, "reached its time limit (1-00:00:00)"),
    ({"JobState": "COMPLETING", "RunTime": "00:00:07", "TimeLimit": "UNLIMITED"}, "was cancelled (scancel, or Slurm ended it)"),
    ({"JobState": "COMPLETING", "RunTime": "00:04:59", "TimeLimit": "00:05:00"}, "was cancelled (scancel, or Slurm ended it)"),
    ({"JobState": "TIMEOUT"}, "reached its time limit"),
    ({}, None),
])
def test_why_slurm_is_ending_a_job(fields, expected):
    from mtrain.launcher.job.slurm import ended_by
    assert ended_by(fields) == expected
