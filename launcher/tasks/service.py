"""A TaskService runs commands on its node for the launcher, in place of sshd (stdlib only).

Horovod's Spark and Ray design: every Ray actor or Spark task that holds a slot runs one of
these, and mpirun on the driver starts Open MPI's daemon on each node THROUGH it (PRRTE's
plm_ssh_agent is launcher/tasks/agent.py), so the daemon and its ranks are children of the
actor or task, and no SSH is needed between nodes.

    task agent (driver)                         TaskService (node)
    connect ───────────────────────────────────▶ CHALLENGE nonce_s
    PROOF nonce_c + HMAC(key, client|s|c) ─────▶ check; else drop the connection
    check ◀──────────────────────────────────── PROOF HMAC(key, service|c|s)
    RUN {argv, env} ───────────────────────────▶ start argv in a new session, env added to ours
    STDIN bytes (b"": close stdin) ────────────▶ to the command's stdin
    ◀────────────────────────────────────────── STDOUT / STDERR bytes
    ◀────────────────────────────────────────── EXIT status (last frame), or ERROR one line

One command per connection.  The connection dropping (the agent killed, the driver gone)
ends the command's whole process group, and whatever it left under it; so does stop().
The frames are this module's record: the agent imports them from here.
"""
from __future__ import annotations

import contextlib
import enum
import hashlib
import hmac
import json
import os
import signal
import socket
import subprocess
import threading
from typing import Mapping

from mtrain.launcher.ssh import wire as frames
from mtrain.launcher.ssh.wire import ProtocolError, send_frame

MAX_FRAME = 1 << 20       # a request is a few KiB; output comes in 64 KiB chunks
HANDSHAKE_TIMEOUT = 10.0  # a peer that connects proves itself within this
TERM_GRACE = 5.0          # SIGTERM -> SIGKILL for a command whose connection dropped
# (the remote guard the agent runs under us ends its daemon's tree within its own 3 s grace)
NONCE_BYTES = 32
_CLIENT, _SERVICE = b"mtrain-task-client", b"mtrain-task-service"


class FrameKind(enum.Enum):
    """What one frame between a task agent and a TaskService carries."""

    CHALLENGE = b"C"  # service -> agent: a fresh nonce
    PROOF = b"P"      # agent -> service: its nonce + its HMAC; service -> agent: its HMAC
    RUN = b"R"        # agent -> service: JSON {"argv": [...], "env": {...}}
    STDIN = b"0"      # agent -> service: bytes for the command's stdin (empty: close it)
    STDOUT = b"1"     # service -> agent
    STDERR = b"2"     # service -> agent
    EXIT = b"X"       # service -> agent: the command's status (ASCII, shell-style); last
    ERROR = b"E"      # service -> agent: why nothing runs (one line); last


def receive_frame(sock: socket.socket) -> tuple[FrameKind, bytes] | None:
    """The next frame; None at a clean end of the stream; ProtocolError for garbage."""
    return frames.receive_frame(sock, FrameKind, MAX_FRAME)


def _expect(sock: socket.socket, kind: FrameKind) -> bytes:
    frame = receive_frame(sock)
    if frame is None or frame[0] is not kind:
        raise ProtocolError(f"expected a {kind.name} frame")
    return frame[1]


def _mac(key: bytes, side: bytes, first: bytes, second: bytes) -> bytes:
    return hmac.new(key, side + first + second, hashlib.sha256).digest()


def authenticate_client(sock: socket.socket, key: bytes) -> None:
    """The agent's half of the handshake: prove we hold `key`, and check that the service does."""
    theirs = _expect(sock, FrameKind.CHALLENGE)
    ours = os.urandom(NONCE_BYTES)
    send_frame(sock, FrameKind.PROOF, ours + _mac(key, _CLIENT, theirs, ours))
    proof = _expect(sock, FrameKind.PROOF)
    if not hmac.compare_digest(proof, _mac(key, _SERVICE, ours, theirs)):
        raise ProtocolError("the task service does not hold the job's key")


