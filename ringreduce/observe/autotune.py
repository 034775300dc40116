"""The autotuner: Horovod's ``--autotune`` (horovod/common/parameter_manager.cc) for mtrain's engine.

During the first steps of a job it tries settings of the engine and scores each by the bytes
the job reduces per microsecond, then keeps the best. How a score is taken is Horovod's:

* a *step* of an op name is one run of it; a sub-sample ends when some name has run
  ``steps_per_sample`` more times, and a *sample* is SUBSAMPLES sub-samples, scored by the
  median of their bytes-per-microsecond (wall time, so the cycle time and the user's own
  work between steps count as they do in training);
* the first ``warmup_samples`` samples are not scored (the job's first steps fault pages
  in and fill caches);
* every rank counts steps from the op stream every rank agrees on, so every rank reaches the
  end of a sample after the same cycle. There the engine gathers each rank's score on rank 0
  over its control communicator, rank 0 (this module's ``Tuner.decide``) takes the slowest
  rank's score, chooses the next setting, and broadcasts it; every rank applies it before
  its next cycle (``exchange``, then ``Engine.apply``): the same point of the op stream everywhere.

What is tuned (``Space``): jointly, by Bayesian optimisation (``optim.py``), the fusion
threshold, the cycle time, the ring's segment size and the shared-memory stripe size, for
``bayes_opt_max_samples`` samples; then, one value at a time from the best so far (as Horovod
tunes its categorical knobs after the joint ones), the all-reduce algorithm (auto, ring,
shared memory — hierarchical on several hosts), the shared-memory transport, and the response
cache on or off. Then the best-scoring setting is fixed and tuning stops.

Rank 0 writes Horovod's log file: the header, one line per scored sample, then the best.
Its columns are Horovod's, so knobs only mtrain has are in rank 0's INFO log lines only.
"""
from __future__ import annotations

import dataclasses
import enum
import math
import statistics
import time
from typing import Any, NamedTuple, Sequence

from mtrain.common.settings import AutotuneConfig, EngineConfig
from mtrain.ringreduce.core import log
from mtrain.ringreduce.observe.optim import BayesianOptimizer
from mtrain.ringreduce.transport.executor import Algorithm, Executor
from mtrain.ringreduce.transport.shm import Transport

SUBSAMPLES = 5  # Horovod's SAMPLES: a sample's score is the median of this many sub-samples
# Horovod 0.28's header. Its data lines put ", " after torus_allreduce (a quirk of its writer);
# ``log_line`` writes them the same way, so that tools reading Horovod's files read ours.
LOG_HEADER = ("hierarchical_allreduce,hierarchical_allgather,torus_allreduce,cache_enabled,"
              "cycle_time_ms,tensor_fusion_threshold,score")
MIB = 1 << 20
SEED = 0x6d747261  # the optimiser's: a job tunes the same way each time it sees the same scores


class Knobs(NamedTuple):
    """One setting of everything the autotuner turns (the message rank 0 broadcasts)."""

    fusion_threshold_bytes: int
    cycle_time_ms: float
    segment_bytes: int      # the ring's
    stripe_bytes: int       # the shared-memory segment's (0: no segment)
    algorithm: Algorithm    # auto, ring or shm
    transport: "Transport | None"  # segment or cma (None: no shared memory)
    cache_enabled: bool

    def describe(self) -> str:
        return (f"fusion_threshold_bytes={self.fusion_threshold_bytes} cycle_time_ms={self.cycle_time_ms:g} "
                f"ring_segment_bytes={self.segment_bytes} shm_stripe_bytes={self.stripe_bytes} "
                f"algorithm={self.algorithm} shm_transport={self.transport or '-'} "
                f"cache_enabled={int(self.cache_enabled)}")


class Dimension(NamedTuple):
    """One knob tuned by the Bayesian optimiser: its field, its box, and whether the box is in log2."""

    field: str
    low: float
    high: float
    log2: bool = False


# The boxes. Horovod's: fusion threshold 0–64 MB, cycle time 1–100 ms. mtrain's engine starts a
# cycle at once when a thread waits on a handle, so its cycle time only paces bursts of
# unwaited submissions and the ticks of a rank waiting for its peers: 0.1–10 ms.
FUSION = Dimension("fusion_threshold_bytes", 0.0, 64.0)
CYCLE = Dimension("cycle_time_ms", 0.1, 10.0)
SEGMENT = Dimension("segment_bytes", 16.0, 22.0, log2=True)   # 64 KiB – 4 MiB
STRIPE = Dimension("stripe_bytes", 18.0, 23.0, log2=True)     # 256 KiB – 8 MiB (shm.TUNABLE_MAX_STRIPE_BYTES)


