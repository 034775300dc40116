"""The straggler report on the namespace cluster: the slow rank, or the throttled host's rank, is
named by the table mtrain run prints, by the table every N steps, and by straggler_stats(); no
other rank is. --progress prints its plain line when stderr is not a terminal."""
from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest

from tests.cluster.conftest import PYTHON, assert_no_leftovers, run_mtrain
from tests.launcher.report_check import assert_only_mtrain_output

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(180)]
RANK = str(Path(__file__).parent / "straggler_rank.py")
_ROW = re.compile(r"^mtrain:\s+(\d+)\s+(\S+)\s+(\d+)\s+([\d.]+) ms\s+([\d.]+) ms\s+(\d+)%(.*)$")


def tables(stderr: str) -> "list[dict[int, tuple]]":
    """Each straggler table mtrain printed: rank -> (host, steps, compute ms, wait ms, last %, flagged)."""
    found: "list[dict[int, tuple]]" = []
    for line in stderr.splitlines():
        if line.startswith("mtrain: straggler report"):
            found.append({})
        match = _ROW.match(line)
        if match and found:
            rank, host, steps, compute, wait, last, rest = match.groups()
            found[-1][int(rank)] = (host, int(steps), float(compute), float(wait), int(last), "slow" in rest)
    return found


def flagged(table: "dict[int, tuple]") -> "list[int]":
    return sorted(rank for rank, row in table.items() if row[5])


def program_stats(stdout: str) -> "list[dict]":
    lines = [line.split(":", 1)[1] for line in stdout.splitlines() if line.startswith("[0]<stdout>:{")]
    assert len(lines) == 1, stdout
    return json.loads(lines[0])["stats"]


def test_a_sleeping_rank_is_named_and_no_other(cluster, tmp_path, token):
    done = run_mtrain(cluster, "-np", "4", "-H", "mtr-a:2,mtr-b:2", "--straggler-report", "20", "--progress",
                      "--progress-interval", "0.5", PYTHON, RANK, "sleep", "3", "80", token, cwd=tmp_path,
                      timeout=120)
    assert done.returncode == 0, done.stderr
    assert_only_mtrain_output(done.stderr)
    found = tables(done.stderr)
    # Every 20 steps while it ran (steps are numbered from 2: the first has no compute to measure),
    # then the whole job's at exit.
    assert len(found) >= 4, done.stderr
    assert "steps 1-20" in done.stderr and "steps 61-80" in done.stderr, done.stderr
    assert "straggler report, the whole job" in done.stderr
    for table in found:
        assert sorted(table) == [0, 1, 2, 3], done.stderr
        assert flagged(table) == [3], done.stderr
    whole = found[-1]
    assert [whole[r][0] for r in range(4)] == ["mtr-a", "mtr-a", "mtr-b", "mtr-b"]
    assert all(row[1] >= 79 for row in whole.values()), whole
    assert whole[3][2] > 30 and whole[3][4] >= 80, whole  # ~45 ms of compute; last in (almost) every step
    assert all(whole[r][3] > 30 for r in range(3)), whole  # the others waited for it
    assert "mtrain: rank 3 slowed the job" in done.stderr
    # The program's own view agrees.
    stats = program_stats(done.stdout)
    assert [row["rank"] for row in stats] == [0, 1, 2, 3]
    assert [row["slow"] for row in stats] == [False, False, False, True], stats
    assert [row["host"] for row in stats] == ["mtr-a", "mtr-a", "mtr-b", "mtr-b"]
    # --progress, not on a terminal: plain lines, with the steps once the ranks have sent some.
    progress = [line for line in done.stderr.splitlines() if line.startswith("mtrain: progress: ")]
    assert progress, done.stderr
    stepping = [line for line in progress if " · step " in line]
    assert any("ranks 4/4 up" in line for line in stepping), progress  # (ranks that ended are no longer up)
    assert any("slowest rank 3 (mtr-b" in line for line in stepping), progress
    assert_no_leftovers(cluster, token, within=10)


def test_a_host_throttled_onto_a_busy_core_is_named(cluster, tmp_path, token):
    # mtr-b's rank shares core 1 with three busy loops; mtr-a's rank has core 0. Each loop is a
    # session of its own: the kernel shares a core fairly between sessions (autogroups), not
    # processes, so three loops in one session would take no more of it than one. Three take
    # about 3/4 of core 1: mtr-b's rank computes several times as long, a margin that whatever
    # else runs on core 0 of a busy machine (the launcher, sshd, the test itself) does not eat.
    hogs = [subprocess.Popen(["taskset", "-c", "1", PYTHON, "-c", f"# {token}\nwhile True:\n    pass"],
                             start_new_session=True) for _ in range(3)]
    try:
        done = run_mtrain(cluster, "-np", "2", "-H", "mtr-a:1,mtr-b:1", PYTHON, RANK, "cpu", "mtr-b", "1", "40",
                          token, cwd=tmp_path, timeout=120)
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait()
    assert done.returncode == 0, done.stderr
    whole = tables(done.stderr)[-1]
    assert flagged(whole) == [1], done.stderr
    assert whole[1][0] == "mtr-b" and whole[1][2] > 1.2 * whole[0][2], whole
    assert whole[1][4] > whole[0][4], whole  # last more often
    stats = program_stats(done.stdout)
    assert [row["slow"] for row in stats] == [False, True], stats
    assert_no_leftovers(cluster, token, within=10)
