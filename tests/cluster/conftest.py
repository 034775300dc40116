"""The real multi-host test cluster (network namespaces + sshd), and helpers to use it.

Needs root.  Elsewhere these tests skip with the reason; in CI (CI=true) a
missing prerequisite is a failure, so the cluster tests can never silently
stop running there.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from tests.cluster import slurmcluster
from tests.cluster.netcluster import Cluster, prerequisites_missing, running_cluster
from tests.cluster.processes import cmdline, comm

PYTHON = sys.executable
# Process ids of the session's service daemons (Slurm's slurmd, Spark's master and workers): not a job's leftovers.
_SERVICE_DAEMONS: set[int] = set()


@pytest.fixture(scope="session")
def cluster():
    missing = prerequisites_missing()
    if missing:
        if os.environ.get("CI"):
            pytest.fail(f"cluster tests must run in CI but cannot: {missing}")
        pytest.skip(f"test cluster unavailable: {missing}")
    with running_cluster(2) as built:
        yield built


def _service_cluster(name: str, module, start):
    """A session's service cluster (Slurm, Spark) from `module` on the hosts: skipped where it cannot
    start (failed in CI); its daemons are not a job's leftovers while it runs."""
    missing = module.prerequisites_missing()
    if missing:
        if os.environ.get("CI"):
            pytest.fail(f"{name} cluster tests must run in CI but cannot: {missing}")
        pytest.skip(f"{name} test cluster unavailable: {missing}")
    with start() as running:
        pids = running.daemon_pids()
        _SERVICE_DAEMONS.update(pids)
        try:
            yield running
        finally:
            _SERVICE_DAEMONS.difference_update(pids)


@pytest.fixture(scope="session")
def slurm(cluster):
    """A real Slurm on the cluster's hosts (slurmctld on the bridge, a slurmd per host); its
    `env()` points Slurm's clients at it.  Once started it lives for the rest of the session."""
    yield from _service_cluster("Slurm", slurmcluster, lambda: slurmcluster.running_slurm(cluster))


@pytest.fixture(scope="session")
def spark_cluster(cluster):
    """A real Spark standalone cluster on the hosts (tests/cluster/sparkcluster.py): a master and a
    worker per host; started once, it lives for the rest of the session."""
    from tests.cluster import sparkcluster
    yield from _service_cluster("Spark", sparkcluster, lambda: sparkcluster.running_spark(cluster))


@pytest.fixture
def token() -> str:
    """A unique word to put on rank command lines, to find leftover processes."""
    return f"mtrtok{uuid.uuid4().hex[:10]}"


def job_env(cluster: Cluster, home: Path | None = None) -> dict[str, str]:
    env = cluster.env()
    if home is not None:
        env["HOME"] = str(home)
    # Ranks run `python` from PATH as users do, so this environment's bin comes first.
    env["PATH"] = os.path.dirname(PYTHON) + os.pathsep + env.get("PATH", "")
    return env


def mtrain_argv(*args: str) -> list[str]:
    return [PYTHON, "-m", "mtrain.launcher.cli.main", "run", *args]


