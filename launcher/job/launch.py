"""From a LaunchConfig to a finished job: argv, dry run, preflight, supervision."""
from __future__ import annotations

import contextlib
import dataclasses
import os
import shlex
import signal
import socket
import stat
import sys
import tempfile
import threading
import uuid
from typing import TYPE_CHECKING, Callable, Mapping, Sequence

import mtrain
from mtrain.common.private import PrivatePathError, temporary_folder
from mtrain.common.records.agent_events import AgentEvent
from mtrain.common.records.daemon_env import ENV_MPIRUN_TMPDIR, ENV_USER_TMPDIR, ENV_USER_UMASK
from mtrain.common.records.elastic import (
    ENV_ELASTIC_UPDATES,
    ENV_ELASTIC_VERSION,
    ENV_JOB_SECRET,
    ElasticResume,
    HostUpdates,
    host_path,
    new_job_secret,
    updates_file,
)
from mtrain.common.records.exit_record import ExitRecord
from mtrain.common.records.gate import Gate
from mtrain.common.records.job_layout import ENV_JOB_FILE, ENV_JOB_LAYOUT, JobLayout
from mtrain.common.records.steps import ENV_STEP_REPORT_SECONDS, ENV_STRAGGLER_EVERY, ENV_STRAGGLER_OFF
from mtrain.launcher.cli.config import LaunchConfig, Launcher, MpiKind, StepSettings
from mtrain.launcher.job import job_files, slurm
from mtrain.launcher.job import mpirun as mpilib
from mtrain.launcher.job.environment import rank_environment
from mtrain.launcher.job.layout import HostFacts, job_layout, ports_needed
from mtrain.launcher.job.netif import free_ports
from mtrain.launcher.ssh import agent as ssh_agent
from mtrain.launcher.supervise.output import log

if TYPE_CHECKING:
    from mtrain.launcher.job.preflight import HostReport

# With --progress, ranks send their measured steps this often (seconds).
PROGRESS_REPORT_SECONDS = 1
# "0" turns off the shared SSH connections (each agent then connects by itself).
ENV_SHARE_SSH = "MTRAIN_SSH_SHARE"


def _log(config: LaunchConfig, message: str) -> None:
    log(config.verbose, message)


def build_job_argv(config: LaunchConfig, agent: list[str] | None, subnets: tuple[str, ...] = (),
                   job_env: "dict[str, str] | None" = None) -> list[str]:
    """The launcher argv for `config` (pure apart from reading os.environ).

    `subnets` is the automatic interface choice, used when the user gave none.
    `job_env`: the job's own variables for the ranks (its files, its secret), which go into
    mpirun's environment (``job_environment``) and are forwarded by name: their values are
    never on a command line, where any user of the host can read them.
    Whether ranks must yield the CPU (more ranks than cores on a host) is decided
    on each host by the rank wrapper, which knows that host's cores.
    """
    environment = job_environment(job_env)
    names, values = rank_environment(environment, config.rank_items)
    if config.mpi.kind is MpiKind.MPICH:
        subnets = ()  # hydra's -iface wants an interface name, not a subnet
    if config.mpi.kind is MpiKind.OPENMPI and "TMPDIR" in names:
        # -x TMPDIR: by value, as mpirun's own is the launch's folder (_private_mpirun_folder).
        names.remove("TMPDIR")
        values["TMPDIR"] = environment["TMPDIR"]
    slurm_agent = slurm.launch_agent(sys.executable, config.mpi.path) if _through_slurm(config) else None
    return mpilib.build_argv(
        config.mpi, config.plan, config.command, rank_python=sys.executable, agent=agent,
        env_names=names, env_values=values, network_interfaces=config.network_interfaces or subnets,
        as_root=os.geteuid() == 0, extra_args=config.mpi_args, binding_args=config.binding_args,
        slurm_agent=slurm_agent)


