"""Calling a Python function in every rank of a job: the driver's `CallServer` and its wire.

`mtrain.spark.run` and `mtrain.ray` hand the user's function to ranks that MPI started
somewhere else (inside Spark tasks or Ray actors).  Each rank runs
`python -m mtrain.launcher.tasks.call_worker`, connects back to the driver's CallServer, and
serves calls until it is told to stop:

    driver (CallServer)                       rank r (call_worker)
        <------------- connect ---------------
        frame: nonce Ns -------------------->
        <--- frame: HMAC(key, "client" + Ns) + nonce Nc
        frame: HMAC(key, "server" + Nc) ---->        both sides proved they hold the key
        <--- Hello(rank, host, pid)
        ("call", id, cloudpickle(fn, args, kwargs)) -->
        <--- ("result", id, True, cloudpickle(value))  or  ("result", id, False, (type, message, traceback))
        ("stop", status) ------------------->        the rank leaves its loop and exits with status

A frame is an 8-byte big-endian length, then that many bytes.  Until the handshake is done a
frame may be at most `HANDSHAKE_LIMIT` bytes and nothing is unpickled, so a peer without the
key can neither make us allocate nor run anything; it is dropped.  The key travels only in the
environment (`env()`), never on a command line.

Stdlib only; cloudpickle (a dependency of the `spark` and `ray` extras, and inside pyspark) is
imported when a function is first sent.
"""
from __future__ import annotations

import hashlib
import hmac
import os
import pickle
import queue
import secrets
import socket
import struct
import threading
import time
from typing import Any, Callable, NamedTuple

ENV_ADDRESS = "MTRAIN_CALL_ADDRESS"
ENV_KEY = "MTRAIN_CALL_KEY"
HANDSHAKE_LIMIT = 1024
HANDSHAKE_SECONDS = 10.0
_HEADER = struct.Struct(">Q")
_NONCE = 32
_CLIENT = b"mtrain-call-client"
_SERVER = b"mtrain-call-server"
# How long stop() waits for the ranks to close their ends after it said stop.
STOP_GRACE_SECONDS = 5.0
# After the failed rank has gone, how long stop() leaves its job to end the other ranks.
FAILURE_SETTLE_SECONDS = 3.0


class CallServerError(RuntimeError):
    """A one-line reason the calls could not be made (missing ranks, a lost rank, a stopped job)."""


class RanksMissing(CallServerError, TimeoutError):
    """Not every rank connected in time."""


class RankFailed(CallServerError):
    """The function raised in a rank: which rank, what it raised, and the rank's traceback."""

    def __init__(self, rank: int, remote_type: str, message: str, remote_traceback: str) -> None:
        super().__init__(f"rank {rank} failed: {remote_type}: {message}")
        self.rank = rank
        self.remote_type = remote_type
        self.remote_message = message
        self.remote_traceback = remote_traceback
        if remote_traceback and hasattr(self, "add_note"):  # shown under the error (Python 3.11+)
            self.add_note(f"traceback in rank {rank}:\n{remote_traceback.rstrip()}")


class Hello(NamedTuple):
    """The first message of an authenticated rank."""

    rank: int
    host: str
    pid: int


def cloudpickle_module():
    """cloudpickle itself, or the copy inside pyspark; a one-line error naming the package when neither is there."""
    try:
        import cloudpickle
        return cloudpickle
    except ImportError:
        pass
    try:
        from pyspark import cloudpickle as bundled
        return bundled
    except ImportError:
        raise CallServerError("mtrain: sending a function to the ranks needs cloudpickle: "
                              "pip install cloudpickle") from None


# --- the wire (both ends) -------------------------------------------------------------------

def send_frame(sock: socket.socket, data: bytes) -> None:
    sock.sendall(_HEADER.pack(len(data)) + data)


def _receive_exactly(sock: socket.socket, count: int) -> bytes:
    parts, left = [], count
    while left:
        chunk = sock.recv(min(left, 1 << 20))
        if not chunk:
            raise ConnectionError("connection closed")
        parts.append(chunk)
        left -= len(chunk)
    return b"".join(parts)


