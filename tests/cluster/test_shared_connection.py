"""The preflight's SSH connection is the job's: one authentication and one session per host.

Counted where it happens, in the hosts' sshd logs: every host also runs a second sshd
(port 2222, LogLevel VERBOSE, in the host's own network and UTS namespaces) that logs
each accepted key and each session.  MTRAIN_SSH_SHARE=0 (each agent connects by
itself, as before) is the contrast that shows the counts can tell the two apart, and
every failure is reported the same either way.
"""
from __future__ import annotations

import re
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest

from tests.cluster.conftest import PYTHON, assert_no_leftovers, job_env, mtrain_argv, run_mtrain, start_mtrain
from tests.launcher.report_check import assert_only_mtrain_output

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(240)]
HERE = Path(__file__).resolve().parent
COUNTED_PORT = 2222
UNSHARED = {"MTRAIN_SSH_SHARE": "0"}
HOSTNAME = "import socket; print(socket.gethostname())"


def _wait_for_port(address: str, port: int, deadline: float) -> None:
    while time.monotonic() < deadline:
        try:
            with socket.create_connection((address, port), timeout=0.5) as sock:
                if sock.recv(4).startswith(b"SSH"):
                    return
        except OSError:
            pass
        time.sleep(0.1)
    raise RuntimeError(f"the counting sshd on {address}:{port} did not come up")


@pytest.fixture(scope="module")
def counted(cluster, tmp_path_factory):
    """A second sshd per host on COUNTED_PORT that logs every login and session; yields
    (HOME that trusts them, {host: its log file})."""
    workdir = cluster.home.parent
    base = tmp_path_factory.mktemp("counted")
    home = base / "home"
    shutil.copytree(cluster.home, home)
    known = home / ".ssh" / "known_hosts"
    logs, procs, lines = {}, [], []
    try:
        for host in cluster.hosts:
            key = workdir / host.name / "ssh_host_ed25519_key"
            config = base / f"{host.name}.sshd_config"
            config.write_text(
                f"ListenAddress {host.address}\nPort {COUNTED_PORT}\nHostKey {key}\n"
                f"AuthorizedKeysFile {workdir / 'authorized_keys'}\nPidFile none\n"
                "PermitRootLogin prohibit-password\nPasswordAuthentication no\n"
                "KbdInteractiveAuthentication no\nUsePAM no\nStrictModes no\n"
                "MaxStartups 100:30:200\nMaxSessions 50\nLogLevel VERBOSE\n")
            logs[host.name] = base / f"{host.name}.log"
            # Inside the host's network and UTS namespaces: its address, and its hostname for MPI.
            procs.append(subprocess.Popen(
                ["nsenter", "-t", str(host.sshd_pid), "-n", "-u", "/usr/sbin/sshd", "-D", "-e", "-f", str(config)],
                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=open(logs[host.name], "w"),
                start_new_session=True))
            public = Path(f"{key}.pub").read_text().split()
            lines.append(f"[{host.address}]:{COUNTED_PORT} {public[0]} {public[1]}")
        known.write_text(known.read_text() + "\n".join(lines) + "\n")
        deadline = time.monotonic() + 30
        for host in cluster.hosts:
            _wait_for_port(host.address, COUNTED_PORT, deadline)
        yield home, logs
    finally:
        for proc in procs:
            proc.kill()
            proc.wait(timeout=10)


def _counts(logs: dict[str, Path]) -> dict[str, tuple[int, int]]:
    """{host: (accepted logins, sessions started)} in the counting sshd's logs."""
    counts = {}
    for name, path in logs.items():
        text = path.read_text()
        counts[name] = (len(re.findall(r"Accepted publickey for root", text)),
                        len(re.findall(r"Starting session: ", text)))
    return counts


_ENDED = re.compile(r"(Disconnected from|Connection closed by|Connection reset by) user root")


def _when_ended(logs: dict[str, Path], timeout: float = 10) -> dict[str, tuple[int, int]]:
    """The counts once sshd has logged the end of every session and connection it logged the
    start of: it logs a session's end after the client has gone, and a login or session logged
    late would be missed. (Past ``timeout`` the counts are taken as they are.)"""
    deadline = time.monotonic() + timeout
    while True:
        texts = {name: path.read_text() for name, path in logs.items()}
        ended = all(text.count("Close session: ") >= text.count("Starting session: ")
                    and len(_ENDED.findall(text)) >= text.count("Accepted publickey for root")
                    for text in texts.values())
        if ended or time.monotonic() > deadline:
            return _counts(logs)
        time.sleep(0.05)


def _counted_run(cluster, counted, env_extra: dict[str, str] | None = None, *args: str):
    home, logs = counted
    before = _counts(logs)
    env = job_env(cluster, home)
    env.update(env_extra or {})
    done = subprocess.run(mtrain_argv("-p", str(COUNTED_PORT), *args), env=env, capture_output=True, text=True,
                          timeout=120)
    after = _when_ended(logs)
    return done, {name: (after[name][0] - before[name][0], after[name][1] - before[name][1]) for name in logs}


def test_one_login_and_one_session_per_host(cluster, counted):
    done, used = _counted_run(cluster, counted, None, "-H", "mtr-a:1,mtr-b:1", PYTHON, "-c", HOSTNAME)
    assert done.returncode == 0, done.stderr
    assert sorted(line.split(">:", 1)[1] for line in done.stdout.splitlines()) == ["mtr-a", "mtr-b"]
    # The preflight's connection and its probe's session ran the job too.
    assert used == {"mtr-a": (1, 1), "mtr-b": (1, 1)}, used


