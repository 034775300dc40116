"""Real multi-host runs of `mtrain run` through the namespace cluster (see conftest.py)."""
from __future__ import annotations

import glob
import json
import os
import shutil
import signal
import time
from pathlib import Path

import pytest

from tests.cluster.conftest import PYTHON, assert_no_leftovers, kill_mpi_daemons, run_mtrain, start_mtrain
from tests.launcher.report_check import assert_only_mtrain_output

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(180)]
HERE = Path(__file__).resolve().parent
TRICKY = ["a b", "$HOME", "*", ";", "'single'", '"double"', "x=$(id)", "tab\there", "", "ünï"]


def ranks_json(stdout: str) -> dict[int, dict]:
    out = {}
    for line in stdout.splitlines():
        prefix, _, rest = line.partition(">:")
        if rest.startswith("{"):
            data = json.loads(rest)
            assert prefix == f"[{data['rank']}]<stdout", line
            out[data["rank"]] = data
    return out


def test_four_ranks_on_two_hosts_topology_allreduce_and_arguments(cluster, tmp_path):
    done = run_mtrain(cluster, "-np", "4", "-H", "mtr-a:2,mtr-b:2", PYTHON, str(HERE / "rank_probe.py"),
                      *TRICKY, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    ranks = ranks_json(done.stdout)
    assert sorted(ranks) == [0, 1, 2, 3], done.stdout
    for rank, data in ranks.items():
        assert data["size"] == 4 and data["sum_ok"] and data["max"] == [3.0] * 3
        assert data["host"] == ("mtr-a" if rank < 2 else "mtr-b")
        assert (data["local_rank"], data["local_size"]) == (rank % 2, 2)
        assert (data["cross_rank"], data["cross_size"]) == (rank // 2, 2)
        assert data["argv"] == TRICKY  # exactly as typed, on remote hosts too


def test_uneven_plan_with_explicit_interface_and_env(cluster, tmp_path):
    code = ("import os,socket,sys; print(os.environ['OMPI_COMM_WORLD_RANK'], socket.gethostname(), "
            "os.environ.get('MTR_VALUE'), os.environ.get('MTRAIN_SEEN'), os.getcwd()==sys.argv[1])")
    env_home = None
    done = run_mtrain(cluster, "-np", "3", "-H", "mtr-a:1,mtr-b:4", "--network-interface", "10.77.0.0/24",
                      "-x", "MTR_VALUE=a b $c", PYTHON, "-c", code, str(tmp_path), cwd=tmp_path, home=env_home)
    assert done.returncode == 0, done.stderr
    lines = sorted(line.split(">:", 1)[1] for line in done.stdout.splitlines())
    assert lines == ["0 mtr-a a b $c None True", "1 mtr-b a b $c None True", "2 mtr-b a b $c None True"]


def test_output_dir_written_per_rank(cluster, tmp_path):
    code = "import os,sys; r=os.environ['OMPI_COMM_WORLD_RANK']; print('out', r); print('err', r, file=sys.stderr)"
    done = run_mtrain(cluster, "-H", "mtr-a:1,mtr-b:1", "--output-dir", str(tmp_path / "logs"),
                      PYTHON, "-c", code, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    for rank in (0, 1):
        assert (tmp_path / "logs" / f"rank.{rank}" / "stdout").read_text() == f"out {rank}\n"
        assert (tmp_path / "logs" / f"rank.{rank}" / "stderr").read_text() == f"err {rank}\n"


def _home_copy(cluster, tmp_path: Path) -> Path:
    home = tmp_path / "home"
    shutil.copytree(cluster.home, home)
    return home


def test_unknown_host_key_refused_then_accepted_on_request(cluster, tmp_path):
    home = _home_copy(cluster, tmp_path)
    known = home / ".ssh" / "known_hosts"
    known.write_text("\n".join(l for l in known.read_text().splitlines() if not l.startswith("10.77.0.12 ")) + "\n")
    marker = tmp_path / "ran"
    done = run_mtrain(cluster, "-H", "mtr-a:1,mtr-b:1", "touch", str(marker), home=home)
    assert done.returncode == 1, done.stderr
    assert "host mtr-b: unknown host key" in done.stderr and "ssh-keyscan" in done.stderr
    assert "--ssh-accept-new-hosts" in done.stderr and "Traceback" not in done.stderr
    assert_only_mtrain_output(done.stderr)
    assert "mtr-a" not in done.stderr.replace("nothing was started", "")
    assert not marker.exists()  # nothing started anywhere
    done = run_mtrain(cluster, "--ssh-accept-new-hosts", "-H", "mtr-a:1,mtr-b:1", "touch", str(marker), home=home)
    assert done.returncode == 0, done.stderr
    assert marker.exists() and "10.77.0.12 ssh-ed25519" in known.read_text()


def test_changed_host_key_refused_even_with_accept_new(cluster, tmp_path):
    home = _home_copy(cluster, tmp_path)
    known = home / ".ssh" / "known_hosts"
    other_key = (cluster.known_hosts.read_text().splitlines()[1]).split(" ", 1)[1]
    lines = [("10.77.0.11 " + other_key) if l.startswith("10.77.0.11 ") else l for l in known.read_text().splitlines()]
    known.write_text("\n".join(lines) + "\n")
    done = run_mtrain(cluster, "--ssh-accept-new-hosts", "-H", "mtr-a:1,mtr-b:1", "true", home=home)
    assert done.returncode == 1
    assert "host mtr-a: host key CHANGED" in done.stderr and "ssh-keygen -R 10.77.0.11" in done.stderr
    assert_only_mtrain_output(done.stderr)


def test_all_failing_hosts_reported_together(cluster, tmp_path):
    home = _home_copy(cluster, tmp_path)
    config = home / ".ssh" / "config"
    # mtr-dead: a port nobody listens on (our own address); mtr-nokey: a key sshd does not accept.
    wrong_key = tmp_path / "wrong_key"
    os.system(f"ssh-keygen -q -t ed25519 -N '' -f {wrong_key}")
    config.write_text(config.read_text() + "\nHost mtr-dead\n    HostName 10.77.0.11\n    Port 2\n"
                      f"\nHost mtr-nokey\n    HostName 10.77.0.12\n    User root\n    IdentitiesOnly yes\n"
                      f"    IdentityFile {wrong_key}\n")
    done = run_mtrain(cluster, "-H", "mtr-a:1,mtr-dead:1,mtr-nokey:1", "true", home=home)
    assert done.returncode == 1, done.stderr
    lines = done.stderr.strip().splitlines()
    assert any(l.startswith("mtrain: host mtr-dead: cannot reach 10.77.0.11:2") for l in lines), lines
    assert any(l.startswith("mtrain: host mtr-nokey: authentication as root refused") for l in lines), lines
    assert not any("mtr-a" in l for l in lines) and "Traceback" not in done.stderr
    assert lines[-1] == "mtrain: preflight failed on 2 hosts; nothing was started"
    assert_only_mtrain_output(done.stderr)


def test_wrong_identity_file_flag(cluster, tmp_path):
    wrong_key = tmp_path / "k"
    os.system(f"ssh-keygen -q -t ed25519 -N '' -f {wrong_key}")
    before = set(glob.glob("/tmp/ompi.*"))
    done = run_mtrain(cluster, "-i", str(wrong_key), "-H", "mtr-a:1", "true")
    assert done.returncode == 1 and f"tried {wrong_key}" in done.stderr
    assert_only_mtrain_output(done.stderr)
    # mpirun, killed once the preflight failed, cannot remove its folder (named after its pid
    # alone: a later mpirun with that pid would not start), so it makes it in the launch's own.
    assert not set(glob.glob("/tmp/ompi.*")) - before


def test_rank_exit_stops_every_rank_and_reports_it_first(cluster, tmp_path, token):
    started = time.monotonic()
    done = run_mtrain(cluster, "-np", "4", "-H", "mtr-a:2,mtr-b:2", PYTHON, str(HERE / "fault_rank.py"),
                      "exit", token, cwd=tmp_path, timeout=60)
    assert done.returncode == 7, done.stderr
    assert "mtrain: job failed; first failure: rank 2 on mtr-b: exit code 7" in done.stderr
    assert "rank 2 giving up: simulated failure" in done.stderr.split("first failure")[1]
    assert time.monotonic() - started < 40
    assert_only_mtrain_output(done.stderr)
    assert_no_leftovers(cluster, token, within=10)


def test_uncaught_exception_is_the_reported_root_cause(cluster, tmp_path, token):
    done = run_mtrain(cluster, "-np", "4", "-H", "mtr-a:2,mtr-b:2", PYTHON, str(HERE / "fault_rank.py"),
                      "raise", token, cwd=tmp_path, timeout=60)
    assert done.returncode != 0, done.stderr
    assert "first failure: rank 2 on mtr-b" in done.stderr
    assert "RuntimeError: simulated failure in rank 2" in done.stderr.split("first failure")[1]
    # The report names the line that raised, on the other host (the job ran from another folder).
    script = HERE / "fault_rank.py"
    line = script.read_text().splitlines().index('    raise RuntimeError("simulated failure in rank 2")') + 1
    first = next(text for text in done.stderr.splitlines() if "first failure" in text)
    assert first.endswith(f") at {script}:{line} in <module>"), first
    assert_only_mtrain_output(done.stderr)
    assert_no_leftovers(cluster, token, within=10)


def test_sigkill_of_a_rank(cluster, tmp_path, token):
    job = start_mtrain(cluster, "-np", "4", "-H", "mtr-a:2,mtr-b:2", PYTHON, str(HERE / "fault_rank.py"),
                        "loop", token, cwd=tmp_path)
    try:
        ready = job.wait_for_lines("ready", 4, timeout=60)
        victim = next(l for l in ready if " ready 3 " in l.replace(">:", " "))
        os.kill(int(victim.split()[-1]), signal.SIGKILL)
        killed_at = time.monotonic()
        job.proc.wait(timeout=30)
    finally:
        err = job.stop()
    assert job.proc.returncode == 128 + 9, err
    assert "first failure: rank 3 on mtr-b: killed by SIGKILL" in err
    assert time.monotonic() - killed_at < 15
    assert_only_mtrain_output(err)
    assert_no_leftovers(cluster, token, within=10)


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_interrupt_ends_everything_on_every_host(cluster, tmp_path, token, sig):
    job = start_mtrain(cluster, "-np", "4", "-H", "mtr-a:2,mtr-b:2", PYTHON, str(HERE / "fault_rank.py"),
                        "loop", token, cwd=tmp_path)
    try:
        job.wait_for_lines("ready", 4, timeout=60)
        job.proc.send_signal(sig)
        sent = time.monotonic()
        job.proc.wait(timeout=15)
    finally:
        err = job.stop()
    assert job.proc.returncode == 128 + sig, err
    assert time.monotonic() - sent < 10
    assert f"{signal.Signals(sig).name} received" in err
    assert_only_mtrain_output(err)
    assert_no_leftovers(cluster, token, within=10)


def test_cut_link_ends_the_job_naming_the_host(cluster, tmp_path, token):
    job = start_mtrain(cluster, "-np", "4", "-H", "mtr-a:2,mtr-b:2", PYTHON, str(HERE / "fault_rank.py"),
                        "loop", token, cwd=tmp_path)
    try:
        job.wait_for_lines("ready", 4, timeout=60)
        cluster.cut_link("mtr-b")
        cut = time.monotonic()
        job.proc.wait(timeout=40)
        elapsed = time.monotonic() - cut
        # The cut host's own guard notices the silence and cleans up there too.
        assert_no_leftovers(cluster, token, within=20)
    finally:
        err = job.stop()
        cluster.restore_link("mtr-b")
    assert job.proc.returncode == 255, err
    assert "host mtr-b: lost the SSH connection" in err
    assert elapsed < 30
    assert_only_mtrain_output(err)


def test_a_hosts_mpi_daemon_killed_is_no_success(cluster, tmp_path, token):
    # Open MPI 5's launcher exits 0 after it loses a remote daemon; the ranks there never finished.
    # The remote guard tells the launcher which host's daemon died: a host lost.
    shared_memory = set(os.listdir("/dev/shm"))
    job = start_mtrain(cluster, "-np", "4", "-H", "mtr-a:2,mtr-b:2", PYTHON, str(HERE / "fault_rank.py"),
                        "loop", token, cwd=tmp_path)
    try:
        job.wait_for_lines("ready", 4, timeout=60)
        kill_mpi_daemons(cluster, "mtr-b")
        job.proc.wait(timeout=30)
    finally:
        err = job.stop()
        # The ranks' Open MPI segments there outlive them: their daemon was to remove them.
        for name in set(os.listdir("/dev/shm")) - shared_memory:
            if name.startswith("sm_segment.mtr-b."):
                os.unlink(f"/dev/shm/{name}")
    assert job.proc.returncode == 255, err
    assert "mtrain: host mtr-b: the MPI daemon there died (killed by SIGKILL); the job was stopped" in err, err
    assert_no_leftovers(cluster, token, within=10)


def test_launcher_host_plus_remote_hosts_from_a_hostfile(cluster, tmp_path):
    hostfile = tmp_path / "hosts"
    hostfile.write_text("# this machine, then two namespace hosts\nlocalhost slots=1\n\nmtr-a slots=2\nmtr-b slots=2\n")
    code = ("import socket; from mpi4py import MPI; c=MPI.COMM_WORLD; "
            "print(c.rank, socket.gethostname() == 'mtr-a', socket.gethostname() == 'mtr-b', c.allreduce(c.rank))")
    done = run_mtrain(cluster, "--hostfile", str(hostfile), "-np", "4", PYTHON, "-c", code, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    lines = sorted(line.split(">:", 1)[1] for line in done.stdout.splitlines())
    assert lines == ["0 False False 6", "1 True False 6", "2 True False 6", "3 False True 6"]


def test_hostile_launcher_bindings_ringreduce_packages_in_the_working_directory(cluster, tmp_path):
    # The agent, the remote guard, the preflight probe and the rank wrapper all start as
    # `python -m mtrain.…`: a user's own packages of these common names change nothing.
    for name in ("launcher", "bindings", "ringreduce"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "__init__.py").write_text(f"raise ImportError('the user\\'s own {name} was imported')\n")
    code = ("import socket, numpy as np, mtrain.ringreduce as rr; rr.init(); "
            "print(socket.gethostname(), rr.allreduce(np.full(2, rr.rank() + 1.0), op=rr.Sum).tolist())")
    done = run_mtrain(cluster, "-H", "mtr-a:1,mtr-b:1", PYTHON, "-c", code, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    lines = sorted(line.split(">:", 1)[1] for line in done.stdout.splitlines())
    assert lines == ["mtr-a [3.0, 3.0]", "mtr-b [3.0, 3.0]"]