def receive_frame(sock: socket.socket, limit: int | None = None) -> bytes:
    """One frame; ConnectionError when the peer closed, or sent more than `limit` bytes."""
    (length,) = _HEADER.unpack(_receive_exactly(sock, _HEADER.size))
    if limit is not None and length > limit:
        raise ConnectionError(f"frame of {length} bytes before authentication")
    return _receive_exactly(sock, length)


def _proof(key: bytes, side: bytes, nonce: bytes) -> bytes:
    return hmac.new(key, side + nonce, hashlib.sha256).digest()


def server_handshake(sock: socket.socket, key: bytes) -> None:
    """Challenge the peer and answer its challenge; ConnectionError when it does not hold `key`."""
    ours = secrets.token_bytes(_NONCE)
    send_frame(sock, ours)
    answer = receive_frame(sock, HANDSHAKE_LIMIT)
    digest = hashlib.sha256().digest_size
    if len(answer) != digest + _NONCE or not hmac.compare_digest(answer[:digest], _proof(key, _CLIENT, ours)):
        raise ConnectionError("the peer failed authentication")
    send_frame(sock, _proof(key, _SERVER, answer[digest:]))


def client_handshake(sock: socket.socket, key: bytes) -> None:
    """Answer the server's challenge and check its answer to ours; ConnectionError on a wrong key."""
    theirs = receive_frame(sock, HANDSHAKE_LIMIT)
    ours = secrets.token_bytes(_NONCE)
    send_frame(sock, _proof(key, _CLIENT, theirs) + ours)
    try:
        reply = receive_frame(sock, HANDSHAKE_LIMIT)
    except ConnectionError:
        raise ConnectionError("the call server refused this rank's key (is MTRAIN_CALL_KEY this job's?)") from None
    if not hmac.compare_digest(reply, _proof(key, _SERVER, ours)):
        raise ConnectionError("the call server failed authentication")


def send_message(sock: socket.socket, message: Any) -> None:
    send_frame(sock, pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL))


def receive_message(sock: socket.socket) -> Any:
    return pickle.loads(receive_frame(sock))  # only ever after the handshake


# --- the driver's side ----------------------------------------------------------------------

class _Rank:
    """One connected rank: its socket (writes under a lock) and what it said it is."""

    def __init__(self, sock: socket.socket, hello: Hello) -> None:
        self.sock, self.hello = sock, hello
        self.lock = threading.Lock()
        self.lost = False
        self.reader = threading.current_thread()  # the thread reading from it (set once registered)

    def send(self, message: Any) -> None:
        with self.lock:
            send_message(self.sock, message)


