"""The runtime's settings: defaults, and the environment variables that change them.

``SETTINGS`` is the one table of the variables the runtime reads: each setting's
``MTRAIN_*`` name, its Horovod twin, and how its text is parsed.  Every reader goes
through ``Setting.read``: our variable wins when both are set, a bad value is a
ValueError at ``init()`` naming the variable and what it accepts (a few observability
variables, ``lenient`` here, have always read a bad value as their default instead; the
flight recorder's size says so on stderr). The default of each is written here once.

One frozen ``EngineConfig`` per engine, read once at ``init()``; the engine
never reads the environment itself.
"""
from __future__ import annotations

import dataclasses
import enum
import math
import os
from typing import Any, Callable, Mapping, NamedTuple

from mtrain.common.records.flight_recorder import ENV_FLIGHT_RECORDER_SIZE
from mtrain.common.records.steps import ENV_STEP_REPORT_SECONDS, ENV_STRAGGLER_EVERY, ENV_STRAGGLER_OFF

# Chosen by measurement on the 2-core development VM (benchmarks/fusion.py; docs/benchmarks.md):
DEFAULT_CYCLE_TIME_MS = 1.0
DEFAULT_FUSION_THRESHOLD_BYTES = 8 << 20
# Tensors at least this big skip the fusion buffer: copying them in and out
# costs more than the per-ring overhead that fusing saves.
DEFAULT_INPLACE_MIN_BYTES = 1 << 20
DEFAULT_STALL_WARNING_SECONDS = 60.0
# Names the response cache keeps (Horovod's default is 1024; ours was sized for
# models with a few thousand gradient tensors, whose every step stays on the fast path).
DEFAULT_CACHE_CAPACITY = 4096
# Ops the flight recorder keeps per process set (0: off).
DEFAULT_FLIGHT_RECORDER_SIZE = 256


class LogLevel(enum.IntEnum):
    """Horovod's log levels, lowest first (HOROVOD_LOG_LEVEL's values, in any case)."""

    TRACE = 0
    DEBUG = 1
    INFO = 2
    WARNING = 3
    ERROR = 4
    FATAL = 5


class TextChoice(str, enum.Enum):
    """A setting with a few allowed texts. A str equal to its text (``str()`` and f-strings give
    that text too), so callers that pass or compare the text keep working. A subclass names
    itself for errors (``noun``)."""

    def __str__(self) -> str:
        return self.value

    @classmethod
    def noun(cls) -> str:
        return cls.__name__.lower()

    @classmethod
    def choices(cls) -> str:
        """The allowed texts, for messages."""
        return ", ".join(member.value for member in cls)

    @classmethod
    def of(cls, value: Any) -> Any:
        """``value`` (a member or its text) as a member; ValueError naming the choices."""
        try:
            return cls(value)
        except ValueError:
            raise ValueError(f"unknown {cls.noun()} {value!r}; use one of {cls.choices()}") from None


def _number(text: str) -> float:
    value = float(text)
    if not value >= 0:  # also refuses nan
        raise ValueError
    return value


def _count(text: str) -> int:
    value = float(text)  # "1e6" and "1048576.0" too, as before
    if not (value >= 0 and value == int(value)):
        raise ValueError
    return int(value)


def _positive_count(text: str) -> int:
    value = _count(text)
    if value < 1:
        raise ValueError
    return value


def _positive_number(text: str) -> float:
    value = _number(text)
    if not 0 < value < math.inf:
        raise ValueError
    return value


def _flag(text: str) -> bool:
    # Horovod reads a flag with strtol(value) > 0: "1" is on, "0" off, and "true" silently
    # off. A word is refused here instead of being read as the opposite of what it says.
    return int(text) > 0


def _level(text: str) -> LogLevel:
    return LogLevel[text.strip().upper()]


def _text(text: str) -> str:
    return text


_REFUSAL = "{name}={raw!r} is not {accepts}; set it to one or unset it"


