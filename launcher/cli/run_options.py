"""`mtrain run`'s options as one frozen value: what the command line (and --config-file) gave,
before cli.build_config validates them into a LaunchConfig.
"""
from __future__ import annotations

import dataclasses
import enum
from typing import Any, Mapping


class LauncherName(enum.Enum):
    """--launcher: how ranks reach their hosts."""

    AUTO = "auto"    # slurm inside an allocation unless -H or --hostfile is given, else ssh
    SSH = "ssh"
    SLURM = "slurm"


# No generated __eq__ or __repr__: over ~60 fields they cost ~2 ms of every `mtrain run`'s start.
@dataclasses.dataclass(frozen=True, eq=False, repr=False)
class RunOptions:
    """One field per option of `mtrain run`, named as click names its parameter (None: not given)."""

    command: tuple[str, ...]
    num_proc: int | None
    host_list: Any                 # list[hosts.HostSlots] | None (-H)
    hostfile: str | None
    launcher_name: LauncherName
    ssh_port: int | None
    ssh_identity_file: str | None
    ssh_accept_new_hosts: bool
    start_timeout: float
    interfaces: tuple[tuple[str, ...], ...]
    output_dir: str | None
    env_items: tuple[str, ...]
    mpirun_path: str | None
    mpi_args: str | None
    master_port: int | None
    one_gpu_per_rank: bool
    # Elastic
    min_np: int | None
    max_np: int | None
    host_discovery_script: str | None
    slots_per_host: int | None
    elastic_timeout: float
    reset_limit: int | None
    cooldown: tuple[int, int] | None
    # What mtrain itself shows
    straggler_every: int
    no_straggler_report: bool
    progress: bool
    progress_interval: float
    dry_run: bool
    verbose: bool
    prefix_timestamp: bool
    config_file: str | None
    # Horovod's flags: tuning settings for the ranks (tuning.FLAGS), or accepted and noted
    disable_cache: bool | None
    fusion_threshold_mb: int | None
    cycle_time_ms: float | None
    cache_capacity: int | None
    hierarchical_allreduce: bool | None
    hierarchical_allgather: bool | None
    autotune: bool | None
    autotune_log_file: str | None
    autotune_warmup_samples: int | None
    autotune_steps_per_sample: int | None
    autotune_bayes_opt_max_samples: int | None
    autotune_gaussian_process_noise: float | None
    timeline_filename: str | None
    timeline_mark_cycles: bool | None
    stall_check: bool | None
    stall_check_warning_time_seconds: float | None
    stall_check_shutdown_time_seconds: float | None
    mpi_threads_disable: bool | None
    num_nccl_streams: int | None
    thread_affinity: int | None
    gloo_timeout_seconds: int | None
    tcp: bool | None
    binding_args: str | None
    log_level: str | None
    log_with_timestamp: bool | None
    use_gloo: bool | None
    use_mpi: bool | None
    use_jsrun: bool | None

    @classmethod
    def from_click(cls, options: Mapping[str, Any]) -> "RunOptions":
        """The options as click hands them to the `run` command."""
        return cls(**{**options, "command": tuple(options["command"]),
                      "launcher_name": LauncherName(options["launcher_name"])})

    def given(self, name: str) -> Any:
        """The value of the option whose parameter is `name` (for options named by data:
        --config-file's keys, tuning's flags)."""
        return getattr(self, name)