class CallServer:
    """Serves `size` ranks on the driver: waits for them, calls functions in them, stops them.

    One call at a time; results come back in rank order.  `fail(reason)` (say, when the job
    running the ranks has ended) wakes any waiter with that reason.
    """

    def __init__(self, key: bytes, size: int, bind: str = "0.0.0.0", advertise: str | None = None) -> None:
        if size < 1:
            raise ValueError("a call server needs at least one rank")
        self.key, self.size, self.bind = key, size, bind
        self.advertise = advertise  # the address ranks connect to (default: see start())
        self._listener: socket.socket | None = None
        self._address: tuple[str, int] | None = None
        self._ranks: dict[int, _Rank] = {}
        self._changed = threading.Condition()
        self._inbox: queue.Queue = queue.Queue()
        self._failure: str | None = None
        self._failed_rank: int | None = None  # the rank whose call raised last: stopped first, with status 1
        self._stopped = False
        self._call_lock = threading.Lock()
        self._next_call = 0
        self._threads: list[threading.Thread] = []

    def start(self) -> tuple[str, int]:
        """Listen; the (address, port) ranks are to connect to (also in `env()`)."""
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind((self.bind, 0))
        listener.listen(max(16, self.size))
        self._listener = listener
        port = listener.getsockname()[1]
        address = self.advertise or (self.bind if self.bind not in ("0.0.0.0", "") else _reachable_address())
        self._address = (address, port)
        self._spawn(self._accept_loop)
        return self._address

    def env(self) -> dict[str, str]:
        """What a rank needs to find and prove itself to this server (pass it by environment)."""
        if self._address is None:
            raise CallServerError("the call server is not started")
        return {ENV_ADDRESS: f"{self._address[0]}:{self._address[1]}", ENV_KEY: self.key.hex()}

    def connected(self) -> list[int]:
        """The ranks connected now, in order."""
        with self._changed:
            return sorted(self._ranks)

    def hosts(self) -> dict[int, str]:
        """{rank: the host it runs on} of the connected ranks."""
        with self._changed:
            return {rank: entry.hello.host for rank, entry in sorted(self._ranks.items())}

    def wait_for_ranks(self, timeout_s: float) -> None:
        """Return once all ranks are connected; RanksMissing (one line, naming them) after `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        with self._changed:
            while len(self._ranks) < self.size:
                self._raise_if_failed()
                left = deadline - time.monotonic()
                if left <= 0:
                    missing = [r for r in range(self.size) if r not in self._ranks]
                    raise RanksMissing(f"mtrain: {_ranks_text(missing)} of {self.size} did not connect "
                                       f"to the driver within {timeout_s:g} s")
                self._changed.wait(min(left, 0.5))
            self._raise_if_failed()

    def call_all(self, fn: Callable, args: tuple = (), kwargs: dict | None = None) -> list:
        """fn(*args, **kwargs) in every rank; the results in rank order.  RankFailed for the first
        rank (in time) whose call raised; CallServerError when a rank's connection drops."""
        return self._call(list(range(self.size)), fn, args, kwargs)

    def call_one(self, rank: int, fn: Callable, args: tuple = (), kwargs: dict | None = None) -> Any:
        """fn(*args, **kwargs) in `rank` alone; its result."""
        if not 0 <= rank < self.size:
            raise ValueError(f"rank {rank} is not in 0..{self.size - 1}")
        return self._call([rank], fn, args, kwargs)[0]

    def fail(self, reason: str) -> None:
        """Make every waiting and later call raise CallServerError(reason)."""
        with self._changed:
            if self._failure is None:
                self._failure = reason
            self._changed.notify_all()
        self._inbox.put(None)

    def stop(self) -> None:
        """Tell the ranks to leave their loops (they exit 0), then close every connection.

        After a RankFailed, the rank that failed is told first, and exits 1, before the others
        are told: the job's report (and MPI) then name that rank as the first to fail, not a
        rank that was still waiting for it in a collective."""
        with self._changed:
            if self._stopped:
                return
            self._stopped = True
            ranks = list(self._ranks.values())
            self._changed.notify_all()
        if self._listener is not None:
            try:
                self._listener.shutdown(socket.SHUT_RDWR)  # (close alone does not wake accept())
            except OSError:
                pass
            _close(self._listener)
        deadline = time.monotonic() + STOP_GRACE_SECONDS
        failed = [e for e in ranks if e.hello.rank == self._failed_rank]
        for entry in failed:
            _tell_stop(entry, 1)
            entry.reader.join(max(0.0, deadline - time.monotonic()))  # until it has gone
            # MPI ends the job's other ranks for it; told now, they would end too, at the same
            # moment, and the job's report could name one of them first.
            settled = min(deadline, time.monotonic() + FAILURE_SETTLE_SECONDS)
            for other in ranks:
                other.reader.join(max(0.0, settled - time.monotonic()))
        for entry in ranks:
            if entry not in failed and not entry.lost:
                _tell_stop(entry, 0)
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        for entry in ranks:
            _close(entry.sock)
        self._inbox.put(None)

    # -- inside -----------------------------------------------------------------------------

    def _raise_if_failed(self) -> None:
        if self._failure is not None:
            raise CallServerError(self._failure)
        if self._stopped:
            raise CallServerError("mtrain: the call server was stopped")

    def _spawn(self, target: Callable, *args: Any) -> None:
        thread = threading.Thread(target=target, args=args, daemon=True)
        self._threads.append(thread)
        thread.start()

    def _accept_loop(self) -> None:
        assert self._listener is not None
        while True:
            try:
                sock, _ = self._listener.accept()
            except OSError:
                return  # closed by stop()
            self._spawn(self._admit, sock)

    def _admit(self, sock: socket.socket) -> None:
        """Authenticate a new connection and register its rank; drop it on any failure."""
        try:
            sock.settimeout(HANDSHAKE_SECONDS)
            server_handshake(sock, self.key)
            hello = receive_message(sock)
            sock.settimeout(None)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if not isinstance(hello, Hello) or not 0 <= hello.rank < self.size:
                raise ConnectionError(f"not a rank of this job: {hello!r}")
        except (OSError, pickle.UnpicklingError, EOFError, AttributeError, ValueError):
            _close(sock)
            return
        entry = _Rank(sock, hello)
        with self._changed:
            if hello.rank in self._ranks or self._stopped:
                _close(sock)  # a second process claiming a rank: keep the first
                return
            entry.reader = threading.current_thread()
            self._ranks[hello.rank] = entry
            self._changed.notify_all()
        self._read(entry)

    def _read(self, entry: _Rank) -> None:
        """Pass the rank's results to the inbox; its loss too (None as the message)."""
        while True:
            try:
                message = receive_message(entry.sock)
            except (OSError, pickle.UnpicklingError, EOFError):
                entry.lost = True
                self._inbox.put((entry.hello.rank, None))
                return
            self._inbox.put((entry.hello.rank, message))

    def _call(self, ranks: list[int], fn: Callable, args: tuple, kwargs: dict | None) -> list:
        payload = cloudpickle_module().dumps((fn, tuple(args), dict(kwargs or {})))
        with self._call_lock:
            with self._changed:
                self._raise_if_failed()
                missing = [r for r in ranks if r not in self._ranks]
                if missing:
                    raise CallServerError(f"mtrain: {_ranks_text(missing)} not connected; "
                                          "wait_for_ranks() first")
                entries = [self._ranks[r] for r in ranks]
            lost = [e.hello.rank for e in entries if e.lost]
            if lost:
                raise CallServerError(f"mtrain: lost the connection to {_ranks_text(lost)} (did it exit?)")
            self._next_call += 1
            call_id = self._next_call
            for entry in entries:
                try:
                    entry.send(("call", call_id, payload))
                except OSError:
                    pass  # its reader reports the loss
            return self._collect(call_id, ranks)

    def _collect(self, call_id: int, ranks: list[int]) -> list:
        results: dict[int, Any] = {}
        while len(results) < len(ranks):
            item = self._inbox.get()
            self._raise_if_failed()
            if item is None:
                continue
            rank, message = item
            if rank not in ranks:
                continue
            if message is None:
                raise CallServerError(f"mtrain: lost the connection to rank {rank} during the call "
                                      "(the rank exited or its host went away)")
            kind, answered, ok, body = message
            if kind != "result" or answered != call_id:
                continue  # a late answer to an earlier call that already failed
            if not ok:
                remote_type, text, trace = body
                self._failed_rank = rank
                raise RankFailed(rank, remote_type, text, trace)
            results[rank] = pickle.loads(body)
        self._failed_rank = None  # the ranks answered again: none is to blame at stop
        return [results[r] for r in ranks]


def _tell_stop(entry: _Rank, status: int) -> None:
    try:
        entry.send(("stop", status))
        # Our end half-closed, not reset: the rank reads "stop" even if it sent more.
        entry.sock.shutdown(socket.SHUT_WR)
    except OSError:
        pass


def _ranks_text(ranks: list[int]) -> str:
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    return "ranks " + ", ".join(str(r) for r in ranks)


def _reachable_address() -> str:
    """A guess at an address of this host that others reach: the first non-loopback interface's
    (callers that know better, e.g. Spark's driver host, pass `advertise`)."""
    from mtrain.launcher.job.netif import interface_addresses
    for name, address in sorted(interface_addresses().items()):
        if not address.startswith("127.") and name != "lo":
            return address.split("/")[0]
    return socket.gethostbyname(socket.gethostname())


def _close(sock: socket.socket) -> None:
    try:
        sock.close()
    except OSError:
        pass


def new_key() -> bytes:
    """A fresh shared secret for one job."""
    return os.urandom(32)
