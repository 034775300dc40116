"""The frozen, validated description of one `mtrain run`, built by the CLI.

Everything downstream (argv builder, preflight, supervisor) reads this and
nothing else, so there is exactly one place where user input is validated.
"""
from __future__ import annotations

import dataclasses
import enum
import re
from pathlib import Path

from mtrain.launcher.cli.tuning import RankSetting
from mtrain.launcher.job.hosts import HostSlots

_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


@dataclasses.dataclass(frozen=True)
class SshOptions:
    """How to reach remote hosts; None means "whatever ~/.ssh/config / OpenSSH defaults say"."""

    port: int | None = None
    identity_file: str | None = None
    accept_new_hosts: bool = False
    connect_timeout: float = 30.0


class MpiKind(enum.Enum):
    """The family of an MPI launcher's command line."""

    OPENMPI = "openmpi"  # Open MPI 5 (PRRTE's prterun)
    MPICH = "mpich"      # MPICH's hydra (also Intel MPI)


@dataclasses.dataclass(frozen=True)
class MpiLauncher:
    """An MPI launcher program and the family of its command line."""

    path: str
    kind: MpiKind


class Launcher(enum.Enum):
    """How the ranks' hosts are reached (--launcher)."""

    SSH = "ssh"      # over SSH (launcher/ssh/agent.py, remote_guard.py)
    SLURM = "slurm"  # through the Slurm allocation mtrain runs in: srun starts MPI's daemons (launcher/job/slurm.py)


@dataclasses.dataclass(frozen=True)
class ElasticSettings:
    """Horovod's elastic flags, validated (see launcher/elastic/driver.py)."""

    initial_np: int                      # -np: ranks of the first generation
    min_np: int                          # --min-np (default -np)
    max_np: int | None                   # --max-np (default: no limit)
    discovery_script: str | None         # --host-discovery-script
    fixed_hosts: tuple[HostSlots, ...]   # -H / --hostfile when there is no script
    slots_per_host: int | None = None    # --slots-per-host, for script lines without `:slots`
    timeout: float = 600.0               # --elastic-timeout
    reset_limit: int | None = None       # --reset-limit
    cooldown: tuple[float, float] | None = None  # --blacklist-cooldown-range


@dataclasses.dataclass(frozen=True)
class StepSettings:
    """What `mtrain run` does with the ranks' measured steps (launcher/supervise/stragglers.py)."""

    report: bool = True               # the straggler table at exit (--no-straggler-report: off)
    every: int = 0                    # --straggler-report N: the table every N steps too (0: at exit only)
    progress: bool = False            # --progress
    progress_interval: float = 10.0   # --progress-interval: seconds between plain progress lines

    @property
    def measured(self) -> bool:
        return self.report or self.progress


@dataclasses.dataclass(frozen=True)
class LaunchConfig:
    """One validated job: which hosts run how many ranks of which command."""

    plan: tuple[HostSlots, ...]          # hosts actually used, in rank order
    command: tuple[str, ...]
    remote_hosts: tuple[str, ...]        # hosts reached over SSH or through Slurm (empty: local job)
    ssh: SshOptions
    mpi: MpiLauncher
    start_timeout: float = 30.0
    network_interfaces: tuple[str, ...] = ()
    output_dir: Path | None = None
    env_pass: tuple[str, ...] = ()       # `-x` items: "VAR" or "VAR=value"
    mpi_args: tuple[str, ...] = ()
    verbose: bool = False
    master_port: int | None = None       # torch.distributed's MASTER_PORT (None: a free one, found)
    one_gpu_per_rank: bool = False       # each rank sees only its own GPU (CUDA_VISIBLE_DEVICES)
    elastic: ElasticSettings | None = None  # an elastic job: the plan is made per generation
    rank_settings: tuple[RankSetting, ...] = ()  # from Horovod's tuning flags / --config-file (tuning.py)
    binding_args: tuple[str, ...] | None = None  # --binding-args: instead of mpirun's default binding
    prefix_timestamp: bool = False       # --prefix-output-with-timestamp
    notices: tuple[str, ...] = ()        # one line per flag that changes nothing in mtrain
    steps: StepSettings = StepSettings()  # the straggler report and --progress
    launcher: Launcher = Launcher.SSH    # how remote_hosts are reached
    slurm_job: str = ""                  # the enclosing Slurm job's id, with Launcher.SLURM

    @property
    def rank_items(self) -> tuple[str, ...]:
        """What every rank gets, as `-x` items: the user's, then the flags' (which never name the same variable)."""
        return self.env_pass + tuple(f"{s.name}={s.value}" for s in self.rank_settings)

    @property
    def num_proc(self) -> int:
        return sum(host.slots for host in self.plan)


def check_env_item(item: str) -> str:
    """Validate one `-x VAR` / `-x VAR=value`; return it unchanged or raise ValueError."""
    name = item.split("=", 1)[0]
    if not _ENV_NAME.match(name):
        raise ValueError(f"-x {item!r}: {name!r} is not an environment variable name")
    return item
