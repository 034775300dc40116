"""`python -m mtrain.launcher.tasks.call_worker`: a rank that runs the functions the driver sends.

The rank program of `mtrain.spark.run` and `mtrain.ray` (the wire is in call_service.py).
It reads its rank from MPI's variables, connects to the address in MTRAIN_CALL_ADDRESS,
proves it holds MTRAIN_CALL_KEY (removed from the environment at once, so the user's code
and its children never see it), and then runs each call it gets in the main thread (MPI and
the frameworks expect their calls there), sending back the result or the error.  A call that
raises does not end the rank (its traceback goes to stderr, the error to the driver): it keeps
serving until the driver says stop (exit 0; 1 for the rank whose call failed).

The driver's connection dropping, or "stop" arriving while a call still runs (a rank stuck
in a collective after another rank failed), ends the rank at once with status 1: MPI then
ends the job, and nothing is left behind.
"""
from __future__ import annotations

import os
import queue
import socket
import sys
import threading
import time
import traceback
from typing import Any

from mtrain.launcher.process_tools import exit_now
from mtrain.launcher.tasks.call_service import (
    ENV_ADDRESS,
    ENV_KEY,
    HANDSHAKE_SECONDS,
    Hello,
    client_handshake,
    cloudpickle_module,
    receive_message,
    send_message,
)

CONNECT_SECONDS = 60.0
_PREFIX = "mtrain call_worker"


def _connect(address: str, port: int, deadline: float) -> socket.socket:
    """Connect, retrying while the driver is not yet listening (it always is first, but a
    congested host may refuse for a moment)."""
    while True:
        try:
            return socket.create_connection((address, port), timeout=HANDSHAKE_SECONDS)
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def _parse_address(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"{ENV_ADDRESS}={text!r} is not HOST:PORT")
    return host.strip("[]"), int(port)


class _Session:
    """The connection to the driver, read by a thread so that a stop or a loss is seen
    even while the main thread is inside a call."""

    def __init__(self, sock: socket.socket, rank: int) -> None:
        self.sock, self.rank = sock, rank
        self.calls: queue.Queue = queue.Queue()
        self.busy = threading.Event()
        self.lock = threading.Lock()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        while True:
            try:
                message = receive_message(self.sock)
            except Exception:
                message = None
            if message is None or message[0] == "stop":
                if self.busy.is_set():
                    why = "stopped" if message is not None else "went away"
                    print(f"{_PREFIX}: rank {self.rank}: the driver {why} while a call was still running; "
                          "ending this rank", file=sys.stderr)
                    exit_now(1)
                self.calls.put(message)
                return
            self.calls.put(message)

    def send(self, message: Any) -> None:
        with self.lock:
            send_message(self.sock, message)


def _run_call(session: _Session, call_id: int, payload: bytes) -> None:
    """Run one call and send its answer: the pickled result, or (type, message, traceback)."""
    pickler = cloudpickle_module()
    session.busy.set()
    try:
        fn, args, kwargs = pickler.loads(payload)
        value = fn(*args, **kwargs)
    except BaseException as error:  # SystemExit and KeyboardInterrupt of the user's fn, too
        session.busy.clear()
        # In the job's output too, where the supervisor's report quotes this rank's last lines.
        print(f"{_PREFIX}: rank {session.rank}: the call raised:\n{traceback.format_exc().rstrip()}",
              file=sys.stderr, flush=True)
        session.send(("result", call_id, False, (type(error).__name__, str(error), traceback.format_exc())))
        return
    session.busy.clear()
    try:
        body = pickler.dumps(value)
    except Exception as error:
        session.send(("result", call_id, False, (type(error).__name__, f"the result could not be pickled: {error}",
                                                 traceback.format_exc())))
        return
    session.send(("result", call_id, True, body))


def serve(address: str, port: int, key: bytes, rank: int, deadline_s: float = CONNECT_SECONDS) -> int:
    """Connect to the CallServer at address:port as `rank` and run its calls until it says stop;
    0 then, 1 when the driver cannot be reached or goes away (said in one line on stderr)."""
    try:
        sock = _connect(address, port, time.monotonic() + deadline_s)
        client_handshake(sock, key)
        sock.settimeout(None)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        send_message(sock, Hello(rank, socket.gethostname(), os.getpid()))
    except OSError as error:
        print(f"{_PREFIX}: rank {rank}: cannot reach the driver at {address}:{port}: {error}", file=sys.stderr)
        return 1
    session = _Session(sock, rank)
    try:
        while True:
            message = session.calls.get()
            if message is None:
                print(f"{_PREFIX}: rank {rank}: lost the connection to the driver", file=sys.stderr)
                return 1
            if message[0] == "stop":
                status = int(message[1]) if len(message) > 1 else 0
                if status:
                    print(f"{_PREFIX}: rank {rank}: ending with status {status}: this rank's call failed "
                          "(its error is above)", file=sys.stderr)
                return status
            if message[0] == "call":
                try:
                    _run_call(session, message[1], message[2])
                except OSError:
                    print(f"{_PREFIX}: rank {rank}: lost the connection to the driver", file=sys.stderr)
                    return 1
    finally:
        try:
            sock.close()
        except OSError:
            pass


def main() -> int:
    from mtrain.launcher.rank import rank_from_env
    rank = rank_from_env(os.environ)
    address_text = os.environ.get(ENV_ADDRESS, "")
    key_text = os.environ.pop(ENV_KEY, "")
    try:
        address, port = _parse_address(address_text)
        key = bytes.fromhex(key_text)
        if not key:
            raise ValueError(f"{ENV_KEY} is not set")
    except ValueError as error:
        print(f"{_PREFIX}: rank {rank}: {error}; this program is started by mtrain.spark.run or mtrain.ray, "
              "not by hand", file=sys.stderr)
        return 2
    # The user's prints reach the driver as they happen, not when the rank ends.
    for stream in (sys.stdout, sys.stderr):
        reconfigure = getattr(stream, "reconfigure", None)
        if reconfigure is not None:
            reconfigure(line_buffering=True)
    return serve(address, port, key, rank)


if __name__ == "__main__":
    status = main()
    if status:
        # Not through the interpreter's exit: a function that started MPI would wait in MPI_Finalize for
        # ranks still inside a collective with this one (Open MPI 5 fences there), and they wait for us.
        exit_now(status)
    sys.exit(0)