def _authenticate_service(sock: socket.socket, key: bytes) -> None:
    ours = os.urandom(NONCE_BYTES)
    send_frame(sock, FrameKind.CHALLENGE, ours)
    payload = _expect(sock, FrameKind.PROOF)
    theirs, proof = payload[:NONCE_BYTES], payload[NONCE_BYTES:]
    if len(theirs) != NONCE_BYTES or not hmac.compare_digest(proof, _mac(key, _CLIENT, ours, theirs)):
        raise ProtocolError("the agent does not hold the job's key")
    send_frame(sock, FrameKind.PROOF, _mac(key, _SERVICE, theirs, ours))


def encode_run(argv: list[str], env: Mapping[str, str] | None = None) -> bytes:
    return json.dumps({"argv": list(argv), "env": dict(env or {})}).encode()


def decode_run(payload: bytes) -> tuple[list[str], dict[str, str]]:
    """(argv, env) of a RUN payload; ProtocolError if it is not one."""
    try:
        data = json.loads(payload)
        argv, env = data["argv"], data.get("env") or {}
    except (ValueError, KeyError, TypeError, AttributeError):
        raise ProtocolError("malformed run request") from None
    if (not isinstance(argv, list) or not argv or not all(isinstance(w, str) for w in argv)
            or not isinstance(env, dict) or not all(isinstance(v, str) for v in env.values())):
        raise ProtocolError("malformed run request")
    return argv, env


def end_group(process: subprocess.Popen, grace: float = TERM_GRACE) -> None:
    """SIGTERM the process group `process` leads (and its descendants that left the group),
    then SIGKILL whatever is left after `grace` seconds."""
    from mtrain.launcher.process_tools import descendants, kill_group, signal_process
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in descendants(process.pid):
            signal_process(pid, sig)
        kill_group(process.pid, sig)
        if sig == signal.SIGTERM:
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(timeout=grace)