class Space:
    """What this job can tune, from what its engine has: the joint dimensions and the categorical
    knobs with their values (a knob with one value is not tuned)."""

    def __init__(self, algorithms: Sequence[Algorithm], transports: Sequence[Transport], stripes: bool) -> None:
        self.dimensions: "tuple[Dimension, ...]" = (FUSION, CYCLE, SEGMENT) + ((STRIPE,) if stripes else ())
        choices = {"algorithm": tuple(algorithms), "transport": tuple(transports), "cache_enabled": (True, False)}
        self.categorical: "tuple[tuple[str, tuple[Any, ...]], ...]" = tuple(
            (field, values) for field, values in choices.items() if len(values) > 1)

    def bounds(self) -> "list[tuple[float, float]]":
        return [(d.low, d.high) for d in self.dimensions]

    def vector(self, knobs: Knobs) -> "list[float]":
        """``knobs``' joint dimensions in the optimiser's coordinates, clipped to the box."""
        out = []
        for d in self.dimensions:
            value = float(getattr(knobs, d.field))
            if d.field == FUSION.field:
                value /= MIB
            elif d.log2:
                value = math.log2(max(value, 1.0))
            out.append(min(max(value, d.low), d.high))
        return out

    def knobs(self, vector: Sequence[float], base: Knobs) -> Knobs:
        """``base`` with the joint dimensions taken from ``vector``."""
        changes: "dict[str, Any]" = {}
        for d, value in zip(self.dimensions, vector):
            value = min(max(float(value), d.low), d.high)
            if d.field == FUSION.field:
                changes[d.field] = int(round(value * MIB))
            elif d.log2:
                changes[d.field] = int(round(2.0 ** value / 1024)) * 1024  # whole KiB
            else:
                changes[d.field] = round(value, 3)
        return base._replace(**changes)


class Stage(enum.Enum):
    BAYES = "bayes"  # the joint dimensions
    SWEEP = "sweep"  # one categorical value at a time
    DONE = "done"


class Decision(NamedTuple):
    """Rank 0's answer at the end of a sample: the setting to run next, and whether tuning goes on."""

    knobs: Knobs
    active: bool


def log_line(knobs: Knobs, hierarchical: bool, score: float) -> str:
    """One data line of Horovod's log file (bools as 0/1, numbers as C++ streams print them)."""
    return (f"{int(hierarchical)},0,0, {int(knobs.cache_enabled)},{knobs.cycle_time_ms:g},"
            f"{knobs.fusion_threshold_bytes / MIB:g},{score:g}")


