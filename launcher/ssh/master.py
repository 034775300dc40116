"""One authenticated SSH connection per host, shared by the preflight and mpirun's agents.

Like OpenSSH's ControlMaster: the launcher keeps the connection the preflight
opened to each host (host key checked, user authenticated) and serves a Unix
socket, mode 0600 in a private 0700 directory.  An SSH agent that mpirun starts
(launcher/ssh/agent.py) connects to that socket instead of making its own
connection, sends one REQUEST frame (host, daemon command words), and the
master runs the command on that host's connection and relays what comes back:

    agent                              master (in the launcher)           host
    REQUEST {host, words}  ──────────▶ wait for the preflight's verdict
                                       (gate), then run the words there ─▶ remote guard
    STDOUT / STDERR bytes  ◀────────── relay                          ◀── daemon output
    (closes the socket)    ──────────▶ close the session              ──▶ guard ends the tree
    EXIT status            ◀────────── the remote exit status         ◀── exit-status

The preflight's probe stays running after it answered and waits for a "go"
line on its stdin (launcher/remote_guard.py): the master hands it the daemon
command, so on each host one session, one login shell and one Python serve
both the probe and the guard.  Nothing runs there before the whole preflight
has passed: until then the master holds every request.  A host without a
shared connection (or a master that is not there) makes the agent connect by
itself.

The frames are this module's record: both sides import it.  The master also
sends the heartbeats the remote guard expects (and an elastic job's host-set
versions), and reports a connection that dies mid-job as LOST.
"""
from __future__ import annotations

import contextlib
import dataclasses
import enum
import json
import os
import select
import socket
import struct
import threading
import time
from typing import Any, Callable, Sequence

from mtrain.launcher.ssh import wire as frames
from mtrain.launcher.ssh.wire import ProtocolError, send_frame, write_all

HEARTBEAT_SECONDS = 1.0
MAX_FRAME = 1 << 20            # a request is a few KiB; anything bigger is garbage
REQUEST_TIMEOUT = 10.0         # an agent that connects says what it wants within this
DRAIN_SECONDS = 2.0            # what a session still says after its agent went, before it is closed
# (the guard's news of its daemon's death, on a loaded host: 0.5 s was too short on 2 busy cores)
SOCKET_NAME = "ssh-master.sock"
_AF_UNIX_PATH_MAX = 107


class FrameKind(enum.Enum):
    """What one frame on the master socket carries."""

    REQUEST = b"R"   # agent → master: JSON {"host": alias, "words": [daemon command words]}
    STDOUT = b"1"    # master → agent: bytes the remote command wrote to stdout
    STDERR = b"2"    # master → agent: ... to stderr
    EXIT = b"X"      # master → agent: the remote exit status (ASCII integer); last frame
    LOST = b"L"      # master → agent: the connection died mid-job (one line for the user); last
    FAILED = b"F"    # master → agent: no session could be started (one line for the user); last
    CLOSED = b"C"    # master → agent: the preflight failed, nothing runs: give up quietly; last
    UNKNOWN = b"U"   # master → agent: no shared connection to that host: connect yourself; last


def receive_frame(sock: socket.socket) -> tuple[FrameKind, bytes] | None:
    """The next frame; None at a clean end of the stream; ProtocolError for garbage."""
    return frames.receive_frame(sock, FrameKind, MAX_FRAME)


def encode_request(host: str, words: list[str]) -> bytes:
    return json.dumps({"host": host, "words": list(words)}).encode()


def decode_request(payload: bytes) -> tuple[str, list[str]]:
    """(host, words) of a REQUEST payload; ProtocolError if it is not one."""
    try:
        data = json.loads(payload)
        host, words = data["host"], data["words"]
    except (ValueError, KeyError, TypeError):
        raise ProtocolError("malformed request") from None
    if not isinstance(host, str) or not host or not isinstance(words, list) \
            or not all(isinstance(word, str) for word in words):
        raise ProtocolError("malformed request")
    return host, words


def peer_uid(sock: socket.socket) -> int | None:
    """The user id of the process at the other end of a Unix socket (Linux), if known."""
    try:
        raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    except (OSError, AttributeError):
        return None
    return struct.unpack("3i", raw)[1]


