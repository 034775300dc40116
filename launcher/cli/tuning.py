"""Horovod's tuning, library, logging and controller flags of `horovodrun`, and its
`--config-file`: what each one becomes in an mtrain job (pure; no click, no runtime).

Flags that tune the runtime reach every rank as mtrain's own variables (the runtime
reads Horovod's too, ours winning: bindings/common/settings.py's table), so a flag beats a
variable set in the environment of `mtrain run`, as `horovodrun`'s flags do.  A flag for
machinery mtrain does not have (Gloo, jsrun, NCCL streams, …) is accepted and gets one
line saying what mtrain does instead; the job runs.

`FLAGS` is the one table: option name (click's), the flag as the user writes it, its key
in Horovod's YAML config file, and its effect.
"""
from __future__ import annotations

import dataclasses
import os
from typing import TYPE_CHECKING, Any, Callable, Mapping, NamedTuple

from mtrain.common import settings

if TYPE_CHECKING:  # config imports this module on every launch's path; only the CLI makes RunOptions
    from mtrain.launcher.cli.run_options import RunOptions

# The runtime's variables, by the settings table's names (mtrain.common.settings, which the ranks read).
FUSION_THRESHOLD = settings.FUSION_THRESHOLD_BYTES.ours
CYCLE_TIME = settings.CYCLE_TIME_MS.ours
CACHE_CAPACITY = settings.CACHE_CAPACITY.ours
ALLREDUCE_ALGORITHM = settings.ALLREDUCE_ALGORITHM.ours
LOG_LEVEL = settings.LOG_LEVEL.ours
AUTOTUNE = settings.AUTOTUNE.ours
AUTOTUNE_LOG = settings.AUTOTUNE_LOG.ours
AUTOTUNE_WARMUP_SAMPLES = settings.AUTOTUNE_WARMUP_SAMPLES.ours
AUTOTUNE_STEPS_PER_SAMPLE = settings.AUTOTUNE_STEPS_PER_SAMPLE.ours
AUTOTUNE_BAYES_OPT_MAX_SAMPLES = settings.AUTOTUNE_BAYES_OPT_MAX_SAMPLES.ours
AUTOTUNE_GAUSSIAN_PROCESS_NOISE = settings.AUTOTUNE_GAUSSIAN_PROCESS_NOISE.ours
TIMELINE = settings.TIMELINE.ours
TIMELINE_MARK_CYCLES = settings.TIMELINE_MARK_CYCLES.ours
STALL_CHECK_DISABLE = settings.STALL_CHECK_DISABLE.ours
STALL_WARNING_SECONDS = settings.STALL_WARNING_SECONDS.ours
STALL_SHUTDOWN_SECONDS = settings.STALL_SHUTDOWN_SECONDS.ours
LOG_LEVELS = ("TRACE", "DEBUG", "INFO", "WARNING", "ERROR", "FATAL")  # Horovod's --log-level choices
# NCCL's own variable: `--tcp` keeps NCCL (a torch.distributed program's) off InfiniBand, as in Horovod.
NCCL_IB_DISABLE = "NCCL_IB_DISABLE"


@dataclasses.dataclass(frozen=True)
class RankSetting:
    """One variable every rank gets, and the flag (or config-file key) it comes from."""

    name: str
    value: str
    origin: str


class Effect(NamedTuple):
    """What one flag's value does: variables for the ranks, or one line for the user."""

    variables: "tuple[tuple[str, str], ...]" = ()
    note: "str | None" = None


def _variable(name: str, convert: Callable[[Any], str] = str) -> Callable[[Any], Effect]:
    return lambda value: Effect(((name, convert(value)),))


def _note_if_set(text: str) -> Callable[[Any], Effect]:
    # A flag left off (False) asks for what mtrain does anyway: nothing to say.
    return lambda value: Effect(note=text) if value not in (False, None) else Effect()


def _number_text(value: float) -> str:
    return f"{value:g}"


class Flag(NamedTuple):
    option: str                      # click's name of the option (its dest)
    flag: str                        # as written on the command line
    config_key: "tuple[str, str] | None"  # (section, key) in Horovod's YAML config file
    effect: Callable[[Any], Effect]
    off_flag: "str | None" = None    # the flag that gives False, where there is one


