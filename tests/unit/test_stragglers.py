"""The straggler table and the progress line, from synthetic step samples (no MPI)."""
from __future__ import annotations

import io

from mtrain.launcher.supervise.progress import ProgressDisplay, describe
from mtrain.common.records.steps import STEP_MARKER, StepReport, StepSample
from mtrain.common.straggler_rows import MIN_EXCESS_SECONDS, straggler_table
from mtrain.launcher.supervise.stragglers import ROWS_SHOWN, StepBoard, format_table, title_for


def samples(rank: int, computes: "list[float]", slow: "set[int]" = frozenset(), waits: "list[float] | None" = None,
            start_cycle: int = 10, nbytes: int = 4096) -> "list[StepSample]":
    """One sample per step; a rank in ``slow`` waits little (it came last), the others long."""
    rows = []
    for i, compute in enumerate(computes):
        wait = waits[i] if waits is not None else (0.0001 * (rank + 1) if rank in slow else 0.02 + 0.001 * rank)
        rows.append(StepSample(i + 2, start_cycle + 3 * i, 100.0 + 0.05 * i, compute, wait, nbytes))
    return rows


def test_the_slow_rank_alone_is_flagged_and_was_last_in_every_step():
    table = {rank: samples(rank, [0.005 + 0.0001 * rank + 0.00001 * i for i in range(21)], slow={2})
             for rank in (0, 1, 3)}
    table[2] = samples(2, [0.035 + 0.00001 * i for i in range(21)], slow={2})
    rows = straggler_table(table, {0: "a", 1: "a", 2: "b", 3: "b"}, threshold=20)
    assert [row.rank for row in rows] == [0, 1, 2, 3]
    assert [row.slow for row in rows] == [False, False, True, False]
    assert [row.last_share for row in rows] == [0.0, 0.0, 1.0, 0.0]
    assert rows[2].host == "b" and rows[2].steps == 21
    assert abs(rows[2].compute - 0.0351) < 1e-9
    assert 6 < rows[2].ratio < 7


def test_steps_not_seen_by_every_rank_do_not_count_for_last():
    a = samples(0, [0.01] * 4, waits=[0.001, 0.002, 0.003, 0.004])
    b = samples(1, [0.01] * 4, waits=[0.002, 0.001, 0.004, 0.003])
    b[3] = b[3].replace(cycle=999)  # rank 1 ended its 4th step in another cycle: not comparable
    rows = straggler_table({0: a, 1: b}, {}, threshold=20)
    assert [round(row.last_share * 3) for row in rows] == [2, 1]
    assert rows[0].host == "?"


def test_no_flag_for_one_rank_nor_for_noise_below_the_absolute_floor():
    alone = straggler_table({0: samples(0, [0.5, 0.7, 0.9])}, {0: "h"})
    assert len(alone) == 1 and not alone[0].slow and alone[0].last_share == 0.0
    # 3x the median, but only by a millisecond: scheduling noise on tiny steps, not a straggler.
    tiny = {0: samples(0, [0.0004] * 5), 1: samples(1, [0.0004] * 5), 2: samples(2, [0.0004 + MIN_EXCESS_SECONDS / 2] * 5)}
    assert not any(row.slow for row in straggler_table(tiny, {}, threshold=20))
    # A higher threshold keeps a rank 30% slower unflagged; the default flags it.
    mild = {0: samples(0, [0.1] * 5), 1: samples(1, [0.1] * 5), 2: samples(2, [0.13] * 5)}
    assert [row.slow for row in straggler_table(mild, {}, threshold=20)] == [False, False, True]
    assert not any(row.slow for row in straggler_table(mild, {}, threshold=50))
    assert straggler_table({0: [], 1: []}, {}) == []
    # A host of two slow ranks out of four: the lower median keeps the reference at the fast ones.
    host = {r: samples(r, [0.1 if r in (0, 2) else 0.2] * 5) for r in range(4)}
    rows = straggler_table(host, {}, threshold=20)
    assert [row.slow for row in rows] == [False, True, False, True]
    assert format_table(rows, title_for("x"))[-1].startswith("mtrain: ranks 1 and 3 slowed the job")


def test_table_lines_are_mtrain_lines_and_large_jobs_show_the_flagged_ranks():
    table = {rank: samples(rank, [0.01 + 0.0001 * rank] * 3) for rank in range(ROWS_SHOWN + 8)}
    table[17] = samples(17, [0.2] * 3, slow={17})
    lines = format_table(straggler_table(table, {r: f"node{r // 4}" for r in table}, threshold=20),
                         title_for("the whole job"))
    assert all(line.startswith("mtrain: ") for line in lines)
    shown = [line for line in lines if "node" in line]
    assert len(shown) == 6  # the 3 fastest and the 3 slowest (the flagged 17 is one of them)
    assert any(line.split()[1] == "17" and "slow" in line for line in shown)
    assert "more ranks within the usual range are not shown" in lines[-2]
    assert lines[-1] == ("mtrain: rank 17 slowed the job: its compute between steps is more than 20% above the "
                         "median rank's, and the others wait for it")


def test_step_report_round_trip_and_bad_payloads():
    report = StepReport("host-1", tuple(samples(0, [0.0123456789, 0.5])))
    line = report.encode()
    assert line.startswith(STEP_MARKER) and line.endswith(b"\n") and b"\n" not in line[:-1]
    back = StepReport.decode(line[len(STEP_MARKER):])
    assert back.host == "host-1" and len(back.samples) == 2
    assert back.samples[0].compute == 0.012346 and back.samples[1].step == 3
    for bad in (b"", b"{", b'{"host": "h"}', b'{"host": "h", "samples": [[1, 2]]}', b"[]"):
        assert StepReport.decode(bad) is None


def test_board_windows_and_progress():
    board = StepBoard(2)
    board.add(0, StepReport("a", tuple(samples(0, [0.01] * 30, nbytes=1_000_000))))
    assert board.steps_everywhere() == 0  # rank 1 has not reported: no step is done everywhere
    board.add(1, StepReport("b", tuple(samples(1, [0.03] * 25, slow={1}, nbytes=1_000_000))))
    assert board.steps_everywhere() == 26  # steps are numbered from 2 (the first has no compute)
    window = board.table(10, 19)
    assert [row.steps for row in window] == [10, 10]
    progress = board.progress()
    assert progress.steps == 26
    assert abs(progress.steps_per_second - 20.0) < 1e-6  # a step every 50 ms
    assert abs(progress.bytes_per_second - 20e6) < 1
    assert progress.slowest.rank == 1
    text = describe(progress, 2, 2)
    assert text.startswith("ranks 2/2 up · step 26 · 20.0 steps/s over 10 s · 20.0 MB/s reduced per rank")
    assert "slowest rank 1 (b, 30.0 ms compute" in text
    assert describe(StepBoard(3).progress(), 1, 3) == "ranks 1/3 up · no step measured yet"


def test_plain_progress_lines_when_not_a_terminal():
    said: "list[str]" = []
    display = ProgressDisplay(lambda: "ranks 1/2 up", 0.1, said.append, stream=io.StringIO())
    assert not display.live
    display.start()
    try:
        import time
        deadline = time.monotonic() + 10
        while len(said) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        display.stop()
    assert said[:2] == ["mtrain: progress: ranks 1/2 up"] * 2
    assert not display.write(b"[0]<stdout>:x\n")  # no live line: the caller writes it