class GateState(enum.Enum):
    WAITING = "waiting"
    OPEN = "open"
    CLOSED = "closed"


@dataclasses.dataclass
class _Host:
    """The shared connection to one host: paramiko's SSHClient, and the probe session
    still waiting for its go line (None once handed out, or if there is none)."""

    client: Any
    waiting_probe: Any | None = None


@dataclasses.dataclass
class Counters:
    """What the master did (for --verbose and the tests)."""

    connections: int = 0      # connections adopted from the preflight
    probe_sessions: int = 0   # agent requests served by a waiting probe (no new session)
    new_sessions: int = 0     # agent requests served by a new session on a shared connection
    unknown: int = 0          # requests for a host without a shared connection
    refused: int = 0          # connections refused (other user, bad request)


class ConnectionMaster:
    """Serves the shared connections on a Unix socket; `close()` removes the socket."""

    def __init__(self, directory: str, hosts: Sequence[str], *, remote_command: Callable[[list[str], str], str],
                 go_line: Callable[[list[str], str], bytes], updates: str | None = None,
                 session_timeout: float = 30.0, log: Callable[[str], None] | None = None,
                 events: str | None = None) -> None:
        """`hosts`: the hosts the preflight checks (a request for another one is sent away at
        once); `remote_command(words, layout)` is the shell command of a new session;
        `go_line(words, layout)` what a waiting probe is sent instead."""
        self.expected = frozenset(hosts)
        self.remote_command, self.go_line = remote_command, go_line
        self.updates, self.session_timeout = updates, session_timeout
        self.events = events  # the supervisor's agent-events file (records.agent_events.AgentEvent)
        self._log = log or (lambda message: None)
        self.hosts: dict[str, _Host] = {}
        self.counters = Counters()
        # The master's state is guarded by `lock`; `gate_changed` (on that lock) wakes the requests
        # held at the gate. Both are public so a test can put an instrumented Condition in place
        # of `gate_changed` before any agent connects (tests/unit/test_ssh_master.py).
        self.lock = threading.Lock()
        self._gate = GateState.WAITING
        self._layout = ""
        self.gate_changed = threading.Condition(self.lock)
        self._closed = False
        # Held while an event is written to the supervisor's file, which lives in the launch's
        # scratch folder: once close() has returned, nothing writes there (the folder goes next).
        self._emitting = threading.Lock()
        self._own_directory: str | None = None
        self._listener: socket.socket | None = None
        self._agents: set[socket.socket] = set()
        self._channels: set[Any] = set()
        self.path = self._socket_path(directory)

    def _socket_path(self, directory: str) -> str:
        path = os.path.join(directory, SOCKET_NAME)
        if len(path.encode()) <= _AF_UNIX_PATH_MAX:
            return path
        # A long $TMPDIR: a private directory of our own where the path fits.
        import tempfile
        self._own_directory = tempfile.mkdtemp(prefix="mtrain-ssh-", dir="/tmp")
        return os.path.join(self._own_directory, SOCKET_NAME)

    # ---- life cycle --------------------------------------------------------------------------

    def start(self) -> None:
        directory = os.path.dirname(self.path)
        if os.stat(directory).st_mode & 0o077:
            raise RuntimeError(f"{directory} must be private (mode 0700)")
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(self.path)
        os.chmod(self.path, 0o600)
        listener.listen(64)
        self._listener = listener
        threading.Thread(target=self._accept, name="mtrain-ssh-master", daemon=True).start()

    def close(self) -> None:
        """Stop serving: remove the socket, end every relayed session, close the connections.
        Idempotent; safe from any thread."""
        with self.lock:
            if self._closed:
                return
            self._closed = True
            if self._gate is GateState.WAITING:
                self._gate = GateState.CLOSED
            self.gate_changed.notify_all()
            listener, self._listener = self._listener, None
            agents, channels = list(self._agents), list(self._channels)
            hosts = list(self.hosts.values())
        with self._emitting:
            pass  # an event being written is finished; no later one is (they see _closed)
        if listener is not None:
            with contextlib.suppress(OSError):
                listener.shutdown(socket.SHUT_RDWR)
            listener.close()
        with contextlib.suppress(OSError):
            os.unlink(self.path)
        if self._own_directory:
            with contextlib.suppress(OSError):
                os.rmdir(self._own_directory)
        for agent in agents:
            with contextlib.suppress(OSError):
                agent.shutdown(socket.SHUT_RDWR)
        for channel in channels + [h.waiting_probe for h in hosts if h.waiting_probe is not None]:
            with contextlib.suppress(Exception):
                channel.close()
        for host in hosts:
            with contextlib.suppress(Exception):
                host.client.close()

    # ---- what the launcher tells us ----------------------------------------------------------

    def adopt(self, host: str, client: Any, waiting_probe: Any | None = None) -> bool:
        """Keep the preflight's connection to `host` (and its probe waiting for a go line).
        False (and the caller closes them) once the master is closed or has one already."""
        with self.lock:
            if self._closed or host in self.hosts:
                return False
            self.hosts[host] = _Host(client, waiting_probe)
            self.counters.connections += 1
            return True

    def open_gate(self, layout: str) -> None:
        """The preflight passed: run what the agents asked for, handing the hosts `layout`."""
        with self.lock:
            if self._gate is GateState.WAITING:
                self._gate, self._layout = GateState.OPEN, layout
            self.gate_changed.notify_all()

    def close_gate(self) -> None:
        """The preflight failed: nothing runs; the agents give up quietly."""
        with self.lock:
            if self._gate is GateState.WAITING:
                self._gate = GateState.CLOSED
            self.gate_changed.notify_all()
            probes = [(h, h.waiting_probe) for h in self.hosts.values() if h.waiting_probe is not None]
            for host, _ in probes:
                host.waiting_probe = None
        for _, probe in probes:
            with contextlib.suppress(Exception):
                probe.close()  # the probe sees the end of its stdin and leaves

    def _wait_for_gate(self, timeout: float) -> tuple[GateState, str]:
        deadline = time.monotonic() + timeout
        with self.lock:
            while self._gate is GateState.WAITING and not self._closed:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self.gate_changed.wait(left)
            return self._gate, self._layout

    # ---- serving agents ----------------------------------------------------------------------

    def _accept(self) -> None:
        frames.accept_connections(lambda: self._listener, self._serve, "mtrain-ssh-relay")

    def _serve(self, agent: socket.socket) -> None:
        with self.lock:
            if self._closed:
                agent.close()
                return
            self._agents.add(agent)
        try:
            self._serve_agent(agent)
        except Exception as error:  # a relay thread never prints a traceback
            self._log(f"ssh master: agent connection ended: {type(error).__name__}: {error}")
        finally:
            with self.lock:
                self._agents.discard(agent)
            with contextlib.suppress(OSError):
                agent.close()

    def _serve_agent(self, agent: socket.socket) -> None:
        if peer_uid(agent) not in (None, os.getuid()):
            with self.lock:
                self.counters.refused += 1
            return
        agent.settimeout(REQUEST_TIMEOUT)
        try:
            frame = receive_frame(agent)
            if frame is None or frame[0] is not FrameKind.REQUEST:
                raise ProtocolError("expected a request")
            host, words = decode_request(frame[1])
        except (ProtocolError, OSError) as error:
            with self.lock:
                self.counters.refused += 1
            with contextlib.suppress(OSError):
                send_frame(agent, FrameKind.FAILED, f"mtrain ssh master: {error}".encode())
            return
        agent.settimeout(None)
        layout = ""
        if host in self.expected:
            # The preflight may still be busy with this host: its verdict comes with the gate.
            # The preflight is bounded by the same timeout: its verdict comes well within this.
            state, layout = self._wait_for_gate(2 * self.session_timeout + 30)
            if state is not GateState.OPEN:
                send_frame(agent, FrameKind.CLOSED)
                return
        with self.lock:
            shared = self.hosts.get(host)
            if shared is None:
                self.counters.unknown += 1
        if shared is None:
            send_frame(agent, FrameKind.UNKNOWN)
            return
        if _hung_up(agent):
            return  # stopped while it waited: start nothing
        channel = self._start(host, shared, words, layout, agent)
        if channel is not None:
            self._relay(host, channel, agent, shared.client.get_transport())

    def _start(self, host: str, shared: _Host, words: list[str], layout: str, agent: socket.socket):
        """The channel running `words` on `host`: the waiting probe if it is still there, else
        a new session; None (after telling the agent) if neither could be had."""
        with self.lock:
            probe, shared.waiting_probe = shared.waiting_probe, None
        if probe is not None:
            try:
                if not probe.closed and not probe.exit_status_ready():
                    probe.sendall(self.go_line(words, layout))
                    with self.lock:
                        self.counters.probe_sessions += 1
                        self._channels.add(probe)
                    return probe
            except Exception:
                pass
            with contextlib.suppress(Exception):
                probe.close()
        try:
            channel = shared.client.get_transport().open_session(timeout=self.session_timeout)
            channel.exec_command(self.remote_command(words, layout))
        except Exception as error:
            detail = f"host {host}: cannot start a session: {error or type(error).__name__}"
            send_frame(agent, FrameKind.FAILED, detail.encode())
            return None
        with self.lock:
            self.counters.new_sessions += 1
            self._channels.add(channel)
        return channel

    def _lost(self, host: str, detail: str) -> None:
        """Tell the supervisor that `host` was lost (its agent-events file, records.agent_events.AgentEvent)."""
        from mtrain.common.records.agent_events import AgentEvent, AgentEventKind
        with self._emitting:
            if self.events and not self._closed:
                AgentEvent(AgentEventKind.HOST_LOST, host, detail, time.time()).emit(self.events)

    def _relay(self, host: str, channel: Any, agent: socket.socket, transport: Any) -> None:
        lock = threading.Lock()
        done = threading.Event()
        closed_here = threading.Event()

        from mtrain.common.records.agent_events import take_events
        from mtrain.launcher.ssh.stream_pump import pump

        def take(data: bytes) -> bytes:
            with self._emitting:  # the guard's news of its daemon's death
                return take_events(data, None if self._closed else self.events)

        def copy(read: Callable[[int], bytes], kind: FrameKind) -> None:
            pump(read, lambda data: send_frame(agent, kind, data, lock), take if kind is FrameKind.STDERR else None)

        def heartbeat() -> None:
            # Keeps the guard's watchdog fed and gives TCP something to time out on; carries
            # an elastic job's host-set versions to the guard.
            from mtrain.common.records.elastic import HostUpdates
            sent = 0
            while not done.is_set() and transport.is_active():
                version = HostUpdates.read(self.updates) if self.updates else 0
                try:
                    channel.sendall(f"update {version}\n".encode() if version > sent else b"\n")
                except Exception:
                    return
                sent = max(sent, version)
                done.wait(HEARTBEAT_SECONDS)

        def agent_gone() -> None:
            # The agent closes its end when it is told to stop (or dies): end the session,
            # and the remote guard ends everything it started.
            with contextlib.suppress(OSError):
                while agent.recv(4096):
                    pass
            if not done.is_set():
                done.set()
                # mpirun stops its agents as soon as it misses a daemon: what the guard said of
                # that (its event line, records.agent_events.EVENT_MARKER) may still be on its way.
                pumps[1].join(timeout=DRAIN_SECONDS)
                closed_here.set()  # (closing sets the channel's status event too: not news)
                with contextlib.suppress(Exception):
                    channel.close()

        pumps = [threading.Thread(target=copy, args=(channel.recv, FrameKind.STDOUT), daemon=True),
                 threading.Thread(target=copy, args=(channel.recv_stderr, FrameKind.STDERR), daemon=True)]
        for thread in pumps + [threading.Thread(target=heartbeat, daemon=True),
                               threading.Thread(target=agent_gone, daemon=True)]:
            thread.start()
        try:
            while not done.is_set():
                # paramiko also sets status_event when the connection dies; the status is then -1.
                if channel.status_event.wait(0.5) or not transport.is_active():
                    break
            if done.is_set():  # the agent went: the session's own end may follow in a moment
                channel.status_event.wait(DRAIN_SECONDS)
            lost = None
            if not transport.is_active() and not self._closed:  # (close() ends the connections too)
                lost = f"host {host}: lost the SSH connection mid-job (host down or network cut)"
            elif (channel.status_event.is_set() and channel.exit_status < 0 and not closed_here.is_set()
                  and not self._closed):  # (close() ends every session: the launch's own end)
                lost = f"host {host}: the job's processes there were killed, its remote guard with them"
            if lost is not None:
                # Said here, not left to the agent: mpirun stops its agents as soon as it misses
                # a daemon, and it may have done so already.
                self._lost(host, lost)
            if done.is_set():
                return
            if lost is None:
                for thread in pumps:
                    thread.join(timeout=2)
                send_frame(agent, FrameKind.EXIT, str(channel.exit_status).encode(), lock)
            else:
                send_frame(agent, FrameKind.LOST, lost.encode(), lock)
        except OSError:
            pass
        finally:
            done.set()
            with contextlib.suppress(Exception):
                channel.close()
            with self.lock:
                self._channels.discard(channel)


