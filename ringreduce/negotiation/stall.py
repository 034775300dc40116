"""The stall inspector: which ops some ranks submitted long ago and others not yet.

Rank 0's coordinator keeps one.  It notes when each undecided op was first seen (reported to
the coordinator, or pending by its cache bit on some ranks only), forgets an op once it ran,
says when the next cycle must ask every rank for its pending list (``due``), and turns those
lists into a warning after MTRAIN_STALL_WARNING_SECONDS or, after
MTRAIN_STALL_SHUTDOWN_SECONDS, into the names of ops that end with a StallError on every rank.
"""
from __future__ import annotations

from typing import Callable, Iterable, NamedTuple, Sequence

from mtrain.ringreduce.core import log


class Stalled(NamedTuple):
    """An op the inspector gives up on: it ends with a StallError saying ``message``."""

    name: str
    message: str


class StallInspector:
    """When each undecided op was first seen, and which stalls were already warned about."""

    def __init__(self, size: int, members: Sequence[int], warn_seconds: float, shutdown_seconds: float) -> None:
        self.size = size
        self.members = members  # the engine's ranks as the job's, for messages
        self.warn_seconds = warn_seconds
        self.shutdown_seconds = shutdown_seconds
        self._first_seen: "dict[str, float]" = {}
        self._warned: "set[str]" = set()
        # Told "stall warning" or "stall shutdown" when a round warns of a stall or gives up on one
        # (the flight recorder then asks the supervisor for every rank's dump); None: nobody listens.
        self.on_stall: "Callable[[str], None] | None" = None

    def seen(self, name: str, now: float) -> None:
        """``name`` is undecided as of ``now`` (the first time counts)."""
        self._first_seen.setdefault(name, now)

    def forget(self, names: Iterable[str]) -> None:
        """These ops ran, or ended: nothing of them is watched any more."""
        if self._first_seen or self._warned:  # else there is nothing to forget (the steady state)
            for name in names:
                self._first_seen.pop(name, None)
                self._warned.discard(name)

    def watched(self) -> "dict[str, float]":
        """The ops watched, with the time each was first seen undecided (a copy)."""
        return dict(self._first_seen)

    def warned(self) -> "set[str]":
        """The ops already warned about (a copy)."""
        return set(self._warned)

    def due(self, now: float) -> bool:
        """Whether some op is due a warning, or past the shutdown time."""
        for name, seen in self._first_seen.items():
            age = now - seen
            if age > self.warn_seconds and name not in self._warned:
                return True
            if self.shutdown_seconds > 0 and age > self.shutdown_seconds:
                return True
        return False

    def inspect(self, holders: "dict[str, list[int]]", now: float) -> "list[Stalled]":
        """From who holds which pending op (by engine rank), warn of the stalls that are due (once
        each) and return the ops to end: those past the shutdown time."""
        warnings: "list[str]" = []
        stalled: "list[Stalled]" = []
        for name, ranks in sorted(holders.items()):
            if len(ranks) == self.size:
                continue
            age = now - self._first_seen.get(name, now)
            missing = [self.members[r] for r in range(self.size) if r not in ranks]
            text = (f"op {name!r} was submitted by rank(s) {[self.members[r] for r in ranks]} {age:.0f}s ago "
                    f"but not yet by rank(s) {missing}")
            if self.shutdown_seconds > 0 and age > self.shutdown_seconds:
                stalled.append(Stalled(name, f"stalled: {text}; giving up after MTRAIN_STALL_SHUTDOWN_SECONDS="
                                             f"{self.shutdown_seconds:g}. Make every rank submit the same ops (same names)"))
                self.forget((name,))
            elif age > self.warn_seconds and name not in self._warned:
                warnings.append(text)
                self._warned.add(name)
        if warnings:
            log.warning("stall warning: " + "; ".join(warnings) + ". One rank may be stuck, or ranks submit "
                        "different ops; MTRAIN_STALL_SHUTDOWN_SECONDS=<s> makes this an error")
        if self.on_stall is not None and (warnings or stalled):
            self.on_stall("stall warning" if warnings else "stall shutdown")
        return stalled