def _through_slurm(config: LaunchConfig) -> bool:
    """Whether the job's other hosts are reached through Slurm (launcher/job/slurm.py), not SSH."""
    return config.launcher is Launcher.SLURM and bool(config.remote_hosts)


def _user_umask() -> int:
    mask = os.umask(0o077)  # the only way to read it is to set it
    os.umask(mask)
    return mask


def job_environment(job_env: "dict[str, str] | None") -> dict[str, str]:
    """mpirun's environment: ours, with the job's own variables (``build_job_argv``)."""
    return {**os.environ, **(job_env or {})}


def _private_mpirun_folder(environment: "dict[str, str]", scratch: str) -> None:
    """Open MPI's launcher makes its folder in our private `scratch`, removed with it however
    mpirun ends: no folder of a killed launcher, nor one another user planted, is in its way
    (records.daemon_env.ENV_MPIRUN_TMPDIR)."""
    if "TMPDIR" in environment:
        environment[ENV_USER_TMPDIR] = environment["TMPDIR"]
    environment["TMPDIR"] = environment[ENV_MPIRUN_TMPDIR] = scratch


def step_environment(steps: StepSettings) -> dict[str, str]:
    """What the ranks' step meters are told (ringreduce/observe/steps.py): how often to send their steps."""
    if not steps.measured:
        return {ENV_STRAGGLER_OFF: "1"}
    environment = {ENV_STRAGGLER_EVERY: str(steps.every)} if steps.every else {}
    if steps.progress:
        environment[ENV_STEP_REPORT_SECONDS] = str(PROGRESS_REPORT_SECONDS)
    return environment


def _agent(config: LaunchConfig, directory: str, events_path: str, gate: str, job_file: str,
           updates: str | None, master: str | None = None) -> list[str]:
    """The remote-shell program handed to mpirun, with its settings written beside it."""
    config_path = os.path.join(directory, "agent.json")
    identity = os.path.abspath(config.ssh.identity_file) if config.ssh.identity_file else None
    options = dataclasses.replace(config.ssh, identity_file=identity, connect_timeout=config.start_timeout)
    ssh_agent.write_config(config_path, options, sys.executable, events_path, gate, job_file, updates, master)
    words = [sys.executable, "-m", "mtrain.launcher.ssh.agent", "--config", config_path]
    if config.mpi.kind is not MpiKind.MPICH:
        return words
    # hydra's -launcher-exec takes one program path, so wrap the words in a script.
    path = os.path.join(directory, "mtrain-ssh-agent")
    with open(path, "w") as handle:
        handle.write(f"#!/bin/sh\nexec {shlex.join(words)} \"$@\"\n")
    os.chmod(path, stat.S_IRWXU)
    return [path]


def print_plan(config: LaunchConfig, argv: list[str]) -> None:
    """--dry-run: the hosts, the settings every rank gets, and the launcher's command."""
    rank = 0
    for host in config.plan:
        where = ("local" if host.name not in config.remote_hosts
                 else "slurm" if config.launcher is Launcher.SLURM else "ssh")
        ranks = f"rank {rank}" if host.slots == 1 else f"ranks {rank}-{rank + host.slots - 1}"
        print(f"host {host.name}: {ranks} ({where})")
        rank += host.slots
    if config.launcher is Launcher.SLURM:
        print(f"launcher: slurm (inside Slurm job {config.slurm_job}: srun starts the MPI daemons, no SSH)")
    elif config.remote_hosts:
        print("launcher: ssh")
    for name, value, origin in rank_settings_shown(config, os.environ):
        print(f"rank setting {name}={value} ({origin})")
    print(shlex.join(argv))