def _hung_up(sock: socket.socket) -> bool:
    """Whether the other end has closed the socket (without waiting)."""
    try:
        readable, _, _ = select.select([sock], [], [], 0)
        return bool(readable) and sock.recv(1, socket.MSG_PEEK) == b""
    except OSError:
        return True


# ---- the agent's side ------------------------------------------------------------------------

class Outcome(enum.Enum):
    EXITED = "exited"        # the remote command ended with `status`
    LOST = "lost"            # the connection died mid-job (`detail`)
    FAILED = "failed"        # no session (`detail`)
    CLOSED = "closed"        # the preflight failed: nothing ran
    UNKNOWN = "unknown"      # no shared connection: connect yourself
    NO_MASTER = "no master"  # nobody serves the socket: connect yourself
    GONE = "gone"            # the master went away mid-session (the launcher is ending)
    STOPPED = "stopped"      # this agent was told to stop


@dataclasses.dataclass(frozen=True)
class Result:
    outcome: Outcome
    status: int = 255
    detail: str = ""


class MasterSession:
    """One agent's session through the master: `connect()`, then `run()` relays to fds 1 and 2.
    `stop()` (from a signal handler) ends it: the master then closes the remote session."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.sock: socket.socket | None = None
        self.stopped = False

    def connect(self) -> bool:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.connect(self.path)
        except OSError:
            sock.close()
            return False
        self.sock = sock
        return True

    def stop(self) -> None:
        self.stopped = True
        if self.sock is not None:
            with contextlib.suppress(OSError):
                self.sock.shutdown(socket.SHUT_RDWR)

    def run(self, host: str, words: list[str]) -> Result:
        sock = self.sock
        if sock is None:
            return Result(Outcome.NO_MASTER)
        try:
            send_frame(sock, FrameKind.REQUEST, encode_request(host, words))
            while True:
                frame = receive_frame(sock)
                if frame is None:
                    return Result(Outcome.STOPPED if self.stopped else Outcome.GONE)
                kind, payload = frame
                if kind is FrameKind.STDOUT:
                    write_all(1, payload)
                elif kind is FrameKind.STDERR:
                    write_all(2, payload)
                elif kind is FrameKind.EXIT:
                    return Result(Outcome.EXITED, int(payload))
                elif kind is FrameKind.LOST:
                    return Result(Outcome.LOST, detail=payload.decode(errors="replace"))
                elif kind is FrameKind.FAILED:
                    return Result(Outcome.FAILED, detail=payload.decode(errors="replace"))
                elif kind is FrameKind.CLOSED:
                    return Result(Outcome.CLOSED)
                elif kind is FrameKind.UNKNOWN:
                    return Result(Outcome.UNKNOWN)
                else:
                    raise ProtocolError(f"unexpected {kind.name} frame")
        except (OSError, ProtocolError, ValueError) as error:
            if self.stopped:
                return Result(Outcome.STOPPED)
            return Result(Outcome.GONE, detail=str(error))
        finally:
            with contextlib.suppress(OSError):
                sock.close()