class Setting(NamedTuple):
    """One variable the runtime reads: ours, Horovod's twin (either may be None), the
    parser of its text, what the parser accepts (for the error), and the default.

    ``refusal`` is the error's text, a format with ``name``, ``raw`` (the value as set),
    ``text`` (stripped), ``lowered`` (stripped, lower case) and ``accepts``.

    ``lenient``: a value the parser refuses reads as the default instead of being a ValueError
    (so neither ``mtrain run`` nor ``init()`` refuses it); ``refused`` still tells."""

    ours: "str | None"
    horovod: "str | None"
    parse: Callable[[str], Any]
    accepts: str
    default: Any
    refusal: str = _REFUSAL
    lenient: bool = False

    def read(self, environ: "Mapping[str, str] | None" = None) -> Any:
        """The value from ``environ`` (default os.environ): ours if set, else Horovod's, else the default.
        An empty variable counts as unset."""
        value, refused = self._parsed(environ)
        if refused is not None and not self.lenient:
            raise ValueError(refused)
        return value

    def refused(self, environ: "Mapping[str, str] | None" = None) -> "str | None":
        """The refusal of the value ``read`` takes (``refusal`` filled in), or None when it parses or is unset."""
        return self._parsed(environ)[1]

    def _parsed(self, environ: "Mapping[str, str] | None") -> "tuple[Any, str | None]":
        environ = os.environ if environ is None else environ
        for name in (self.ours, self.horovod):
            raw = environ.get(name, "") if name else ""
            if raw.strip() == "":
                continue
            try:
                return self.parse(raw.strip()), None
            except (ValueError, KeyError):
                text = raw.strip()
                return self.default, self.refusal.format(name=name, raw=raw, text=text, lowered=text.lower(),
                                                         accepts=self.accepts)
        return self.default, None

    def source(self, environ: "Mapping[str, str] | None" = None) -> "str | None":
        """The name of the variable ``read`` takes its value from, or None for the default."""
        environ = os.environ if environ is None else environ
        for name in (self.ours, self.horovod):
            if name and environ.get(name, "").strip():
                return name
        return None


def _choice(choices: "tuple[str, ...]") -> Callable[[str], str]:
    """A parser that takes one of ``choices``, in any case."""
    def parse(text: str) -> str:
        value = text.lower()
        if value not in choices:
            raise ValueError
        return value
    return parse


