"""The straggler table's rows, from every rank's measured steps (records.StepSample).

Both halves of mtrain compute it: ``mtrain run`` (launcher/supervise/stragglers.py: the table at exit,
``--straggler-report N`` and the ``--progress`` line) and each rank's ``straggler_stats()``
(ringreduce/api.py). So it lives in mtrain.common, on the standard library alone: the
runtime imports it without the launcher's reporting (the hang report), and the launcher without
the runtime (which starts MPI). How the rows are read: launcher/supervise/stragglers.py's docstring.
"""
from __future__ import annotations

import statistics
from typing import Mapping, NamedTuple, Sequence

from mtrain.common import settings
from mtrain.common.records.steps import StepSample

# A rank is flagged only when it is also this much slower than the median in absolute terms:
# steps of a few hundred microseconds differ by more than 20% from scheduling noise alone.
MIN_EXCESS_SECONDS = 0.002


class StragglerRow(NamedTuple):
    """One rank's line of the straggler table."""

    rank: int
    host: str
    steps: int
    compute: float      # median compute time per step, seconds
    wait: float         # median wait per step, seconds
    last_share: float   # the share of measured steps (seen by every rank) in which it submitted last
    slow: bool          # more than the threshold slower than the median rank
    ratio: float        # its median compute over the median rank's (the lower median for an even count)


def threshold_percent(environ: "Mapping[str, str] | None" = None) -> float:
    """MTRAIN_STRAGGLER_THRESHOLD_PERCENT (its default for a value that is not a number >= 0)."""
    return settings.STRAGGLER_THRESHOLD_PERCENT.read(environ)


def straggler_table(samples: Mapping[int, Sequence[StepSample]], hosts: Mapping[int, str],
                    threshold: "float | None" = None) -> "list[StragglerRow]":
    """One row per rank that measured at least one step, in rank order."""
    measured = {rank: list(rows) for rank, rows in samples.items() if rows}
    if not measured:
        return []
    threshold = threshold_percent() if threshold is None else threshold
    last = _last_counts(measured)
    aligned = max(sum(last.values()), 1)
    medians = {rank: (statistics.median(s.compute for s in rows), statistics.median(s.wait for s in rows))
               for rank, rows in measured.items()}
    # The lower median for an even count: half the ranks being slow (a throttled host of two)
    # must not pull the reference up to their own speed.
    typical = statistics.median_low(compute for compute, _ in medians.values())
    table = []
    for rank in sorted(measured):
        compute, wait = medians[rank]
        slow = (len(measured) > 1 and compute > typical * (1 + threshold / 100)
                and compute - typical > MIN_EXCESS_SECONDS)
        table.append(StragglerRow(rank, hosts.get(rank, "?"), len(measured[rank]), compute, wait,
                                  last.get(rank, 0) / aligned, slow, compute / typical if typical > 0 else 1.0))
    return table


def _last_counts(measured: Mapping[int, Sequence[StepSample]]) -> "dict[int, int]":
    """How often each rank submitted last, over the steps every rank measured (by engine cycle)."""
    by_cycle: "dict[int, dict[int, float]]" = {}
    for rank, rows in measured.items():
        for sample in rows:
            by_cycle.setdefault(sample.cycle, {})[rank] = sample.wait
    counts: "dict[int, int]" = {}
    everyone = len(measured)
    for waits in by_cycle.values():
        if len(waits) == everyone and everyone > 1:
            last = min(waits, key=lambda rank: (waits[rank], rank))
            counts[last] = counts.get(last, 0) + 1
    return counts
