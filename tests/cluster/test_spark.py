"""mtrain.spark.run on a real Spark standalone cluster (tests/cluster/sparkcluster.py): one task per
namespace host, ranks started through the tasks' TaskServices, fn called in every rank."""
from __future__ import annotations

import os
import re
import socket
import sys
import time
import uuid

import pytest

from tests.cluster.conftest import leftovers
from tests.cluster.processes import cmdline, comm

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(600)]


@pytest.fixture(autouse=True, scope="module")
def functions_by_value():
    """The executors cannot import this test module: its functions travel by value, as a user's would."""
    import cloudpickle
    module = sys.modules[__name__]
    cloudpickle.register_pickle_by_value(module)
    yield
    cloudpickle.unregister_pickle_by_value(module)


@pytest.fixture(scope="module")
def spark(spark_cluster, cluster):
    """The driver's Spark session (this process), for this module; stopped, its executors gone, after."""
    from pyspark.sql import SparkSession
    builder = SparkSession.builder.master(spark_cluster.master_url).appName("mtrain-spark-test")
    for name, value in spark_cluster.session_settings().items():
        builder = builder.config(name, value)
    session = builder.getOrCreate()
    yield session
    session.stop()
    deadline = time.monotonic() + 60  # the workers end the application's executors
    while (alive := [line for line in leftovers(cluster, f"mtrtok{uuid.uuid4().hex}")
                     if "java" in line or "python" in line]):
        if time.monotonic() > deadline:
            pytest.fail("Spark executors outlived the session:\n" + "\n".join(alive))
        time.sleep(0.5)


def job_processes(cluster) -> list[str]:
    """What an mtrain job may leave: MPI daemons and mtrain's processes, on the hosts or below us."""
    from mtrain.launcher.process_tools import descendants
    # (Spark's own JVMs and Python workers stay on the hosts for the session: not the job's.)
    found = [line for line in leftovers(cluster, f"mtrtok{uuid.uuid4().hex}")
             if "prted" in line or "mtrain.launcher." in line]
    for pid in descendants(os.getpid()):  # mpirun and the task agents ran here
        if comm(pid) in ("prted", "mpirun", "prterun") or "mtrain.launcher." in cmdline(pid):
            found.append(f"{pid}: {cmdline(pid)[:120]}")
    return found


def assert_nothing_left(cluster, within: float = 20) -> None:
    deadline = time.monotonic() + within
    while (alive := job_processes(cluster)):
        if time.monotonic() > deadline:
            raise AssertionError("the job left processes behind:\n" + "\n".join(alive))
        time.sleep(0.2)


def test_the_cluster_is_one_master_and_a_worker_per_host_and_no_leftover(spark_cluster, cluster) -> None:
    # (First in this file: before the module's Spark session starts executors on the hosts.)
    commands = {pid: cmdline(pid) for host in cluster.hosts for pid in cluster.namespace_pids(host.name)}
    daemons = {pid: line for pid, line in commands.items() if "org.apache.spark.deploy." in line}
    assert sorted(line.split("org.apache.spark.deploy.")[1].split()[0] for line in daemons.values()) == [
        "master.Master", "worker.Worker", "worker.Worker"]
    assert set(daemons) == spark_cluster.daemon_pids()  # so the other tests do not take them for leftovers
    assert leftovers(cluster, f"mtrtok{uuid.uuid4().hex}") == []


def where_am_i(scale: int, offset: int = 0) -> tuple[int, str, int]:
    import mtrain.torch as hvd
    hvd.init()
    return hvd.rank() * scale + offset, socket.gethostname(), hvd.size()


def test_run_returns_every_rank_result_in_rank_order(spark, cluster) -> None:
    import mtrain.spark
    results = mtrain.spark.run(where_am_i, args=(10,), kwargs={"offset": 3}, start_timeout=180)
    assert [value for value, _, _ in results] == [3, 13]
    assert {host for _, host, _ in results} == {"mtr-a", "mtr-b"}  # one rank in each host's task
    assert [size for _, _, size in results] == [2, 2]
    assert_nothing_left(cluster)


def train(steps: int) -> dict:
    """Rank r trains on its half of a fixed data set with DistributedOptimizer; the final weights. Each
    rank starts from weights of its own (seed r): only broadcast_parameters gives them rank 0's."""
    import torch
    import mtrain.torch as hvd
    hvd.init()
    torch.manual_seed(hvd.rank())
    model = torch.nn.Linear(4, 1)
    features = torch.arange(32, dtype=torch.float32).reshape(8, 4) / 10
    targets = features.sum(dim=1, keepdim=True) * torch.linspace(0.5, 2.0, 8).reshape(8, 1)
    half = slice(hvd.rank() * 4, hvd.rank() * 4 + 4)
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05),
                                         named_parameters=model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    for _ in range(steps):
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(model(features[half]), targets[half]).backward()
        optimizer.step()
    return {name: value.detach().numpy().copy() for name, value in model.state_dict().items()}