def rank_settings_shown(config: LaunchConfig, environ: Mapping[str, str]) -> list[tuple[str, str, str]]:
    """(name, value, origin) of the runtime's settings every rank gets: from the flags, from -x,
    and the MTRAIN_* / HOROVOD_* variables of this environment they inherit (the job's own
    variables, its secret among them, are not in `environ` and never shown)."""
    shown = {s.name: (s.value, s.origin) for s in config.rank_settings}
    for item in config.env_pass:
        name, eq, value = item.partition("=")
        if name.startswith(_SETTING_PREFIXES) and name not in shown and (eq or name in environ):
            shown[name] = (value if eq else environ[name], f"-x {name}")
    for name in sorted(environ):
        if name.startswith(_SETTING_PREFIXES) and name not in shown and name not in _JOB_VARIABLES:
            shown[name] = (environ[name], "this environment")
    return [(name, value, origin) for name, (value, origin) in sorted(shown.items())]


_SETTING_PREFIXES = ("MTRAIN_", "HOROVOD_")
# Each job sets its own (an inherited one, of a job this `mtrain run` runs in, is replaced).
_JOB_VARIABLES = frozenset({ENV_JOB_FILE, ENV_JOB_LAYOUT, ENV_JOB_SECRET, ENV_ELASTIC_UPDATES, ENV_ELASTIC_VERSION,
                            ENV_USER_UMASK, ENV_MPIRUN_TMPDIR, ENV_USER_TMPDIR})


@dataclasses.dataclass
class Generation:
    """What an elastic driver (launcher/elastic/driver.py) adds to one launch, and learns from it."""

    env: dict[str, str] = dataclasses.field(default_factory=dict)  # more of the job's variables for the ranks
    on_resume: Callable[[ElasticResume], None] | None = None
    job_id: str = dataclasses.field(default_factory=lambda: uuid.uuid4().hex)
    number: int = 0   # the generation's number in its job: its files' names (job_files.py)
    secret: str = dataclasses.field(default_factory=new_job_secret)  # one for every generation of the job
    # Filled in by launch(): where a new host-set version goes (this host's file for its ranks,
    # and the file the SSH agents forward to their hosts), then how the job ended.
    updates_paths: list[str] = dataclasses.field(default_factory=list)
    notify_remote: Callable[[int], None] | None = None  # through Slurm: a step that writes the other nodes' files
    size: int = 0   # ranks in this generation
    records: list[ExitRecord] = dataclasses.field(default_factory=list)
    host_problems: list[AgentEvent] = dataclasses.field(default_factory=list)
    interrupted: bool = False

    def notify(self, version: int) -> None:
        """Tell every rank of this generation that the host set is now `version`."""
        for path in self.updates_paths:
            with contextlib.suppress(OSError):  # the generation may be ending as we speak
                HostUpdates(version).write(path)
        if self.notify_remote is not None:
            self.notify_remote(version)


def launch(config: LaunchConfig, dry_run: bool = False, generation: Generation | None = None) -> int:
    """Run the job described by `config`; return mtrain's exit status.

    With remote hosts, mpirun starts right away and its agents ask for their
    hosts while the preflight runs, but nothing of the job executes on any
    host until the whole preflight has passed (the gate): the handshakes
    overlap instead of adding up.  The preflight's connection to each host
    is kept and shared with the agents (launcher/ssh/master.py), and its probe
    stays there to become the host's remote guard, so each host sees one SSH
    connection, one session and one Python for checking and running.  The
    job's layout (torchrun's variables, TF_CONFIG) needs the preflight's
    ports, so it travels through the gate to the hosts, where the remote guard
    leaves it for the rank wrappers in the job's folder (job_files.py).
    """
    with Termination() as termination:
        return _launch(config, dry_run, generation, termination)


