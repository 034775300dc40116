"""Pure: the JobLayout every rank is told (torchrun's variables, TF_CONFIG) from what the
launcher and the preflight learned about the hosts.

Ports come from the hosts themselves (the preflight's probe binds them there), so
MASTER_PORT is free on rank 0's host and every tf.distribute worker's port is
free on its own host.  Addresses are each host's address on the network the job
uses: `--network-interface` (names or subnets) when given, else the subnets on
the routes to the remote hosts, else the address the host is reached at.  Where
that address belongs to a known interface, the host's ranks are also told its
name (GLOO_SOCKET_IFNAME, NCCL_SOCKET_IFNAME): Gloo otherwise goes by what the
host name resolves to, often a loopback address.
"""
from __future__ import annotations

import dataclasses
from typing import Mapping, Sequence

from mtrain.common.records.job_layout import JobLayout
from mtrain.launcher.job.hosts import HostSlots
from mtrain.launcher.job.netif import choose_interface


@dataclasses.dataclass(frozen=True)
class HostFacts:
    """What the layout needs of one host."""

    addresses: Mapping[str, str]   # interface -> "ip/len" (interface_addresses)
    ports: tuple[int, ...]         # free TCP ports there, at least ports_needed() of them
    gpus: int = 0
    fallback_address: str = ""     # used when no network of the job matches an address


def ports_needed(plan: Sequence[HostSlots], master_port: int | None) -> dict[str, int]:
    """Free ports to find per host: one per rank (its TF worker), plus rank 0's MASTER_PORT."""
    needed = {host.name: host.slots for host in plan}
    if master_port is None:
        needed[plan[0].name] += 1
    return needed


def job_layout(plan: Sequence[HostSlots], facts: Mapping[str, HostFacts], networks: Sequence[str],
               master_port: int | None = None, one_gpu_per_rank: bool = False) -> JobLayout:
    """The layout for `plan` (hosts in rank order); raises ValueError if a host lacks ports."""
    workers: list[str] = []
    addresses: list[str] = []
    interfaces: list[str] = []
    chosen_master = master_port
    for index, host in enumerate(plan):
        fact = facts[host.name]
        interface, address = choose_interface(dict(fact.addresses), networks) or ("", fact.fallback_address)
        if not address:
            raise ValueError(f"host {host.name}: no address on the job's network "
                             f"({', '.join(networks) or 'none given'}); choose one with --network-interface")
        ports = list(fact.ports)
        if index == 0 and chosen_master is None:
            if not ports:
                raise ValueError(f"host {host.name}: no free port found for MASTER_PORT; give --master-port")
            chosen_master = ports.pop(0)
        if len(ports) < host.slots:
            raise ValueError(f"host {host.name}: found {len(ports)} free ports for {host.slots} ranks")
        addresses.append(address)
        interfaces.append(interface)
        workers += [f"{_url_host(address)}:{port}" for port in ports[:host.slots]]
    return JobLayout(slots=tuple(host.slots for host in plan), master_addr=addresses[0],
                     master_port=int(chosen_master), workers=tuple(workers), interfaces=tuple(interfaces),
                     gpu_per_rank=tuple(facts[h.name].gpus for h in plan) if one_gpu_per_rank else ())


def _url_host(address: str) -> str:
    return f"[{address}]" if ":" in address else address
