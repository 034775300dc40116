"""AgentEvent: what the SSH agents (children of mpirun, whose own reports may hide them) tell
the supervisor, as JSON lines appended to a file the supervisor polls.

The remote guard, which sees its host's MPI daemon die first, says so in a marker line on its
stderr; the SSH relay that carries it (the connection master, or the agent) takes it out and
appends the event (``take_events``), before mpirun, which stops its agents as soon as it misses
a daemon, can.
"""
import enum
import os

from mtrain.common.records.base import Record

EVENT_MARKER = b"@@mtrain-agent-event@@ "


class AgentEventKind(enum.Enum):
    CONNECT_FAILED = "connect-failed"  # the host could not be reached or refused a session
    HOST_LOST = "host-lost"            # the connection died while the job ran
    DAEMON_DIED = "daemon-died"        # the host's MPI daemon was killed (by a signal) while the job ran


class AgentEvent(Record):
    kind: AgentEventKind
    host: str
    detail: str   # one line for the user, naming the host
    time: float

    def emit(self, path: "str | None") -> None:
        """Append the event to `path` if a supervisor listens (None: nothing)."""
        if not path:
            return
        line = self.encode() + "\n"
        # One write() on an O_APPEND file: lines from several agents never interleave.
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        try:
            os.write(fd, line.encode())
        finally:
            os.close(fd)


def event_line(event: AgentEvent) -> bytes:
    """The guard's marker line for `event`."""
    return EVENT_MARKER + event.encode().encode() + b"\n"


def take_events(data: bytes, path: "str | None") -> bytes:
    """`data` (a chunk of a guard's stderr) without its event lines, which go to `path`."""
    if EVENT_MARKER not in data:
        return data
    kept = []
    for line in data.splitlines(keepends=True):
        before, marker, payload = line.partition(EVENT_MARKER)
        event = AgentEvent.decode(payload) if marker else None
        if event is None:
            kept.append(line)
            continue
        event.emit(path)
        if before:
            kept.append(before + b"\n")
    return b"".join(kept)


class AgentEventReader:
    """Reads the events appended to a file since the last poll."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.offset = 0
        self.partial = b""

    def poll(self) -> "list[AgentEvent]":
        try:
            with open(self.path, "rb") as handle:
                handle.seek(self.offset)
                data = handle.read()
        except FileNotFoundError:
            return []
        self.offset += len(data)
        *lines, self.partial = (self.partial + data).split(b"\n")
        return [event for event in map(AgentEvent.decode, lines) if event is not None]
