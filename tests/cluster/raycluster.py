"""A real two-node Ray cluster on the namespace hosts of tests/cluster/netcluster.py.

    mtr-a (10.77.0.11)                          mtr-b (10.77.0.12)
    ray start --head  (GCS, raylet, …)          ray start --address 10.77.0.11:PORT (raylet, …)
    the test's driver (python DRIVER)

Each `ray start` runs inside its host's network namespace and a UTS namespace with the host's
name, so Ray (and MPI) see two machines with two names; each node keeps its files in a
--temp-dir of its own, since both "hosts" share this filesystem.  Small resources
(--num-cpus 2, no dashboard): Ray is slow on a 2-core machine, so a session starts the
cluster once.  At the end every process left in the two namespaces other than sshd (Ray's
own) is killed and the temp dirs are removed.
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Iterator

from tests.cluster.netcluster import Cluster
from tests.cluster.processes import cmdline, comm

RAY_PORT = 6380
START_SECONDS = 180.0
BIN = os.path.dirname(sys.executable)


def in_host(host: str, argv: list[str]) -> list[str]:
    """`argv` run inside namespace host `host`: its network and a hostname of its own."""
    return ["ip", "netns", "exec", host, "unshare", "--uts", "sh", "-c", 'hostname "$0" && exec "$@"', host, *argv]


def _ray_processes(cluster: Cluster, before: dict[str, set[int]]) -> dict[str, list[int]]:
    """The processes in each host that were not there before Ray started (sshd's sessions aside)."""
    found = {}
    for host in cluster.hosts:
        found[host.name] = [pid for pid in cluster.namespace_pids(host.name) if pid not in before[host.name]]
    return found


@dataclasses.dataclass
class RayCluster:
    """A running Ray cluster on the namespace hosts."""

    cluster: Cluster
    address: str                  # "ip:port" of the head's GCS
    temp_dirs: dict[str, Path]
    home: Path                    # an empty HOME for drivers: no SSH keys, no ~/.ssh/config
    scratch: dict[str, Path]      # each host's $TMPDIR
    ray_pids: dict[str, set[int]] = dataclasses.field(default_factory=dict)  # Ray's own processes per host

    def driver_env(self) -> dict[str, str]:
        env = dict(os.environ)
        env["HOME"] = str(self.home)
        env.pop("SSH_AUTH_SOCK", None)
        env["RAY_ADDRESS"] = self.address
        env["PATH"] = BIN + os.pathsep + env.get("PATH", "")
        env["PYTHONPATH"] = str(Path(__file__).resolve().parents[2]) + os.pathsep + env.get("PYTHONPATH", "")
        env["OMPI_MCA_mpi_yield_when_idle"] = "1"
        env["RAY_DISABLE_USAGE_STATS"] = "1"
        return env

    def start_driver(self, argv: list[str], host: str = "mtr-a") -> subprocess.Popen:
        """A driver process in `host` (stdin a pipe, stdout and stderr text pipes)."""
        env = dict(self.driver_env(), TMPDIR=str(self.scratch[host]))
        return subprocess.Popen(in_host(host, argv), env=env, stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)

    def job_processes(self, driver: int) -> list[str]:
        """Processes in either host that are neither Ray's own (its daemons, or a worker idle now: the
        raylet keeps some for the next task), nor sshd's, nor the `driver`: what a job left.  An actor
        is a worker named after its class (ray::SlotActor) until it ends."""
        found = []
        for host in self.cluster.hosts:
            for pid in self.cluster.namespace_pids(host.name):
                if pid == driver or pid in self.ray_pids.get(host.name, set()):
                    continue
                line = cmdline(pid)
                if not line or comm(pid) in ("sshd", "sshd-session") or line.startswith("ray::IDLE"):
                    continue
                found.append(f"{host.name} {pid}: {line[:160]}")
        return found


def _run(argv: list[str], env: dict[str, str], what: str) -> None:
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=START_SECONDS)
    if done.returncode != 0:
        raise RuntimeError(f"{what} failed ({done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")


