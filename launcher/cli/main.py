"""`mtrain`: the command line.  Parsing and user-facing errors only.

Usage errors print one line and exit 2; environment problems found by the
preflight exit 1; otherwise mtrain exits with the job's status (see supervise).
"""
from __future__ import annotations

import dataclasses
import difflib
import os
import re
import shlex
import signal
import sys
from pathlib import Path
from typing import Any

import click

import mtrain
from mtrain.common.private import PrivatePathError
from mtrain.launcher.cli import tuning
from mtrain.launcher.cli.config import (
    ElasticSettings,
    LaunchConfig,
    Launcher,
    MpiKind,
    SshOptions,
    StepSettings,
    check_env_item,
)
from mtrain.launcher.cli.run_options import LauncherName, RunOptions
from mtrain.launcher.job import hosts as hostlib

_INTERFACE = re.compile(r"^[A-Za-z0-9_.:/\-]+$")


class HostListType(click.ParamType):
    """`-H host1:4,host2:4`, parsed into [HostSlots] or a usage error."""

    name = "HOST:SLOTS,…"

    def convert(self, value: Any, param, ctx) -> list[hostlib.HostSlots]:
        if isinstance(value, list):
            return value
        try:
            return hostlib.parse_host_list(value)
        except hostlib.HostSpecError as error:
            self.fail(str(error), param, ctx)


class EnvItemType(click.ParamType):
    """`-x VAR` or `-x VAR=value`."""

    name = "VAR[=VALUE]"

    def convert(self, value: Any, param, ctx) -> str:
        try:
            return check_env_item(value)
        except ValueError as error:
            self.fail(str(error), param, ctx)


class InterfaceListType(click.ParamType):
    """`--network-interface(s) eth0[,ib0]` (names or CIDR subnets); repeatable, as in Horovod."""

    name = "IF[,IF…]"

    def convert(self, value: Any, param, ctx) -> tuple[str, ...]:
        if isinstance(value, tuple):
            return value
        names = tuple(part.strip() for part in value.split(","))
        for part in names:
            if not part or not _INTERFACE.match(part):
                self.fail(f"{part!r} is not an interface name or subnet (e.g. eth0 or 10.0.0.0/16)",
                          param, ctx)
        return names


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(mtrain.__version__, prog_name="mtrain")
def main_group() -> None:
    """mtrain: data-parallel training across hosts (Horovod-style launcher)."""


def _check_build(ctx: click.Context, param: click.Parameter, value: bool) -> None:
    """`-cb`: Horovod's table of what this install has, then exit (needs no -np or command)."""
    if not value or ctx.resilient_parsing:
        return
    from mtrain.launcher.cli.capabilities import check_build
    click.echo(check_build())
    ctx.exit(0)


_NONNEGATIVE = click.IntRange(min=0)


@main_group.command(context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False})
@click.version_option(mtrain.__version__, "-v", "--version", prog_name="mtrain")
@click.option("-cb", "--check-build", is_flag=True, is_eager=True, expose_value=False, callback=_check_build,
              help="Show which frameworks, controllers and tensor operations this install has, and exit.")
@click.option("-np", "--num-proc", "num_proc", type=int, default=None,
              help="Number of ranks (default: all slots of the hosts).")
@click.option("-H", "--hosts", "host_list", type=HostListType(), default=None,
              help="Hosts and slots, e.g. host1:4,host2:4 (a host without :N has 1 slot).")
@click.option("-hostfile", "--hostfile", type=click.Path(dir_okay=False), default=None,
              help="File with one `host slots=N` per line.")
@click.option("--launcher", "launcher_name", type=click.Choice([name.value for name in LauncherName]),
              default=LauncherName.AUTO.value,
              show_default=True,
              help="How ranks reach their hosts: slurm starts them through the Slurm allocation mtrain runs "
                   "in (srun, no SSH); ssh over SSH; auto: slurm inside an allocation unless -H or "
                   "--hostfile is given.")