def _launch(config: LaunchConfig, dry_run: bool, generation: Generation | None,
            termination: "Termination") -> int:
    from mtrain.launcher.supervise import supervisor as supervise
    with tempfile.TemporaryDirectory(prefix="mtrain-agent-", dir=temporary_folder()) as scratch:
        agent = None
        master = None
        events_path = os.path.join(scratch, "events")
        gate = os.path.join(scratch, "gate")
        job_id = generation.job_id if generation else uuid.uuid4().hex
        job_file = job_files.template(job_id, generation.number if generation else 0)
        job_env = {ENV_JOB_FILE: job_file, ENV_JOB_SECRET: generation.secret if generation else new_job_secret(),
                   ENV_USER_UMASK: f"{_user_umask():03o}"}
        job_env.update(step_environment(config.steps))
        agents_updates = os.path.join(scratch, "updates") if generation else None
        local_file = host_path(job_file)
        local_host = socket.gethostname()
        job_files.remove_host(job_file, local_host, earlier=True)  # what a killed generation left here
        try:
            if generation is not None:
                job_env.update(generation.env)
                job_env.update({ENV_ELASTIC_UPDATES: updates_file(job_file), ENV_ELASTIC_VERSION: "0"})
                generation.updates_paths = [host_path(updates_file(job_file)), agents_updates]
            through_slurm = _through_slurm(config)
            if config.remote_hosts and not through_slurm:
                if dry_run and config.mpi.kind is not MpiKind.MPICH:
                    # Printed for a human to rerun: no scratch config that vanishes when we exit
                    # (the agent then uses ~/.ssh/config and OpenSSH defaults).
                    agent = [sys.executable, "-m", "mtrain.launcher.ssh.agent"]
                else:
                    if not dry_run and os.environ.get(ENV_SHARE_SSH, "1") != "0":
                        master = start_master(config, scratch, job_file, agents_updates)
                    agent = _agent(config, scratch, events_path, gate, job_file, agents_updates,
                                   master.path if master else None)
            subnets = (_route_subnets(config) if config.remote_hosts and not through_slurm
                       and not config.network_interfaces else ())
            if through_slurm and not dry_run:
                checked = _slurm_preflight(config, local_file)
                if checked is None:
                    return 1
                layout, subnets = checked
                job_env[ENV_JOB_LAYOUT] = layout.encode()
                if generation is not None:
                    generation.notify_remote = _slurm_notifier(config, job_file)
            try:
                argv = build_job_argv(config, agent, subnets, job_env)
            except ValueError as error:
                print(f"mtrain run: error: {error}", file=sys.stderr)
                return 2
            if dry_run:
                print_plan(config, argv)
                return 0
            if subnets:
                _log(config, f"hosts are reached through {', '.join(subnets)}")
            if master is not None:
                _log(config, f"SSH connections of the preflight are shared through {master.path}")
            if config.remote_hosts and not through_slurm:
                def preflight() -> str | None:
                    return _preflight(config, subnets, local_file, master,
                                      stopped=lambda: job.interrupted is not None)
            else:
                preflight = None
                try:
                    if not through_slurm:  # (through Slurm the preflight wrote it)
                        _local_layout(config).write(local_file)
                except PrivatePathError as error:  # another user's folder at the job's path
                    print(error, file=sys.stderr)
                    return 1
            environment = job_environment(job_env)
            if config.mpi.kind is MpiKind.OPENMPI:
                _private_mpirun_folder(environment, scratch)
            job = supervise.Job(argv, environment, config.num_proc, config.output_dir, config.verbose,
                                events_path if agent else None, preflight=preflight,
                                prefix_timestamp=config.prefix_timestamp,
                                gate=Gate(gate) if agent else None,
                                on_resume=generation.on_resume if generation else None,
                                report_failures=generation is None, steps=config.steps,
                                interrupted_line=((lambda number: slurm.interrupted_line(config.slurm_job, number))
                                                  if config.launcher is Launcher.SLURM else None),
                                events_on_stderr=through_slurm)
            status = job.run()
            if generation is not None:
                generation.size, generation.records = config.num_proc, list(job.records)
                generation.host_problems = list(job.host_problems)
                generation.interrupted = job.interrupted is not None
            return status
        finally:
            with termination.cleaning():
                if master is not None:
                    master.close()
                    counters = master.counters
                    _log(config, f"SSH: {counters.connections} connections shared; agents served by the "
                         f"waiting probe {counters.probe_sessions}, by a new session {counters.new_sessions}, "
                         f"sent to connect themselves {counters.unknown}")
                job_files.remove_host(job_file, local_host)  # and the job's folders, once no host's entry is left


