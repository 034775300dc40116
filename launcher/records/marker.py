"""Records that a rank's runtime (or wrapper) writes as marker lines on the rank's stderr.

``mtrain run``'s supervisor takes such lines out of the ranks' output (mpirun prefixes each with
the rank that wrote it): a line is ``MARKER`` + the record's JSON + a newline, written whole.
"""
import os

from mtrain.launcher.records.base import Record
from mtrain.launcher.records.errors import supervised


class MarkerRecord(Record):
    """A record sent as one marker line; a subclass sets ``marker`` (bytes ending in a space).
    ``decode`` takes the payload after the marker."""

    marker = b""

    def encode(self) -> bytes:  # type: ignore[override]
        return self.marker + super().encode().encode() + b"\n"

    def emit(self) -> None:
        """Write the line to fd 2, whole, when a supervisor reads it (the rank runs under mtrain
        run's rank wrapper); never raises."""
        if not supervised():
            return
        try:
            os.write(2, self.encode())
        except OSError:
            pass