@click.option("-p", "--ssh-port", type=click.IntRange(1, 65535), default=None,
              help="SSH port of the remote hosts (default: ~/.ssh/config, else 22).")
@click.option("-i", "--ssh-identity-file", type=click.Path(exists=True, dir_okay=False), default=None,
              help="Private key to log in with (with ssh-agent's keys).")
@click.option("--ssh-accept-new-hosts", is_flag=True,
              help="Record unknown host keys in ~/.ssh/known_hosts instead of refusing them.")
@click.option("--start-timeout", type=click.FloatRange(min=0, min_open=True), default=30.0,
              show_default=True, help="Seconds allowed for checking and reaching all hosts.")
@click.option("--network-interfaces", "--network-interface", "interfaces", type=InterfaceListType(), multiple=True,
              help="Interfaces (or subnets) MPI may use between hosts, e.g. eth0 or eth0,ib0; repeatable.")
@click.option("--output-filename", "--output-dir", "output_dir", type=click.Path(file_okay=False),
              default=None, help="Also write DIR/rank.N/stdout and DIR/rank.N/stderr.")
@click.option("-x", "env_items", type=EnvItemType(), multiple=True,
              help="Pass VAR (or set VAR=value) to every rank; repeatable.")
@click.option("--mpirun", "mpirun_path", default=None,
              help="MPI launcher to use (default: $MTRAIN_MPIRUN, else the one of this environment).")
@click.option("--mpi-args", default=None, help="Extra arguments for mpirun, as one quoted string.")
@click.option("--master-port", type=click.IntRange(1, 65535), default=None,
              help="MASTER_PORT for torch.distributed programs (default: a port found free on rank 0's host).")
@click.option("--one-gpu-per-rank", is_flag=True,
              help="Each rank sees only its own GPU (CUDA_VISIBLE_DEVICES=local rank), as tf.distribute "
                   "workers need; LOCAL_RANK stays the rank's index on its host.")
@click.option("--min-np", "--min-num-proc", "min_np", type=click.IntRange(min=1), default=None,
              help="Elastic: fewest ranks to go on training with (default: -np).")
@click.option("--max-np", "--max-num-proc", "max_np", type=click.IntRange(min=1), default=None,
              help="Elastic: most ranks to grow to (default: no limit).")
@click.option("--host-discovery-script", type=click.Path(dir_okay=False), default=None,
              help="Elastic: executable printing the available hosts, one `host` or `host:slots` a line.")
@click.option("--slots-per-host", type=click.IntRange(min=1), default=None,
              help="Elastic: slots of a discovered host printed without `:slots`.")
@click.option("--elastic-timeout", type=click.FloatRange(min=0, min_open=True), default=600.0, show_default=True,
              help="Elastic: seconds to wait for at least --min-np slots before giving up.")
@click.option("--reset-limit", type=click.IntRange(min=0), default=None,
              help="Elastic: most resets (host lost or host set changed) before the job ends.")
@click.option("--blacklist-cooldown-range", "cooldown", type=click.IntRange(min=0), nargs=2, default=None,
              help="Elastic: a failed host returns after MIN·n seconds for its n-th failure, at most MAX "
                   "(default: never).")
@click.option("--straggler-report", "straggler_every", type=click.IntRange(min=0), default=0,
              envvar="MTRAIN_STRAGGLER_EVERY", metavar="N",
              help="Print the straggler table (each rank's compute and wait per step, who submitted last, "
                   "the slow ranks) every N training steps too, not only at exit ($MTRAIN_STRAGGLER_EVERY).")
@click.option("--no-straggler-report", is_flag=True,
              help="Measure no steps and print no straggler table at exit.")
@click.option("--progress", is_flag=True,
              help="Show one live status line (ranks up, steps, steps/s, GB/s, the slowest rank); a plain "
                   "line every --progress-interval seconds when stderr is not a terminal.")
