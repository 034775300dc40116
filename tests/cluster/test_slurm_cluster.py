"""The Slurm test cluster itself (tests/cluster/slurmcluster.py): jobs run on both hosts,
batch jobs report their exit code, allocations work, jobs do not queue behind each other."""
from __future__ import annotations

import subprocess
import time

import pytest

from tests.cluster.conftest import assert_no_leftovers

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(180)]


def test_srun_runs_one_task_per_host(slurm, cluster, token):
    done = slurm.run(["srun", "-N2", "-n2", "--time=2", "sh", "-c", f"hostname # {token}"], timeout=60)
    assert done.returncode == 0, done.stderr + slurm.log_tails()
    assert sorted(done.stdout.split()) == ["mtr-a", "mtr-b"], done.stdout
    assert_no_leftovers(cluster, token, within=10)


@pytest.mark.parametrize("code", [0, 3])
def test_sbatch_wait_returns_the_script_exit_code(slurm, cluster, token, tmp_path, code):
    script = tmp_path / "job.sh"
    script.write_text("#!/bin/sh\n"
                      f"#SBATCH -N2 --ntasks-per-node=2 --time=2 -o {tmp_path}/out-%j.txt\n"
                      f"srun sh -c 'hostname # {token}'\n"
                      f"exit {code}\n")
    done = slurm.run(["sbatch", "--parsable", "--wait", str(script)], timeout=90, cwd=tmp_path)
    assert done.returncode == code, done.stdout + done.stderr
    job_id = done.stdout.split()[0].split(";")[0]
    output = (tmp_path / f"out-{job_id}.txt").read_text()
    assert sorted(output.split()) == ["mtr-a", "mtr-a", "mtr-b", "mtr-b"], output
    # No accounting daemon, so no sacct: scontrol keeps a finished job for MinJobAge seconds.
    assert slurm.job_exit_code(job_id) == f"{code}:0"
    assert_no_leftovers(cluster, token, within=10)


def test_salloc_then_srun(slurm, cluster, token):
    done = slurm.run(["salloc", "-N2", "--time=2", "srun", "sh", "-c", f"hostname # {token}"], timeout=60)
    assert done.returncode == 0, done.stderr
    assert sorted(done.stdout.split()) == ["mtr-a", "mtr-b"], done.stdout + done.stderr
    assert_no_leftovers(cluster, token, within=10)


def test_jobs_filling_the_cluster_do_not_queue_behind_each_other(slurm, cluster, token):
    """OverSubscribe: a 2x2 job starts while another 2x2 job still holds both nodes."""
    holder = subprocess.Popen(["srun", "-N2", "-n4", "--time=2", "sh", "-c", f"sleep 60 # {token}"],
                              env=slurm.env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 30
        while "mtr-" not in slurm.run(["squeue", "-h", "-t", "R", "-o", "%N"], timeout=15).stdout:
            assert holder.poll() is None and time.monotonic() < deadline, holder.stderr.read() if holder.stderr else ""
            time.sleep(0.2)
        started = time.monotonic()
        done = slurm.run(["srun", "--immediate=20", "-N2", "-n4", "--time=2", "hostname"], timeout=60)
        assert done.returncode == 0, done.stderr
        assert sorted(done.stdout.split()) == ["mtr-a", "mtr-a", "mtr-b", "mtr-b"], done.stdout
        assert time.monotonic() - started < 15
    finally:
        holder.terminate()  # srun forwards it to the tasks
        try:
            holder.wait(timeout=30)
        except subprocess.TimeoutExpired:
            holder.kill()
            holder.wait(timeout=10)
    assert_no_leftovers(cluster, token, within=15)
