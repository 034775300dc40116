"""The flight recorder's hang report on the namespace cluster: four hangs, each ended by the stall
shutdown with the diagnosis asserted, and a SIGUSR1 to `mtrain run` while the job goes on."""
from __future__ import annotations

import json
import re
import signal
from pathlib import Path

import pytest

from tests.cluster.conftest import PYTHON, assert_no_leftovers, run_mtrain, start_mtrain
from tests.launcher.report_check import assert_only_mtrain_output

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(120)]
SCRIPT = str(Path(__file__).parent / "hang_rank.py")
STALL = ("--stall-check-warning-time-seconds", "1", "--stall-check-shutdown-time-seconds", "3")
FOUR = ("-np", "4", "-H", "mtr-a:2,mtr-b:2")


def first_diagnosis(stderr: str, reason: str) -> str:
    """The diagnosis of the first report made for ``reason``."""
    table = stderr[stderr.index(f"mtrain: flight recorder ({reason}): where each rank is"):]
    return re.search(r"^mtrain: diagnosis: (.*)$", table, re.M).group(1)


def run_hang(cluster, tmp_path, token, scenario, *hosts):
    done = run_mtrain(cluster, *(hosts or FOUR), *STALL, "--output-filename", str(tmp_path / "out"), PYTHON, SCRIPT,
                      scenario, token, cwd=tmp_path, timeout=60)
    assert done.returncode == 1, done.stderr
    assert_only_mtrain_output(done.stderr)
    # The report comes before the failure report, whose lines stay last.
    assert done.stderr.index("mtrain: flight recorder (stall warning)") < done.stderr.index("mtrain: job failed")
    kept = json.loads((tmp_path / "out" / "flight-recorder-1.json").read_text())
    assert kept["reason"] == "stall warning" and kept["diagnosis"] == first_diagnosis(done.stderr, "stall warning")
    assert sorted(d["rank"] for d in kept["dumps"]) == list(range(int(hosts[1]) if hosts else 4))
    assert (tmp_path / "out" / "flight-recorder-1.json").stat().st_mode & 0o077 == 0
    assert_no_leftovers(cluster, token, within=10)
    return first_diagnosis(done.stderr, "stall warning")


def test_rank_skipping_an_op(cluster, tmp_path, token):
    assert run_hang(cluster, tmp_path, token, "skip") == (
        "ranks 0-2 wait in allreduce 'layer4.grad' (seq 2); rank 3 has not submitted it: it waits in allreduce "
        "'layer5.grad' (seq 2) instead, which ranks 0-2 have not submitted")


def test_rank_in_a_sleep_loop(cluster, tmp_path, token):
    diagnosis = run_hang(cluster, tmp_path, token, "sleep")
    assert re.fullmatch(r"ranks 0-2 wait in allreduce 'layer4.grad' \(seq 2\); rank 3 has not submitted it and has "
                        r"been in user code for \d+\.\d s at \S*hang_rank.py:\d+ in sleepy "
                        r"\(last op: allgather 'metrics', seq 1\)", diagnosis), diagnosis


def test_two_ranks_calling_different_collectives(cluster, tmp_path, token):
    assert run_hang(cluster, tmp_path, token, "different", "-np", "2", "-H", "mtr-a:1,mtr-b:1") == (
        "rank 0 waits in allreduce 'a' (seq 2); rank 1 has not submitted it: it waits in allgather 'b' (seq 2) "
        "instead, which rank 0 has not submitted")


def test_process_set_op_one_member_never_calls(cluster, tmp_path, token):
    diagnosis = run_hang(cluster, tmp_path, token, "set")
    assert re.fullmatch(r"process set 1 \(ranks 0, 2\): rank 0 waits in allreduce 'ps.grad' \(seq 1\); rank 2 has "
                        r"not submitted it and has been in user code for \d+\.\d s at \S*hang_rank.py:\d+ in sleepy "
                        r"\(last op: allgather 'metrics', seq 1\)", diagnosis), diagnosis


def test_a_failing_rank_gets_the_others_dumps_before_its_failure_report(cluster, tmp_path, token):
    done = run_mtrain(cluster, *FOUR, PYTHON, SCRIPT, "raise", token, cwd=tmp_path, timeout=60)
    assert done.returncode == 1, done.stderr
    assert_only_mtrain_output(done.stderr)
    assert done.stderr.index("mtrain: flight recorder (rank 3 failed)") < done.stderr.index("mtrain: job failed")
    assert first_diagnosis(done.stderr, "rank 3 failed") == (
        "ranks 0-2 wait in allreduce 'layer4.grad' (seq 2); rank 3 has not submitted it: its program has ended")
    assert_no_leftovers(cluster, token, within=10)


def test_sigusr1_to_mtrain_prints_the_table_and_the_job_goes_on(cluster, tmp_path, token):
    release = tmp_path / "release"
    job = start_mtrain(cluster, *FOUR, PYTHON, SCRIPT, "usr1", str(release), token, cwd=tmp_path)
    try:
        seen = job.wait_for_lines("rank ", 4, timeout=40)  # every rank's first line, in any order
        assert sorted(line.split(":", 1)[1].strip() for line in seen) == [
            "rank 0 submitted", "rank 1 submitted", "rank 2 submitted", "rank 3 sleeping"], seen
        job.proc.send_signal(signal.SIGUSR1)
        job.wait_for_stderr("mtrain: diagnosis:", timeout=20)
        release.touch()
        assert job.proc.wait(timeout=40) == 0
    finally:
        stderr = job.stop()
    assert_only_mtrain_output(stderr)
    diagnosis = first_diagnosis(stderr, "SIGUSR1 to mtrain run")
    assert diagnosis.startswith("ranks 0-2 wait in allreduce 'layer4.grad' (seq 2); rank 3 has not submitted it "
                                "and has been in user code for "), diagnosis
    for rank in range(3):
        assert f"    rank {rank} (mtr-" in stderr and "waiting in allreduce 'layer4.grad' (seq 2)" in stderr
    assert "hang_rank.py" in diagnosis and "in sleepy" in diagnosis
    assert "".join(job.stdout_parts).count("done") == 4
    assert_no_leftovers(cluster, token, within=10)
