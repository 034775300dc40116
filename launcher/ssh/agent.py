"""`python -m mtrain.launcher.ssh.agent [ssh options] HOST WORD…`: mtrain's stand-in for `ssh`.

MPI's launcher calls this exactly as it would call ssh.  Like OpenSSH, the
command words are joined with spaces into one string for the remote shell
(MPI has already quoted them for that shell).  Unlike plain ssh:

* hosts are reached with mtrain's host-key policy and ~/.ssh/config handling
  (launcher/ssh/client.py), configured by a JSON file named with `--config FILE`
  (written by `mtrain run`; a file rather than environment variables, because
  local ranks inherit mpirun's whole environment);
* when that file names the launcher's connection master (launcher/ssh/master.py),
  the command runs over the connection the preflight already opened and
  authenticated, and this agent only relays; without one, or for a host the
  master has no connection to, the agent connects by itself as below;
* PRRTE's `--daemonize` is dropped, so the remote daemon stays inside this SSH
  session, and the session runs under `mtrain.launcher.remote_guard`: when this agent
  dies or the link goes silent, the guard kills the daemon and its ranks;
* a heartbeat goes to the guard every second; with TCP_USER_TIMEOUT on the
  socket a cut link is noticed here within seconds, reported to the supervisor
  as a `host-lost` event naming the host, and the agent exits 255 like ssh.

The user's own command never passes through here: MPI delivers it to each
rank as an argv list.
"""
from __future__ import annotations

import json
import os
import shlex
import signal
import sys
import threading
import time
from typing import TYPE_CHECKING, Any, Callable

from mtrain.launcher.process_tools import die_with_parent, exit_now

if TYPE_CHECKING:
    from mtrain.common.records.agent_events import AgentEventKind
    from mtrain.launcher.cli.config import SshOptions

# Every rank's launch waits for its agents: the path through the connection master imports only
# what it needs (the settings, records and paramiko are loaded when the agent connects itself).

HEARTBEAT_SECONDS = 1.0
# ssh options MPI launchers may put before the host (hydra passes -x); ignored.
_FLAGS = {"-x", "-X", "-q", "-T", "-t", "-tt", "-n", "-a", "-A", "-4", "-6", "-C"}
_WITH_VALUE = {"-o", "-l", "-p", "-i", "-F", "-E"}


def write_config(path: str, options: SshOptions, python: str, events_path: str | None,
                 gate: str | None = None, job_file: str | None = None, updates: str | None = None,
                 master: str | None = None) -> None:
    """Write the agent's settings for `--config` (done by the launcher before mpirun starts).

    With `gate` (a records.gate.Gate path), the agent connects and authenticates at
    once but runs nothing until the supervisor opens the gate (closed: give up
    quietly); that lets mpirun and the SSH handshakes start while the preflight runs.
    The gate opens with the job's layout, which the remote guard leaves in
    `job_file` (a template with "{host}") for the ranks on its host.  In an
    elastic job, `updates` is the launcher's host-set version file: the agent
    passes each new version to the guard, which leaves it for the ranks.  `master` is the
    Unix socket of the launcher's connection master, if it shares its connections.
    """
    from mtrain.common.private import write_private
    write_private(path, json.dumps({
        "port": options.port, "identity_file": options.identity_file, "accept_new_hosts": options.accept_new_hosts,
        "connect_timeout": options.connect_timeout, "python": python, "events": events_path, "gate": gate,
        "job_file": job_file, "updates": updates, "master": master}).encode())


def _settings(path: str | None) -> dict[str, Any]:
    if not path:
        return {}
    with open(path, encoding="utf-8") as handle:
        data = json.load(handle)
    if not isinstance(data, dict):
        raise ValueError(f"{path}: not an agent configuration")
    return data


def read_config(path: str | None) -> tuple[SshOptions, str, str | None, str | None, str | None, str | None]:
    """(SSH options, remote Python, events file, gate, job file, updates file) from a
    `--config` file; defaults without one."""
    from mtrain.launcher.cli.config import SshOptions
    if not path:
        return SshOptions(), sys.executable, None, None, None, None
    data = _settings(path)
    options = SshOptions(port=data.get("port"), identity_file=data.get("identity_file"),
                         accept_new_hosts=bool(data.get("accept_new_hosts")),
                         connect_timeout=float(data.get("connect_timeout", 30)))
    return (options, data.get("python") or sys.executable, data.get("events"), data.get("gate"),
            data.get("job_file"), data.get("updates"))


