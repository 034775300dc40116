"""Per-step timings of one rank, for ``mtrain run``'s straggler report and ``straggler_stats()``.

The engine of the job's process set calls ``StepMeter`` from its cycles only (its thread's, or
a waiting thread's: ``Engine.assist``; one at a time, under the cycle lock): ``batch`` when it
runs a batch of ops, ``done`` when the batch has completed, and ``step_end`` when it learns
that a step is over (it is idle again after a thread waited on a handle:
``SubmitQueue.idle_check``). A step's

* compute is the time from the previous step's last completion to this step's first submit
  (what the rank did between two steps: the forward and backward pass, data loading);
* wait is the longest any of its ops waited between its submit and the cycle that ran it:
  the time the rank spent waiting for the others to submit the same op (and for the engine's
  own short hold, the same on every rank);
* cycle is the engine cycle that ran its last ops, the same on every rank for the same step
  (every cycle is one collective exchange), which lets the launcher line up the ranks' steps
  without comparing clocks.

Nothing extra goes on the wire between ranks: the samples go to ``mtrain run`` as marker lines
on stderr (records.steps.StepReport), every ``MTRAIN_STRAGGLER_EVERY`` steps, every
``MTRAIN_STEP_REPORT_SECONDS`` (settings.STEP_REPORT_STEPS, STEP_REPORT_SECONDS), and when the
engine stops; and ``straggler_stats()`` gathers them when the program asks.
"""
from __future__ import annotations

import math
import socket
import time
from collections import deque
from typing import Any, NamedTuple, Sequence

from mtrain.common import settings
from mtrain.common.records.error_report import supervised
from mtrain.common.records.steps import StepReport, StepSample
from mtrain.common.straggler_rows import StragglerRow, straggler_table

KEPT = 4096               # the newest steps straggler_stats() sees
SAMPLES_PER_LINE = 50     # keeps one marker line under a pipe's atomic write size (4 KiB)


class StepMeter:
    """One rank's step timings (engine thread only, apart from ``recent``)."""

    def __init__(self) -> None:
        self.host = socket.gethostname()
        self.kept: "deque[tuple]" = deque(maxlen=KEPT)  # StepSample rows (``step_end``)
        self._every = settings.STEP_REPORT_STEPS.read()
        self._seconds = settings.STEP_REPORT_SECONDS.read()
        self._unsent: "list[tuple]" = []
        self._supervised = supervised()  # whether an ``mtrain run`` reads the reports
        self._sent_at = time.monotonic()
        self._steps = 0
        self._previous_done: "float | None" = None  # the last step's last completion
        self.compute_start = 0.0  # where the compute of the step step_end recorded last began
        self._reset()

    def _reset(self) -> None:
        self._first_submit = math.inf
        self._wait = 0.0
        self._nbytes = 0
        self._cycle = -1
        self._done = 0.0

    def batch(self, first_submit: float, started: float, nbytes: int, cycle: int) -> None:
        """The engine runs a batch whose earliest op was submitted at ``first_submit``."""
        if first_submit < self._first_submit:
            self._first_submit = first_submit
        waited = started - first_submit
        if waited > self._wait:
            self._wait = waited
        self._nbytes += nbytes
        self._cycle = cycle

    def done(self, now: float) -> None:
        self._done = now

    def step_end(self) -> bool:
        """The ops run since the last step_end were one step: record it; False when nothing ran,
        or when it was the first step (which has no previous one to measure its compute from: it
        holds the start-up). Rows are kept here as plain tuples, made into ``StepSample`` records
        only when read (``last``, ``recent``, ``send``): a lone op may be a whole step, and making
        a record costs more than the tuple."""
        if self._cycle < 0:
            return False
        self._steps += 1
        previous, self._previous_done = self._previous_done, self._done
        row = None
        if previous is not None:
            self.compute_start = previous
            first = self._first_submit
            row = (self._steps, self._cycle, self._done, first - previous if first > previous else 0.0, self._wait,
                   self._nbytes)
            self.kept.append(row)
            if self._supervised:  # (straggler_stats() reads ``kept``; only mtrain run reads the rest)
                self._unsent.append(row)
        self._reset()
        return row is not None

    def last(self) -> StepSample:
        """The step ``step_end`` recorded last (after it returned True)."""
        return StepSample(*self.kept[-1])

    def due(self) -> bool:
        """Whether what was measured should go to the launcher now."""
        return bool(self._unsent) and (self._steps % self._every == 0
                                       or time.monotonic() - self._sent_at >= self._seconds)

    def send(self) -> None:
        """Send the unsent samples to ``mtrain run`` (nothing without it)."""
        unsent, self._unsent = self._unsent, []
        self._sent_at = time.monotonic()
        for start in range(0, len(unsent), SAMPLES_PER_LINE):
            StepReport(self.host, tuple(StepSample(*row) for row in unsent[start:start + SAMPLES_PER_LINE])).emit()

    def recent(self) -> "list[StepSample]":
        """The kept samples (any thread: the rows are copied at C level under the GIL first)."""
        return [StepSample(*row) for row in list(self.kept)]


def job_meter() -> "StepMeter | None":
    """The job's engine's meter, or None when the straggler report is off
    (MTRAIN_STRAGGLER_REPORT_DISABLE=1: ``mtrain run --no-straggler-report``)."""
    return None if settings.STRAGGLER_REPORT_DISABLE.read() else StepMeter()


class MeasuredSteps(NamedTuple):
    """What one rank sends for ``straggler_stats()``: its host and its kept samples as plain rows."""

    host: str
    rows: "list[dict[str, Any]]"  # StepSample._asdict()


def measured(meter: "StepMeter | None") -> MeasuredSteps:
    """This rank's share of ``straggler_stats()`` (nothing when it measures nothing)."""
    if meter is None:
        return MeasuredSteps("", [])
    return MeasuredSteps(meter.host, [sample._asdict() for sample in meter.recent()])


def straggler_rows(gathered: "Sequence[MeasuredSteps]") -> "list[StragglerRow]":
    """The straggler table from every rank's ``measured`` (in rank order)."""
    hosts = {rank: part.host for rank, part in enumerate(gathered)}
    samples = {rank: [StepSample(**row) for row in part.rows] for rank, part in enumerate(gathered)}
    return straggler_table(samples, hosts)
