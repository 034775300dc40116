"""straggler_stats(): every rank's steps, measured by the engine, in the program (real mpirun)."""
from __future__ import annotations

import os
import time

import numpy as np

import mtrain.ringreduce as rr
from tests.mpi.harness import mpi_test

STEPS = 25


def _train(slow_rank: int, extra: float) -> None:
    """Steps of three named all-reduces (odd sizes, one empty), ``slow_rank`` sleeping ``extra`` in each."""
    me = rr.rank()
    grads = [np.arange(n, dtype=np.float32) + me for n in (1001, 0, 37)]
    for _ in range(STEPS):
        if me == slow_rank:
            time.sleep(extra)
        handles = [rr.allreduce_async(g, name=f"grad.{i}", op=rr.Sum) for i, g in enumerate(grads)]
        for handle in handles:
            rr.synchronize(handle)


@mpi_test(nps=(1, 2, 3))
def test_straggler_stats_names_the_slow_rank_on_every_rank():
    n, me = rr.size(), rr.rank()
    slow = n - 1
    _train(slow, 0.03 if n > 1 else 0.0)
    rows = rr.straggler_stats()
    assert [row.rank for row in rows] == list(range(n)), rows
    # The first step has no compute to measure (it began at start-up): the rest are measured.
    assert all(STEPS - 1 <= row.steps <= STEPS for row in rows), rows
    assert all(row.host == os.uname().nodename for row in rows), rows
    nbytes = (1001 + 37) * 4
    assert rows[me].compute >= 0 and rows[me].wait >= 0
    if n == 1:
        assert not rows[0].slow and rows[0].last_share == 0.0
        return
    assert [row.slow for row in rows] == [r == slow for r in range(n)], rows
    assert rows[slow].compute > 0.025 and rows[slow].ratio > 5, rows
    assert rows[slow].last_share > 0.8, rows
    for row in rows[:slow]:
        assert row.wait > 0.02, rows  # the others waited for the slow rank's submissions
    # Every rank got the same table.
    everyone = rr.allgather_object([tuple(row) for row in rows], name="tables")
    assert all(table == everyone[0] for table in everyone)
    meter = rr.runtime.current().engine.steps
    assert all(sample.nbytes == nbytes for sample in meter.recent()[:-2]), [s.nbytes for s in meter.recent()]


@mpi_test(nps=(2,), env={"MTRAIN_STRAGGLER_REPORT_DISABLE": "1"})
def test_no_steps_are_measured_when_the_report_is_off():
    _train(1, 0.0)
    assert rr.runtime.current().engine.steps is None
    assert rr.straggler_stats() == []


@mpi_test(nps=(2, 3))
def test_steps_beside_a_joined_rank_measure_only_what_was_submitted():
    # Rank 0 joins at once; the others go on, and rank 0's engine runs its stand-ins for their ops
    # (never submitted on rank 0): they must not count as ops that waited since the clock's origin.
    me = rr.rank()
    if me != 0:
        _train(-1, 0.0)
    assert rr.join() >= 0
    rows = rr.straggler_stats()
    assert [row.rank for row in rows] == list(range(rr.size())), rows
    for row in rows:
        assert row.wait < 5 and row.compute < 5, rows
    meter = rr.runtime.current().engine.steps
    assert all(sample.wait < 5 for sample in meter.recent()), meter.recent()
