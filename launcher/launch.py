"""From a LaunchConfig to a finished job: argv, dry run, preflight, supervision."""
from __future__ import annotations

import contextlib
import dataclasses
import os
import shlex
import socket
import stat
import sys
import tempfile
import time
import uuid
from typing import Callable

import mtrain
from mtrain.launcher import mpirun as mpilib
from mtrain.launcher import ssh_agent
from mtrain.launcher.config import LaunchConfig, MpiKind
from mtrain.launcher.environment import rank_environment
from mtrain.launcher.layout import HostFacts, job_layout, ports_needed
from mtrain.launcher.netif import free_ports
from mtrain.records import (ENV_ELASTIC_UPDATES, ENV_ELASTIC_VERSION, ENV_JOB_FILE, AgentEvent, ElasticResume,
                            ExitRecord, Gate, HostUpdates, JobLayout, host_path, updates_file)

# Where each host keeps the job's layout for its ranks: a path that exists on every Linux host.
JOB_FILE_DIRECTORY = "/tmp"


def _log(config: LaunchConfig, message: str) -> None:
    if config.verbose:
        print(f"mtrain: [{_stamp()}] {message}", file=sys.stderr, flush=True)


def build_job_argv(config: LaunchConfig, agent: list[str] | None, subnets: tuple[str, ...] = (),
                   job_file: str | None = None) -> list[str]:
    """The launcher argv for `config` (pure apart from reading os.environ).

    `subnets` is the automatic interface choice, used when the user gave none.
    Whether ranks must yield the CPU (more ranks than cores on a host) is decided
    on each host by the rank wrapper, which knows that host's cores.
    """
    names, values = rank_environment(os.environ, config.env_pass)
    if job_file:
        values.setdefault(ENV_JOB_FILE, job_file)
    if config.mpi.kind is MpiKind.MPICH:
        subnets = ()  # hydra's -iface wants an interface name, not a subnet
    return mpilib.build_argv(
        config.mpi, config.plan, config.command, rank_python=sys.executable, agent=agent,
        env_names=names, env_values=values, network_interfaces=config.network_interfaces or subnets,
        as_root=os.geteuid() == 0, extra_args=config.mpi_args)


def _agent(config: LaunchConfig, directory: str, events_path: str, gate: str, job_file: str,
           updates: str | None) -> list[str]:
    """The remote-shell program handed to mpirun, with its settings written beside it."""
    config_path = os.path.join(directory, "agent.json")
    identity = os.path.abspath(config.ssh.identity_file) if config.ssh.identity_file else None
    options = dataclasses.replace(config.ssh, identity_file=identity, connect_timeout=config.start_timeout)
    ssh_agent.write_config(config_path, options, sys.executable, events_path, gate, job_file, updates)
    words = [sys.executable, "-m", "mtrain.launcher.ssh_agent", "--config", config_path]
    if config.mpi.kind is not MpiKind.MPICH:
        return words
    # hydra's -launcher-exec takes one program path, so wrap the words in a script.
    path = os.path.join(directory, "mtrain-ssh-agent")
    with open(path, "w") as handle:
        handle.write(f"#!/bin/sh\nexec {shlex.join(words)} \"$@\"\n")
    os.chmod(path, stat.S_IRWXU)
    return [path]


def print_plan(config: LaunchConfig, argv: list[str]) -> None:
    rank = 0
    for host in config.plan:
        where = "ssh" if host.name in config.remote_hosts else "local"
        ranks = f"rank {rank}" if host.slots == 1 else f"ranks {rank}-{rank + host.slots - 1}"
        print(f"host {host.name}: {ranks} ({where})")
        rank += host.slots
    print(shlex.join(argv))


