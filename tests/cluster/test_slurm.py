"""`mtrain run` inside a real Slurm allocation (tests/cluster/slurmcluster.py): the ranks start
through Slurm, with no SSH, and everything that holds over SSH holds here too.

The launching user's HOME here has no ~/.ssh at all, so any SSH connection would fail.
"""
from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import pytest

from tests.cluster.conftest import PYTHON, assert_no_leftovers, mtrain_argv

pytest.importorskip("torch")
pytestmark = [pytest.mark.cluster, pytest.mark.timeout(180)]
HERE = Path(__file__).resolve().parent
ALLOCATION = ["-N2", "--ntasks-per-node=2", "--time=5"]


def no_ssh_env(slurm, tmp_path: Path) -> dict[str, str]:
    """The cluster's Slurm environment for a user without any SSH setup; `python` is this one."""
    home = tmp_path / "home"
    home.mkdir(exist_ok=True)
    env = slurm.env()
    env["HOME"] = str(home)
    env["PATH"] = str(Path(PYTHON).parent) + ":" + env["PATH"]
    return env


def json_lines(text: str) -> dict[int, dict]:
    found = {}
    for line in text.splitlines():
        _, _, rest = line.partition(">:")
        if rest.startswith("{"):
            data = json.loads(rest)
            found[data["rank"]] = data
    return found


def salloc(slurm, tmp_path: Path, *words: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """`salloc` of 2 nodes x 2 tasks running `words` (on this, the submitting host, as salloc does)."""
    return subprocess.run(["salloc", "--quiet", *ALLOCATION, *words], env=no_ssh_env(slurm, tmp_path),
                          capture_output=True, text=True, timeout=timeout, cwd=tmp_path)


def batch_script(tmp_path: Path, *lines: str) -> Path:
    script = tmp_path / "job.sh"
    script.write_text("#!/bin/sh\n" + "".join(f"#SBATCH {option}\n" for option in ALLOCATION)
                      + f"#SBATCH -o {tmp_path}/out-%j.txt\n" + "\n".join(lines) + "\n")
    return script


def sbatch_wait(slurm, tmp_path: Path, *lines: str) -> "tuple[int, str, str]":
    """(sbatch --wait's status, the job's id, its output) of a batch job running `lines`."""
    script = batch_script(tmp_path, *lines)
    done = subprocess.run(["sbatch", "--parsable", "--wait", str(script)], env=no_ssh_env(slurm, tmp_path),
                          capture_output=True, text=True, timeout=150, cwd=tmp_path)
    job = done.stdout.split(";")[0].strip()
    output = tmp_path / f"out-{job}.txt"
    return done.returncode, job, output.read_text() if output.exists() else done.stderr


def mtrain_run(*args: str) -> str:
    import shlex
    return shlex.join(mtrain_argv(*args))


def test_a_training_job_of_2_nodes_by_2_tasks_under_sbatch(slurm, cluster, tmp_path, token):
    status, job, output = sbatch_wait(slurm, tmp_path, mtrain_run(PYTHON, str(HERE / "slurm_train.py"), "5", token))
    assert status == 0, output + slurm.log_tails()
    ranks = json_lines(output)
    assert sorted(ranks) == [0, 1, 2, 3], output
    assert [ranks[r]["host"] for r in range(4)] == ["mtr-a", "mtr-a", "mtr-b", "mtr-b"]
    assert [(ranks[r]["env_rank"], ranks[r]["local_rank"]) for r in range(4)] == [
        ("0", "0"), ("1", "1"), ("2", "0"), ("3", "1")]
    assert {ranks[r]["master_addr"] for r in range(4)} == {"10.77.0.11"}
    assert ranks[0]["equal_to_one_process"] and ranks[0]["moved"], ranks[0]
    assert "mtrain:" not in output, output
    assert slurm.job_exit_code(job) == "0:0"
    assert_no_leftovers(cluster, token, within=10)


def test_under_salloc_from_a_host_outside_the_allocation(slurm, cluster, tmp_path, token):
    done = salloc(slurm, tmp_path, *mtrain_argv(PYTHON, str(HERE / "rank_probe.py"), token))
    assert done.returncode == 0, done.stderr + slurm.log_tails()
    ranks = json_lines(done.stdout)
    assert sorted(ranks) == [0, 1, 2, 3], done.stdout
    assert [ranks[r]["host"] for r in range(4)] == ["mtr-a", "mtr-a", "mtr-b", "mtr-b"]
    assert all(data["sum_ok"] and data["size"] == 4 and data["local_size"] == 2 for data in ranks.values())
    assert done.stderr == "", done.stderr
    assert_no_leftovers(cluster, token, within=10)