FLAGS: "tuple[Flag, ...]" = (
    Flag("fusion_threshold_mb", "--fusion-threshold-mb", ("params", "fusion_threshold_mb"),
         _variable(FUSION_THRESHOLD, lambda mb: str(mb * 1024 * 1024))),
    Flag("cycle_time_ms", "--cycle-time-ms", ("params", "cycle_time_ms"), _variable(CYCLE_TIME, _number_text)),
    Flag("cache_capacity", "--cache-capacity", ("params", "cache_capacity"), _variable(CACHE_CAPACITY)),
    # Off is Horovod's default, which in mtrain is `auto` (shared memory within a host where it pays).
    Flag("hierarchical_allreduce", "--hierarchical-allreduce", ("params", "hierarchical_allreduce"),
         _variable(ALLREDUCE_ALGORITHM, lambda on: "hierarchical" if on else "auto"), "--no-hierarchical-allreduce"),
    Flag("hierarchical_allgather", "--hierarchical-allgather", ("params", "hierarchical_allgather"),
         _note_if_set("mtrain has no hierarchical allgather; allgather runs on the ring"),
         "--no-hierarchical-allgather"),
    # --autotune off (the default) sets nothing: MTRAIN_AUTOTUNE / HOROVOD_AUTOTUNE in the environment still count.
    Flag("autotune", "--autotune", ("autotune", "enabled"),
         lambda on: Effect(((AUTOTUNE, "1"),)) if on else Effect(), "--no-autotune"),
    Flag("autotune_log_file", "--autotune-log-file", ("autotune", "log_file"),
         _variable(AUTOTUNE_LOG, lambda path: os.path.abspath(str(path)))),
    Flag("autotune_warmup_samples", "--autotune-warmup-samples", ("autotune", "warmup_samples"),
         _variable(AUTOTUNE_WARMUP_SAMPLES)),
    Flag("autotune_steps_per_sample", "--autotune-steps-per-sample", ("autotune", "steps_per_sample"),
         _variable(AUTOTUNE_STEPS_PER_SAMPLE)),
    Flag("autotune_bayes_opt_max_samples", "--autotune-bayes-opt-max-samples",
         ("autotune", "bayes_opt_max_samples"), _variable(AUTOTUNE_BAYES_OPT_MAX_SAMPLES)),
    Flag("autotune_gaussian_process_noise", "--autotune-gaussian-process-noise",
         ("autotune", "gaussian_process_noise"), _variable(AUTOTUNE_GAUSSIAN_PROCESS_NOISE, _number_text)),
    # Rank 0 writes the timeline of every rank (Horovod's Chrome trace); a relative path is the launch folder's.
    Flag("timeline_filename", "--timeline-filename", ("timeline", "filename"),
         _variable(TIMELINE, lambda path: os.path.abspath(str(path)))),
    Flag("timeline_mark_cycles", "--timeline-mark-cycles", ("timeline", "mark_cycles"),
         lambda on: Effect(((TIMELINE_MARK_CYCLES, "1" if on else "0"),)), "--no-timeline-mark-cycles"),
    # Horovod has --no-stall-check only; its config file's `stall_check.enabled` is the other side.
    Flag("stall_check", "--stall-check", ("stall_check", "enabled"),
         lambda on: Effect(((STALL_CHECK_DISABLE, "0" if on else "1"),)), "--no-stall-check"),
    Flag("stall_check_warning_time_seconds", "--stall-check-warning-time-seconds",
         ("stall_check", "warning_time_seconds"), _variable(STALL_WARNING_SECONDS, _number_text)),
    Flag("stall_check_shutdown_time_seconds", "--stall-check-shutdown-time-seconds",
         ("stall_check", "shutdown_time_seconds"), _variable(STALL_SHUTDOWN_SECONDS, _number_text)),
    Flag("mpi_threads_disable", "--mpi-threads-disable", ("library_options", "mpi_threads_disable"),
         _note_if_set("mtrain's background engine needs MPI's thread support; it stays on"),
         "--no-mpi-threads-disable"),
    Flag("num_nccl_streams", "--num-nccl-streams", ("library_options", "num_nccl_streams"),
         _note_if_set("mtrain's collectives do not use NCCL; the setting has no effect")),
    Flag("thread_affinity", "--thread-affinity", None,
         _note_if_set("mtrain does not pin its background thread; the setting has no effect")),
    Flag("gloo_timeout_seconds", "--gloo-timeout-seconds", ("library_options", "gloo_timeout_seconds"),
         _note_if_set("mtrain runs on MPI, not Gloo; the setting has no effect")),
    Flag("tcp", "--tcp", None, lambda on: Effect(((NCCL_IB_DISABLE, "1"),)) if on else Effect()),
    Flag("log_level", "--log-level", ("logging", "level"), _variable(LOG_LEVEL, lambda level: level.lower())),
    # mtrain's runtime messages carry no timestamp (Horovod's do unless hidden): hiding them is what
    # mtrain does anyway; asking for them (config file) gets a line.
    Flag("log_with_timestamp", "--log-with-timestamp", ("logging", "with_timestamp"),
         lambda on: Effect(note="mtrain's runtime messages carry no timestamp; --prefix-output-with-timestamp "
                                "stamps every line of the job's output") if on else Effect(),
         "--log-without-timestamp"),
    Flag("use_gloo", "--gloo", None, _note_if_set("mtrain runs on MPI; --gloo is not needed")),
    Flag("use_jsrun", "--jsrun", None,
         _note_if_set("mtrain starts the ranks with mpirun (inside an LSF allocation too)")),
    Flag("disable_cache", "--disable-cache", None,
         _note_if_set("mtrain keeps no cache of its host checks; every run checks every host")),
)

