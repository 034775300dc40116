"""Records that a rank's runtime (or wrapper) writes as marker lines on the rank's stderr.

``mtrain run``'s supervisor takes such lines out of the ranks' output (mpirun prefixes each with
the rank that wrote it): a line is ``MARKER`` + the record's JSON + a newline, written whole.

A program may point its fd 2 elsewhere before the runtime starts: pytest's default capture
(``--capture=fd``) puts a temporary file there for the whole test, so a hung test's stall
requests and flight-recorder dumps would never reach ``mtrain run``. The rank wrapper therefore
hands the child its stderr pipe a second time, at the fd ``$MTRAIN_MARKER_FD`` names together with
the pipe's identity (``fd:st_dev:st_ino``); markers go there while that fd is still the same pipe
(a grandchild that inherited the variable but not the fd, or a program that reused the number,
falls back to fd 2).
"""
import os
from typing import Mapping

from mtrain.common.records.base import Record
from mtrain.common.records.error_report import supervised

ENV_MARKER_FD = "MTRAIN_MARKER_FD"


def marker_channel(fd: int) -> str:
    """The ``$MTRAIN_MARKER_FD`` value for the open ``fd``: its number and the file it is."""
    stat = os.fstat(fd)
    return f"{fd}:{stat.st_dev}:{stat.st_ino}"


def marker_fd(environ: "Mapping[str, str]" = os.environ) -> int:
    """Where marker lines go: the wrapper's pipe named by ``$MTRAIN_MARKER_FD`` while this process
    still holds it at that number, else fd 2."""
    text = environ.get(ENV_MARKER_FD, "")
    if text:
        try:
            fd, dev, ino = (int(part) for part in text.split(":"))
            stat = os.fstat(fd)
            if (stat.st_dev, stat.st_ino) == (dev, ino):
                return fd
        except (ValueError, OSError):
            pass
    return 2


class MarkerRecord(Record):
    """A record sent as one marker line; a subclass sets ``marker`` (bytes ending in a space).
    ``decode`` takes the payload after the marker."""

    marker = b""

    def encode(self) -> bytes:  # type: ignore[override]
        return self.marker + super().encode().encode() + b"\n"

    def emit(self) -> None:
        """Write the line whole to the rank's stderr pipe (``marker_fd``), when a supervisor reads
        it (the rank runs under mtrain run's rank wrapper); never raises."""
        if not supervised():
            return
        try:
            os.write(marker_fd(), self.encode())
        except OSError:
            pass
