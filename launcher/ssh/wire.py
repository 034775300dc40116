"""Kind-tagged, length-prefixed frames on a stream socket (stdlib only).

The wire of the launcher's relays, each with a frame-kind enum of its own: the SSH connection
master and its agents (launcher/ssh/master.py), and a task service and its agents
(launcher/tasks/service.py).  A frame is one kind byte, a 4-byte big-endian length, then that
many bytes.
"""
from __future__ import annotations

import enum
import os
import socket
import struct
import threading
from typing import Callable, TypeVar

HEADER = struct.Struct("!cI")  # kind (one byte), payload length
Kind = TypeVar("Kind", bound=enum.Enum)


class ProtocolError(Exception):
    """The other side sent something that is not a frame (or, on an authenticated wire, failed its proof)."""


def send_frame(sock: socket.socket, kind: enum.Enum, payload: bytes = b"",
               lock: threading.Lock | None = None) -> None:
    """Send one frame whose kind is `kind.value` (one byte), under `lock` when several threads write."""
    data = HEADER.pack(kind.value, len(payload)) + payload
    if lock is None:
        sock.sendall(data)
    else:
        with lock:
            sock.sendall(data)


def receive_exactly(sock: socket.socket, count: int) -> bytes | None:
    """`count` bytes, or None when the stream ends first."""
    chunks, wanted = [], count
    while wanted:
        chunk = sock.recv(min(wanted, 1 << 16))
        if not chunk:
            return None
        chunks.append(chunk)
        wanted -= len(chunk)
    return b"".join(chunks)


def receive_frame(sock: socket.socket, kinds: type[Kind], limit: int) -> tuple[Kind, bytes] | None:
    """The next frame, its kind one of `kinds` and its payload at most `limit` bytes; None at a
    clean end of the stream; ProtocolError for anything else."""
    header = receive_exactly(sock, HEADER.size)
    if header is None:
        return None
    raw_kind, length = HEADER.unpack(header)
    try:
        kind = kinds(raw_kind)
    except ValueError:
        raise ProtocolError(f"unknown frame kind {raw_kind!r}") from None
    if length > limit:
        raise ProtocolError(f"frame of {length} bytes is too large")
    payload = receive_exactly(sock, length) if length else b""
    if payload is None:
        raise ProtocolError("stream ended inside a frame")
    return kind, payload


def write_all(fd: int, data: bytes) -> None:
    """Write all of `data` to `fd`; a reader that has gone is ignored (the relay keeps draining)."""
    view = memoryview(data)
    while view:
        try:
            written = os.write(fd, view)
        except OSError:
            return
        view = view[written:]


def accept_connections(listener: Callable[[], "socket.socket | None"], serve: Callable[[socket.socket], None],
                       name: str) -> None:
    """Accept on `listener()` until it is gone or closed, serving each connection on a daemon thread named
    `name` (the loop of every relay's listening thread)."""
    while True:
        current = listener()
        if current is None:
            return
        try:
            connection, _ = current.accept()
        except OSError:
            return  # closed by its owner's stop()
        threading.Thread(target=serve, args=(connection,), name=name, daemon=True).start()