def train_alone(steps: int) -> dict:
    """The same model trained by one process on the whole data set (means of equal halves), from rank 0's start."""
    import torch
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    features = torch.arange(32, dtype=torch.float32).reshape(8, 4) / 10
    targets = features.sum(dim=1, keepdim=True) * torch.linspace(0.5, 2.0, 8).reshape(8, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    for _ in range(steps):
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(model(features), targets).backward()
        optimizer.step()
    return {name: value.detach().numpy().copy() for name, value in model.state_dict().items()}


def test_training_equals_the_single_process_model(spark, cluster) -> None:
    import numpy
    import mtrain.spark
    ranks = mtrain.spark.run(train, args=(20,), start_timeout=180)
    alone = train_alone(20)
    untrained = train_alone(0)
    assert len(ranks) == 2
    for weights in ranks:
        assert weights.keys() == alone.keys()
        for name in alone:
            numpy.testing.assert_allclose(weights[name], alone[name], rtol=1e-5, atol=1e-6)
            assert not numpy.allclose(alone[name], untrained[name])  # it did train
    assert_nothing_left(cluster)


def fail_in_rank_one() -> int:
    import mtrain.torch as hvd
    hvd.init()
    if hvd.rank() == 1:
        raise ValueError(f"rank {hvd.rank()} found bad data on {socket.gethostname()}")
    hvd.allreduce(__import__("torch").ones(1), name="stuck")  # rank 0 waits for a rank that failed
    return 0


def test_a_failing_rank_fails_the_job_naming_the_rank(spark, cluster) -> None:
    import mtrain.spark
    from mtrain.spark import RankFailed
    with pytest.raises(RankFailed) as failed:
        mtrain.spark.run(fail_in_rank_one, start_timeout=180)
    assert failed.value.rank == 1 and failed.value.remote_type == "ValueError"
    assert "rank 1 failed: ValueError: rank 1 found bad data on mtr-" in str(failed.value)
    assert "fail_in_rank_one" in failed.value.remote_traceback
    tracker = spark.sparkContext.statusTracker()
    jobs = tracker.getJobIdsForGroup(failed.value.spark_job_group)
    assert jobs and all(tracker.getJobInfo(job).status == "FAILED" for job in jobs)
    assert_nothing_left(cluster)
    # The cluster is fine afterwards: the next job runs.
    assert [value for value, _, _ in mtrain.spark.run(where_am_i, args=(1,), start_timeout=180)] == [0, 1]
    assert_nothing_left(cluster)


def die_in_rank_one() -> int:
    import mtrain.torch as hvd
    hvd.init()
    if hvd.rank() == 1:
        print("rank 1 is going", file=sys.stderr, flush=True)
        os._exit(7)  # no exception, no goodbye: a crash
    hvd.allreduce(__import__("torch").ones(1), name="never")
    return 0


def test_a_rank_that_dies_ends_the_job_and_the_report_names_it(spark, cluster) -> None:
    import io
    import mtrain.spark
    from mtrain.launcher.tasks.call_service import CallServerError
    output, errors = io.StringIO(), io.StringIO()
    with pytest.raises(CallServerError) as ended:
        mtrain.spark.run(die_in_rank_one, start_timeout=180, stdout=output, stderr=errors)
    report = errors.getvalue()
    assert "mtrain: job failed; first failure: rank 1 on mtr-" in report and ": exit code 7" in report, report
    assert "[1]<stderr>:rank 1 is going" in report  # the job's output went to the stream given
    # Whichever the driver sees first: the rank's connection dropping, or the job's end.
    assert re.fullmatch(r"mtrain: lost the connection to rank 1 during the call .*|"
                        r"mtrain\.spark\.run: the job's ranks ended \(status [1-9]\d*\) before fn returned .*",
                        str(ended.value)), str(ended.value)
    assert_nothing_left(cluster)


NO_ROOM = """
import sys
from pyspark.sql import SparkSession
import mtrain.spark
master, driver = sys.argv[1:3]
# Executors of 4 cores: no worker (1 core each) can start one, so no task ever runs.
session = (SparkSession.builder.master(master).config("spark.driver.host", driver)
           .config("spark.driver.bindAddress", driver).config("spark.ui.enabled", "false")
           .config("spark.executor.cores", "4").config("spark.executor.memory", "512m").getOrCreate())
try:
    mtrain.spark.run(print, num_proc=2, start_timeout=15)
except mtrain.spark.SparkRunError as error:
    print(error, file=sys.stderr)
session.stop()
try:
    mtrain.spark.run(print, num_proc=2, start_timeout=15)
except mtrain.spark.SparkRunError as error:
    print(error, file=sys.stderr)
    sys.exit(3)
"""


def test_no_room_for_the_tasks_and_no_session_are_one_line_each(spark_cluster) -> None:
    from tests.jobs import run_job
    done = run_job([sys.executable, "-c", NO_ROOM, spark_cluster.master_url, spark_cluster.driver_host],
                   timeout=180)
    lines = [line for line in done.stderr.splitlines() if line.startswith("mtrain")]
    assert done.returncode == 3, done.stderr[-3000:]
    assert lines == [
        "mtrain.spark.run: 0 of 2 Spark tasks started within 15 s: the application needs 2 free task slots "
        "(cores / spark.task.cpus) on a reachable cluster; or raise start_timeout",
        "mtrain.spark.run: no active Spark session: start one first, e.g. "
        "SparkSession.builder.master('spark://HOST:7077').getOrCreate(), then call run"], done.stderr[-3000:]


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