class Tuner:
    """One engine's autotuner. Every rank counts steps (``note``); rank 0 also decides (``decide``)
    and writes the log. ``hosts``: how many hosts the job spans (shared memory across hosts is
    Horovod's hierarchical all-reduce)."""

    def __init__(self, config: AutotuneConfig, space: Space, start: Knobs, rank: int, hosts: int) -> None:
        self.config = config
        self.space = space
        self.current = start
        self.rank = rank
        self.hosts = hosts
        self.active = True
        self.warmups_left = config.warmup_samples
        self.stage = Stage.BAYES
        self.optimizer = BayesianOptimizer(space.bounds(), config.gaussian_process_noise, SEED)
        self.bayes_samples = 0
        self.sweep: "list[tuple[str, Any]]" = [(field, value) for field, values in space.categorical
                                              for value in values]
        self.scored: "list[tuple[Knobs, float]]" = []
        self.due = False
        self._reset(time.monotonic())
        self._log = None
        if rank == 0:
            log.info("autotune: tuning " + ", ".join(
                [d.field for d in space.dimensions] + [field for field, _ in space.categorical])
                + f" from {start.describe()}")
            if config.log_path:
                try:
                    self._log = open(config.log_path, "w", encoding="utf-8")
                    self._write(LOG_HEADER)
                except OSError as error:
                    log.warning(f"autotune: cannot write the log file {config.log_path} ({error.strerror}); "
                                "tuning goes on without it")
                    self._log = None

    # -- every rank ---------------------------------------------------------------
    def _reset(self, now: float) -> None:
        self._counts: "dict[str, int]" = {}
        self._subsample = 0
        self._bytes = 0
        self._started = now
        self._scores: "list[float]" = []

    def note(self, names: "Sequence[str]", nbytes: int) -> None:
        """The ops of one cycle ran (names, bytes): count their steps. Sets ``due`` when a scored
        sample has ended (a warm-up sample just starts the next)."""
        counts = self._counts
        limit = (self._subsample + 1) * self.config.steps_per_sample
        for name in names:
            step = counts.get(name, 0)
            counts[name] = step + 1
            if step >= limit:
                now = time.monotonic()
                micros = max((now - self._started) * 1e6, 1.0)
                self._scores.append(self._bytes / micros)
                self._bytes, self._started = 0, now
                self._subsample += 1
                break
        self._bytes += nbytes
        if self._subsample >= SUBSAMPLES:
            if self.warmups_left > 0:
                self.warmups_left -= 1
                if self.rank == 0:
                    log.info(f"autotune: warming up ({self.warmups_left} remaining)")
                self._reset(time.monotonic())
            else:
                self.due = True

    def score(self) -> float:
        """This rank's score of the sample that just ended: the median sub-sample's bytes per microsecond."""
        return statistics.median(self._scores)

    def follow(self, decision: Decision) -> None:
        """Every rank, after applying ``decision``: count the next sample from now."""
        self.current = decision.knobs
        self.active = decision.active
        self.due = False
        self._reset(time.monotonic())
        if not self.active and self._log is not None:
            self._log.close()
            self._log = None

    # -- rank 0 ---------------------------------------------------------------------
    def _hierarchical(self, knobs: Knobs) -> bool:
        return self.hosts > 1 and knobs.algorithm != Algorithm.RING and bool(knobs.transport)

    def _write(self, line: str) -> None:
        if self._log is not None:
            self._log.write(line + "\n")
            self._log.flush()

    def decide(self, scores: "Sequence[float]") -> Decision:
        """Rank 0: the sample of ``current`` ended with these per-rank scores; the next setting."""
        score = min(scores)  # the slowest rank's is the job's
        knobs = self.current
        self.scored.append((knobs, score))
        log.info(f"autotune: [{knobs.describe()}] {score:g}")
        self._write(log_line(knobs, self._hierarchical(knobs), score))
        if self.stage is Stage.BAYES:
            self.optimizer.add_sample(self.space.vector(knobs), score)
            self.bayes_samples += 1
            if self.bayes_samples < self.config.bayes_opt_max_samples:
                return Decision(self.space.knobs(self.optimizer.next_sample(), knobs), True)
            self.stage = Stage.SWEEP
        best = self.best()
        while self.sweep:
            field, value = self.sweep.pop(0)
            if getattr(best, field) != value:
                candidate = best._replace(**{field: value})
                if all(candidate != tried for tried, _ in self.scored):
                    return Decision(candidate, True)
        self.stage = Stage.DONE
        best_score = max(s for _, s in self.scored)
        log.info(f"autotune: best params [{best.describe()}] {best_score:g}; tuning ends")
        self._write(log_line(best, self._hierarchical(best), best_score))
        return Decision(best, False)

    def best(self) -> Knobs:
        return max(self.scored, key=lambda pair: pair[1])[0]


# -- the engine's side (``Engine``): every rank, at the same point of the op stream ----------------

def start_tuner(executor: Executor, config: EngineConfig, rank: int) -> Tuner:
    """The tuner of an engine that runs ``executor`` by ``config``, starting from what it runs now."""
    shared = executor.shared
    if shared is None:
        algorithm = Algorithm.RING
    else:
        algorithm = Algorithm.AUTO if executor.algorithm is Algorithm.AUTO else Algorithm.SHM
    start = Knobs(config.fusion_threshold_bytes, round(config.cycle_time_s * 1000, 6), executor.segment_bytes,
                  shared.stripe_bytes if shared is not None else 0, algorithm,
                  Transport(shared.transport) if shared is not None else None, config.cache_capacity > 0)
    space = Space(list(executor.algorithms()), list(shared.transports) if shared is not None else [],
                  stripes=shared is not None and shared.segment is not None)
    hosts = executor.cross.Get_size() if executor.cross is not None else 1
    return Tuner(config.autotune, space, start, rank, hosts)


def exchange(tuner: Tuner, control: Any, rank: int) -> Decision:
    """The end of an autotune sample, reached by every rank after the same cycle: rank 0 takes
    every rank's score (over ``control``, the engine's communicator) and says what runs next."""
    scores = control.gather(tuner.score(), root=0)
    decision = None
    if rank == 0:
        try:
            decision = tuner.decide(scores)
        except Exception as error:  # never leave the other ranks waiting in the broadcast
            log.warning(f"autotune failed ({error!r}); keeping {tuner.current.describe()}")
            decision = Decision(tuner.current, False)
    return control.bcast(decision, root=0)


def config_with(config: EngineConfig, knobs: Knobs) -> EngineConfig:
    """``config`` with the engine's own knobs taken from ``knobs``."""
    return dataclasses.replace(config, fusion_threshold_bytes=knobs.fusion_threshold_bytes,
                               cycle_time_s=knobs.cycle_time_ms / 1000)


def use_on_executor(executor: Executor, knobs: Knobs) -> None:
    """Run the collectives by ``knobs`` from the next all-reduce on."""
    executor.use(Algorithm(knobs.algorithm), knobs.segment_bytes)
    shared = executor.shared
    if shared is not None:
        shared.use(Transport(knobs.transport), knobs.stripe_bytes)
