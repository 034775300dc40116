"""Elastic training on the namespace cluster: hosts lost and added mid-training, --min-np, Ctrl-C."""
from __future__ import annotations

import json
import os
import re
import signal
import stat
import subprocess
import time
from pathlib import Path

import pytest

from tests.cluster.conftest import PYTHON, assert_no_leftovers, kill_mpi_daemons, start_mtrain
from tests.shared_places import shared_entries

pytest.importorskip("torch")
pytestmark = [pytest.mark.cluster, pytest.mark.timeout(300)]
HERE = Path(__file__).resolve().parent
EPOCHS, BATCHES = 2, 12
ALL_BATCHES = [[epoch, batch] for epoch in range(EPOCHS) for batch in range(BATCHES)]


def discovery(tmp_path: Path, hosts: str) -> Path:
    """A discovery script printing the hosts file, which the test rewrites to add or drop hosts."""
    (tmp_path / "hosts.txt").write_text(hosts)
    script = tmp_path / "discover.sh"
    script.write_text(f"#!/bin/sh\ncat {tmp_path / 'hosts.txt'}\n")
    script.chmod(0o755)
    return script


def start(cluster, tmp_path, token, *flags, pause="0.25"):
    return start_mtrain(cluster, *flags, PYTHON, str(HERE / "elastic_train.py"), str(EPOCHS), str(BATCHES),
                        pause, token, cwd=tmp_path)


def progress(job, count: int, timeout: float = 90) -> list[tuple[int, str, int]]:
    """(rank, host, pid) of the first `count` progress lines."""
    lines = job.wait_for_lines("progress", count, timeout=timeout)
    found = []
    for line in lines:
        words = line.split(">:", 1)[1].split()
        found.append((int(words[1]), words[2], int(words[5])))
    return found


def results(stdout: str) -> dict[int, dict]:
    found = {}
    for line in stdout.splitlines():
        _, _, rest = line.partition(">:")
        if rest.startswith("{"):
            data = json.loads(rest)
            found[data["rank"]] = data
    return found


def assert_trained_exactly_once(final: dict[int, dict], size: int) -> None:
    assert sorted(final) == list(range(size)), final
    for data in final.values():
        assert data["size"] == size
        # Every optimizer step of the committed history is counted once; no committed batch lost or repeated.
        assert data["steps"] == EPOCHS * BATCHES
        assert data["done"] == ALL_BATCHES
        assert data["params"] == final[0]["params"]  # identical replicas


def shared_entries_since(started: float) -> "dict[str, int]":
    """What mtrain and Open MPI made in /tmp and /dev/shm (the namespace hosts share them) since
    `started`, the test cluster's own folders aside, with everything inside: path -> mode."""
    def wanted(top: str, info: os.stat_result) -> bool:
        name = os.path.basename(top)
        return (name.startswith(("mtrain-", "ompi.", "prte", "sm_segment."))
                and not name.startswith(("mtrain-cluster-", "mtrain-netcluster")) and info.st_ctime >= started)
    return shared_entries(wanted)


def reachable(path: str, modes: "dict[str, int]") -> bool:
    """Whether other users may use `path`: it is open to them, and no folder above it (below
    /tmp or /dev/shm) is closed to them (Open MPI opens its own folders inside ours)."""
    if not modes[path] & 0o077:
        return False
    parent = os.path.dirname(path)
    while parent in modes:
        if not modes[parent] & 0o077:
            return False
        parent = os.path.dirname(parent)
    return True


def test_losing_a_host_mid_training_finishes_at_the_smaller_size(cluster, tmp_path, token):
    script = discovery(tmp_path, "mtr-a:2\nmtr-b:2\n")
    started = time.time()
    job = start(cluster, tmp_path, token, "-np", "4", "--min-np", "2", "--host-discovery-script", str(script))
    try:
        seen = progress(job, 4 * 5)
        # While it runs on both hosts: every file and folder the job has in a shared place is
        # closed to other users (mtrain's: the job's layout, snapshots, scratch; Open MPI's too).
        made = shared_entries_since(started)
        job_id = next((os.path.basename(p)[len("mtrain-elastic-"):] for p in made
                       if os.path.basename(p).startswith("mtrain-elastic-")), None)
        assert job_id and f"/tmp/mtrain-job-{job_id}/mtr-b.g1.json" in made, sorted(made)  # generation 1's
        assert f"/dev/shm/mtrain-elastic-{job_id}/mtr-b/state.snapshot" in made, sorted(made)
        # Open MPI's shared-memory segments are in the job's folder, not loose in /dev/shm.
        assert any(p.startswith(f"/dev/shm/mtrain-job-{job_id}/mtr-b.g1/") for p in made), sorted(made)
        assert not [p for p in made if os.path.dirname(p) == "/dev/shm" and "sm_segment" in p], sorted(made)
        open_to_others = [f"{stat.filemode(mode)} {p}" for p, mode in sorted(made.items()) if reachable(p, made)]
        assert not open_to_others, "\n".join(open_to_others)
        victims = {pid for rank, host, pid in seen if host == "mtr-b"}
        assert len(victims) == 2, seen
        for pid in victims:  # every rank on mtr-b dies at once, as when the host goes
            os.kill(pid, signal.SIGKILL)
        job.proc.wait(timeout=200)
    finally:
        err = job.stop()
    out = "".join(job.stdout_parts)
    assert job.proc.returncode == 0, err
    line = re.search(r"mtrain: elastic reset 1: host mtr-b failed \(rank [23] on mtr-b: killed by SIGKILL\); "
                     r"now 2 ranks on mtr-a:2; resumed from commit (\d+) ([\d.]+) s after the failure", err)
    assert line, err
    assert_trained_exactly_once(results(out), 2)
    assert_no_leftovers(cluster, token, within=10)
    assert not [p for p in shared_entries_since(started) if job_id in p]  # nothing of the job's is left


