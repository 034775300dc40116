"""Deciding, identically on every rank, which submitted ops are ready to run.

An op is ready when every rank has submitted it (matched by name) with the
same metadata. Two paths:

* **Response cache, the steady state.** Once an op name has run, every rank
  knows it as bit ``b`` of a bit vector. Each cycle every rank contributes the
  vector of cached ops it has pending, and its complement, to one tiny
  ``MPI_Allreduce(BAND)``: the first half gives the ops pending *everywhere*
  (ready), the complement gives the ops pending *anywhere* (for the stall
  inspector), and a control word carries "someone has uncached ops",
  "someone is shutting down" and "stall check". Training steps that repeat
  the same names need no coordinator round trip.
* **Coordinator, for new names.** Ops not in the cache are reported to rank 0,
  which keeps a table of who submitted what. When all ranks have reported a
  name it checks their metadata agree, assigns a cache bit, and broadcasts the
  decision; if they disagree, it broadcasts an error naming each rank's
  submission. It also names the ranks missing from a stalled op.
"""
from __future__ import annotations

import dataclasses
import enum
import sys
from typing import Any, Sequence

import numpy as np

from .errors import Verdict

CONTROL_UNREPORTED = 1  # "I have ops the coordinator has not seen"
CONTROL_SHUTDOWN = 2  # "I am shutting down"
CONTROL_STALL_CHECK = 4  # rank 0 asks every rank for its pending list

# Auto-named ops are never cached: their names never repeat.
CACHE_CAPACITY = 4096
# Ops submitted without a name are named by a per-rank counter under this prefix
# (``Engine.auto_name``); such names never repeat, so the response cache never keeps them.
UNNAMED_PREFIX = "noname."


class RequestState(enum.Enum):
    """Where one submitted op stands in the negotiation on this rank."""

    UNREPORTED = "unreported"  # neither cached nor reported to the coordinator yet
    REPORTED = "reported"      # sent to the coordinator; waiting for its verdict
    CACHED = "cached"          # known to every rank as a cache bit: goes in the bit vector


@dataclasses.dataclass(frozen=True)
class Response:
    """One decision of the coordinator, applied by every rank in order."""

    verdict: Verdict
    name: str
    bit: int = -1  # cache bit for READY (-1: not cached)
    meta: Any = None
    message: str = ""  # for MISMATCH and STALLED: what the error says


class ResponseCache:
    """Name ⇄ bit, kept identical on every rank by applying the same responses."""

    def __init__(self) -> None:
        self.entries: "dict[str, tuple[int, Any]]" = {}
        self.names: "list[str | None]" = []
        # Counts the changes that move a cached name's bit or the vector's length (an invalidation,
        # a name cached anew, a new word): what was learned from the bits before is stale then.
        # A name cached for the first time within the current words moves nothing.
        self.version = 0

    @property
    def words(self) -> int:
        return (len(self.names) + 63) // 64

    def lookup(self, name: str, meta: Any) -> int:
        entry = self.entries.get(name)
        return entry[0] if entry is not None and entry[1] == meta else -1

    def apply(self, response: Response) -> None:
        if response.verdict is Verdict.READY and response.bit >= 0:
            words = self.words
            if response.bit == len(self.names):
                self.names.append(response.name)
            self.names[response.bit] = response.name
            if response.name in self.entries or self.words != words:
                self.version += 1
            self.entries[response.name] = (response.bit, response.meta)
        elif response.verdict is Verdict.INVALIDATE:
            bit, _ = self.entries.pop(response.name)
            self.names[bit] = None  # a tombstone keeps later bits where they are
            self.version += 1

    @staticmethod
    def cacheable(name: str) -> bool:
        return not name.startswith(UNNAMED_PREFIX)


def set_bit(words: np.ndarray, bit: int) -> None:
    words.view(np.uint8)[bit >> 3] |= np.uint8(1 << (bit & 7))


def bits_of(words: np.ndarray) -> "list[int]":
    """Indices of the set bits, ascending (little-endian words, as set_bit writes them)."""
    return np.flatnonzero(np.unpackbits(words.view(np.uint8), bitorder="little")).tolist()