class TaskService:
    """Runs the commands authenticated agents ask for, on this node (see the module docstring)."""

    def __init__(self, key: bytes, bind: str = "0.0.0.0", address: str | None = None) -> None:
        """`address`: what other nodes reach this one at (default: the bind address, or for a
        wildcard bind the address of this node's first non-loopback interface)."""
        if not key:
            raise ValueError("a TaskService needs a non-empty key")
        self.key, self.bind, self.address = key, bind, address
        self.hostname = socket.gethostname()
        self.lock = threading.Lock()
        self._listener: socket.socket | None = None
        self._connections: set[socket.socket] = set()
        self._processes: set[subprocess.Popen] = set()
        self._threads: list[threading.Thread] = []
        self._stopped = False
        self.refused = 0  # connections dropped for failing authentication

    def start(self) -> tuple[str, int]:
        """Listen; (the address other nodes reach this one at, port)."""
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind((self.bind, 0))
        listener.listen(64)
        self._listener = listener
        port = listener.getsockname()[1]
        thread = threading.Thread(target=self._accept, name="mtrain-task-service", daemon=True)
        thread.start()
        self._threads.append(thread)
        return self._advertised(), port

    def _advertised(self) -> str:
        if self.address:
            return self.address
        if self.bind not in ("", "0.0.0.0"):
            return self.bind
        from mtrain.launcher.job.netif import interface_addresses
        for name, cidr in sorted(interface_addresses().items()):
            if name != "lo" and not cidr.startswith("127."):
                return cidr.split("/")[0]
        return "127.0.0.1"

    def stop(self) -> None:
        """Stop listening and end every command started here (whole process groups)."""
        with self.lock:
            self._stopped = True
            listener, self._listener = self._listener, None
            processes = list(self._processes)
            connections = list(self._connections)
        if listener is not None:
            with contextlib.suppress(OSError):
                listener.shutdown(socket.SHUT_RDWR)
            listener.close()
        for process in processes:
            end_group(process)
        for connection in connections:
            with contextlib.suppress(OSError):
                connection.shutdown(socket.SHUT_RDWR)

    def running(self) -> int:
        """How many commands started here are still running."""
        with self.lock:
            return sum(1 for p in self._processes if p.poll() is None)

    def _accept(self) -> None:
        frames.accept_connections(lambda: self._listener, self._serve, "mtrain-task")

    def _serve(self, connection: socket.socket) -> None:
        with self.lock:
            if self._stopped:
                connection.close()
                return
            self._connections.add(connection)
        try:
            connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            connection.settimeout(HANDSHAKE_TIMEOUT)
            try:
                _authenticate_service(connection, self.key)
                argv, env = decode_run(_expect(connection, FrameKind.RUN))
            except (ProtocolError, OSError):
                with self.lock:
                    self.refused += 1
                return
            connection.settimeout(None)
            self._run(connection, argv, env)
        except Exception:  # a serving thread never prints a traceback into the actor's log
            pass
        finally:
            with self.lock:
                self._connections.discard(connection)
            with contextlib.suppress(OSError):
                connection.close()

    def _run(self, connection: socket.socket, argv: list[str], env: dict[str, str]) -> None:
        lock = threading.Lock()
        try:
            process = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                       env={**os.environ, **env}, start_new_session=True)
        except OSError as error:
            send_frame(connection, FrameKind.ERROR,
                       f"{self.hostname}: cannot run {argv[0]}: {error.strerror or error}".encode())
            return
        with self.lock:
            self._processes.add(process)
            stopped = self._stopped
        if stopped:
            end_group(process)
        from mtrain.launcher.ssh.stream_pump import pump
        pumps = [threading.Thread(target=pump, args=(_reader(stream), _sender(connection, kind, lock)), daemon=True)
                 for stream, kind in ((process.stdout, FrameKind.STDOUT), (process.stderr, FrameKind.STDERR))]
        for thread in pumps:
            thread.start()
        dropped = threading.Event()
        threading.Thread(target=self._feed, args=(connection, process, dropped), daemon=True).start()
        try:
            while process.poll() is None:
                if dropped.wait(0.2):
                    end_group(process)
                    break
            process.wait()
            for thread in pumps:
                thread.join(timeout=5)
            if not dropped.is_set():
                from mtrain.launcher.process_tools import exit_code
                with contextlib.suppress(OSError):
                    send_frame(connection, FrameKind.EXIT, str(exit_code(process.returncode)).encode(), lock)
        finally:
            with self.lock:
                self._processes.discard(process)
            # Whatever the command left in its group (or under it) goes with it.
            end_group(process, grace=0.5)
            for stream in (process.stdin, process.stdout, process.stderr):
                with contextlib.suppress(OSError):
                    stream.close()

    @staticmethod
    def _feed(connection: socket.socket, process: subprocess.Popen, dropped: threading.Event) -> None:
        """The agent's STDIN frames to the command; the connection's end sets `dropped`."""
        stdin = process.stdin
        try:
            while True:
                frame = receive_frame(connection)
                if frame is None:
                    break
                kind, payload = frame
                if kind is not FrameKind.STDIN:
                    break
                if stdin is None:
                    continue
                if not payload:
                    stdin.close()
                    stdin = None
                    continue
                try:
                    stdin.write(payload)
                    stdin.flush()
                except (OSError, ValueError):
                    stdin = None  # the command closed its stdin: keep reading the agent
        except (OSError, ProtocolError):
            pass
        dropped.set()
        if stdin is not None:
            with contextlib.suppress(OSError, ValueError):
                stdin.close()


def _reader(stream):
    return lambda size: os.read(stream.fileno(), size)


def _sender(connection: socket.socket, kind: FrameKind, lock: threading.Lock):
    return lambda data: send_frame(connection, kind, data, lock)