def read_master(path: str | None) -> str | None:
    """The connection master's socket named in a `--config` file (None: connect directly)."""
    master = _settings(path).get("master")
    return master if isinstance(master, str) and master else None


def wait_for_gate(gate: str | None, timeout: float, stop: threading.Event) -> bool:
    """True once the launcher opens the gate (or there is none); False if it closes or never opens."""
    from mtrain.common.records.gate import Gate
    return gate is None or Gate(gate).wait(timeout, stop)


def _report(events_path: str | None, kind: AgentEventKind, host: str, detail: str) -> None:
    from mtrain.common.records.agent_events import AgentEvent
    AgentEvent(kind, host, detail, time.time()).emit(events_path)


def split_arguments(argv: list[str]) -> tuple[str, list[str], int | None]:
    """(host, command words, port from -p) out of an ssh-style argv."""
    index, port = 0, None
    while index < len(argv) and argv[index].startswith("-"):
        word = argv[index]
        if word in _WITH_VALUE:
            if word == "-p" and index + 1 < len(argv):
                port = int(argv[index + 1])
            index += 2
        elif word in _FLAGS:
            index += 1
        else:
            raise ValueError(f"unsupported ssh option {word}")
    if index >= len(argv):
        raise ValueError("no host given")
    return argv[index], argv[index + 1:], port


def daemon_command(words: list[str]) -> str:
    """MPI's daemon command as the remote shell gets it (without --daemonize, see above)."""
    # What OpenSSH would send: MPI quoted the words for a shell.
    return " ".join(word for word in words if word != "--daemonize")


def remote_command(words: list[str], python: str, job_file: str | None = None, layout: str = "") -> str:
    """The string the remote shell runs: the guard around MPI's daemon command
    (the guard also leaves the job's `layout` in `job_file` for the ranks)."""
    inner = daemon_command(words)
    guard = f"exec {shlex.quote(python)} -m mtrain.launcher.remote_guard"
    if job_file and layout:
        guard += f" --job-file {shlex.quote(job_file)} --layout {shlex.quote(layout)}"
    return f"{guard} {shlex.quote(inner)}"


def _copy(read: Callable[[int], bytes], fd: int, events_path: str | None = None) -> None:
    """Copy a channel's stream to our `fd`; from stderr, the guard's news of its daemon's death
    goes to `events_path` instead."""
    from mtrain.common.records.agent_events import take_events
    from mtrain.launcher.ssh.stream_pump import pump
    take = (lambda data: take_events(data, events_path)) if fd == 2 else None
    pump(read, lambda data: os.write(fd, data), take)