def test_losing_a_hosts_mpi_daemon_mid_training_finishes_at_the_smaller_size(cluster, tmp_path, token):
    # Open MPI's launcher exits 0 when it loses a remote daemon, and the ranks there die without a
    # word: the driver counts their host as lost, as it does a host whose link dies.
    script = discovery(tmp_path, "mtr-a:2\nmtr-b:2\n")
    job = start(cluster, tmp_path, token, "-np", "4", "--min-np", "2", "--host-discovery-script", str(script))
    try:
        progress(job, 4 * 5)
        kill_mpi_daemons(cluster, "mtr-b")
        job.proc.wait(timeout=200)
    finally:
        err = job.stop()
    assert job.proc.returncode == 0, err
    assert re.search(r"mtrain: elastic reset 1: host mtr-b lost; now 2 ranks on mtr-a:2", err), err
    assert_trained_exactly_once(results("".join(job.stdout_parts)), 2)
    assert_no_leftovers(cluster, token, within=10)


def test_a_host_added_by_the_discovery_script_joins(cluster, tmp_path, token):
    script = discovery(tmp_path, "mtr-a:2\n")
    job = start(cluster, tmp_path, token, "-np", "2", "--min-np", "2", "--max-np", "4",
                "--host-discovery-script", str(script))
    try:
        progress(job, 2 * 3)
        (tmp_path / "hosts.txt").write_text("mtr-a:2\nmtr-b:2\n")
        job.proc.wait(timeout=200)
    finally:
        err = job.stop()
    out = "".join(job.stdout_parts)
    assert job.proc.returncode == 0, err
    assert re.search(r"mtrain: elastic reset 1: host set changed \(mtr-b added\); now 4 ranks on mtr-a:2, mtr-b:2; "
                     r"resumed from commit \d+ [\d.]+ s after the change", err), err
    final = results(out)
    assert_trained_exactly_once(final, 4)
    assert {data["host"] for data in final.values()} == {"mtr-a", "mtr-b"}
    assert_no_leftovers(cluster, token, within=10)


def test_below_min_np_ends_with_a_clear_error_within_the_timeout(cluster, tmp_path, token):
    script = discovery(tmp_path, "mtr-a:2\nmtr-b:2\n")
    job = start(cluster, tmp_path, token, "-np", "4", "--min-np", "4", "--elastic-timeout", "4",
                "--host-discovery-script", str(script))
    try:
        seen = progress(job, 4 * 2)
        for pid in {pid for rank, host, pid in seen if host == "mtr-b"}:
            os.kill(pid, signal.SIGKILL)
        killed = time.monotonic()
        job.proc.wait(timeout=60)
        elapsed = time.monotonic() - killed
    finally:
        err = job.stop()
    assert job.proc.returncode == 1, err
    assert "mtrain: elastic: below --min-np 4 for --elastic-timeout 4 s (2 slots on mtr-a:2; blacklisted: mtr-b)" in err
    assert elapsed < 4 + 20, elapsed
    assert_no_leftovers(cluster, token, within=10)


def test_discovery_script_failing_or_printing_garbage_does_not_kill_the_job(cluster, tmp_path, token):
    script = discovery(tmp_path, "mtr-a:2\n")
    job = start(cluster, tmp_path, token, "-np", "2", "--host-discovery-script", str(script), pause="0.1")
    try:
        progress(job, 2)
        (tmp_path / "hosts.txt").write_text("mtr-a:2\nthis is not a host line\n")
        job.wait_for_stderr("printed garbage", timeout=30)
        job.proc.wait(timeout=120)
    finally:
        err = job.stop()
    assert job.proc.returncode == 0, err
    assert "mtrain: warning: --host-discovery-script" in err and "the job goes on with its hosts" in err
    assert_trained_exactly_once(results("".join(job.stdout_parts)), 2)


def test_ctrl_c_during_a_reset_leaves_nothing(cluster, tmp_path, token):
    script = discovery(tmp_path, "mtr-a:2\nmtr-b:2\n")
    job = start(cluster, tmp_path, token, "-np", "4", "--min-np", "4", "--elastic-timeout", "60",
                "--host-discovery-script", str(script), "--verbose")
    try:
        seen = progress(job, 4 * 2)
        for pid in {pid for rank, host, pid in seen if host == "mtr-b"}:
            os.kill(pid, signal.SIGKILL)
        # The generation has ended; the driver now waits for enough hosts.
        job.wait_for_stderr("all processes of the job have ended", timeout=60)
        sent = time.monotonic()
        job.proc.send_signal(signal.SIGINT)
        # Measured: about 1-1.5 s, also with ten busy loops beside the job on the 2-core VM; the
        # longest part is removing the snapshots over SSH, which mtrain bounds at 10 s in all
        # (elastic.CLEANUP_TIMEOUT twice). The rest of the 30 s is for a CI machine that runs
        # several times slower than that (one such run failed at the 20 s this test had before).
        try:
            job.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            pytest.fail(f"mtrain had not ended 30 s after SIGINT; its stderr:\n{job.stop()}")
        print(f"mtrain ended {time.monotonic() - sent:.2f} s after SIGINT")
    finally:
        err = job.stop()
    assert job.proc.returncode == 130, err
    assert_no_leftovers(cluster, token, within=10)