@click.option("--progress-interval", type=click.FloatRange(min=0.1), default=10.0, show_default=True,
              metavar="SECONDS", help="Seconds between --progress lines when stderr is not a terminal.")
@click.option("--dry-run", is_flag=True,
              help="Print the host plan, the settings the ranks get and the mpirun command; run nothing.")
@click.option("--verbose", is_flag=True, help="Log each step.")
@click.option("--disable-cache", is_flag=True, default=None,
              help="Horovod's: run the host checks every time. mtrain keeps no cache of them, so it always does.")
@click.option("--config-file", type=click.Path(dir_okay=False), default=None,
              help="Horovod's YAML file of settings (params:, library_options:, logging:, controller:); "
                   "flags given on the command line win over it.")
# Horovod's tuning flags: each reaches every rank as mtrain's variable (bindings/common/settings.py).
@click.option("--fusion-threshold-mb", type=_NONNEGATIVE, default=None,
              help="Most MB of tensors fused into one all-reduce; 0 turns fusion off (default: 8).")
@click.option("--cycle-time-ms", type=click.FloatRange(min=0), default=None,
              help="Milliseconds the engine waits for more ops before negotiating (default: 1).")
@click.option("--cache-capacity", type=_NONNEGATIVE, default=None,
              help="Op names kept in the response cache; 0 turns it off (default: 4096).")
@click.option("--hierarchical-allreduce/--no-hierarchical-allreduce", default=None,
              help="All-reduce within each host through shared memory, then across hosts (default: chosen "
                   "per buffer).")
@click.option("--hierarchical-allgather/--no-hierarchical-allgather", default=None,
              help="Horovod's hierarchical allgather; mtrain's allgather runs on the ring.")
@click.option("--autotune/--no-autotune", default=None,
              help="Tune the fusion threshold, cycle time, ring segment and shared-memory stripe sizes, the "
                   "all-reduce algorithm, the shared-memory transport and the response cache during the first "
                   "steps, then keep the best (Horovod's autotune).")
@click.option("--autotune-log-file", type=click.Path(dir_okay=False), default=None,
              help="Rank 0 writes each autotune sample here, in Horovod's CSV format.")
@click.option("--autotune-warmup-samples", type=_NONNEGATIVE, default=None,
              help="Autotune samples run before scoring starts (default: 3).")
@click.option("--autotune-steps-per-sample", type=click.IntRange(min=1), default=None,
              help="Steps in each of the 5 parts of an autotune sample (default: 10).")
@click.option("--autotune-bayes-opt-max-samples", type=click.IntRange(min=1), default=None,
              help="Samples of Bayesian optimisation before the categorical settings are tried (default: 20).")
@click.option("--autotune-gaussian-process-noise", type=click.FloatRange(min=0, min_open=True), default=None,
              help="Noise of the autotuner's Gaussian process, in units of the scores' spread (default: 0.8).")
@click.option("--timeline-filename", type=click.Path(dir_okay=False), default=None,
              help="Write a timeline of every rank's collectives here (Chrome trace format, as Horovod's; rank 0 writes it). Read it with `mtrain timeline-summary`.")
@click.option("--timeline-mark-cycles/--no-timeline-mark-cycles", default=None,
              help="Mark each engine cycle in the timeline.")
@click.option("--stall-check/--no-stall-check", default=None,
              help="Warn about ops some ranks submitted and others did not (default: on).")
@click.option("--stall-check-warning-time-seconds", type=click.FloatRange(min=0), default=None,
              help="Seconds an op may wait for the other ranks before the stall warning (default: 60).")
@click.option("--stall-check-shutdown-time-seconds", type=click.FloatRange(min=0), default=None,
              help="Seconds an op may wait before the job ends with an error naming the missing ranks "
                   "(default: 0, never).")
@click.option("--mpi-threads-disable/--no-mpi-threads-disable", default=None,
              help="Horovod's; mtrain's background engine needs MPI threads, so they stay on.")