class Termination:
    """Outside the job's own run (the supervisor handles signals then), SIGTERM, SIGHUP and
    SIGINT end a launch through its cleanup, so the connection master's socket and the scratch
    directory are removed; a signal that arrives during the cleanup waits for its end."""

    SIGNALS = (signal.SIGTERM, signal.SIGHUP, signal.SIGINT)

    def __init__(self) -> None:
        self.received: int | None = None
        self._cleaning = False
        self._previous: dict = {}

    def __enter__(self) -> "Termination":
        if threading.current_thread() is threading.main_thread():
            self._previous = {sig: signal.signal(sig, self._handle) for sig in self.SIGNALS}
        return self

    def __exit__(self, kind, value, traceback) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        if kind is None and self.received is not None:
            self._leave(self.received)

    def _handle(self, number: int, frame) -> None:
        if self.received is None:
            self.received = number
            if not self._cleaning:
                self._leave(number)

    @staticmethod
    def _leave(number: int) -> None:
        if number == signal.SIGINT:
            raise KeyboardInterrupt
        raise SystemExit(128 + number)

    @contextlib.contextmanager
    def cleaning(self):
        self._cleaning = True
        try:
            yield
        finally:
            self._cleaning = False


def start_master(config: LaunchConfig, scratch: str, job_file: str, updates: str | None):
    """The connection master for this launch, serving in `scratch` (a private directory);
    None if it cannot serve there."""
    from mtrain.launcher import remote_guard
    from mtrain.launcher.ssh.master import ConnectionMaster

    def remote_command(words: list[str], layout: str) -> str:
        return ssh_agent.remote_command(words, sys.executable, job_file, layout)

    def go_line(words: list[str], layout: str) -> bytes:
        return remote_guard.go_line(ssh_agent.daemon_command(words), job_file, layout)

    master = ConnectionMaster(scratch, config.remote_hosts, remote_command=remote_command, go_line=go_line,
                              updates=updates, session_timeout=config.start_timeout,
                              log=lambda message: _log(config, message), events=os.path.join(scratch, "events"))
    try:
        master.start()
    except (OSError, RuntimeError) as error:
        # No Unix socket here (an odd $TMPDIR, say): the agents connect by themselves.
        master.close()
        _log(config, f"SSH connections are not shared: cannot serve {master.path}: {error}")
        return None
    return master


def _preflight_passed(config: LaunchConfig, reports: "Mapping[str, HostReport]") -> bool:
    """Print the preflight's verdict: one line per failing host (then False), or the warnings."""
    from mtrain.launcher.job.preflight import slot_warnings
    errors = [r.error for r in reports.values() if r.error]
    for line in errors:
        print(f"mtrain: {line}", file=sys.stderr)
    if errors:
        failed = "1 host" if len(errors) == 1 else f"{len(errors)} hosts"
        print(f"mtrain: preflight failed on {failed}; nothing was started", file=sys.stderr)
        return False
    for line in slot_warnings(reports, {h.name: h.slots for h in config.plan}):
        print(f"mtrain: warning: {line}", file=sys.stderr)
    return True


