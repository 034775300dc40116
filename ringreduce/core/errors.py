"""The errors an op can end with, and which of them the negotiation decides.

Every rank raises the same class for the same op: the class of a negotiated
error travels in the coordinator's response (``Verdict``), never in its text.
"""
from __future__ import annotations

import enum
import pickle
from typing import NamedTuple, Sequence


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
    """An op was refused at submission: a RuntimeError, as Horovod raises these, and a
    ValueError, as Python's own argument errors are."""


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
    REFUSED = "refused"        # a rank refused its own arguments at submission (``Refusal``)

    def error(self, message: str, refusal: "Refusal | None" = None) -> Exception:
        """The exception this verdict ends an op with (MISMATCH, STALLED, and REFUSED with the
        first refusing rank's ``refusal``)."""
        if self is Verdict.REFUSED:
            assert refusal is not None
            return refusal.error(message)
        return _ERROR_OF[self](message)


_ERROR_OF = {Verdict.MISMATCH: MismatchError, Verdict.STALLED: StallError}

# The classes a submit-time check raises, so that a refusal can name its class to the other ranks
# by position (most specific first: a class not listed travels as the first one it derives from).
REFUSABLE: "tuple[type[Exception], ...]" = (InvalidArgumentError, TypeError, ValueError, pickle.PicklingError,
                                              AttributeError, NotImplementedError)


class Refusal(NamedTuple):
    """What a rank submits under an op's name in the place of an op whose arguments it refused.

    The rank raises its own error at once; the op's name still goes through the negotiation, so
    the ranks that did submit the op get a ``Verdict.REFUSED`` and raise the same class (instead
    of waiting for an op that never comes), and unnamed ops stay numbered alike on every rank.
    Never equal to a ``Signature``: a refused op never runs."""

    error_class: int  # position in REFUSABLE
    text: str         # "TypeError: ...", for the other ranks' messages

    @staticmethod
    def of(error: Exception) -> "Refusal":
        kind = type(error)
        index = REFUSABLE.index(kind) if kind in REFUSABLE else next(
            (i for i, cls in enumerate(REFUSABLE) if isinstance(error, cls)), 0)
        return Refusal(index, f"{kind.__name__}: {error}")

    def error(self, message: str) -> Exception:
        return REFUSABLE[self.error_class](message)


class NotInitializedError(ValueError, RuntimeError):
    """A collective was called before ``init()``: a ValueError, as Horovod's ``rank()`` raises, and a
    RuntimeError, as its collectives raise (horovod/torch/mpi_ops.py wraps them in HorovodInternalError)."""