@click.option("--num-nccl-streams", type=_NONNEGATIVE, default=None,
              help="Horovod's; mtrain's collectives do not use NCCL.")
@click.option("--thread-affinity", type=_NONNEGATIVE, default=None,
              help="Horovod's; mtrain does not pin its background thread.")
@click.option("--gloo-timeout-seconds", type=_NONNEGATIVE, default=None,
              help="Horovod's; mtrain runs on MPI, not Gloo.")
@click.option("--tcp", is_flag=True, default=None,
              help="Keep NCCL (a torch.distributed program's) off InfiniBand: NCCL_IB_DISABLE=1 for every rank.")
@click.option("--binding-args", default=None,
              help="mpirun's process binding arguments, as one quoted string, instead of the default "
                   "`--map-by slot --bind-to none` (MPICH: `-bind-to none`).")
@click.option("--log-level", type=click.Choice(tuning.LOG_LEVELS, case_sensitive=False), default=None,
              help="Least severe runtime message shown (default: WARNING).")
# Horovod's deprecated --log-hide-timestamp / --no-log-hide-timestamp are the same switch, reversed.
@click.option("--log-with-timestamp/--log-without-timestamp", "--no-log-hide-timestamp/--log-hide-timestamp",
              "log_with_timestamp", default=None,
              help="Horovod's; mtrain's runtime messages carry no timestamp anyway.")
@click.option("-prefix-timestamp", "--prefix-output-with-timestamp", "prefix_timestamp", is_flag=True,
              help="Start every line of the ranks' output with the time mtrain received it.")
@click.option("--gloo", "use_gloo", is_flag=True, default=None, help="Horovod's; mtrain runs on MPI.")
@click.option("--mpi", "use_mpi", is_flag=True, default=None, help="Run on MPI (what mtrain always does).")
@click.option("--jsrun", "use_jsrun", is_flag=True, default=None,
              help="Horovod's; mtrain starts the ranks with mpirun.")
@click.argument("command", nargs=-1, type=click.UNPROCESSED)
def run(**options: Any) -> None:
    """Run COMMAND as NUM_PROC ranks across the hosts."""
    from mtrain.launcher.job.launch import launch  # deferred: keeps `mtrain --help` fast
    # SIGUSR1 asks a running job for its hang report (supervise.Job); before a job runs, or
    # between an elastic job's generations, it must not end mtrain (its default action). A
    # handler, not SIG_IGN: an ignored signal stays ignored in mpirun, which must pass it on.
    signal.signal(signal.SIGUSR1, lambda number, frame: None)
    config, dry_run = build_config(RunOptions.from_click(options))
    for line in config.notices:
        click.echo(line, err=True)
    if config.elastic is not None and not dry_run:
        from mtrain.launcher.elastic.driver import run_elastic
        sys.exit(run_elastic(config))
    sys.exit(launch(config, dry_run=dry_run))