def _slurm_preflight(config: LaunchConfig, local_file: str) -> "tuple[JobLayout, tuple[str, ...]] | None":
    """The preflight through srun (launcher/job/slurm.py), one line per failing node: the job's layout
    (left in `local_file` when ranks run here too) and the subnets MPI is to use; None when the
    job must not start."""
    from mtrain.launcher.cli.capabilities import gpu_count
    from mtrain.launcher.job.netif import interface_addresses, shared_subnets
    _log(config, f"preflight of {', '.join(config.remote_hosts)} through srun")
    needed = ports_needed(config.plan, config.master_port)
    reports = slurm.preflight(config.remote_hosts, sys.executable, mtrain.__version__, config.start_timeout, needed)
    if not _preflight_passed(config, reports):
        return None
    facts = {}
    for host in config.plan:
        if host.name in reports:
            report = reports[host.name]
            facts[host.name] = HostFacts(report.addresses, report.ports, report.gpus)
        else:
            facts[host.name] = HostFacts(interface_addresses(), tuple(free_ports(needed[host.name])),
                                         gpu_count() if config.one_gpu_per_rank else 0)
    subnets = config.network_interfaces or shared_subnets([f.addresses for f in facts.values()],
                                                          skip=mpilib.EXCLUDED_INTERFACES)
    if not subnets:
        print("mtrain: the nodes share no IPv4 network; choose one with --network-interface; "
              "nothing was started", file=sys.stderr)
        return None
    try:
        layout = job_layout(config.plan, facts, subnets, config.master_port, config.one_gpu_per_rank)
        if any(h.name not in config.remote_hosts for h in config.plan):
            layout.write(local_file)
    except ValueError as error:
        print(f"mtrain: {error}; nothing was started", file=sys.stderr)
        return None
    except PrivatePathError as error:  # another user's folder at the job's path
        print(error, file=sys.stderr)
        return None
    _log(config, f"preflight passed; MASTER_ADDR={layout.master_addr} MASTER_PORT={layout.master_port}")
    return layout, tuple(subnets)


def _slurm_notifier(config: LaunchConfig, job_file: str) -> Callable[[int], None]:
    """How an elastic generation started through Slurm tells the ranks on the other nodes of a
    new host set: a step that leaves the version where their wrappers look (launcher/job/slurm.py)."""
    def notify(version: int) -> None:
        slurm.run_step(config.remote_hosts, [sys.executable, "-m", "mtrain.launcher.job.slurm", "update", job_file,
                                             str(version)], config.start_timeout, "mtrain-update")
    return notify


def _local_layout(config: LaunchConfig) -> JobLayout:
    """The layout of a job on this machine alone: everything on the loopback address."""
    from mtrain.launcher.cli.capabilities import gpu_count
    needed = ports_needed(config.plan, config.master_port)
    ports = free_ports(sum(needed.values()))
    gpus = gpu_count() if config.one_gpu_per_rank else 0
    facts, start = {}, 0
    for host in config.plan:
        facts[host.name] = HostFacts({}, tuple(ports[start:start + needed[host.name]]), gpus, "127.0.0.1")
        start += needed[host.name]
    return job_layout(config.plan, facts, (), config.master_port, config.one_gpu_per_rank)


def _preflight(config: LaunchConfig, subnets: tuple[str, ...], local_file: str, master=None,
               stopped: Callable[[], bool] = lambda: False) -> str | None:
    """Check every remote host; print one line per failing host.

    When all passed, return the job's layout for the gate (and leave it in `local_file`
    for the ranks on this machine); None when the job must not start, also when
    `stopped()` (mtrain is being stopped) turns true meanwhile.  The connection
    `master` keeps the connections that passed and hears the verdict first.
    """
    layout = _checked_layout(config, subnets, local_file, master, stopped)
    if master is not None:
        if layout is None:
            master.close_gate()
        else:
            master.open_gate(layout)
    return layout


def _checked_layout(config: LaunchConfig, subnets: tuple[str, ...], local_file: str, master,
                    stopped: Callable[[], bool]) -> str | None:
    from mtrain.launcher.job.preflight import run_preflight
    _log(config, f"preflight of {', '.join(config.remote_hosts)}")
    needed = ports_needed(config.plan, config.master_port)
    reports = run_preflight(config.remote_hosts, config.ssh, sys.executable,
                            mtrain.__version__, config.start_timeout, needed,
                            keep=master.adopt if master is not None else None, stopped=stopped)
    if stopped():
        return None  # the supervisor says why
    if not _preflight_passed(config, reports):
        return None
    try:
        layout = _remote_layout(config, subnets, reports, needed)
    except ValueError as error:
        print(f"mtrain: {error}; nothing was started", file=sys.stderr)
        return None
    if any(h.name not in config.remote_hosts for h in config.plan):
        layout.write(local_file)
    _log(config, f"preflight passed; MASTER_ADDR={layout.master_addr} MASTER_PORT={layout.master_port}")
    return layout.encode()


