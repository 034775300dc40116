"""Where an mtrain.ray job's ranks go: a placement group, one actor per bundle, one TaskService
per node (launcher/tasks/service.py), run by the first actor on that node.

Horovod's two strategies, by the same rule (horovod/ray/strategy.py):
* `num_hosts` (× `num_workers_per_host`): one bundle per host holding all its workers' resources,
  STRICT_SPREAD, so each bundle is a different node (Horovod's ColocatedStrategy);
* `num_workers`: one bundle per worker, PACK (Horovod's PGStrategy).
An actor holds its bundle's resources for the executor's life; the ranks themselves are MPI
processes that mpirun starts through the node's TaskService, under that actor.  MPI numbers
ranks host by host, so ranks are grouped by node: the driver's node first when it holds
bundles (its ranks are then mpirun's own children), the others in the order of their first
bundle.
"""
from __future__ import annotations

import dataclasses
import os
import socket
from typing import Any

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy


class SlotActor:
    """A Ray actor holding one bundle; the first one on each node serves its TaskService."""

    def __init__(self) -> None:
        self.service = None

    def where(self) -> tuple[str, str, str, int]:
        """(Ray node id, hostname, node IP, this actor's pid)."""
        return (ray.get_runtime_context().get_node_id(), socket.gethostname(), ray.util.get_node_ip_address(),
                os.getpid())

    def start_service(self, key: bytes) -> tuple[str, int]:
        """Start this node's TaskService; (address, port) for the driver's task agents."""
        from mtrain.launcher.tasks.service import TaskService
        if self.service is None:
            self.service = TaskService(key, address=ray.util.get_node_ip_address())
            return self.service.start()
        raise RuntimeError("this actor's task service is already running")

    def stop_service(self) -> int:
        """End everything the service started here; how many commands were still running."""
        if self.service is None:
            return 0
        running = self.service.running()
        self.service.stop()
        self.service = None
        return running


@dataclasses.dataclass
class Node:
    """One node of the job: its hostname (what MPI calls it), its service, its slots."""

    node_id: str
    hostname: str
    address: str
    slots: int
    service_actor: Any                     # the SlotActor running the node's TaskService
    service: tuple[str, int] | None = None


@dataclasses.dataclass
class Placement:
    """The placement group, its actors, and the nodes in rank order."""

    group: Any
    actors: list
    nodes: list[Node]
    actor_pids: dict[str, list[int]]     # hostname -> pids of the actors there

    @property
    def size(self) -> int:
        return sum(node.slots for node in self.nodes)

    def release(self) -> None:
        """Stop the services, end the actors, free the placement group."""
        services = [node.service_actor.stop_service.remote() for node in self.nodes if node.service]
        try:
            ray.get(services, timeout=30)
        except Exception:  # an actor already gone: its node's service went with it
            pass
        for actor in self.actors:
            ray.kill(actor, no_restart=True)
        if self.group is not None:
            remove_placement_group(self.group)
            self.group = None


def bundles_for(num_workers: int | None, num_hosts: int | None, num_workers_per_host: int, cpus_per_worker: float,
                gpus_per_worker: float) -> tuple[list[dict], str, int]:
    """(bundles, strategy, workers per bundle) by Horovod's rule (see the module docstring)."""
    def resources(workers: int) -> dict:
        needed = {"CPU": cpus_per_worker * workers}
        if gpus_per_worker:
            needed["GPU"] = gpus_per_worker * workers
        return needed
    if num_hosts:
        return [resources(num_workers_per_host) for _ in range(num_hosts)], "STRICT_SPREAD", num_workers_per_host
    return [resources(1) for _ in range(int(num_workers or 0))], "PACK", 1


def place(bundles: list[dict], strategy: str, per_bundle: int, timeout_s: float,
          first_node: str | None = None) -> Placement:
    """Reserve `bundles`, start an actor on each, group them by node, `first_node` (the driver's,
    whose ranks are then mpirun's own children there) first; TimeoutError (one line) when the
    cluster cannot hold them within `timeout_s`."""
    group = placement_group(bundles, strategy=strategy)
    ready, _ = ray.wait([group.ready()], timeout=timeout_s)
    if not ready:
        remove_placement_group(group)
        raise TimeoutError(f"mtrain.ray: the cluster could not hold {len(bundles)} bundles of {bundles[0]} "
                           f"({strategy}) within {timeout_s:g} s; available now: {ray.available_resources()}")
    remote = ray.remote(SlotActor)
    actors = []
    for index, bundle in enumerate(bundles):
        options = {"num_cpus": bundle.get("CPU", 0), "num_gpus": bundle.get("GPU", 0),
                   "scheduling_strategy": PlacementGroupSchedulingStrategy(
                       placement_group=group, placement_group_bundle_index=index)}
        actors.append(remote.options(**options).remote())
    try:
        where = ray.get([actor.where.remote() for actor in actors], timeout=timeout_s)
    except Exception:
        for actor in actors:
            ray.kill(actor, no_restart=True)
        remove_placement_group(group)
        raise
    nodes: dict[str, Node] = {}
    pids: dict[str, list[int]] = {}
    for actor, (node_id, hostname, address, pid) in zip(actors, where):
        if node_id not in nodes:
            nodes[node_id] = Node(node_id, hostname, address, 0, actor)
        nodes[node_id].slots += per_bundle
        pids.setdefault(hostname, []).append(pid)
    ordered = sorted(nodes.values(), key=lambda node: node.node_id != first_node)  # (a stable sort)
    names = [node.hostname for node in ordered]
    placement = Placement(group, actors, ordered, pids)
    if len(set(names)) != len(names):
        placement.release()
        # MPI tells hosts apart by name: two nodes of one name would be taken for one.
        raise RuntimeError(f"mtrain.ray: Ray nodes share a hostname ({', '.join(sorted(names))}); "
                           "MPI needs each node to have its own")
    return placement
