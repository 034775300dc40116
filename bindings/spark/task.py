"""What each Spark task of `mtrain.spark.run` does, inside its executor (no pyspark import at load).

A task holds one slot of the job for as long as the job runs:

1. it starts a TaskService (launcher/tasks/service.py) on its node, through which the driver's
   mpirun starts Open MPI's daemon there, so that the node's ranks are children of this task;
2. it connects to the driver's task CallServer as "rank" = its partition index and serves the
   driver's calls (the driver asks each task for its service with `service_facts`);
3. when the driver says stop (the job is over), it stops the service, which ends anything the
   service started, and the task finishes.  The driver going away ends it the same way.
"""
from __future__ import annotations

import os
from typing import Iterator, NamedTuple

from mtrain.launcher.tasks.call_worker import serve
from mtrain.launcher.tasks.service import TaskService

# A task's connection to the driver: the driver is already listening when the tasks start.
CONNECT_SECONDS = 30.0


class ServiceFacts(NamedTuple):
    """Where the driver's task agents reach one task's TaskService."""

    hostname: str   # what PRRTE calls this node (socket.gethostname())
    address: str
    port: int


class _Held:
    """The TaskService of the task this Python worker is running (one task at a time)."""

    service: TaskService | None = None
    facts: ServiceFacts | None = None


def service_facts() -> ServiceFacts:
    """Called by the driver in each task: the facts of the task's running TaskService."""
    if _Held.facts is None:
        raise RuntimeError("mtrain.spark: no task service is running in this Spark task")
    return _Held.facts


def hold_slot(index: int, driver_address: str, driver_port: int, key_hex: str) -> Iterator[int]:
    """The body of Spark task `index` (a mapPartitionsWithIndex function's generator): start a
    TaskService, serve the driver until the job is over, stop the service; yields `index`."""
    from pyspark import TaskContext
    context = TaskContext.get()
    if context is not None and context.attemptNumber() > 0:
        # The job's ranks were placed on the first attempts' nodes: a retried task has no part in it.
        raise RuntimeError(f"mtrain.spark: Spark retried task {index}; an mtrain job does not restart its "
                           "tasks (see the first attempt's error)")
    key = bytes.fromhex(key_hex)
    # Spark's own idea of this node's address, where set (a standalone worker's SPARK_LOCAL_IP).
    service = TaskService(key, address=os.environ.get("SPARK_LOCAL_IP") or None)
    address, port = service.start()
    _Held.service, _Held.facts = service, ServiceFacts(service.hostname, address, port)
    try:
        status = serve(driver_address, driver_port, key, index, deadline_s=CONNECT_SECONDS)
    finally:
        _Held.service, _Held.facts = None, None
        service.stop()
    if status != 0:
        raise RuntimeError(f"mtrain.spark: task {index} lost the driver of its mtrain job")
    yield index
