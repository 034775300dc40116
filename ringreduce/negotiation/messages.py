"""What crosses between the ranks in a coordinator round, and the decisions that come back.

Each rank sends rank 0 one ``Gathered`` (its ``Report`` per op not cached, and its pending names
when the round is a stall check); rank 0's coordinator answers every rank with the same list of
``Response``, which every rank's response cache and engine apply in order.
"""
from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

from mtrain.ringreduce.core.errors import Verdict


class Report(NamedTuple):
    """What a rank tells the coordinator about one op it submitted that is not cached."""

    name: str
    signature: Any    # requests.Signature, or an errors.Refusal
    description: str  # what the rank submitted, for error messages
    group: int = 0    # the parts of one grouped op share it on their rank (0: not grouped)


class Gathered(NamedTuple):
    """What one rank sends rank 0 in a coordinator round."""

    reports: "list[Report]"
    pending: "list[str] | None"  # every name it has pending, when the round is a stall check


@dataclasses.dataclass(frozen=True)
class Response:
    """One decision of the coordinator, applied by every rank in order."""

    verdict: Verdict
    name: str
    bit: int = -1  # cache bit for READY (-1: not cached)
    meta: Any = None
    message: str = ""  # for MISMATCH and STALLED: what the error says
