"""mtrain.ray on a real two-node Ray cluster (tests/cluster/raycluster.py), driver inside mtr-a.

One driver run (tests/cluster/ray_driver.py) serves every test of this module: Ray on two
cores takes tens of seconds to start anything, so the driver does each thing once and reports
it; each test checks one part of the report.  The driver's HOME is empty (no SSH key, no
~/.ssh/config naming the hosts), so nothing of the job can have gone over SSH; the ranks'
ancestry shows the way they were started.
"""
from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from pathlib import Path

import pytest

from tests.cluster import raycluster

try:
    import ray  # noqa: F401
except ImportError:
    if os.environ.get("CI"):  # (CI installs the extra: these tests must run there)
        pytest.fail("mtrain.ray's cluster tests must run in CI but Ray is missing: pip install 'mtrain[ray]'",
                    pytrace=False)
    pytest.skip("mtrain.ray's cluster tests need Ray: pip install 'mtrain[ray]'", allow_module_level=True)

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(600)]
DRIVER = Path(__file__).with_name("ray_driver.py")
STEPS = 5


@pytest.fixture(scope="module")
def ray_cluster(cluster):
    # Started once (only this module uses it) and stopped when the module ends: the other cluster
    # tests take any process in the hosts but sshd for a job's leftover.
    with raycluster.running_ray(cluster) as running:
        yield running


@pytest.fixture(scope="module")
def report(ray_cluster):
    """What the driver reported, its stderr, and the job's processes left after shutdown()."""
    driver = ray_cluster.start_driver([sys.executable, str(DRIVER), str(STEPS)])
    results: dict = {}
    errors: list[str] = []
    reader = threading.Thread(target=lambda: errors.extend(driver.stderr), daemon=True)
    reader.start()
    left: list[list[str]] = []
    # A driver that hangs is killed (and its silence ends the loop below): the tests then fail on what it did not say.
    watchdog = threading.Timer(420, lambda: os.killpg(driver.pid, signal.SIGKILL))
    watchdog.start()
    try:
        for line in driver.stdout:
            if line.startswith("RESULT "):
                results.update(json.loads(line[len("RESULT "):]))
            elif line.strip() == "SHUT DOWN":
                # The driver still lives (and holds its Ray connection): shutdown() alone must have
                # ended the ranks, daemons, services and actors on both hosts.
                left.append(_settled(ray_cluster, driver.pid))
                driver.stdin.write("go on\n")
                driver.stdin.flush()
            elif line.strip() == "RUNNING":
                # A driver that dies without shutdown(): its job must not outlive it on either host.
                os.kill(driver.pid, signal.SIGKILL)
                driver.wait(timeout=60)
                left.append(_settled(ray_cluster, driver.pid, within=60))
                break
    finally:
        watchdog.cancel()
        if driver.poll() is None:
            os.killpg(driver.pid, signal.SIGKILL)
            driver.wait()
        reader.join(timeout=10)
    return {"results": results, "stderr": "".join(errors), "left": left, "status": driver.returncode}


def _settled(ray_cluster, driver: int, within: float = 20.0) -> list[str]:
    """The job's processes still alive `within` seconds after shutdown() returned (or none, once gone)."""
    deadline = time.monotonic() + within
    while True:
        left = ray_cluster.job_processes(driver)
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.2)


def _result(report, name):
    assert name in report["results"], f"the driver did not report {name!r}; its stderr:\n{report['stderr'][-4000:]}"
    return report["results"][name]


def test_ranks_start_through_the_actors_without_ssh(report):
    where = _result(report, "where")
    actors = _result(report, "actors")
    assert [w["rank"] for w in where] == [0, 1]
    assert [w["host"] for w in where] == ["mtr-a", "mtr-b"]
    assert [w["word"] for w in where] == ["w7", "w7"]  # extra_env_vars reached every rank
    # Rank 1 on mtr-b descends from that node's actor, through the remote guard and PRRTE's daemon.
    chain = where[1]["ancestors"]
    assert any(pid in actors["mtr-b"] for pid, _ in chain), chain
    assert any("mtrain.launcher.remote_guard" in line for _, line in chain), chain
    assert any("prted" in line for _, line in chain), chain
    assert not any(line.split(" ", 1)[0].endswith(("ssh", "sshd")) for _, line in chain), chain
    # mpirun's remote shell was the task agent (the job's command line, shown with verbose=2).
    assert "plm_ssh_agent" in report["stderr"] and "mtrain.launcher.tasks.agent" in report["stderr"]