def build_config(options: RunOptions) -> tuple[LaunchConfig, bool]:
    """Validate the options of `mtrain run` into a LaunchConfig (usage errors raise click errors)."""
    from mtrain.launcher.job import mpirun as mpilib
    command = options.command
    if not command:
        raise click.UsageError("no command given; write e.g. `mtrain run -np 2 python train.py`")
    if command[0].startswith("-"):
        raise click.UsageError(f"unknown option {command[0]}; mtrain's options go before the command")
    if options.host_list is not None and options.hostfile is not None:
        raise click.UsageError("give either -H or --hostfile, not both")
    options, origins, file_notes = with_config_file(options)
    controllers = [flag for name, flag in _CONTROLLER_FLAGS.items() if options.given(name)]
    if len(controllers) > 1:
        raise click.UsageError(f"give one of --gloo, --mpi and --jsrun, not {' and '.join(controllers)}")
    rank_settings, notes = tuning.rank_settings(options, origins)
    for setting in rank_settings:
        for item in options.env_items:
            if item.split("=", 1)[0] == setting.name:
                raise click.UsageError(f"{setting.origin} sets {setting.name} for the ranks, and so does "
                                       f"-x {item}; give one of them")
    ranks_environ = dict(os.environ)
    for item in options.env_items:
        if "=" in item:
            key, value = item.split("=", 1)
            ranks_environ[key] = value
    ranks_environ.update((setting.name, setting.value) for setting in rank_settings)
    refusal = tuning.refused_variable(ranks_environ)
    if refusal is not None:
        raise click.UsageError(refusal)
    binding_args: tuple[str, ...] | None = None
    if options.binding_args is not None:
        try:
            binding_args = tuple(shlex.split(options.binding_args))
        except ValueError as error:
            raise click.UsageError(f"--binding-args: {error}") from None
    elastic = elastic_settings(options)
    allocation = None
    try:
        if elastic is not None:
            available = []  # the elastic driver plans each generation from what is there then
        elif options.host_list is not None:
            available = options.host_list
        elif options.hostfile is not None:
            available = hostlib.read_hostfile(options.hostfile)
        else:
            allocation = hostlib.scheduler_allocation(os.environ)
            available = list(allocation.hosts) if allocation else None
        launcher, slurm_job = choose_launcher(options)
        num_proc = options.num_proc
        if elastic is not None:
            pass
        elif available is None:
            if num_proc is None:
                raise click.UsageError("-np is required when no hosts are given (e.g. -np 2)")
            if num_proc < 1:
                raise hostlib.HostSpecError(f"-np {num_proc}: need at least one process")
            available = [hostlib.HostSlots("localhost", num_proc)]
        elif allocation is not None and num_proc is not None and num_proc > allocation.slots:
            raise hostlib.HostSpecError(f"-np {num_proc} is more than the {allocation.slots} slots of "
                                        f"{allocation.describe()}; lower -np or ask the scheduler for more tasks")
        plan = [] if elastic is not None else hostlib.assign_slots(
            available, num_proc if num_proc is not None else sum(h.slots for h in available))
    except hostlib.HostSpecError as error:
        raise click.UsageError(str(error)) from None
    names = hostlib.local_names()
    remote = tuple(h.name for h in plan if not hostlib.is_local(h.name, names))
    mpi_args: tuple[str, ...] = ()
    if options.mpi_args:
        try:
            mpi_args = tuple(shlex.split(options.mpi_args))
        except ValueError as error:
            raise click.UsageError(f"--mpi-args: {error}") from None
    try:
        mpi = mpilib.find_mpirun(options.mpirun_path)
    except mpilib.MpiNotFound as error:
        raise click.UsageError(str(error)) from None
    if launcher is Launcher.SLURM and mpi.kind is not MpiKind.OPENMPI:
        if options.launcher_name is LauncherName.SLURM:
            raise click.UsageError(f"--launcher slurm needs Open MPI's mpirun, and {mpi.path} is MPICH's; "
                                   "give --launcher ssh")
        launcher, slurm_job = Launcher.SSH, ""
    ssh = SshOptions(port=options.ssh_port, identity_file=options.ssh_identity_file,
                     accept_new_hosts=options.ssh_accept_new_hosts,
                     connect_timeout=options.start_timeout)
    config = LaunchConfig(
        plan=tuple(plan), command=command, remote_hosts=remote, ssh=ssh, mpi=mpi,
        start_timeout=options.start_timeout, network_interfaces=_interfaces(options.interfaces),
        output_dir=Path(options.output_dir).resolve() if options.output_dir else None,
        env_pass=tuple(options.env_items), mpi_args=mpi_args, verbose=options.verbose,
        master_port=options.master_port, one_gpu_per_rank=options.one_gpu_per_rank, elastic=elastic,
        rank_settings=rank_settings, binding_args=binding_args,
        prefix_timestamp=bool(options.prefix_timestamp), notices=file_notes + notes,
        steps=StepSettings(report=not options.no_straggler_report, every=options.straggler_every,
                           progress=options.progress, progress_interval=options.progress_interval),
        launcher=launcher, slurm_job=slurm_job)
    if elastic is not None and options.dry_run:
        config = _first_generation(config)
    return config, bool(options.dry_run)