def _remote_layout(config: LaunchConfig, subnets: tuple[str, ...], reports: Mapping[str, HostReport],
                   needed: Mapping[str, int]) -> JobLayout:
    """The job's layout from the preflight's reports.  Each report carries the address its
    connection reached (and ours on it), so nothing is resolved again here; only a host
    reached over IPv6 is looked up, all such hosts at once."""
    from mtrain.launcher.cli.capabilities import gpu_count
    from mtrain.launcher.job.netif import interface_addresses
    remote = [name for name in config.remote_hosts if name in reports]
    missing = [name for name in remote if not reports[name].address]
    looked_up = _ipv4_addresses(config, missing)
    first = reports.get(config.remote_hosts[0]) if config.remote_hosts else None
    facts = {}
    for host in config.plan:
        if host.name in config.remote_hosts:
            report = reports[host.name]
            facts[host.name] = HostFacts(report.addresses, report.ports, report.gpus,
                                         report.address or looked_up.get(host.name, ""))
        else:
            facts[host.name] = HostFacts(interface_addresses(), tuple(free_ports(needed[host.name])),
                                         gpu_count() if config.one_gpu_per_rank else 0,
                                         (first.source if first else "") or _source_to(config, config.remote_hosts[0]))
    return job_layout(config.plan, facts, config.network_interfaces or subnets, config.master_port,
                      config.one_gpu_per_rank)


def _ipv4_addresses(config: LaunchConfig, hosts: Sequence[str]) -> dict[str, str]:
    """{alias: IPv4 address of its HostName} for `hosts`, looked up in parallel ("" unknown)."""
    from mtrain.launcher.ssh import client as ssh
    found: dict[str, str] = {}

    def look_up(host: str) -> None:
        try:
            found[host] = _ipv4_of(ssh.resolve(host, config.ssh).hostname)
        except ssh.SshError:
            found[host] = ""

    _in_parallel(look_up, hosts)
    return found


def _source_to(config: LaunchConfig, host: str) -> str:
    from mtrain.launcher.job.netif import source_address
    from mtrain.launcher.ssh import client as ssh
    target = ssh.resolve(host, config.ssh)
    return source_address(target.hostname, target.port) or ""


def _in_parallel(work: Callable[[str], None], items: Sequence[str]) -> None:
    """work(item) for every item, each in its own thread when there are several (name lookups)."""
    if len(items) <= 1:
        for item in items:
            work(item)
        return
    threads = [threading.Thread(target=work, args=(item,), daemon=True) for item in items]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()


def _ipv4_of(name: str) -> str:
    try:
        return socket.getaddrinfo(name, None, socket.AF_INET, socket.SOCK_STREAM)[0][4][0]
    except (OSError, IndexError):
        return ""


def _route_subnets(config: LaunchConfig) -> tuple[str, ...]:
    """Subnets of our interfaces on the routes to the remote hosts; () if any is unknown.
    The hosts' names are looked up in parallel: this runs before mpirun starts."""
    from mtrain.launcher.job.netif import source_address, subnet_of
    from mtrain.launcher.ssh import client as ssh
    subnets: dict[str, str | None] = {}

    def route(host: str) -> None:
        try:
            target = ssh.resolve(host, config.ssh)
        except ssh.SshError:
            subnets[host] = None  # the preflight will say what is wrong with this host
            return
        address = source_address(target.hostname, target.port)
        subnets[host] = subnet_of(address) if address else None

    _in_parallel(route, config.remote_hosts)
    found = [subnets.get(host) for host in config.remote_hosts]
    if any(subnet is None for subnet in found):
        return ()  # some host reached in a way we cannot name: fall back to the exclude list
    return tuple(sorted(set(found)))