def test_run_gives_results_in_rank_order(report):
    assert _result(report, "order") == [100, 110]
    assert _result(report, "after_failure") == [0, 1]


def test_executable_is_made_once_in_each_rank(report):
    where, (first, second) = _result(report, "where"), _result(report, "execute")
    assert [value for value, _, _, _ in first] == [21, 21]  # made with executable_args and executable_kwargs
    assert [pid for _, pid, _, _ in first] == [w["pid"] for w in where]  # the ranks live on between calls
    # Each rank's instance (its token) serves every call and counts them: one instance per rank, kept.
    tokens = [token for _, _, token, _ in first]
    assert len(set(tokens)) == 2, first
    assert [calls for _, _, _, calls in first] == [1, 1], first
    assert [[value, pid, token, calls] for value, pid, token, calls in second] == [
        [value, pid, token, 2] for value, pid, token, _ in first], (first, second)
    assert _result(report, "execute_single") == [21, first[0][1], tokens[0], 3], (first, second)


def test_distributed_training_equals_single_process_training(report):
    trained, alone = _result(report, "trained"), _result(report, "alone")
    assert [t["rank"] for t in trained] == [0, 1] and {t["size"] for t in trained} == {2}
    for result in trained:
        for got, want in zip(result["weights"], alone):
            assert got == pytest.approx(want, rel=1e-5, abs=1e-6)
    # (Training moved every parameter from rank 0's start, which the ranks left after the broadcast: the
    # comparison means something.)
    untrained = _result(report, "untrained")
    assert len(untrained) == len(alone) == 2, (untrained, alone)
    for start, want in zip(untrained, alone):
        assert want != pytest.approx(start, rel=1e-3, abs=1e-3), (start, want)


def test_a_failing_worker_raises_naming_its_rank(report):
    failure = _result(report, "failure")
    assert failure is not None, "run() of a raising function returned"
    assert failure["rank"] == 1
    assert "rank 1" in failure["text"] and "batch 17 is corrupt on mtr-b" in failure["text"], failure


def test_run_remote_gives_object_refs(report):
    remote = _result(report, "run_remote")
    assert remote["types"] == ["ObjectRef"]
    assert remote["values"] == [5, 6]
    failure = _result(report, "run_remote_failure")
    assert failure is not None and failure["rank_failed"] and failure["rank"] == 1, failure


def test_shutdown_leaves_no_process_on_either_node(report):
    assert len(report["left"]) >= 2, f"the driver reported {len(report['left'])} of 2 shutdowns"
    for left in report["left"][:2]:  # after a job that worked, and after one whose rank died
        assert left == [], "\n".join(left)


def test_a_killed_driver_leaves_no_process_on_either_node(report):
    assert _result(report, "orphaned") == ["mtr-a", "mtr-b"]
    assert len(report["left"]) == 3, "the driver never reported its third executor running"
    assert report["left"][2] == [], "\n".join(report["left"][2])


def test_packed_workers_run_on_one_node(report):
    """num_workers=2 asks for PACK: both 1-CPU bundles on one node of 2 free CPUs, so both ranks in one
    host (num_hosts=2, STRICT_SPREAD, put one on each: test_ranks_start_through_the_actors_without_ssh)."""
    packed, nodes = _result(report, "packed"), _result(report, "packed_nodes")
    assert _result(report, "free_before_packing") == 4, "Ray had not freed the first executor's CPUs"
    assert [rank for rank, _ in packed] == [0, 1]
    assert len(nodes) == 1 and nodes[0][0] in ("mtr-a", "mtr-b") and nodes[0][1] == 2, nodes
    assert [host for _, host in packed] == [nodes[0][0]] * 2, (packed, nodes)


def test_a_rank_that_dies_ends_the_job_naming_it(report):
    death, after = _result(report, "death"), _result(report, "after_death")
    assert death is not None and "rank 1" in death["text"], death
    # A later call raises too (the executor is over until shutdown() and start()), naming why.
    assert after is not None and ("rank 1" in after["text"] or "ranks ended" in after["text"]), after
    # mtrain's report on the driver's stderr names the rank and how it ended.
    assert "rank 1" in report["stderr"] and "exit code 3" in report["stderr"], report["stderr"][-3000:]

