"""Which rank is slow: the straggler table, from every rank's measured steps (records.steps.StepSample).

Each rank's runtime measures every training step (ringreduce/observe/steps.py): its *compute* (from
its previous step's last completion to this step's first submit: the time it spent in the
user's code) and its *wait* (the longest any of its ops waited from submit to running: the
time it spent waiting for the others).  A rank that is slow computes longer and waits less;
the rank that submitted last waited least, so the step's last rank is the one with the
smallest wait, among the ranks that measured the same step (the same engine cycle ran its
last ops on every rank: ``StepSample.cycle``).  Clocks never need to agree across hosts.

``mtrain run`` uses this module: a table at exit, every N steps with ``--straggler-report N``,
and the live ``--progress`` line.  The rows themselves (straggler_rows.py) are computed the
same way by ``hvd.straggler_stats()`` in the program.  Standard library only.
"""
from __future__ import annotations

import statistics
import threading
from collections import deque
from typing import Iterable, NamedTuple, Sequence

from mtrain.common.records.steps import StepReport, StepSample
from mtrain.common.straggler_rows import StragglerRow, straggler_table, threshold_percent
from mtrain.launcher.supervise.hang_report import ranks_text

MIN_STEPS = 10          # the table at exit needs at least this many measured steps
ROWS_SHOWN = 32         # larger jobs: the flagged ranks and the fastest and slowest others
KEPT_PER_RANK = 100_000  # the launcher's memory of each rank's steps


def format_table(rows: Sequence[StragglerRow], title: str) -> "list[str]":
    """The table as lines for mtrain's stderr (each line starts with 'mtrain: ')."""
    shown = list(rows)
    hidden = 0
    if len(shown) > ROWS_SHOWN:
        ordered = sorted(shown, key=lambda row: row.compute)
        keep = {row.rank for row in shown if row.slow} | {r.rank for r in ordered[:3]} | {r.rank for r in ordered[-3:]}
        hidden = len(shown) - len(keep)
        shown = [row for row in shown if row.rank in keep]
    width = max([4] + [len(row.host) for row in shown])
    lines = [f"mtrain: {title}",
             f"mtrain:   {'rank':>4}  {'host':<{width}}  {'steps':>6}  {'compute':>10}  {'wait':>10}  {'last':>5}"]
    for row in shown:
        flag = f"  <- slow: compute {row.ratio:.1f}x the median rank's" if row.slow else ""
        lines.append(f"mtrain:   {row.rank:>4}  {row.host:<{width}}  {row.steps:>6}  {_ms(row.compute):>10}  "
                     f"{_ms(row.wait):>10}  {row.last_share:>5.0%}{flag}")
    if hidden:
        lines.append(f"mtrain:   ({hidden} more ranks within the usual range are not shown)")
    slow = [row.rank for row in rows if row.slow]
    if slow:
        lines.append(f"mtrain: {ranks_text(slow)} slowed the job: its compute between steps is more than "
                     f"{threshold_percent():g}% above the median rank's, and the others wait for it")
    return lines


def _ms(seconds: float) -> str:
    return f"{seconds * 1000:.1f} ms"


def title_for(span: str) -> str:
    return (f"straggler report, {span} (compute: a rank's time between its steps; wait: its ops waiting "
            "for the others; last: share of steps it submitted last)")


class Progress(NamedTuple):
    """What the live ``--progress`` line shows (launcher side)."""

    steps: int              # steps done by the rank that did fewest
    steps_per_second: float  # over the last RATE_WINDOW seconds (0 until measured)
    bytes_per_second: float  # collective bytes per second of one rank, same window
    slowest: "StragglerRow | None"  # the rank with the longest median compute in that window


RATE_WINDOW = 10.0


class StepBoard:
    """The launcher's collection of every rank's steps (filled by the output reader threads)."""

    def __init__(self, ranks: int) -> None:
        self.ranks = ranks
        self._lock = threading.Lock()
        self._samples: "dict[int, deque[StepSample]]" = {}
        self._hosts: "dict[int, str]" = {}

    def add(self, rank: int, report: StepReport) -> None:
        with self._lock:
            kept = self._samples.get(rank)
            if kept is None:
                kept = self._samples[rank] = deque(maxlen=KEPT_PER_RANK)
            kept.extend(report.samples)
            self._hosts[rank] = report.host

    def steps_everywhere(self) -> int:
        """The number of steps every rank that reports has measured (0 before all ranks reported)."""
        with self._lock:
            if len(self._samples) < self.ranks:
                return 0
            return min((rows[-1].step if rows else 0) for rows in self._samples.values())

    def table(self, first_step: int = 1, last_step: "int | None" = None) -> "list[StragglerRow]":
        """The straggler table over steps [first_step, last_step] of each rank."""
        with self._lock:
            window = {rank: [s for s in rows if s.step >= first_step and (last_step is None or s.step <= last_step)]
                      for rank, rows in self._samples.items()}
            hosts = dict(self._hosts)
        return straggler_table(window, hosts)

    def measured_steps(self) -> int:
        with self._lock:
            return max((len(rows) for rows in self._samples.values()), default=0)

    def reporting_ranks(self) -> int:
        with self._lock:
            return len(self._samples)

    def progress(self) -> Progress:
        with self._lock:
            recent: "dict[int, list[StepSample]]" = {}
            rates, byte_rates = [], []
            for rank, rows in self._samples.items():
                if not rows:
                    continue
                newest = rows[-1].end
                window = [s for s in _newest(rows, newest - RATE_WINDOW)]
                recent[rank] = window
                span = newest - window[0].end if len(window) > 1 else 0.0
                if span > 0:
                    rates.append((len(window) - 1) / span)
                    byte_rates.append(sum(s.nbytes for s in window[1:]) / span)
            steps = min((rows[-1].step for rows in self._samples.values() if rows), default=0)
            hosts = dict(self._hosts)
        table = straggler_table(recent, hosts)
        slowest = max(table, key=lambda row: row.compute) if len(table) > 1 else None
        return Progress(steps, statistics.median(rates) if rates else 0.0,
                        statistics.median(byte_rates) if byte_rates else 0.0, slowest)


def _newest(rows: "deque[StepSample]", since: float) -> Iterable[StepSample]:
    """The samples that ended after ``since``, oldest first (walks back from the newest)."""
    picked = []
    for sample in reversed(rows):
        if sample.end < since:
            break
        picked.append(sample)
    picked.reverse()
    return picked