@dataclasses.dataclass
class Generation:
    """What an elastic driver (launcher/elastic.py) adds to one launch, and learns from it."""

    env: tuple[str, ...] = ()   # extra `-x NAME=value` items for the ranks
    on_resume: Callable[[ElasticResume], None] | None = None
    job_id: str = dataclasses.field(default_factory=lambda: uuid.uuid4().hex)
    # Filled in by launch(): where a new host-set version goes (this host's file for its ranks,
    # and the file the SSH agents forward to their hosts), then how the job ended.
    updates_paths: list[str] = dataclasses.field(default_factory=list)
    records: list[ExitRecord] = dataclasses.field(default_factory=list)
    host_problems: list[AgentEvent] = dataclasses.field(default_factory=list)
    interrupted: bool = False

    def notify(self, version: int) -> None:
        """Tell every rank of this generation that the host set is now `version`."""
        for path in self.updates_paths:
            with contextlib.suppress(OSError):  # the generation may be ending as we speak
                HostUpdates(version).write(path)


def launch(config: LaunchConfig, dry_run: bool = False, generation: Generation | None = None) -> int:
    """Run the job described by `config`; return mtrain's exit status.

    With remote hosts, mpirun starts right away and its agents connect while
    the preflight runs, but they execute nothing on any host until the
    preflight has passed (the agents' gate): the handshakes overlap instead
    of adding up.  The job's layout (torchrun's variables, TF_CONFIG) needs
    the preflight's ports, so it travels through the gate to the hosts, where
    the remote guard leaves it for the rank wrappers in JOB_FILE_DIRECTORY.
    """
    from mtrain.launcher import supervise
    with tempfile.TemporaryDirectory(prefix="mtrain-agent-") as scratch:
        agent = None
        events_path = os.path.join(scratch, "events")
        gate = os.path.join(scratch, "gate")
        job_id = generation.job_id if generation else uuid.uuid4().hex
        job_file = os.path.join(JOB_FILE_DIRECTORY, f"mtrain-job-{job_id}-{{host}}.json")
        agents_updates = os.path.join(scratch, "updates") if generation else None
        if generation is not None:
            config = dataclasses.replace(config, env_pass=config.env_pass + generation.env + (
                f"{ENV_ELASTIC_UPDATES}={updates_file(job_file)}", f"{ENV_ELASTIC_VERSION}=0"))
            generation.updates_paths = [host_path(updates_file(job_file)), agents_updates]
        if config.remote_hosts:
            if dry_run and config.mpi.kind is not MpiKind.MPICH:
                # Printed for a human to rerun: no scratch config that vanishes when we exit
                # (the agent then uses ~/.ssh/config and OpenSSH defaults).
                agent = [sys.executable, "-m", "mtrain.launcher.ssh_agent"]
            else:
                agent = _agent(config, scratch, events_path, gate, job_file, agents_updates)
        subnets = _route_subnets(config) if config.remote_hosts and not config.network_interfaces else ()
        try:
            argv = build_job_argv(config, agent, subnets, job_file)
        except ValueError as error:
            print(f"mtrain run: error: {error}", file=sys.stderr)
            return 2
        if dry_run:
            print_plan(config, argv)
            return 0
        if subnets:
            _log(config, f"hosts are reached through {', '.join(subnets)}")
        local_file = host_path(job_file)
        try:
            if config.remote_hosts:
                preflight = lambda: _preflight(config, subnets, local_file)  # noqa: E731
            else:
                preflight = None
                _local_layout(config).write(local_file)
            job = supervise.Job(argv, dict(os.environ), config.num_proc, config.output_dir, config.verbose,
                                events_path if agent else None, preflight=preflight,
                                gate=Gate(gate) if agent else None,
                                on_resume=generation.on_resume if generation else None,
                                report_failures=generation is None)
            status = job.run()
            if generation is not None:
                generation.records, generation.host_problems = list(job.records), list(job.host_problems)
                generation.interrupted = job.interrupted is not None
            return status
        finally:
            for path in (local_file, host_path(updates_file(job_file))):
                with contextlib.suppress(OSError):
                    os.unlink(path)