def choose_launcher(options: RunOptions) -> "tuple[Launcher, str]":
    """--launcher resolved: (how remote hosts are reached, the Slurm job's id or "")."""
    from mtrain.launcher.job import slurm
    name = options.launcher_name
    hosts_given = options.host_list is not None or options.hostfile is not None
    job = slurm.job_id(os.environ)
    if name is LauncherName.SSH or (name is LauncherName.AUTO and (hosts_given or not job)):
        return Launcher.SSH, ""
    if hosts_given:
        raise click.UsageError("--launcher slurm starts the ranks on the nodes of the Slurm allocation; "
                               "drop -H / --hostfile, or give --launcher ssh to use them over SSH")
    if not job:
        raise click.UsageError("--launcher slurm: not inside a Slurm allocation (no SLURM_JOB_ID); run "
                               "`mtrain run` in an sbatch script or under salloc, or give the hosts with -H")
    problem = slurm.missing_tools()
    if problem is not None:
        if name is LauncherName.AUTO:  # inside an allocation whose tools we cannot run: SSH
            return Launcher.SSH, ""
        raise click.UsageError(f"--launcher slurm: {problem}")
    return Launcher.SLURM, job


_CONTROLLER_FLAGS = {"use_gloo": "--gloo", "use_mpi": "--mpi", "use_jsrun": "--jsrun"}  # Horovod: one at most


def _interfaces(given: "tuple[tuple[str, ...], ...] | None") -> tuple[str, ...]:
    """The interfaces of every --network-interface(s), once each, in order (Horovod takes their union)."""
    names: list[str] = []
    for group in given or ():
        names += [name for name in group if name not in names]
    return tuple(names)


def with_config_file(options: RunOptions) -> "tuple[RunOptions, dict[str, str], tuple[str, ...]]":
    """`options` with the values of --config-file filled in where the command line gave
    none (Horovod: flags win over the file); also where each came from, and the lines to
    print for the file's settings that this `mtrain run` cannot apply."""
    path = options.config_file
    if not path:
        return options, {}, ()
    try:
        values = tuning.read_config_file(path)
    except tuning.ConfigFileError as error:
        raise click.UsageError(f"--config-file {path}: {error}") from None
    params = {param.name: param for param in run.params if isinstance(param, click.Option)}
    merged, origins, notes = {}, {}, []
    controllers_given = any(options.given(name) for name in _CONTROLLER_FLAGS)
    for entry in values:
        param = params.get(entry.option)
        if param is None:  # a Horovod flag this mtrain run does not have (yet)
            notes.append(f"mtrain: --config-file {entry.key}: not applied; this mtrain run has no "
                         f"--{entry.option.replace('_', '-')}")
            continue
        if options.given(entry.option) is not None:
            continue  # given on the command line
        if entry.key == "controller" and controllers_given:
            continue
        try:
            # Flags take YAML's true/false (or 1/0); the rest go through the flag's own type and range.
            kind = click.BOOL if param.is_flag or param.secondary_opts else param.type
            value = kind.convert(entry.value, None, None)  # the message names the key, not a flag
        except click.BadParameter as error:
            raise click.UsageError(f"--config-file {path}: {entry.key}: {error.message}") from None
        merged[entry.option] = value
        origins[entry.option] = f"--config-file {entry.key}"
    return dataclasses.replace(options, **merged), origins, tuple(notes)


_ELASTIC_ONLY = {"slots_per_host": "--slots-per-host", "reset_limit": "--reset-limit",
                 "cooldown": "--blacklist-cooldown-range"}


