"""The errors an op can end with, and which of them the negotiation decides.

Every rank raises the same class for the same op: the class of a negotiated
error travels in the coordinator's response (``Verdict``), never in its text.
"""
from __future__ import annotations

import enum
from typing import Sequence


class HorovodInternalError(RuntimeError):
    """A collective failed (as ``horovod.common.exceptions.HorovodInternalError``).

    The base of every error an op ends with: ``except RuntimeError`` (or this
    class) catches each of them, as it does in Horovod.
    """


class MismatchError(HorovodInternalError, ValueError):
    """Ranks passed incompatible arguments to the same collective.

    Also a ValueError (what mtrain raised before it matched Horovod's RuntimeError).
    """


class InvalidArgumentError(RuntimeError, ValueError):
    """An op was refused at submission (Horovod raises these as RuntimeError);
    also a ValueError, what mtrain raised before."""


class JoinedError(HorovodInternalError):
    """An op that cannot run because a rank it needs has called ``join()`` (a broadcast from a
    joined root, say). Raised on every rank that submitted the op."""


class StallError(HorovodInternalError):
    """Some ranks never submitted an op the others are waiting on."""


class ShutdownError(HorovodInternalError):
    """The runtime shut down (here or on another rank) while the op was in flight.

    ``peers`` lists the other ranks whose leaving caused it (empty: this rank's own shutdown).
    """

    def __init__(self, message: str, peers: "Sequence[int]" = ()) -> None:
        super().__init__(message)
        self.peers = list(peers)


class EngineError(HorovodInternalError):
    """The background engine failed; the message carries the original error."""


class Verdict(enum.Enum):
    """What the coordinator decided about one op name; every rank applies it alike."""

    READY = "ready"            # every rank submitted it with the same arguments: run it
    INVALIDATE = "invalidate"  # drop its cache entry; every rank reports it afresh
    MISMATCH = "mismatch"      # ranks submitted it with different arguments
    STALLED = "stalled"        # some ranks never submitted it within the stall limit

    def error(self, message: str) -> Exception:
        """The exception this verdict ends an op with (only MISMATCH and STALLED end one)."""
        return _ERROR_OF[self](message)


_ERROR_OF = {Verdict.MISMATCH: MismatchError, Verdict.STALLED: StallError}
