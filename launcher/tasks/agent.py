"""`python -m mtrain.launcher.tasks.agent --config FILE [ssh options] HOST WORD…`: PRRTE's remote
shell when the nodes are reached through TaskServices (launcher/tasks/service.py), not SSH.

mpirun calls this exactly as it would call ssh (`--prtemca plm_ssh_agent`).  The words are
joined with spaces for a shell, as OpenSSH does, `--daemonize` is dropped so the daemon stays
under the service, and the command runs under mtrain's remote guard there, as over SSH
(launcher/ssh/agent.py): the guard ends the daemon's whole tree when this agent stops sending
its heartbeat (STDIN frames, one a second) or the connection drops.  Output is relayed to our
fds, the guard's event lines to the supervisor's events file; we exit with the command's
status, or 255 when HOST's service cannot be reached (like ssh).

FILE (0600, in a 0700 folder: bindings/common/private.py) is JSON:
{"key": hex, "services": {hostname: [address, port]}, "python": path, "events": path|null}.
"""
from __future__ import annotations

import contextlib
import json
import signal
import socket
import sys
import threading
import time
from typing import Mapping

from mtrain.launcher.process_tools import die_with_parent, exit_now

HEARTBEAT_SECONDS = 1.0
CONNECT_TIMEOUT = 30.0
USAGE = "usage: python -m mtrain.launcher.tasks.agent --config FILE [ssh options] HOST COMMAND…"


def write_config(path: str, key: bytes, services: Mapping[str, tuple[str, int]], python: str,
                 events: str | None = None) -> None:
    """Write the agent's settings for `--config` (0600, bindings/common/private.py)."""
    from mtrain.common.private import write_private
    write_private(path, json.dumps({
        "key": key.hex(), "services": {host: [address, int(port)] for host, (address, port) in services.items()},
        "python": python, "events": events}).encode())


def read_config(path: str) -> dict:
    """The settings in a `--config` file; ValueError when it is not one."""
    from mtrain.common.private import read_private
    data = json.loads(read_private(path))
    if not isinstance(data, dict) or not isinstance(data.get("services"), dict) or not data.get("key"):
        raise ValueError(f"{path}: not a task agent configuration")
    return data


def _report(events: str | None, host: str, detail: str, lost: bool) -> None:
    from mtrain.common.records.agent_events import AgentEvent, AgentEventKind
    kind = AgentEventKind.HOST_LOST if lost else AgentEventKind.CONNECT_FAILED
    AgentEvent(kind, host, detail, time.time()).emit(events)


def run(host: str, words: list[str], settings: dict, stop: threading.Event, held: list) -> int:
    """Run the daemon command `words` on `host` through its TaskService; our exit status."""
    from mtrain.launcher.ssh import agent as ssh_agent
    from mtrain.launcher.ssh import wire as frames
    from mtrain.launcher.tasks import service as task_service
    from mtrain.launcher.tasks.service import FrameKind, ProtocolError, receive_frame, send_frame
    events = settings.get("events")
    entry = settings["services"].get(host)
    if not entry:
        known = ", ".join(sorted(settings["services"])) or "none"
        print(f"mtrain-task-agent: no task service for host {host} (known: {known})", file=sys.stderr)
        _report(events, host, f"host {host}: no task service runs there", lost=False)
        return 255
    address, port = entry[0], int(entry[1])
    try:
        sock = socket.create_connection((address, port), timeout=CONNECT_TIMEOUT)
        held.append(sock)
        task_service.authenticate_client(sock, bytes.fromhex(settings["key"]))
        command = ssh_agent.remote_command(words, settings.get("python") or sys.executable)
        send_frame(sock, FrameKind.RUN, task_service.encode_run(["/bin/sh", "-c", command]))
        sock.settimeout(None)
    except (OSError, ProtocolError, ValueError) as error:
        detail = f"host {host}: cannot reach its task service at {address}:{port}: {error}"
        if not stop.is_set():
            _report(events, host, detail, lost=False)
            print(f"mtrain-task-agent: {detail}", file=sys.stderr)
        return 255
    lock = threading.Lock()

    def heartbeat() -> None:
        # Keeps the remote guard's watchdog fed (launcher/remote_guard.py).
        while not stop.is_set():
            try:
                send_frame(sock, FrameKind.STDIN, b"\n", lock)
            except OSError:
                return
            stop.wait(HEARTBEAT_SECONDS)

    threading.Thread(target=heartbeat, daemon=True).start()
    from mtrain.common.records.agent_events import take_events
    try:
        while True:
            frame = receive_frame(sock)
            if frame is None:
                break
            kind, payload = frame
            if kind is FrameKind.STDOUT:
                frames.write_all(1, payload)
            elif kind is FrameKind.STDERR:
                rest = take_events(payload, events)  # the guard's news of its daemon's death
                if rest:
                    frames.write_all(2, rest)
            elif kind is FrameKind.EXIT:
                return int(payload)
            elif kind is FrameKind.ERROR:
                detail = payload.decode(errors="replace")
                _report(events, host, detail, lost=False)
                print(f"mtrain-task-agent: {detail}", file=sys.stderr)
                return 255
            else:
                break
    except (OSError, ProtocolError, ValueError):
        pass
    if stop.is_set():
        return 143
    detail = f"host {host}: lost its task service mid-job (its actor or task ended, or the network failed)"
    _report(events, host, detail, lost=True)
    print(f"mtrain-task-agent: {detail}", file=sys.stderr)
    return 255


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    die_with_parent(signal.SIGTERM)
    from mtrain.launcher.ssh.agent import split_arguments
    if argv[:1] != ["--config"] or len(argv) < 2:
        print(f"mtrain-task-agent: no --config FILE; {USAGE}", file=sys.stderr)
        return 255
    try:
        settings = read_config(argv[1])
        host, words, _ = split_arguments(argv[2:])
    except (ValueError, OSError) as error:
        print(f"mtrain-task-agent: {error}; {USAGE}", file=sys.stderr)
        return 255
    stop = threading.Event()
    held: list[socket.socket] = []

    def on_signal(number, frame) -> None:
        stop.set()
        for sock in held:  # the service ends the command when its connection drops
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, on_signal)
    return run(host, words, settings, stop, held)


if __name__ == "__main__":
    exit_now(main())  # mpirun waits for its agents to end
