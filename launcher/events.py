"""A tiny side channel from the SSH agents to the supervisor: JSON lines in a file.

Agents run as children of mpirun, whose own error reporting may hide them, so
they append one-line JSON events (`connect-failed`, `host-lost`) to a file
named in their config; the supervisor polls it.
"""
from __future__ import annotations

import json
import os
import time
from typing import Any

def emit(path: str | None, kind: str, host: str, detail: str) -> None:
    """Append an event to `path` if a supervisor is listening (None: no-op)."""
    if not path:
        return
    line = json.dumps({"event": kind, "host": host, "detail": detail, "time": time.time()}) + "\n"
    # One write() on an O_APPEND file: lines from several agents never interleave.
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    try:
        os.write(fd, line.encode())
    finally:
        os.close(fd)


class EventReader:
    """Reads new events from the file as they arrive."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.offset = 0
        self.partial = b""

    def poll(self) -> list[dict[str, Any]]:
        try:
            with open(self.path, "rb") as handle:
                handle.seek(self.offset)
                data = handle.read()
        except FileNotFoundError:
            return []
        self.offset += len(data)
        data = self.partial + data
        lines = data.split(b"\n")
        self.partial = lines.pop()
        events = []
        for line in lines:
            try:
                events.append(json.loads(line))
            except ValueError:
                continue
        return events
