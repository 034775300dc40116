"""The response cache: op name ⇄ bit, kept identical on every rank by applying the same responses.

Once an op name has run, every rank knows it as bit ``b`` of the negotiation vector
(``vector.py``), and a step that submits the same names again needs no coordinator round.
Only the coordinator on rank 0 hands out bits (``Coordinator.decide``); every rank, rank 0
included, applies its responses (``apply``) in the same order, so the caches never differ.
The cache answers questions about its entries; nobody reads them directly.
"""
from __future__ import annotations

from typing import Any, Iterable, Sequence

from mtrain.common.settings import DEFAULT_CACHE_CAPACITY
from mtrain.ringreduce.core.errors import Verdict
from mtrain.ringreduce.core.requests import UNNAMED_PREFIX, RequestState
from mtrain.ringreduce.negotiation.messages import Response

# Names the response cache holds unless told otherwise (settings.CACHE_CAPACITY: the
# engine passes the configured capacity). Auto-named ops are never cached: their names never repeat.
CACHE_CAPACITY = DEFAULT_CACHE_CAPACITY


class ResponseCache:
    """Name ⇄ bit, kept identical on every rank by applying the same responses."""

    __slots__ = ("_capacity", "_entries", "_names", "version")

    def __init__(self, capacity: "int | None" = None) -> None:
        # Bits the coordinator may hand out (only rank 0's cache decides); 0: nothing is cached.
        self._capacity = CACHE_CAPACITY if capacity is None else capacity
        self._entries: "dict[str, tuple[int, Any]]" = {}
        self._names: "list[str | None]" = []  # by bit; None: a tombstone (an invalidated name)
        # Counts the changes that move a cached name's bit or the vector's length (an invalidation,
        # a name cached anew, a new word): what was learned from the bits before is stale then.
        # A name cached for the first time within the current words moves nothing.
        self.version = 0

    @property
    def words(self) -> int:
        """The 64-bit words the cache bits take in the vector."""
        return (len(self._names) + 63) // 64

    @property
    def enabled(self) -> bool:
        return self._capacity > 0

    @property
    def next_bit(self) -> int:
        """The bit the next name cached would get: every bit handed out so far lies below it."""
        return len(self._names)

    def enable(self, capacity: int) -> None:
        """Hand out up to ``capacity`` bits from now on (every rank at the same point)."""
        self._capacity = capacity

    def disable(self) -> None:
        """Cache nothing from now on, and forget every name: what was learned from the bits is
        stale (``version``), and ops pending by their bit must go to the coordinator again."""
        self._capacity = 0
        self._entries.clear()
        self._names.clear()
        self.version += 1

    def lookup(self, name: str, meta: Any) -> int:
        """The cache bit of ``name`` submitted with ``meta``, or -1."""
        entry = self._entries.get(name)
        return entry[0] if entry is not None and entry[1] == meta else -1

    def holds(self, name: str) -> bool:
        """Whether ``name`` is cached (under whatever signature)."""
        return name in self._entries

    def bit_of(self, name: str) -> int:
        """The bit of a cached ``name`` (``holds(name)`` first)."""
        return self._entries[name][0]

    def signature_of(self, name: str) -> Any:
        """The signature a cached ``name`` was agreed with."""
        return self._entries[name][1]

    def names_at(self, bits: Sequence[int]) -> "list[str]":
        """The names of cached ``bits``, in their order."""
        names = self._names
        return [names[bit] for bit in bits]  # type: ignore[misc]  (a bit set by a rank is never a tombstone)

    def may_cache(self, name: str, bit: int) -> bool:
        """Whether the coordinator may hand ``bit`` to ``name``: a name that repeats, within the capacity."""
        return bit < self._capacity and not name.startswith(UNNAMED_PREFIX)

    def mark(self, requests: "Iterable[Any]") -> "tuple[list[int], bool]":
        """Look up every pending request not yet placed: a cached one becomes CACHED with its
        bit. Returns the bits of every CACHED request and whether any is still unreported (it
        goes to the coordinator). ``requests``: core.requests.Request (or AllreduceOp)."""
        bits: "list[int]" = []
        unreported_any = False
        lookup = self.lookup
        unreported, cached = RequestState.UNREPORTED, RequestState.CACHED
        for request in requests:
            state = request.state
            if state is unreported:
                bit = lookup(request.name, request.signature)
                if bit < 0:
                    unreported_any = True
                    continue
                request.cache_at(bit)
                bits.append(bit)
            elif state is cached:
                bits.append(request.bit)
        return bits, unreported_any

    def apply(self, response: Response) -> None:
        """One of the coordinator's responses, as every rank applies it."""
        if response.verdict is Verdict.READY and response.bit >= 0:
            words = self.words
            if response.bit == len(self._names):
                self._names.append(response.name)
            self._names[response.bit] = response.name
            if response.name in self._entries or self.words != words:
                self.version += 1
            self._entries[response.name] = (response.bit, response.meta)
        elif response.verdict is Verdict.INVALIDATE:
            bit, _ = self._entries.pop(response.name)
            self._names[bit] = None  # a tombstone keeps later bits where they are
            self.version += 1
