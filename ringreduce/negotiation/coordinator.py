"""The coordinator: rank 0 decides, identically for every rank, what happens to ops not cached.

Ops not in the response cache are reported to rank 0 (``messages.Report``), which keeps a table of who
submitted what.  When all ranks have reported a name it checks their signatures agree, assigns
a cache bit, and every rank gets the decision (``Response``); if they disagree, an error naming
each rank's submission.  A rank that refused its own arguments at submission reports a
``Refusal`` under the name instead: every rank then raises that rank's error class.  When one
part of a grouped op fails, so do the rest of its parts.  A cached name that some ranks hold by
its bit while others report it with new arguments is invalidated at the next cycle.  The stall
inspector (``stall.py``) watches the ops still undecided.

``decide`` is pure with respect to the cache: every rank, rank 0 included, applies the
responses afterwards (``ResponseCache.apply``).
"""
from __future__ import annotations

import dataclasses
from typing import Iterable, Sequence

from mtrain.ringreduce.core.errors import Refusal, Verdict
from mtrain.ringreduce.negotiation.cache import ResponseCache
from mtrain.ringreduce.negotiation.messages import Gathered, Report, Response
from mtrain.ringreduce.negotiation.stall import StallInspector


class Coordinator:
    """Rank 0's bookkeeping: who reported which op, and the decisions."""

    def __init__(self, size: int, warn_seconds: float, shutdown_seconds: float,
                 members: "Sequence[int] | None" = None) -> None:
        self.size = size
        self.members = list(members) if members is not None else list(range(size))  # names in messages
        self.stall = StallInspector(size, self.members, warn_seconds, shutdown_seconds)
        self._reported: "dict[str, dict[int, Report]]" = {}
        # (rank, group) -> the parts of that rank's grouped op still reported and undecided. When
        # one part fails, so do the rest: a rank that grouped more tensors than the others would
        # otherwise keep parts nobody else submits, which a later op of that name would meet.
        self._groups: "dict[tuple[int, int], set[str]]" = {}
        # Cached ops pending on some ranks while others reported the same name afresh (new
        # arguments, or a refusal): those ranks wait on a cache bit the others never set, so
        # the next cycle must coordinate (``after_round``) to invalidate the entry.
        self._conflicts = False

    def after_round(self, ran: Iterable[str], partial: Sequence[str], now: float) -> bool:
        """The bookkeeping after every cycle: the ops that ran are no longer watched, and
        ``partial`` (cached ops pending on some ranks but not all) are. Returns whether the
        next cycle must coordinate: a stall to warn about or end, or a conflict."""
        stall = self.stall
        stall.forget(ran)
        reported = self._reported
        for name in partial:
            stall.seen(name, now)
            if name in reported:
                self._conflicts = True
        return self._conflicts or stall.due(now)

    def undecided(self) -> "list[str]":
        """The names some rank reported that are not decided yet."""
        return sorted(self._reported)

    def _drop(self, name: str) -> "dict[int, Report]":
        """Remove ``name``'s reports (its op is decided, or ended); returns them."""
        by_rank = self._reported.pop(name, {})
        for rank, report in by_rank.items():
            if report.group:
                parts = self._groups.get((rank, report.group))
                if parts is not None:
                    parts.discard(name)
                    if not parts:
                        del self._groups[(rank, report.group)]
        return by_rank

    def _siblings(self, by_rank: "dict[int, Report]") -> "list[str]":
        """The other parts, still undecided, of the grouped ops these reports belong to."""
        names: "set[str]" = set()
        for rank, report in by_rank.items():
            if report.group:
                names |= self._groups.get((rank, report.group), set())
        return sorted(names)

    def _record(self, gathered: "Sequence[Gathered]", now: float) -> None:
        for rank, sent in enumerate(gathered):
            for report in sent.reports:
                report = Report(*report)
                name = report.name
                self._reported.setdefault(name, {})[rank] = report
                self.stall.seen(name, now)
                if report.group:
                    self._groups.setdefault((rank, report.group), set()).add(name)

    def decide(self, gathered: "Sequence[Gathered]", cache: ResponseCache, cached_anywhere: "set[str]",
               now: float, joined: "frozenset[int]" = frozenset()) -> "list[Response]":
        """Responses for this round, from every rank's ``Gathered`` (by engine rank)."""
        gathered = [Gathered(*sent) for sent in gathered]
        self._record(gathered, now)
        responses: "list[Response]" = []
        invalidated: "set[str]" = set()
        # Some ranks hold an op under its cached metadata, others reported it (now or in an
        # earlier round) under other metadata: drop the entry so every rank reports it afresh.
        for name in self._reported:
            if name in cached_anywhere and cache.holds(name):
                responses.append(Response(Verdict.INVALIDATE, name))
                invalidated.add(name)
        self._conflicts = False
        next_bit = cache.next_bit
        for name in list(self._reported):
            by_rank = self._reported.get(name)
            # Ranks that have joined (hvd.join()) never submit: the others decide.
            if by_rank is None or len(by_rank.keys() | joined) < self.size:
                continue
            self._drop(name)
            self.stall.forget((name,))
            metas = [by_rank[r].signature for r in sorted(by_rank)]
            refused = [r for r in sorted(by_rank) if isinstance(by_rank[r].signature, Refusal)]
            if refused:  # every rank raises the first refusing rank's class
                lines = "; ".join(f"rank {self.members[r]}: {by_rank[r].signature.text}" for r in refused)
                responses.append(Response(Verdict.REFUSED, name, meta=by_rank[refused[0]].signature, message=(
                    f"op {name!r} was refused at submission ({lines}), so no rank runs it; every rank "
                    f"raises that error: fix the arguments there")))
            elif all(m == metas[0] for m in metas):
                if cache.holds(name) and name not in invalidated:
                    bit = cache.bit_of(name)  # same name, new metadata everywhere: update
                elif cache.may_cache(name, next_bit):
                    bit, next_bit = next_bit, next_bit + 1
                else:
                    bit = -1
                responses.append(Response(Verdict.READY, name, bit, metas[0]))
                continue
            else:
                lines = "; ".join(f"rank {self.members[r]}: {by_rank[r].description}" for r in sorted(by_rank))
                responses.append(Response(Verdict.MISMATCH, name, message=(
                    f"ranks submitted op {name!r} with different arguments ({lines}); every rank must "
                    f"submit the same dtype, shape, op and root for the same name")))
            failed = responses[-1]
            for sibling in self._siblings(by_rank):  # the rest of a failed group fails with it
                self._drop(sibling)
                self.stall.forget((sibling,))
                responses.append(dataclasses.replace(failed, name=sibling))
        if any(sent.pending is not None for sent in gathered):
            holders: "dict[str, list[int]]" = {}
            for rank, sent in enumerate(gathered):
                for name in sent.pending or ():
                    holders.setdefault(name, []).append(rank)
            for stalled in self.stall.inspect(holders, now):
                # The reports end with the op: a rank that submits the name later starts afresh
                # (and stalls in turn) instead of completing the stale reports of ops that failed.
                self._drop(stalled.name)
                responses.append(Response(Verdict.STALLED, stalled.name, message=stalled.message))
        return responses