def elastic_settings(options: RunOptions) -> ElasticSettings | None:
    """Horovod's elastic flags, validated; None for a job of fixed size."""
    script = options.host_discovery_script
    if script is None and options.min_np is None and options.max_np is None:
        for key, flag in _ELASTIC_ONLY.items():
            if options.given(key) is not None:
                raise click.UsageError(f"{flag} applies to elastic jobs only; give --host-discovery-script "
                                       "or --min-np / --max-np too")
        return None
    initial = options.num_proc
    if initial is None:
        raise click.UsageError("an elastic job needs -np, the number of ranks to start with")
    min_np = options.min_np if options.min_np is not None else initial
    max_np = options.max_np
    if min_np > initial:
        raise click.UsageError(f"--min-np {min_np} is more than -np {initial}")
    if max_np is not None and max_np < initial:
        raise click.UsageError(f"--max-np {max_np} is less than -np {initial}")
    fixed: tuple[hostlib.HostSlots, ...] = ()
    if script is not None:
        if options.host_list is not None or options.hostfile is not None:
            raise click.UsageError("give either --host-discovery-script or -H / --hostfile, not both")
        if not os.access(script, os.X_OK) or os.path.isdir(script):
            raise click.UsageError(f"--host-discovery-script {script}: not an executable file "
                                   f"(chmod +x {shlex.quote(script)}?)")
    else:
        try:
            if options.host_list is not None:
                fixed = tuple(options.host_list)
            elif options.hostfile is not None:
                fixed = tuple(hostlib.read_hostfile(options.hostfile))
        except hostlib.HostSpecError as error:
            raise click.UsageError(str(error)) from None
        if not fixed:
            raise click.UsageError("an elastic job needs --host-discovery-script (or a fixed -H / --hostfile)")
    cooldown = options.cooldown
    if cooldown is not None and cooldown[0] > cooldown[1]:
        raise click.UsageError(f"--blacklist-cooldown-range {cooldown[0]} {cooldown[1]}: MIN is more than MAX")
    return ElasticSettings(initial_np=initial, min_np=min_np, max_np=max_np, discovery_script=script,
                           fixed_hosts=fixed, slots_per_host=options.slots_per_host,
                           timeout=options.elastic_timeout, reset_limit=options.reset_limit,
                           cooldown=(float(cooldown[0]), float(cooldown[1])) if cooldown else None)


def _first_generation(config: LaunchConfig) -> LaunchConfig:
    """For --dry-run of an elastic job: the plan its first generation would get now."""
    from mtrain.launcher.elastic.driver import Blacklist, DiscoveryError, plan_hosts, run_discovery
    settings = config.elastic
    try:
        hosts = (run_discovery(settings.discovery_script, settings.slots_per_host)
                 if settings.discovery_script else list(settings.fixed_hosts))
    except DiscoveryError as error:
        raise click.UsageError(str(error)) from None
    plan = plan_hosts(hosts, Blacklist(None), 0.0, settings.initial_np)
    names = hostlib.local_names()
    return dataclasses.replace(config, plan=tuple(plan),
                               remote_hosts=tuple(h.name for h in plan if not hostlib.is_local(h.name, names)))


@main_group.command()
def check() -> None:
    """Print what this install can do: MPI, CUDA-awareness, frameworks, GPUs."""
    from mtrain.launcher.cli.capabilities import report
    sys.exit(report())


@main_group.command("timeline-summary")
@click.argument("timeline", type=click.Path(dir_okay=False))
@click.option("--png", type=click.Path(dir_okay=False), default=None,
              help="Also draw each rank's compute and wait per step into this PNG (needs matplotlib).")
@click.option("--top", type=click.IntRange(min=1), default=10, show_default=True,
              help="How many ops to list, by total time.")
