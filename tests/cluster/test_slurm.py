"""`mtrain run` inside a real Slurm allocation (tests/cluster/slurmcluster.py): the ranks start
through Slurm, with no SSH, and everything that holds over SSH holds here too.

The launching user's HOME here has no ~/.ssh at all, so any SSH connection would fail.
"""
from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

import pytest

from tests.cluster.conftest import PYTHON, assert_no_leftovers, kill_mpi_daemons, mtrain_argv
from tests.cluster.leaving import FAILURES, POLITE
from tests.cluster.test_launch_styles import json_lines
from tests.launcher.report_check import assert_only_mtrain_output

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


def salloc(slurm, tmp_path: Path, *words: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """`salloc` of 2 nodes x 2 tasks running `words` (on this, the submitting host, as salloc does)."""
    return subprocess.run(["salloc", "--quiet", *ALLOCATION, *words], env=no_ssh_env(slurm, tmp_path),
                          capture_output=True, text=True, timeout=timeout, cwd=tmp_path)


def batch_script(tmp_path: Path, *lines: str) -> Path:
    script = tmp_path / "job.sh"
    script.write_text("#!/bin/sh\n" + "".join(f"#SBATCH {option}\n" for option in ALLOCATION)
                      + f"#SBATCH -o {tmp_path}/out-%j.txt\n" + "\n".join(lines) + "\n")
    return script


def mtrain_run(*args: str) -> str:
    import shlex
    return shlex.join(mtrain_argv(*args))


def test_a_training_job_of_2_nodes_by_2_tasks_under_sbatch(slurm, cluster, tmp_path, token):
    # Polled, not `sbatch --wait` (test_slurm_cluster.py checks that it returns the script's
    # status): its own look every 10 s or more made this test take 10 to 42 s.
    job, output_file = submit(slurm, tmp_path, mtrain_run(PYTHON, str(HERE / "slurm_train.py"), "5", token))
    wait_job_gone(slurm, job, timeout=150)
    output = output_file.read_text() if output_file.exists() else ""
    assert slurm.job_exit_code(job) == "0:0", output + slurm.log_tails()
    ranks = json_lines(output, "rank")
    assert sorted(ranks) == [0, 1, 2, 3], output
    assert [ranks[r]["host"] for r in range(4)] == ["mtr-a", "mtr-a", "mtr-b", "mtr-b"]
    assert [(ranks[r]["env_rank"], ranks[r]["local_rank"]) for r in range(4)] == [
        ("0", "0"), ("1", "1"), ("2", "0"), ("3", "1")]
    assert {ranks[r]["master_addr"] for r in range(4)} == {"10.77.0.11"}
    assert ranks[0]["equal_to_one_process"] and ranks[0]["moved"], ranks[0]
    assert "mtrain:" not in output, output
    assert_no_leftovers(cluster, token, within=10)


def test_under_salloc_from_a_host_outside_the_allocation(slurm, cluster, tmp_path, token):
    done = salloc(slurm, tmp_path, *mtrain_argv(PYTHON, str(HERE / "rank_probe.py"), token))
    assert done.returncode == 0, done.stderr + slurm.log_tails()
    ranks = json_lines(done.stdout, "rank")
    assert sorted(ranks) == [0, 1, 2, 3], done.stdout
    assert [ranks[r]["host"] for r in range(4)] == ["mtr-a", "mtr-a", "mtr-b", "mtr-b"]
    assert all(data["sum_ok"] and data["size"] == 4 and data["local_size"] == 2 for data in ranks.values())
    assert done.stderr == "", done.stderr
    assert_no_leftovers(cluster, token, within=10)


@pytest.mark.parametrize("how", ["raise", "sigkill"])
def test_a_failing_rank_under_sbatch_is_named_and_the_job_exit_code_agrees(slurm, cluster, tmp_path, token, how):
    job, output = submit(slurm, tmp_path, mtrain_run(PYTHON, str(HERE / "exit_rank.py"), how, "collective", token))
    wait_job_gone(slurm, job, timeout=90)
    code, line = FAILURES[how]
    assert line in output.read_text(), output.read_text()
    # No accounting daemon here, so no sacct: Slurm's own record of the job, as sacct would show it.
    assert slurm.job_exit_code(job) == f"{code}:0"
    assert_no_leftovers(cluster, token, within=10)


def run_leaving_in_salloc(slurm, tmp_path, token, how: str, others: str) -> "tuple[subprocess.CompletedProcess, float]":
    """exit_rank.py's cell under salloc: the result, and the seconds from rank 3's leaving to the end."""
    done = salloc(slurm, tmp_path, *mtrain_argv(PYTHON, str(HERE / "exit_rank.py"), how, others, token))
    ended = time.time()
    left = [float(line.rsplit(" ", 1)[1]) for line in done.stdout.splitlines() if "leaving at " in line]
    assert len(left) == 1, done.stdout + done.stderr
    return done, ended - left[0]


# The exit matrix's ways of leaving (tests/cluster/test_rank_exits.py) under Slurm, with the others in a
# collective or outside MPI: what reaches mtrain from a rank on a node Slurm started is the same either way.
@pytest.mark.parametrize("others", ["collective", "sleep"])
@pytest.mark.parametrize("how", list(FAILURES))
def test_exit_matrix_under_slurm(slurm, cluster, tmp_path, token, how, others):
    done, elapsed = run_leaving_in_salloc(slurm, tmp_path, token, how, others)
    status, line = FAILURES[how]
    assert done.returncode == status, done.stderr
    assert line in done.stderr, done.stderr
    assert elapsed < 10, elapsed
    assert_only_mtrain_output(done.stderr)
    assert_no_leftovers(cluster, token, within=10)


@pytest.mark.parametrize("how", POLITE)
def test_a_rank_finishing_early_under_slurm_is_named_not_a_hang(slurm, cluster, tmp_path, token, how):
    done, elapsed = run_leaving_in_salloc(slurm, tmp_path, token, how, "collective")
    assert done.returncode != 0, done.stderr
    report = done.stderr[done.stderr.index("mtrain: job failed; first failure:"):]
    assert "rank 3 left the job" in report or "rank(s) [3] left the job" in report, done.stderr
    assert elapsed < 10, elapsed
    assert_no_leftovers(cluster, token, within=10)


def wait_for_output(path: Path, fragment: str, count: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while (path.read_text().count(fragment) if path.exists() else 0) < count:
        assert time.monotonic() < deadline, path.read_text() if path.exists() else f"no {path}"
        time.sleep(0.2)


def submit(slurm, tmp_path: Path, *lines: str) -> "tuple[str, Path]":
    """sbatch without waiting: the job's id and its output file."""
    done = subprocess.run(["sbatch", "--parsable", str(batch_script(tmp_path, *lines))],
                          env=no_ssh_env(slurm, tmp_path), capture_output=True, text=True, timeout=30, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    job = done.stdout.split(";")[0].strip()
    return job, tmp_path / f"out-{job}.txt"


def wait_job_gone(slurm, job: str, timeout: float) -> float:
    """Seconds until Slurm no longer lists `job` as pending, running or completing."""
    started = time.monotonic()
    while slurm.run(["squeue", "-h", "-j", job, "-o", "%T"], timeout=15).stdout.strip():
        assert time.monotonic() - started < timeout, slurm.run(["squeue", "-j", job], timeout=15).stdout
        time.sleep(0.2)
    return time.monotonic() - started


def test_scancel_mid_training_ends_everything_and_says_so(slurm, cluster, tmp_path, token):
    job, output = submit(slurm, tmp_path, mtrain_run(PYTHON, str(HERE / "slurm_train.py"), "0", "forever", token))
    wait_for_output(output, "ready", 4, timeout=90)
    # mtr-b's MPI daemon, which srun started with mpirun's environment, has the user's TMPDIR back
    # (none here: Slurm's /tmp), not mpirun's private folder on the launching host, which other nodes
    # do not have; the guard took the launcher's note of it out.
    daemons = [pid for pid in cluster.namespace_pids("mtr-b") if Path(f"/proc/{pid}/comm").read_text().strip() == "prted"]
    assert daemons
    for pid in daemons:
        environment = dict(item.split("=", 1) for item in Path(f"/proc/{pid}/environ").read_text().split("\0") if "=" in item)
        assert "MTRAIN_MPIRUN_TMPDIR" not in environment and "mtrain-agent-" not in environment.get("TMPDIR", ""), (
            environment.get("TMPDIR"), environment.get("MTRAIN_MPIRUN_TMPDIR"))
        assert "MTRAIN_JOB_SECRET" in environment  # (the job's own variables did come with it)
    cancelled = time.monotonic()
    done = slurm.run(["scancel", job], timeout=15)
    assert done.returncode == 0, done.stderr
    assert_no_leftovers(cluster, token, within=10)  # on both nodes, and here
    assert time.monotonic() - cancelled < 12
    wait_job_gone(slurm, job, timeout=30)
    text = output.read_text()
    assert f"mtrain: Slurm job {job} was cancelled (scancel" in text, text
    assert "first failure" not in text, text


def submit_elastic(slurm, tmp_path: Path, token: str, discovery: Path) -> "tuple[str, Path]":
    """An elastic training job of 4 ranks (at least 2) on `discovery`'s hosts, submitted."""
    discovery.chmod(0o755)
    job, output = submit(slurm, tmp_path, mtrain_run("-np", "4", "--min-np", "2", "--host-discovery-script",
                                                     str(discovery), PYTHON, str(HERE / "elastic_train.py"),
                                                     "2", "12", "0.25", token))
    return job, output


def test_elastic_job_in_an_allocation_goes_on_without_a_drained_node(slurm, cluster, tmp_path, token):
    script = tmp_path / "discover.sh"
    # What a site's discovery script may do: the allocation's nodes, less those drained since.
    script.write_text("#!/bin/sh\n"
                      "drained=\" $(sinfo -h -N -t drain,draining,drained -o %N | tr '\\n' ' ') \"\n"
                      "for host in $(scontrol show hostnames \"$SLURM_JOB_NODELIST\"); do\n"
                      "    case $drained in *\" $host \"*) ;; *) echo \"$host:2\" ;; esac\n"
                      "done\n")
    job, output = submit_elastic(slurm, tmp_path, token, script)
    try:
        wait_for_output(output, "progress", 8, timeout=120)
        drained = slurm.run(["scontrol", "update", "nodename=mtr-b", "state=drain", "reason=mtrain-test"])
        assert drained.returncode == 0, drained.stderr
        wait_job_gone(slurm, job, timeout=150)
    finally:
        slurm.run(["scontrol", "update", "nodename=mtr-b", "state=resume"])
        slurm.run(["scancel", job])
    text = output.read_text()
    assert "elastic reset 1: " in text and "now 2 ranks on mtr-a:2" in text, text
    final = json_lines(text, "rank")
    assert sorted(final) == [0, 1], text
    for data in final.values():
        assert data["size"] == 2 and data["steps"] == 2 * 12
        assert data["done"] == [[epoch, batch] for epoch in range(2) for batch in range(12)]
    assert slurm.job_exit_code(job) == "0:0", text
    assert_no_leftovers(cluster, token, within=10)


def test_torchrun_variables_tf_config_and_ddp_backends_under_slurm(slurm, cluster, tmp_path, token):
    code = "import json, os; print(json.dumps({'rank': int(os.environ['RANK']), 'tf': json.loads(os.environ['TF_CONFIG'])}))"
    done = salloc(slurm, tmp_path, *mtrain_argv(PYTHON, "-c", code, token))
    assert done.returncode == 0, done.stderr
    ranks = json_lines(done.stdout, "rank")
    workers = ranks[0]["tf"]["cluster"]["worker"]
    assert [w.split(":")[0] for w in workers] == ["10.77.0.11"] * 2 + ["10.77.0.12"] * 2
    assert [ranks[r]["tf"]["task"] for r in range(4)] == [{"type": "worker", "index": r} for r in range(4)]
    for backend in ("gloo", "mtrain"):
        done = salloc(slurm, tmp_path, *mtrain_argv(PYTHON, str(HERE / "ddp_plain.py"), backend, token))
        assert done.returncode == 0, done.stderr
        ranks = json_lines(done.stdout, "rank")
        assert sorted(ranks) == [0, 1, 2, 3], done.stdout
        assert all(data["params"] == ranks[0]["params"] for data in ranks.values())
    assert_no_leftovers(cluster, token, within=10)


def test_srun_starting_the_ranks_directly(slurm, cluster, tmp_path, token):
    from tests.cluster.slurmcluster import pmix_missing
    missing = pmix_missing()
    if missing:
        (pytest.fail if os.environ.get("CI") else pytest.skip)(f"cannot test srun --mpi=pmix here: {missing}")
    # Slurm's PMIx plugin and the MPI mtrain ships find each other: init() works with no launcher.
    done = salloc(slurm, tmp_path, "srun", "--mpi=pmix", PYTHON, str(HERE / "rank_probe.py"), token)
    assert done.returncode == 0, done.stderr
    ranks = {data["rank"]: data for data in map(json.loads, done.stdout.splitlines())}
    assert sorted(ranks) == [0, 1, 2, 3], done.stdout
    assert all(data["size"] == 4 and data["sum_ok"] for data in ranks.values())
    # A rank raising: the job ends at once, and the rank's stderr says which rank and why.
    done, elapsed = run_in_srun(slurm, tmp_path, token, "--mpi=pmix")
    assert done.returncode != 0
    assert elapsed < 10, elapsed
    assert ("mtrain: job failed; first failure: rank 3 on mtr-b: exit code 1 "
            "(RuntimeError: rank 3 raised on purpose)") in done.stderr, done.stderr
    assert_no_leftovers(cluster, token, within=10)


def run_in_srun(slurm, tmp_path, token, *srun_args: str) -> "tuple[subprocess.CompletedProcess, float]":
    done = salloc(slurm, tmp_path, "srun", *srun_args, PYTHON, str(HERE / "exit_rank.py"), "raise", "collective",
                  token, timeout=60)
    ended = time.time()
    left = [float(line.rsplit(" ", 1)[1]) for line in done.stdout.splitlines() if "leaving at " in line]
    return done, ended - (left[0] if left else ended)


def test_srun_without_pmix_fails_at_once_instead_of_running_alone(slurm, cluster, tmp_path, token):
    # No PMIx (this cluster's MpiDefault is none): each task would be an MPI job of one.
    started = time.monotonic()
    done = salloc(slurm, tmp_path, "srun", PYTHON, str(HERE / "rank_probe.py"), token, timeout=60)
    assert time.monotonic() - started < 20
    assert done.returncode != 0
    assert done.stdout == "", done.stdout
    lines = [line for line in done.stderr.splitlines() if line.startswith("mtrain:")]
    assert len(lines) == 4, done.stderr
    assert all("srun --mpi=pmix" in line and "mtrain run" in line for line in lines), done.stderr
    assert "Traceback" not in done.stderr
    assert_no_leftovers(cluster, token, within=10)


def test_elastic_job_in_an_allocation_blacklists_a_node_whose_daemon_died(slurm, cluster, tmp_path, token):
    script = tmp_path / "discover.sh"
    script.write_text("#!/bin/sh\nfor host in $(scontrol show hostnames \"$SLURM_JOB_NODELIST\"); do echo \"$host:2\"; done\n")
    job, output = submit_elastic(slurm, tmp_path, token, script)
    try:
        wait_for_output(output, "progress", 8, timeout=120)
        kill_mpi_daemons(cluster, "mtr-b")  # the node's part of the job dies; Slurm still lists the node
        wait_job_gone(slurm, job, timeout=150)
    finally:
        slurm.run(["scancel", job])
    text = output.read_text()
    assert "elastic reset 1: host mtr-b lost" in text and "now 2 ranks on mtr-a:2" in text, text
    final = json_lines(text, "rank")
    assert sorted(final) == [0, 1] and all(data["size"] == 2 and data["steps"] == 2 * 12 for data in final.values()), text
    assert slurm.job_exit_code(job) == "0:0", text
    assert_no_leftovers(cluster, token, within=10)