def run_mtrain(cluster: Cluster, *args: str, timeout: float = 90, home: Path | None = None,
               cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(mtrain_argv(*args), env=job_env(cluster, home), capture_output=True,
                          text=True, timeout=timeout, cwd=cwd)


def run_leaving(cluster: Cluster, tmp_path: Path, token: str, script: str, *args: str
                ) -> "tuple[subprocess.CompletedProcess, float]":
    """Run `script` (in this folder, rank 3 leaving as leaving.py says) at -np 4 on both hosts:
    the result, and the seconds from rank 3's leaving (the time it printed) to the job's end."""
    done = run_mtrain(cluster, "-np", "4", "-H", "mtr-a:2,mtr-b:2", PYTHON, str(Path(__file__).parent / script),
                      *args, token, cwd=tmp_path, timeout=90)
    ended = time.time()
    left = [float(line.rsplit(" ", 1)[1]) for line in done.stdout.splitlines() if "leaving at " in line]
    assert len(left) == 1, done.stdout
    return done, ended - left[0]


def assert_followed_rank_3(cluster: Cluster, token: str, done: subprocess.CompletedProcess, elapsed: float,
                           named_as_leaving: bool = False) -> None:
    """The job of run_leaving ended within 10 s of rank 3's leaving, said only mtrain's lines, and
    left no process; with `named_as_leaving`, its report names rank 3 as the rank that left."""
    from tests.launcher.report_check import assert_only_mtrain_output
    if named_as_leaving:
        assert done.returncode != 0, done.stderr
        report = done.stderr[done.stderr.index("mtrain: job failed; first failure:"):]
        assert "rank 3 left the job" in report or "rank(s) [3] left the job" in report, done.stderr
    assert elapsed < 10, elapsed  # the job follows rank 3 within seconds, whatever the others do
    assert_only_mtrain_output(done.stderr)
    assert_no_leftovers(cluster, token, within=10)


def kill_mpi_daemons(cluster: Cluster, host: str) -> None:
    """SIGKILL Open MPI's daemon(s) on `host` (there must be one): the host's part of the job dies."""
    daemons = [pid for pid in cluster.namespace_pids(host) if Path(f"/proc/{pid}/comm").read_text().strip() == "prted"]
    assert daemons, f"no MPI daemon on {host}"
    for pid in daemons:
        os.kill(pid, signal.SIGKILL)


class RunningJob:
    """An mtrain started in the background, its output read by threads (never blocks the job)."""

    def __init__(self, proc: subprocess.Popen) -> None:
        import queue
        import threading
        self.proc = proc
        self.lines: queue.Queue = queue.Queue()
        self.stderr_parts: list[str] = []
        self.stdout_parts: list[str] = []  # everything, also what wait_for_lines consumed

        def pump_out() -> None:
            for line in proc.stdout:
                self.stdout_parts.append(line)
                self.lines.put(line)
            self.lines.put(None)

        def pump_err() -> None:
            for line in proc.stderr:
                self.stderr_parts.append(line)

        self.threads = [threading.Thread(target=pump_out, daemon=True),
                        threading.Thread(target=pump_err, daemon=True)]
        for thread in self.threads:
            thread.start()

    def wait_for_lines(self, fragment: str, count: int, timeout: float) -> list[str]:
        """Wait until `count` stdout lines contain `fragment` (bounded); return them."""
        import queue
        found: list[str] = []
        deadline = time.monotonic() + timeout
        while len(found) < count:
            try:
                line = self.lines.get(timeout=max(0.01, deadline - time.monotonic()))
            except queue.Empty:
                line = None
            if line is None:
                raise AssertionError(f"saw {len(found)} of {count} lines with {fragment!r}: {found}; "
                                     f"stdout: {''.join(self.stdout_parts)[-2000:]!r}; "
                                     f"stderr: {''.join(self.stderr_parts)[-4000:]}")
            if fragment in line:
                found.append(line)
        return found

    def wait_for_stderr(self, fragment: str, timeout: float) -> None:
        """Wait until mtrain's stderr contains `fragment` (bounded)."""
        deadline = time.monotonic() + timeout
        while fragment not in "".join(self.stderr_parts):
            if time.monotonic() > deadline or self.proc.poll() is not None and fragment not in "".join(self.stderr_parts):
                raise AssertionError(f"no {fragment!r} on stderr: {''.join(self.stderr_parts)[-2000:]}")
            time.sleep(0.1)

    def stop(self) -> str:
        """End mtrain politely (SIGTERM), then for sure; return its stderr."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        for thread in self.threads:
            thread.join(timeout=5)
        return "".join(self.stderr_parts)


def start_mtrain(cluster: Cluster, *args: str, cwd: Path | None = None) -> RunningJob:
    proc = subprocess.Popen(mtrain_argv(*args), env=job_env(cluster), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=cwd)
    return RunningJob(proc)


def leftovers(cluster: Cluster, token: str) -> list[str]:
    """Processes of a job still alive: anything with the token, anything but sshd on the hosts.

    The session's slurmd daemons (the `slurm` fixture's) are not leftovers; every slurmstepd
    is: one lives only while its step (or batch script) runs, so after a job has ended a
    slurmstepd still there is a step the job left behind, e.g. tasks that outlived their
    srun and wait out KillWait.  Check for leftovers once the Slurm job is over."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) != os.getpid() and token in cmdline(int(entry)):
            found.append(f"{entry}: {cmdline(int(entry))[:120]}")
    for host in cluster.hosts:
        for pid in cluster.namespace_pids(host.name):
            if pid in _SERVICE_DAEMONS:
                continue
            if comm(pid) not in ("sshd", "sshd-session") and cmdline(pid):
                found.append(f"{host.name} {pid}: {cmdline(pid)[:120]}")
    return found


def assert_no_leftovers(cluster: Cluster, token: str, within: float) -> None:
    """Every process of the job is gone within `within` seconds."""
    deadline = time.monotonic() + within
    while True:
        alive = leftovers(cluster, token)
        if not alive:
            return
        if time.monotonic() > deadline:
            for line in alive:  # do not leave them behind for the next test
                pid = int(line.split(":")[0].split()[-1])
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            raise AssertionError("processes left after the job:\n" + "\n".join(alive))
        time.sleep(0.2)