def test_without_sharing_every_agent_logs_in_again(cluster, counted):
    done, used = _counted_run(cluster, counted, UNSHARED, "-H", "mtr-a:1,mtr-b:1", PYTHON, "-c", HOSTNAME)
    assert done.returncode == 0, done.stderr
    assert used == {"mtr-a": (2, 2), "mtr-b": (2, 2)}, used


def test_verbose_log_names_what_was_shared(cluster, tmp_path):
    done = run_mtrain(cluster, "--verbose", "-np", "4", "-H", "mtr-a:2,mtr-b:2", PYTHON, "-c", "pass", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert ("SSH: 2 connections shared; agents served by the waiting probe 2, by a new session 0, "
            "sent to connect themselves 0") in done.stderr


def _home_copy(cluster, tmp_path: Path) -> Path:
    home = tmp_path / "home"
    shutil.copytree(cluster.home, home)
    return home


def _both_ways(cluster, *args: str, home: Path | None = None, cwd: Path | None = None):
    shared = run_mtrain(cluster, *args, home=home, cwd=cwd)
    env = job_env(cluster, home)
    env.update(UNSHARED)
    alone = subprocess.run(mtrain_argv(*args), env=env, capture_output=True, text=True, timeout=120, cwd=cwd)
    return shared, alone


def test_preflight_failures_read_the_same_shared_or_not(cluster, tmp_path):
    home = _home_copy(cluster, tmp_path)
    known = home / ".ssh" / "known_hosts"
    known.write_text("\n".join(l for l in known.read_text().splitlines() if not l.startswith("10.77.0.12 ")) + "\n")
    config = home / ".ssh" / "config"
    config.write_text(config.read_text() + "\nHost mtr-dead\n    HostName 10.77.0.11\n    Port 2\n")
    marker = tmp_path / "ran"
    # mtr-b: unknown host key; mtr-dead: nobody listens.
    shared, alone = _both_ways(cluster, "-H", "mtr-a:1,mtr-b:1,mtr-dead:1", "touch", str(marker), home=home)
    assert shared.returncode == alone.returncode == 1, shared.stderr
    assert shared.stderr == alone.stderr
    lines = shared.stderr.strip().splitlines()
    assert any(l.startswith("mtrain: host mtr-b: unknown host key") for l in lines), lines
    assert any(l.startswith("mtrain: host mtr-dead: cannot reach 10.77.0.11:2") for l in lines), lines
    assert lines[-1] == "mtrain: preflight failed on 2 hosts; nothing was started"
    assert_only_mtrain_output(shared.stderr)
    assert not marker.exists()


def test_rank_failure_reads_the_same_shared_or_not(cluster, tmp_path, token):
    shared, alone = _both_ways(cluster, "-np", "4", "-H", "mtr-a:2,mtr-b:2", PYTHON, str(HERE / "fault_rank.py"),
                               "exit", token, cwd=tmp_path)
    for done in (shared, alone):
        assert done.returncode == 7, done.stderr
        assert "mtrain: job failed; first failure: rank 2 on mtr-b: exit code 7" in done.stderr
        assert_only_mtrain_output(done.stderr)
    first = [l for l in shared.stderr.splitlines() if "first failure" in l]
    assert first == [l for l in alone.stderr.splitlines() if "first failure" in l]
    assert_no_leftovers(cluster, token, within=10)


def _master_socket(job) -> Path:
    job.wait_for_stderr("are shared through ", timeout=60)
    text = "".join(job.stderr_parts)
    return Path(text.split("are shared through ", 1)[1].split()[0])


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_master_socket_and_directory_removed_when_the_launcher_is_stopped(cluster, tmp_path, token, sig):
    job = start_mtrain(cluster, "--verbose", "-np", "4", "-H", "mtr-a:2,mtr-b:2", PYTHON,
                       str(HERE / "fault_rank.py"), "loop", token, cwd=tmp_path)
    try:
        path = _master_socket(job)
        assert path.is_socket() and (path.stat().st_mode & 0o777) == 0o600
        assert (path.parent.stat().st_mode & 0o777) == 0o700
        job.wait_for_lines("ready", 4, timeout=60)
        job.proc.send_signal(sig)
        job.proc.wait(timeout=20)
    finally:
        err = job.stop()
    assert job.proc.returncode == 128 + sig, err
    assert not path.exists() and not path.parent.exists()
    assert_no_leftovers(cluster, token, within=10)


def test_stopped_during_the_preflight_ends_at_once_and_cleans_up(cluster, tmp_path, token):
    cluster.cut_link("mtr-b")  # its preflight hangs in the TCP handshake
    try:
        job = start_mtrain(cluster, "--verbose", "--start-timeout", "40", "-H", "mtr-a:1,mtr-b:1",
                           PYTHON, "-c", f"print('{token}')", cwd=tmp_path)
        try:
            path = _master_socket(job)
            job.wait_for_stderr("preflight of", timeout=30)
            time.sleep(0.5)
            job.proc.send_signal(signal.SIGTERM)
            sent = time.monotonic()
            job.proc.wait(timeout=20)
            took = time.monotonic() - sent
        finally:
            err = job.stop()
    finally:
        cluster.restore_link("mtr-b")
    assert job.proc.returncode == 143, err
    assert took < 10, err
    assert "SIGTERM received; nothing was started" in err
    assert token not in "".join(job.stdout_parts)
    assert not path.exists() and not path.parent.exists()
    assert_no_leftovers(cluster, token, within=10)