def _local_layout(config: LaunchConfig) -> JobLayout:
    """The layout of a job on this machine alone: everything on the loopback address."""
    from mtrain.launcher.capabilities import gpu_count
    needed = ports_needed(config.plan, config.master_port)
    ports = free_ports(sum(needed.values()))
    gpus = gpu_count() if config.one_gpu_per_rank else 0
    facts, start = {}, 0
    for host in config.plan:
        facts[host.name] = HostFacts({}, tuple(ports[start:start + needed[host.name]]), gpus, "127.0.0.1")
        start += needed[host.name]
    return job_layout(config.plan, facts, (), config.master_port, config.one_gpu_per_rank)


def _preflight(config: LaunchConfig, subnets: tuple[str, ...], local_file: str) -> str | None:
    """Check every remote host; print one line per failing host.

    When all passed, return the job's layout for the gate (and leave it in `local_file`
    for the ranks on this machine); None when the job must not start.
    """
    from mtrain.launcher.preflight import run_preflight, slot_warnings
    _log(config, f"preflight of {', '.join(config.remote_hosts)}")
    needed = ports_needed(config.plan, config.master_port)
    reports = run_preflight(config.remote_hosts, config.ssh, sys.executable,
                            mtrain.__version__, config.start_timeout, needed)
    errors = [r.error for r in reports.values() if r.error]
    for line in errors:
        print(f"mtrain: {line}", file=sys.stderr)
    if errors:
        failed = "1 host" if len(errors) == 1 else f"{len(errors)} hosts"
        print(f"mtrain: preflight failed on {failed}; nothing was started", file=sys.stderr)
        return None
    for line in slot_warnings(reports, {h.name: h.slots for h in config.plan}):
        print(f"mtrain: warning: {line}", file=sys.stderr)
    try:
        layout = _remote_layout(config, subnets, reports, needed)
    except ValueError as error:
        print(f"mtrain: {error}; nothing was started", file=sys.stderr)
        return None
    if any(h.name not in config.remote_hosts for h in config.plan):
        layout.write(local_file)
    _log(config, f"preflight passed; MASTER_ADDR={layout.master_addr} MASTER_PORT={layout.master_port}")
    return layout.encode()


def _remote_layout(config: LaunchConfig, subnets: tuple[str, ...], reports, needed) -> JobLayout:
    from mtrain.launcher import ssh
    from mtrain.launcher.capabilities import gpu_count
    from mtrain.launcher.netif import interface_addresses, source_address
    facts = {}
    for host in config.plan:
        if host.name in config.remote_hosts:
            report = reports[host.name]
            target = ssh.resolve(host.name, config.ssh)
            facts[host.name] = HostFacts(report.addresses, report.ports, report.gpus,
                                         _ipv4_of(target.hostname))
        else:
            first_remote = ssh.resolve(config.remote_hosts[0], config.ssh)
            facts[host.name] = HostFacts(interface_addresses(), tuple(free_ports(needed[host.name])),
                                         gpu_count() if config.one_gpu_per_rank else 0,
                                         source_address(first_remote.hostname, first_remote.port) or "")
    return job_layout(config.plan, facts, config.network_interfaces or subnets, config.master_port,
                      config.one_gpu_per_rank)


def _ipv4_of(name: str) -> str:
    try:
        return socket.getaddrinfo(name, None, socket.AF_INET, socket.SOCK_STREAM)[0][4][0]
    except (OSError, IndexError):
        return ""


def _route_subnets(config: LaunchConfig) -> tuple[str, ...]:
    """Subnets of our interfaces on the routes to the remote hosts; () if any is unknown."""
    from mtrain.launcher import ssh
    from mtrain.launcher.netif import source_address, subnet_of
    found = set()
    for host in config.remote_hosts:
        try:
            target = ssh.resolve(host, config.ssh)
        except ssh.SshError:
            return ()  # the preflight will say what is wrong with this host
        address = source_address(target.hostname, target.port)
        subnet = subnet_of(address) if address else None
        if subnet is None:
            return ()  # some host reached in a way we cannot name: fall back to the exclude list
        found.add(subnet)
    return tuple(sorted(found))


def _stamp() -> str:
    now = time.time()
    return time.strftime("%H:%M:%S", time.localtime(now)) + f".{int(now % 1 * 1000):03d}"