# Horovod's config file keys with no flag in `mtrain run`: (section, key) -> the option name they
# would set (the file's value then gets a line saying it is not applied).
OTHER_CONFIG_KEYS: "dict[tuple[str, str], str]" = {
    ("library_options", "ccl_bgt_affinity"): "ccl_bgt_affinity",  # a file-only setting in Horovod too
}
CONFIG_KEYS: "dict[tuple[str, str], str]" = {
    **{flag.config_key: flag.option for flag in FLAGS if flag.config_key is not None},
    **OTHER_CONFIG_KEYS,
}
CONTROLLERS = {"gloo": "use_gloo", "mpi": "use_mpi"}  # the file's `controller:` (Horovod takes these two)


class ConfigFileError(ValueError):
    """The config file cannot be read, or is not Horovod's schema."""


class ConfigValue(NamedTuple):
    option: str
    value: Any
    key: str  # where it was in the file, e.g. "params.cycle_time_ms"


def read_config_file(path: str) -> "list[ConfigValue]":
    """The settings of Horovod's YAML config file at `path`, by option name (values as
    written; the CLI converts and checks them).  Unknown sections or keys are errors:
    Horovod ignores them, so a misspelt key would silently do nothing."""
    import yaml  # deferred: only a run with --config-file pays for it
    try:
        with open(path, encoding="utf-8") as handle:
            document = yaml.safe_load(handle)
    except OSError as error:
        raise ConfigFileError(f"cannot read it ({error.strerror})") from None
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark is not None else ""
        raise ConfigFileError(f"not valid YAML{where}") from None
    if document is None:
        return []
    if not isinstance(document, dict):
        raise ConfigFileError("expected a mapping of sections (params:, library_options:, logging:, …)")
    sections = sorted({section for section, _ in CONFIG_KEYS} | {"controller"})
    found: "list[ConfigValue]" = []
    for section, body in document.items():
        if section == "controller":
            if not isinstance(body, str) or body.lower() not in CONTROLLERS:
                raise ConfigFileError(f"controller: {body!r}: expected one of {', '.join(CONTROLLERS)}")
            found.append(ConfigValue(CONTROLLERS[body.lower()], True, "controller"))
            continue
        if section not in sections:
            raise ConfigFileError(f"unknown section {section!r}; Horovod's are {', '.join(sections)}")
        if body is None:
            continue
        if not isinstance(body, dict):
            raise ConfigFileError(f"{section}: expected a mapping of settings")
        for key, value in body.items():
            option = CONFIG_KEYS.get((section, key))
            if option is None:
                known = sorted(k for s, k in CONFIG_KEYS if s == section)
                raise ConfigFileError(f"unknown key {section}.{key}; {section} takes {', '.join(known)}")
            found.append(ConfigValue(option, value, f"{section}.{key}"))
    return found


def rank_settings(options: "RunOptions", origins: Mapping[str, str]) -> "tuple[tuple[RankSetting, ...], tuple[str, ...]]":
    """The variables every rank gets from the flags in `options`, and the lines to print
    for flags that change nothing in mtrain.  `origins`: option -> where its value came
    from, for options set by the config file (default: the flag)."""
    settings: "list[RankSetting]" = []
    notes: "list[str]" = []
    for flag in FLAGS:
        value = options.given(flag.option)
        if value is None:
            continue
        origin = origins.get(flag.option) or (flag.off_flag if value is False and flag.off_flag else flag.flag)
        effect = flag.effect(value)
        settings += [RankSetting(name, text, origin) for name, text in effect.variables]
        if effect.note:
            notes.append(f"mtrain: {origin}: {effect.note}")
    return tuple(settings), tuple(notes)


def refused_variable(environ: Mapping[str, str]) -> "str | None":
    """The one-line refusal of the first runtime variable (ours or Horovod's, as the ranks will
    see it in ``environ``) whose value every rank's ``init()`` would refuse, or None."""
    for setting in settings.SETTINGS:
        try:
            setting.read(environ)
        except ValueError as error:
            return str(error)
    return None
