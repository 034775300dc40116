"""Copy one stream of a remote command (an SSH channel's stdout or stderr) to where it goes,
chunk by chunk, until it ends: the SSH agent copies to its own fds, the connection master to
its agent's socket.  Both take the remote guard's event lines out of stderr on the way
(records.agent_events.take_events).
"""
from __future__ import annotations

from typing import Callable

CHUNK = 65536


def pump(read: Callable[[int], bytes], deliver: Callable[[bytes], object],
         take: "Callable[[bytes], bytes] | None" = None) -> None:
    """Read chunks with `read` until the stream ends (or reading fails: the session is gone),
    pass each through `take` when given, and hand what remains to `deliver`; stops when
    `deliver` raises OSError (whoever read our copy is gone)."""
    while True:
        try:
            data = read(CHUNK)
        except Exception:
            return
        if not data:
            return
        if take is not None:
            data = take(data)
            if not data:
                continue
        try:
            deliver(data)
        except OSError:
            return
