"""Gate: the SSH agents connect while the preflight runs, and run nothing until it passes.

Two marker files beside `path`: the supervisor creates one, the agents watch for both.
"""
import enum
import os
import threading
import time

from mtrain.common.private import write_private
from mtrain.common.records.base import Record


class GateState(enum.Enum):
    WAITING = "waiting"
    OPEN = "open"      # the preflight passed: go on
    CLOSED = "closed"  # the preflight failed: give up quietly


class Gate(Record):
    """Two marker files beside `path`: the supervisor creates one, the agents watch for both."""

    path: str

    def _marker(self, state: GateState) -> str:
        return f"{self.path}.{state.value}"

    def open(self, message: str = "") -> None:
        """Let the agents go on, handing them `message` (the job's layout, for the hosts)."""
        write_private(self._marker(GateState.OPEN), message.encode())  # agents never see half a message

    def message(self) -> str:
        """What the supervisor handed over when it opened the gate ("" before)."""
        try:
            with open(self._marker(GateState.OPEN), encoding="utf-8") as handle:
                return handle.read()
        except OSError:
            return ""

    def close(self) -> None:
        write_private(self._marker(GateState.CLOSED), b"")

    def state(self) -> GateState:
        for state in (GateState.OPEN, GateState.CLOSED):
            if os.path.exists(self._marker(state)):
                return state
        return GateState.WAITING

    def wait(self, timeout: float, stop: threading.Event) -> bool:
        """True once the gate opens; False when it closes, `stop` is set or `timeout` passes."""
        deadline = time.monotonic() + timeout
        while not stop.is_set() and time.monotonic() < deadline:
            state = self.state()
            if state is not GateState.WAITING:
                return state is GateState.OPEN
            time.sleep(0.01)
        return False