def _wait_for_nodes(ray_cluster: RayCluster, count: int) -> None:
    code = ("import ray, sys, time\nray.init(logging_level='ERROR')\ndeadline = time.monotonic() + 120\n"
            "while sum(n['Alive'] for n in ray.nodes()) < int(sys.argv[1]):\n"
            "    assert time.monotonic() < deadline, ray.nodes()\n    time.sleep(0.5)\n")
    driver = ray_cluster.start_driver([sys.executable, "-c", code, str(count)])
    try:
        out, err = driver.communicate(timeout=START_SECONDS)
    except subprocess.TimeoutExpired:
        os.killpg(driver.pid, signal.SIGKILL)
        out, err = driver.communicate()
    if driver.returncode != 0:
        raise RuntimeError(f"the Ray cluster did not reach {count} nodes:\n{out[-2000:]}\n{err[-3000:]}")


@contextlib.contextmanager
def running_ray(cluster: Cluster) -> Iterator[RayCluster]:
    """Start the head on mtr-a and a worker node on mtr-b; yield; stop every Ray process."""
    head, worker = cluster.hosts[0], cluster.hosts[1]
    before = {host.name: set(cluster.namespace_pids(host.name)) for host in cluster.hosts}
    # Short paths: Ray's Unix sockets live in its temp dir (a socket path has ~107 characters).
    base = Path(tempfile.mkdtemp(prefix="mtrray-", dir="/tmp"))
    temp_dirs = {head.name: base / "a", worker.name: base / "b"}
    home = base / "home"
    home.mkdir(mode=0o700)
    # Each host's own $TMPDIR too, as machines have their own /tmp: what the actors' commands leave
    # there (a killed driver's daemon session folder, docs/ray.md) goes with the cluster.
    scratch = {}
    for host in cluster.hosts:
        scratch[host.name] = base / f"tmp-{host.name}"
        scratch[host.name].mkdir(mode=0o700)
    address = f"{head.address}:{RAY_PORT}"
    ray_cluster = RayCluster(cluster, address, temp_dirs, home, scratch)
    env = ray_cluster.driver_env()
    ray = os.path.join(BIN, "ray")
    common = ["--num-cpus", "2", "--disable-usage-stats"]
    try:
        head_start = ["--head", "--node-ip-address", head.address, "--port", str(RAY_PORT), "--include-dashboard=false"]
        _run(in_host(head.name, ["env", f"TMPDIR={scratch[head.name]}", ray, "start", *head_start,
                                 "--temp-dir", str(temp_dirs[head.name]), *common]), env, "ray start --head")
        worker_start = ["--address", address, "--node-ip-address", worker.address]
        _run(in_host(worker.name, ["env", f"TMPDIR={scratch[worker.name]}", ray, "start", *worker_start,
                                   "--temp-dir", str(temp_dirs[worker.name]), *common]), env, "ray start --address")
        _wait_for_nodes(ray_cluster, 2)
        # Ray's daemons; not its idle workers, one of which may become an actor of the job.
        ray_cluster.ray_pids = {host: {pid for pid in pids if not cmdline(pid).startswith("ray::IDLE")}
                                for host, pids in _ray_processes(cluster, before).items()}
        yield ray_cluster
    finally:
        stop_ray(cluster, before)
        shutil.rmtree(base, ignore_errors=True)


def stop_ray(cluster: Cluster, before: dict[str, set[int]]) -> None:
    """Kill every process Ray (or anything after it) started in the hosts; wait until they are gone."""
    deadline = time.monotonic() + 30
    while True:
        left = {host: pids for host, pids in _ray_processes(cluster, before).items() if pids}
        if not left:
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"Ray processes outlived SIGKILL: {left}")
        for pids in left.values():
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        time.sleep(0.2)