def _positive_bytes(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise ValueError
    return value


def _on_off(text: str) -> bool:
    value = text.lower()
    if value in ("1", "true", "yes"):
        return True
    if value in ("0", "false", "no"):
        return False
    raise ValueError


def _whole_at_least_zero(text: str) -> int:
    return max(0, int(text))  # a negative size is 0 (off), as the recorder always read it


def _steps(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise ValueError
    return int(text)


def _above_zero(text: str) -> float:
    value = float(text)
    if not value > 0:  # also refuses nan; inf: never by time
        raise ValueError
    return value


def _one(text: str) -> bool:
    return text == "1"  # anything else, as the step meter always read it: measure


_SECONDS = "a number of seconds >= 0"
_FLAG = "an integer: 1 (on) or 0 (off), as Horovod reads it"

CYCLE_TIME_MS = Setting("MTRAIN_CYCLE_TIME_MS", "HOROVOD_CYCLE_TIME", _number,
                        "a number of milliseconds >= 0", DEFAULT_CYCLE_TIME_MS)
FUSION_THRESHOLD_BYTES = Setting("MTRAIN_FUSION_THRESHOLD_BYTES", "HOROVOD_FUSION_THRESHOLD", _count,
                                 "a whole number of bytes >= 0 (0 turns fusion off)", DEFAULT_FUSION_THRESHOLD_BYTES)
INPLACE_MIN_BYTES = Setting("MTRAIN_FUSION_INPLACE_MIN_BYTES", None, _count, "a whole number of bytes >= 0",
                            DEFAULT_INPLACE_MIN_BYTES)
CACHE_CAPACITY = Setting("MTRAIN_CACHE_CAPACITY", "HOROVOD_CACHE_CAPACITY", _count,
                         "a whole number of op names >= 0 (0 turns the response cache off)", DEFAULT_CACHE_CAPACITY)
STALL_CHECK_DISABLE = Setting("MTRAIN_STALL_CHECK_DISABLE", "HOROVOD_STALL_CHECK_DISABLE", _flag, _FLAG, False)
STALL_WARNING_SECONDS = Setting("MTRAIN_STALL_WARNING_SECONDS", "HOROVOD_STALL_CHECK_TIME_SECONDS", _number,
                                _SECONDS, DEFAULT_STALL_WARNING_SECONDS)
STALL_SHUTDOWN_SECONDS = Setting("MTRAIN_STALL_SHUTDOWN_SECONDS", "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS", _number,
                                 _SECONDS + " (0: never)", 0.0)
TIMELINE = Setting("MTRAIN_TIMELINE", "HOROVOD_TIMELINE", _text, "a file path", None)
TIMELINE_MARK_CYCLES = Setting("MTRAIN_TIMELINE_MARK_CYCLES", "HOROVOD_TIMELINE_MARK_CYCLES", _flag, _FLAG, False)
LOG_LEVEL = Setting("MTRAIN_LOG_LEVEL", "HOROVOD_LOG_LEVEL", _level,
                    "one of " + ", ".join(level.name.lower() for level in LogLevel), LogLevel.WARNING)
# Horovod's alone: mtrain's variable for the all-reduce path is MTRAIN_ALLREDUCE_ALGORITHM (a
# choice, not a flag: ALLREDUCE_ALGORITHM; collectives.algorithm_from_environment, where ours wins too).
HIERARCHICAL_ALLREDUCE = Setting(None, "HOROVOD_HIERARCHICAL_ALLREDUCE", _flag, _FLAG, False)
# Read so that a bad value is still an error; mtrain has no hierarchical allgather (init says so
# once), and its runtime messages carry no timestamp.
HIERARCHICAL_ALLGATHER = Setting(None, "HOROVOD_HIERARCHICAL_ALLGATHER", _flag, _FLAG, False)
LOG_HIDE_TIME = Setting(None, "HOROVOD_LOG_HIDE_TIME", _flag, _FLAG, False)
# None (unset): sets may be added and removed after init(), as mtrain always allowed; set to 0,
# add_process_set and remove_process_set refuse, as Horovod's do (runtime.add_process_set).
DYNAMIC_PROCESS_SETS = Setting(None, "HOROVOD_DYNAMIC_PROCESS_SETS", _flag, _FLAG, None)

# The autotuner (autotune.py). Horovod's defaults (parameter_manager.cc): 3 warm-up samples, 10
# steps a sample, 20 Bayesian samples, noise 0.8.
AUTOTUNE = Setting("MTRAIN_AUTOTUNE", "HOROVOD_AUTOTUNE", _flag, _FLAG, False)
AUTOTUNE_LOG = Setting("MTRAIN_AUTOTUNE_LOG", "HOROVOD_AUTOTUNE_LOG", _text, "a file path", None)
AUTOTUNE_WARMUP_SAMPLES = Setting("MTRAIN_AUTOTUNE_WARMUP_SAMPLES", "HOROVOD_AUTOTUNE_WARMUP_SAMPLES", _count,
                                  "a whole number of samples >= 0", 3)
AUTOTUNE_STEPS_PER_SAMPLE = Setting("MTRAIN_AUTOTUNE_STEPS_PER_SAMPLE", "HOROVOD_AUTOTUNE_STEPS_PER_SAMPLE",
                                    _positive_count, "a whole number of steps >= 1", 10)
AUTOTUNE_BAYES_OPT_MAX_SAMPLES = Setting("MTRAIN_AUTOTUNE_BAYES_OPT_MAX_SAMPLES",
                                         "HOROVOD_AUTOTUNE_BAYES_OPT_MAX_SAMPLES", _positive_count,
                                         "a whole number of samples >= 1", 20)
AUTOTUNE_GAUSSIAN_PROCESS_NOISE = Setting("MTRAIN_AUTOTUNE_GAUSSIAN_PROCESS_NOISE",
                                          "HOROVOD_AUTOTUNE_GAUSSIAN_PROCESS_NOISE", _positive_number,
                                          "a number > 0", 0.8)

# The collectives' own (mtrain's alone). The choices are collectives.Algorithm's and
# shm.Transport's texts (transport/executor.py checks that they agree); None defaults: the path's own.
ALLREDUCE_ALGORITHMS = ("auto", "ring", "shm", "hierarchical", "mpi")
SHM_TRANSPORTS = ("auto", "cma", "segment")
DEFAULT_SHM_STRIPE_BYTES = 2 << 20  # shm.DEFAULT_STRIPE_BYTES (transport/executor.py checks that they agree)
RING_SEGMENT_BYTES = Setting("MTRAIN_RING_SEGMENT_BYTES", None, _number, "a number >= 0", None)
SMALL_ALLREDUCE_BYTES = Setting("MTRAIN_SMALL_ALLREDUCE_BYTES", None, _number, "a number >= 0", None)
ALLREDUCE_ALGORITHM = Setting(
    "MTRAIN_ALLREDUCE_ALGORITHM", None, _choice(ALLREDUCE_ALGORITHMS), "an all-reduce algorithm", None,
    "{name}={raw!r} is not {accepts}; set it to one of " + ", ".join(ALLREDUCE_ALGORITHMS) + " (or unset it for auto)")
SHM_TRANSPORT = Setting(
    "MTRAIN_SHM_TRANSPORT", None, _choice(SHM_TRANSPORTS), "a shared-memory transport", None,
    "{name}={raw!r} is not {accepts}; set it to one of " + ", ".join(SHM_TRANSPORTS) + " (or unset it for auto)")
SHM_STRIPE_BYTES = Setting(
    "MTRAIN_SHM_STRIPE_BYTES", None, _positive_bytes, "a positive number of bytes", None,
    "{name}={text!r} is not {accepts}; set it to one (default " + str(DEFAULT_SHM_STRIPE_BYTES) + ") or unset it")
# None: ask MPI whether it reads device memory (cuda.py).
CUDA_AWARE = Setting(
    "MTRAIN_CUDA_AWARE", None, _on_off, "1 or 0", None,
    "{name}={lowered!r}: use 1 (MPI reads GPU memory), 0 (stage through host memory), or leave it unset to ask MPI")
# Point-to-point transfers (p2p.py, whose constants are the defaults): the largest payload sent
# in one message, the chunk size of a larger one, and how many chunks are in flight at once.
P2P_EAGER_BYTES = Setting("MTRAIN_P2P_EAGER_BYTES", None, _number, "a number >= 0", None)
P2P_CHUNK_BYTES = Setting("MTRAIN_P2P_CHUNK_BYTES", None, _number, "a number >= 0", None)
P2P_WINDOW = Setting("MTRAIN_P2P_WINDOW", None, _number, "a number >= 0", None)

# Observability (ringreduce/observe/: recorder.py, steps.py), read when an engine starts. Lenient,
# as they always were: a bad value is the default (the recorder's size says so on stderr).
FLIGHT_RECORDER_SIZE = Setting(
    ENV_FLIGHT_RECORDER_SIZE, None, _whole_at_least_zero, "a whole number", DEFAULT_FLIGHT_RECORDER_SIZE,
    "{name}={text!r} is not {accepts}; using " + str(DEFAULT_FLIGHT_RECORDER_SIZE)
    + " (set it to 0 to turn the flight recorder off)", lenient=True)
# How often a rank sends its step samples to mtrain run: every N steps, and every S seconds.
STEP_REPORT_STEPS = Setting(ENV_STRAGGLER_EVERY, None, _steps, "a whole number of steps >= 1", 1000, lenient=True)
STEP_REPORT_SECONDS = Setting(ENV_STEP_REPORT_SECONDS, None, _above_zero, "a number of seconds > 0", 30.0,
                              lenient=True)
STRAGGLER_REPORT_DISABLE = Setting(ENV_STRAGGLER_OFF, None, _one, "1 (measure no step)", False)
# How much slower than the median rank a rank must be to be named a straggler (both halves read it).
STRAGGLER_THRESHOLD_PERCENT = Setting("MTRAIN_STRAGGLER_THRESHOLD_PERCENT", None, _number, "a number of percent >= 0",
                                      20.0, lenient=True)

SETTINGS: "tuple[Setting, ...]" = (
    CYCLE_TIME_MS, FUSION_THRESHOLD_BYTES, INPLACE_MIN_BYTES, CACHE_CAPACITY, STALL_CHECK_DISABLE,
    STALL_WARNING_SECONDS, STALL_SHUTDOWN_SECONDS, TIMELINE, TIMELINE_MARK_CYCLES, LOG_LEVEL,
    HIERARCHICAL_ALLREDUCE, HIERARCHICAL_ALLGATHER, LOG_HIDE_TIME, DYNAMIC_PROCESS_SETS,
    AUTOTUNE, AUTOTUNE_LOG, AUTOTUNE_WARMUP_SAMPLES, AUTOTUNE_STEPS_PER_SAMPLE, AUTOTUNE_BAYES_OPT_MAX_SAMPLES,
    AUTOTUNE_GAUSSIAN_PROCESS_NOISE, RING_SEGMENT_BYTES, SMALL_ALLREDUCE_BYTES, ALLREDUCE_ALGORITHM, SHM_TRANSPORT,
    SHM_STRIPE_BYTES, CUDA_AWARE, P2P_EAGER_BYTES, P2P_CHUNK_BYTES, P2P_WINDOW,
    FLIGHT_RECORDER_SIZE, STEP_REPORT_STEPS, STEP_REPORT_SECONDS, STRAGGLER_REPORT_DISABLE,
    STRAGGLER_THRESHOLD_PERCENT,
)


def number_or(setting: Setting, default: float) -> float:
    """``setting``'s number from the environment, or ``default`` when it is unset or empty."""
    value = setting.read()
    return default if value is None else value


@dataclasses.dataclass(frozen=True)
class AutotuneConfig:
    """Whether and how the autotuner runs (Horovod's --autotune flags; autotune.py)."""

    enabled: bool = AUTOTUNE.default
    log_path: "str | None" = AUTOTUNE_LOG.default
    warmup_samples: int = AUTOTUNE_WARMUP_SAMPLES.default
    steps_per_sample: int = AUTOTUNE_STEPS_PER_SAMPLE.default
    bayes_opt_max_samples: int = AUTOTUNE_BAYES_OPT_MAX_SAMPLES.default
    gaussian_process_noise: float = AUTOTUNE_GAUSSIAN_PROCESS_NOISE.default

    @staticmethod
    def from_environment(environ: "Mapping[str, str] | None" = None) -> "AutotuneConfig":
        environ = os.environ if environ is None else environ
        return AutotuneConfig(
            enabled=AUTOTUNE.read(environ), log_path=AUTOTUNE_LOG.read(environ),
            warmup_samples=AUTOTUNE_WARMUP_SAMPLES.read(environ),
            steps_per_sample=AUTOTUNE_STEPS_PER_SAMPLE.read(environ),
            bayes_opt_max_samples=AUTOTUNE_BAYES_OPT_MAX_SAMPLES.read(environ),
            gaussian_process_noise=AUTOTUNE_GAUSSIAN_PROCESS_NOISE.read(environ))


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """How one engine cycles, fuses, caches, watches for stalls and logs."""

    cycle_time_s: float = CYCLE_TIME_MS.default / 1000
    fusion_threshold_bytes: int = FUSION_THRESHOLD_BYTES.default
    inplace_min_bytes: int = INPLACE_MIN_BYTES.default
    stall_warning_s: float = STALL_WARNING_SECONDS.default  # inf: the stall check is off
    stall_shutdown_s: float = STALL_SHUTDOWN_SECONDS.default
    timeline_path: "str | None" = TIMELINE.default
    timeline_mark_cycles: bool = TIMELINE_MARK_CYCLES.default
    cache_capacity: int = CACHE_CAPACITY.default
    log_level: LogLevel = LOG_LEVEL.default
    hierarchical_allgather: bool = HIERARCHICAL_ALLGATHER.default  # asked for (Horovod's variable); mtrain has none
    autotune: AutotuneConfig = AutotuneConfig()

    @staticmethod
    def from_environment(environ: "Mapping[str, str] | None" = None) -> "EngineConfig":
        environ = os.environ if environ is None else environ
        stall_check = not STALL_CHECK_DISABLE.read(environ)
        timeline = TIMELINE.read(environ)
        DYNAMIC_PROCESS_SETS.read(environ)
        LOG_HIDE_TIME.read(environ)
        return EngineConfig(
            cycle_time_s=CYCLE_TIME_MS.read(environ) / 1000,
            fusion_threshold_bytes=FUSION_THRESHOLD_BYTES.read(environ),
            inplace_min_bytes=INPLACE_MIN_BYTES.read(environ),
            # Horovod's "stall check disabled" means no warning and no shutdown either.
            stall_warning_s=STALL_WARNING_SECONDS.read(environ) if stall_check else math.inf,
            stall_shutdown_s=STALL_SHUTDOWN_SECONDS.read(environ) if stall_check else 0.0,
            # Horovod's "DYNAMIC" names no file: the program starts the timeline itself (start_timeline).
            timeline_path=None if timeline == "DYNAMIC" else timeline,
            timeline_mark_cycles=TIMELINE_MARK_CYCLES.read(environ),
            cache_capacity=CACHE_CAPACITY.read(environ),
            log_level=LOG_LEVEL.read(environ),
            hierarchical_allgather=HIERARCHICAL_ALLGATHER.read(environ),
            autotune=AutotuneConfig.from_environment(environ),
        )

    def describe(self) -> str:
        """The settings in one line, in the variables' units (for the debug log)."""
        return (f"cycle_time_ms={self.cycle_time_s * 1000:g} fusion_threshold_bytes={self.fusion_threshold_bytes} "
                f"inplace_min_bytes={self.inplace_min_bytes} cache_capacity={self.cache_capacity} "
                f"stall_warning_seconds={self.stall_warning_s:g} stall_shutdown_seconds={self.stall_shutdown_s:g} "
                f"timeline={self.timeline_path or '-'} timeline_mark_cycles={int(self.timeline_mark_cycles)} "
                f"log_level={self.log_level.name.lower()} autotune={int(self.autotune.enabled)}")
