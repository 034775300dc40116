"""A real Spark standalone cluster on the namespace hosts of tests/cluster/netcluster.py.

    namespace mtr-a (hostname mtr-a)           namespace mtr-b (hostname mtr-b)
    Master  10.77.0.11:7077                    Worker 10.77.0.12, 1 core, work dir of its own
    Worker  10.77.0.11, 1 core, own work dir     └─ executor JVM ─ python workers ─ Spark tasks
      └─ executor JVM ─ python workers ─ Spark tasks

The driver is the test process itself (root namespace), reached by the executors on the
bridge address.  Every JVM runs inside its host's network namespace and, under
`unshare --uts`, with the host's hostname (Open MPI tells nodes apart by hostname), bound to
the host's private address (SPARK_LOCAL_IP).  One core per worker and spark.task.cpus=1 put
one task on each host.  Three daemon JVMs in all (plus the driver's and one executor per host
while a session runs): the machine has two cores.

Used by the `spark_cluster` fixture of tests/cluster/conftest.py.
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Iterator

from tests.cluster.netcluster import BRIDGE_ADDRESS, Cluster, ClusterHost
from tests.jobs import kill_session

MASTER_PORT = 7077
START_SECONDS = 120.0


@dataclasses.dataclass(frozen=True)
class SparkCluster:
    """A running standalone cluster: where its master is, and its daemons."""

    master_url: str
    driver_host: str           # the address the executors reach the driver (this process) at
    workers: int
    daemons: tuple[subprocess.Popen, ...]
    logs: Path

    def daemon_pids(self) -> set[int]:
        return {proc.pid for proc in self.daemons}

    def session_settings(self) -> dict[str, str]:
        """Spark settings of a driver in this process using the whole cluster, one task per host."""
        return {
            "spark.driver.host": self.driver_host, "spark.driver.bindAddress": self.driver_host,
            "spark.ui.enabled": "false", "spark.executor.memory": "512m", "spark.executor.cores": "1",
            "spark.task.cpus": "1", "spark.cores.max": str(self.workers),
            "spark.default.parallelism": str(self.workers),
            # The first job waits until every executor is there, so the tasks land on all hosts.
            "spark.scheduler.minRegisteredResourcesRatio": "1.0",
            "spark.scheduler.maxRegisteredResourcesWaitingTime": "120s",
            "spark.pyspark.python": sys.executable, "spark.pyspark.driver.python": sys.executable,
        }


def prerequisites_missing() -> str | None:
    """Why this machine cannot run the Spark cluster, or None."""
    try:
        import pyspark  # noqa: F401
    except ImportError:
        return "needs pyspark (pip install 'mtrain[spark]')"
    from mtrain.spark.runner import java_problem
    return java_problem()


def spark_home() -> str:
    import pyspark
    return os.path.dirname(pyspark.__file__)


def _start(host: ClusterHost, argv: list[str], log: Path, env: dict[str, str]) -> subprocess.Popen:
    """A Spark daemon inside `host` (its namespace, its hostname), in a session of its own."""
    inner = ["unshare", "--uts", "sh", "-c", 'hostname "$0" && exec "$@"', host.name,
             os.path.join(spark_home(), "bin", "spark-class"), *argv]
    host_env = {**env, "SPARK_LOCAL_IP": host.address, "SPARK_LOCAL_HOSTNAME": host.address}
    with open(log, "wb") as out:
        return subprocess.Popen(["ip", "netns", "exec", host.netns, *inner], env=host_env, stdin=subprocess.DEVNULL,
                                stdout=out, stderr=subprocess.STDOUT, start_new_session=True)


def _wait_for_log(log: Path, fragment: str, count: int, deadline: float, daemons: list[subprocess.Popen]) -> None:
    while True:
        text = log.read_text(errors="replace") if log.exists() else ""
        if text.count(fragment) >= count:
            return
        dead = [proc.args for proc in daemons if proc.poll() is not None]
        if dead or time.monotonic() > deadline:
            raise RuntimeError(f"Spark cluster did not start ({'a daemon died' if dead else 'timed out'}: "
                               f"waiting for {count} x {fragment!r} in {log.name}):\n{text[-3000:]}")
        time.sleep(0.2)


@contextlib.contextmanager
def running_spark(cluster: Cluster) -> Iterator[SparkCluster]:
    """Start a master on the first host and a worker on each; yield; stop them and their executors."""
    logs = Path(tempfile.mkdtemp(prefix="mtrain-spark-"))
    env = {**cluster.env(), "SPARK_HOME": spark_home(), "SPARK_DAEMON_MEMORY": "256m", "SPARK_NO_DAEMONIZE": "1",
           "PYSPARK_PYTHON": sys.executable, "SPARK_CONF_DIR": str(logs)}
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
    master = cluster.hosts[0]
    url = f"spark://{master.address}:{MASTER_PORT}"
    daemons: list[subprocess.Popen] = []
    try:
        deadline = time.monotonic() + START_SECONDS
        master_log = logs / "master.log"
        daemons.append(_start(master, ["org.apache.spark.deploy.master.Master", "--host", master.address,
                                       "--port", str(MASTER_PORT), "--webui-port", "8080"], master_log, env))
        _wait_for_log(master_log, "Successfully started service 'sparkMaster'", 1, deadline, daemons)
        for host in cluster.hosts:
            work = logs / host.name / "work"
            work.mkdir(parents=True)
            daemons.append(_start(host, ["org.apache.spark.deploy.worker.Worker", url, "--host", host.address,
                                         "--cores", "1", "--memory", "1g", "--work-dir", str(work),
                                         "--webui-port", "8081"], logs / f"worker-{host.name}.log", env))
        _wait_for_log(master_log, "Registering worker", len(cluster.hosts), deadline, daemons)
        yield SparkCluster(url, BRIDGE_ADDRESS, len(cluster.hosts), tuple(daemons), logs)
    finally:
        for proc in reversed(daemons):  # workers first; each session holds its executors too
            kill_session(proc.pid)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=10)
        shutil.rmtree(logs, ignore_errors=True)