class Coordinator:
    """Rank 0's bookkeeping: who reported which op, and since when."""

    def __init__(self, size: int, warn_seconds: float, shutdown_seconds: float,
                 members: "Sequence[int] | None" = None) -> None:
        self.size = size
        self.members = list(members) if members is not None else list(range(size))  # names in messages
        self.warn_seconds = warn_seconds
        self.shutdown_seconds = shutdown_seconds
        self.reported: "dict[str, dict[int, tuple[Any, str]]]" = {}
        self.first_seen: "dict[str, float]" = {}
        self.warned: "set[str]" = set()

    def note_partial(self, names: Sequence[str], now: float) -> None:
        """Cached ops pending on some ranks but not all (from the bit vectors)."""
        for name in names:
            self.first_seen.setdefault(name, now)

    def forget(self, name: str) -> None:
        self.first_seen.pop(name, None)
        self.warned.discard(name)

    def stall_check_due(self, now: float) -> bool:
        for name, seen in self.first_seen.items():
            age = now - seen
            if age > self.warn_seconds and name not in self.warned:
                return True
            if self.shutdown_seconds > 0 and age > self.shutdown_seconds:
                return True
        return False

    def decide(self, gathered: "list[tuple[list, list | None]]", cache: ResponseCache,
               cached_anywhere: "set[str]", now: float, joined: "frozenset[int]" = frozenset()) -> "list[Response]":
        """Responses for this round. Pure with respect to ``cache``: every rank,
        this one included, applies the responses afterwards."""
        responses: "list[Response]" = []
        invalidated: "set[str]" = set()
        for rank, (reports, _) in enumerate(gathered):
            for name, meta, description in reports:
                if name in cache.entries and name in cached_anywhere and name not in invalidated:
                    # Some ranks hold this op under its cached metadata, this one under
                    # other metadata: drop the entry so every rank reports it afresh.
                    responses.append(Response(Verdict.INVALIDATE, name))
                    invalidated.add(name)
                self.reported.setdefault(name, {})[rank] = (meta, description)
                self.first_seen.setdefault(name, now)
        next_bit = len(cache.names)
        for name in list(self.reported):
            by_rank = self.reported[name]
            # Ranks that have joined (hvd.join()) never submit: the others decide.
            if len(by_rank.keys() | joined) < self.size:
                continue
            del self.reported[name]
            self.forget(name)
            metas = [by_rank[r][0] for r in sorted(by_rank)]
            if all(m == metas[0] for m in metas):
                if name in cache.entries and name not in invalidated:
                    bit = cache.entries[name][0]  # same name, new metadata everywhere: update
                elif cache.cacheable(name) and next_bit < CACHE_CAPACITY:
                    bit, next_bit = next_bit, next_bit + 1
                else:
                    bit = -1
                responses.append(Response(Verdict.READY, name, bit, metas[0]))
            else:
                lines = "; ".join(f"rank {self.members[r]}: {by_rank[r][1]}" for r in sorted(by_rank))
                responses.append(Response(Verdict.MISMATCH, name, message=(
                    f"ranks submitted op {name!r} with different arguments ({lines}); every rank must "
                    f"submit the same dtype, shape, op and root for the same name")))
        if any(pending is not None for _, pending in gathered):
            responses += self._stall_report(gathered, now)
        return responses

    def _stall_report(self, gathered: list, now: float) -> "list[Response]":
        holders: "dict[str, list[int]]" = {}
        for rank, (_, pending) in enumerate(gathered):
            for name in pending or ():
                holders.setdefault(name, []).append(rank)
        stalled = []
        responses = []
        for name, ranks in sorted(holders.items()):
            if len(ranks) == self.size:
                continue
            age = now - self.first_seen.get(name, now)
            missing = [self.members[r] for r in range(self.size) if r not in ranks]
            ranks = [self.members[r] for r in ranks]
            text = (f"op {name!r} was submitted by rank(s) {ranks} {age:.0f}s ago but not yet by "
                    f"rank(s) {missing}")
            if self.shutdown_seconds > 0 and age > self.shutdown_seconds:
                responses.append(Response(Verdict.STALLED, name, message=(
                    f"stalled: {text}; giving up after MTRAIN_STALL_SHUTDOWN_SECONDS="
                    f"{self.shutdown_seconds:g}. Make every rank submit the same ops (same names)")))
                self.forget(name)
            elif age > self.warn_seconds and name not in self.warned:
                stalled.append(text)
                self.warned.add(name)
        if stalled:
            sys.stderr.write("mtrain: stall warning: " + "; ".join(stalled) +
                             ". One rank may be stuck, or ranks submit different ops; "
                             "MTRAIN_STALL_SHUTDOWN_SECONDS=<s> makes this an error\n")
            sys.stderr.flush()
        return responses
