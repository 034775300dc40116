"""The steady batch: a step that submits the same cached ops, in the same order, as a step before.

Such a step needs no lookup per op: the names and signatures are compared as two lists, and the
vector, the agreed order of execution and the plan are the ones learned the first time.
"""
from __future__ import annotations

import operator
from typing import Any

import numpy as np

from mtrain.ringreduce.core.requests import RequestState
from mtrain.ringreduce.negotiation.vector import Control, Negotiator, VectorLayout

_NAME = operator.attrgetter("name")
_SIGNATURE = operator.attrgetter("signature")


class SteadyBatch:
    """A batch that ran whole in the cycle that took it, every op cached: the names and
    signatures in the order they were submitted, and what a cycle derives from them (this
    rank's vector, the agreed order of execution, the plan). A training step submits the same
    batch again, in the same order; ``matches`` checks that with two C-level list comparisons
    instead of a lookup per op.

    Valid only while the response cache stays as it was (``ResponseCache.version``): the
    bits, and so the vector and the order, come from it."""

    __slots__ = ("names", "signatures", "bits", "order", "ready_names", "vector", "send", "layout", "version",
                 "expected", "head", "nobody", "plan", "nbytes")

    def __init__(self, requests: "list[Any]", version: int, negotiator: Negotiator, layout: VectorLayout) -> None:
        self.names = list(map(_NAME, requests))
        self.signatures = list(map(_SIGNATURE, requests))
        self.bits = [request.bit for request in requests]
        # The agreed order is ascending bit order (what decode gives), whatever the submission order.
        self.order = sorted(range(len(requests)), key=self.bits.__getitem__)
        self.ready_names = [self.names[i] for i in self.order]
        # What this rank sends: these bits, no news, this rank busy.
        self.vector = negotiator.vector(layout, self.bits, Control.NONE, leaving=False, busy=True, joined=False)[1]
        self.send = negotiator.packed(self.vector)  # what the exchange sends (Negotiator.exchange_packed)
        self.layout, self.version = layout, version
        # Every rank must have sent exactly these cache bits, no control word and no "leaving"
        # bit, and nobody may have joined, for the batch to run as it is.
        self.expected = self.vector[:layout.words].tobytes()
        # The OR half's complement, as exchanged: these bits, no news, nobody leaving; nobody joined.
        self.head = (~self.vector[:layout.busy_at]).tobytes()
        self.nobody = b"\xff" * (8 * (layout.length - layout.joined_at))
        self.plan: Any = None  # fusion.Plan, made at its first run
        self.nbytes = 0  # its arrays' bytes (set by the engine, which knows arrays)

    @staticmethod
    def learn(requests: "list[Any]", version: int, negotiator: Negotiator,
              layout: VectorLayout) -> "SteadyBatch | None":
        """``requests`` as a steady batch, or None if not every one is cached."""
        cached = RequestState.CACHED
        if not all(request.state is cached for request in requests):
            return None  # unnamed ops (never cached) go through the coordinator every time
        return SteadyBatch(requests, version, negotiator, layout)

    def matches(self, incoming: "list[Any]", version: int) -> bool:
        if len(incoming) == 1:  # a lone op (signatures are interned: ``requests.intern``, mostly)
            op, kept = incoming[0], self.signatures[0]
            return (version == self.version and len(self.names) == 1 and op.name == self.names[0]
                    and (op.signature is kept or op.signature == kept))
        return (version == self.version and len(incoming) == len(self.names)
                and list(map(_NAME, incoming)) == self.names
                and list(map(_SIGNATURE, incoming)) == self.signatures)

    def agreed(self, everywhere: np.ndarray, not_anywhere: np.ndarray) -> bool:
        """Whether every rank sent this batch and nothing else: then it runs as learned.
        ``not_anywhere``: the complement of the OR half, as ``exchange_packed`` returns it."""
        layout = self.layout
        return (everywhere[:layout.words].tobytes() == self.expected
                and not_anywhere[:layout.busy_at].tobytes() == self.head
                and not_anywhere[layout.joined_at:].tobytes() == self.nobody)

    def place(self, incoming: "list[Any]") -> None:
        """Another rank differed: these ops become ordinary cached pending ops."""
        for request, bit in zip(incoming, self.bits):
            request.cache_at(bit)