def _through_master(path: str, host: str, words: list[str], events_path: str | None,
                    stop: threading.Event, shared: list) -> int | None:
    """Run the command over the launcher's shared connection; our exit status, or None when
    the master is not there or has no connection to `host` (then we connect ourselves)."""
    from mtrain.common.records.agent_events import AgentEventKind
    from mtrain.launcher.ssh.master import MasterSession, Outcome
    session = MasterSession(path)
    if not session.connect():
        return None
    shared.append(session)
    if stop.is_set():
        session.stop()
    result = session.run(host, words)
    shared.clear()
    if result.outcome is Outcome.EXITED:
        return result.status
    if result.outcome in (Outcome.UNKNOWN, Outcome.NO_MASTER):
        return None
    if result.outcome is Outcome.STOPPED:
        return 143
    if result.outcome is Outcome.LOST:  # (the master has told the supervisor)
        print(f"mtrain-agent: {result.detail}", file=sys.stderr)
    elif result.outcome is Outcome.FAILED:
        _report(events_path, AgentEventKind.CONNECT_FAILED, host, result.detail)
        print(f"mtrain-agent: {result.detail}", file=sys.stderr)
    elif result.outcome is Outcome.GONE:
        # The launcher is going away (it stops the job itself) or broke the protocol.
        print(f"mtrain-agent: host {host}: the launcher's shared SSH connection went away"
              f"{': ' + result.detail if result.detail else ''}", file=sys.stderr)
    return 255  # CLOSED: the preflight failed and reports it; nothing ran


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    die_with_parent(signal.SIGTERM)
    config_path = None
    if argv[:1] == ["--config"] and len(argv) > 1:
        config_path, argv = argv[1], argv[2:]
    usage = "usage: python -m mtrain.launcher.ssh.agent [--config FILE] HOST COMMAND…"
    try:
        host, words, port = split_arguments(argv)
        settings = _settings(config_path)
        master = read_master(config_path)
    except (ValueError, OSError) as error:
        print(f"mtrain-agent: {error}; {usage}", file=sys.stderr)
        return 255
    stop = threading.Event()
    shared = []  # the session through the master, once there is one

    def on_signal(number, frame) -> None:
        stop.set()
        for session in shared:
            session.stop()

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, on_signal)

    # A -p from MPI that differs from the preflight's port is another sshd: connect ourselves.
    if master and (port is None or port == settings.get("port")):
        status = _through_master(master, host, words, settings.get("events"), stop, shared)
        if status is not None:
            return status

    try:
        options, python, events_path, gate, job_file, updates = read_config(config_path)
    except (ValueError, TypeError, OSError) as error:
        print(f"mtrain-agent: {error}; {usage}", file=sys.stderr)
        return 255
    from mtrain.common.records.agent_events import AgentEventKind
    from mtrain.common.records.elastic import HostUpdates
    from mtrain.common.records.gate import Gate
    from mtrain.launcher.cli.config import SshOptions
    from mtrain.launcher.ssh import client as ssh  # paramiko is imported only once we know we need it
    if port is not None:
        options = SshOptions(port, options.identity_file, options.accept_new_hosts, options.connect_timeout)
    # Accepting new host keys writes known_hosts: leave that to the preflight alone.
    if options.accept_new_hosts and not wait_for_gate(gate, options.connect_timeout, stop):
        return 255
    try:
        client = ssh.connect(host, options)
    except ssh.SshError as error:
        # The preflight reports this host itself; speak only if it somehow let the job go on.
        if wait_for_gate(gate, options.connect_timeout, stop):
            _report(events_path, AgentEventKind.CONNECT_FAILED, host, str(error))
            print(f"mtrain-agent: {error}", file=sys.stderr)
        return 255
    if not wait_for_gate(gate, options.connect_timeout, stop):
        client.close()
        return 255
    transport = client.get_transport()
    try:
        channel = transport.open_session(timeout=options.connect_timeout)
        layout = Gate(gate).message() if gate else ""
        channel.exec_command(remote_command(words, python, job_file, layout))
    except Exception as error:
        _report(events_path, AgentEventKind.CONNECT_FAILED, host, f"host {host}: cannot start a session: {error}")
        print(f"mtrain-agent: host {host}: cannot start a session: {error}", file=sys.stderr)
        return 255
    pumps = [threading.Thread(target=_copy, args=(channel.recv, 1), daemon=True),
             threading.Thread(target=_copy, args=(channel.recv_stderr, 2, events_path), daemon=True)]
    for thread in pumps:
        thread.start()

    def heartbeat() -> None:
        # Keeps the guard's watchdog fed and gives TCP something to time out on; carries
        # host-set versions of an elastic job to the guard.
        sent = 0
        while not stop.is_set() and transport.is_active():
            version = HostUpdates.read(updates) if updates else 0
            try:
                channel.sendall(f"update {version}\n".encode() if version > sent else b"\n")
            except Exception:
                return
            sent = max(sent, version)
            stop.wait(HEARTBEAT_SECONDS)

    threading.Thread(target=heartbeat, daemon=True).start()
    while True:
        # paramiko also sets status_event when the connection dies; the status is then -1.
        if channel.status_event.wait(0.2) and channel.exit_status >= 0:
            for thread in pumps:
                thread.join(timeout=2)
            status = channel.recv_exit_status()
            client.close()
            return status
        if stop.is_set():
            client.close()  # the guard sees the session end and kills the daemon
            return 143
        if channel.status_event.is_set() or not transport.is_active():
            detail = f"host {host}: lost the SSH connection mid-job (host down or network cut)"
            _report(events_path, AgentEventKind.HOST_LOST, host, detail)
            print(f"mtrain-agent: {detail}", file=sys.stderr)
            client.close()
            return 255


if __name__ == "__main__":
    exit_now(main())  # mtrain waits for its agents to end