def timeline_summary(timeline: str, png: "str | None", top: int) -> None:
    """Print the top ops by time and each rank's steps from TIMELINE (a --timeline-filename file)."""
    from mtrain.launcher.cli import timeline_summary as ts
    try:
        summary = ts.summarize(ts.load_events(timeline))
    except ts.TimelineError as error:
        click.echo(f"mtrain timeline-summary: error: {error}", err=True)
        sys.exit(2)
    click.echo(ts.report(summary, top))
    if png is None:
        return
    if not summary.steps:
        click.echo(f"mtrain timeline-summary: no PNG drawn: {timeline} has no STEP events "
                   "(they are recorded per training step by the ranks' engines)", err=True)
        sys.exit(1)
    try:
        drawn = ts.draw(summary, png)
    except ImportError:
        click.echo("mtrain timeline-summary: error: drawing needs matplotlib: pip install matplotlib", err=True)
        sys.exit(2)
    except OSError as error:
        click.echo(f"mtrain timeline-summary: error: cannot write {png}: {error.strerror or error}", err=True)
        sys.exit(2)
    left = len(summary.ranks) - drawn
    click.echo(f"wrote {png}" + (f" (the first {drawn} ranks; {left} more not drawn)" if left > 0 else ""))


def usage_error_line(error: click.UsageError, args: list[str]) -> str:
    """The one line a usage error prints.  At the top level a forgotten `run`
    (`mtrain -np 2 python x.py`) or a mistyped command gets the line to write instead."""
    command = error.ctx.command_path if error.ctx else "mtrain"
    message = error.format_message().rstrip(".")
    if (error.ctx is None or error.ctx.command is main_group) and args and args[0] not in main_group.commands:
        first = args[0]
        run_options = {name for param in run.params for name in getattr(param, "opts", ())}
        if first.split("=", 1)[0] in run_options:
            return f"mtrain: error: {first} is an option of `mtrain run`; write `mtrain run {shlex.join(args)}`"
        if not first.startswith("-"):
            close = difflib.get_close_matches(first, list(main_group.commands), n=1)
            if close:
                return f"mtrain: error: no command {first!r}; did you mean `mtrain {close[0]}`?"
            return (f"mtrain: error: no command {first!r}; to start a job write "
                    f"`mtrain run -np N {shlex.join(args)}`")
    if message.endswith("?"):  # click already says what to do
        return f"{command}: error: {message}"
    return f"{command}: error: {message}; see `{command} --help`"


def main(argv: list[str] | None = None) -> int:
    """Console entry point: click without tracebacks and with one-line usage errors."""
    args = sys.argv[1:] if argv is None else argv
    try:
        main_group.main(args=args, prog_name="mtrain", standalone_mode=False)
    except click.exceptions.NoArgsIsHelpError as error:  # bare `mtrain`
        click.echo(error.ctx.get_help() if error.ctx else str(error))
        return 0
    except click.UsageError as error:
        click.echo(usage_error_line(error, args), err=True)
        return 2
    except click.Abort:
        click.echo("mtrain: aborted", err=True)
        return 130
    except click.ClickException as error:
        click.echo(f"mtrain: error: {error.format_message()}", err=True)
        return error.exit_code
    except SystemExit as done:
        return done.code if isinstance(done.code, int) else (0 if done.code is None else 1)
    except KeyboardInterrupt:
        click.echo("mtrain: interrupted", err=True)
        return 130
    except PrivatePathError as error:  # a shared folder this user may not use: the line says what to do
        click.echo(str(error), err=True)
        return 1
    except Exception as error:  # a bug in mtrain: still one line, the traceback on request
        if os.environ.get("MTRAIN_DEBUG"):
            raise
        click.echo(f"mtrain: internal error: {type(error).__name__}: {error} "
                   "(rerun with MTRAIN_DEBUG=1 for the traceback, and please report it)", err=True)
        return 1
    return 0


def entry() -> None:
    """The `mtrain` command: `main`, then out without the interpreter's teardown."""
    from mtrain.launcher.process_tools import exit_now
    exit_now(main())


if __name__ == "__main__":
    entry()
