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
  submission. A rank that refused its own arguments at submission reports a
  ``Refusal`` under the name instead: every rank then raises that rank's error
  class. When one part of a grouped op fails, so do the rest of its parts.
  It also names the ranks missing from a stalled op, and forgets the op's
  reports when the stall ends it. A cached name that some ranks hold by its bit
  while others report it with new arguments is invalidated at the next cycle.

This module is the one owner of the negotiation vector: its layout
(``VectorLayout``), how a rank fills it (``Negotiator.vector``), the
exchange (``Negotiator.exchange``) and what the exchanged halves mean
(``Negotiator.decode`` → ``Agreement``). The steady batch (``SteadyBatch``)
keeps a vector built by the same ``Negotiator.vector``::

    | cache bits (words × 64) | control | leaving (rank bits) | busy (rank bits) | joined (rank bits) |

Each rank sends (its vector for the AND, the complement of its vector for the
OR) in one BAND all-reduce: AND over the cache bits gives the ops held
everywhere, OR gives the ops held anywhere, the control word and the rank
bits are read from the OR.
"""
from __future__ import annotations

import dataclasses
import enum
import operator
import time
from typing import Any, Callable, Iterable, NamedTuple, Sequence

import numpy as np

from mtrain.ringreduce.core import log
from mtrain.ringreduce.core.errors import Refusal, Verdict
from mtrain.common.settings import DEFAULT_CACHE_CAPACITY


class Control(enum.IntFlag):
    """The control word of the vector: news that makes every rank take the slow path."""

    NONE = 0
    UNREPORTED = 1   # "I have ops the coordinator has not seen"
    SHUTDOWN = 2     # "I am shutting down"
    STALL_CHECK = 4  # rank 0 asks every rank for its pending list


# How long the exchange spins on its all-reduce before it starts to sleep.
SPIN_SECONDS = 300e-6

# Names the response cache holds unless told otherwise (settings.CACHE_CAPACITY: the
# engine passes the configured capacity). Auto-named ops are never cached: their names never repeat.
CACHE_CAPACITY = DEFAULT_CACHE_CAPACITY
# Ops submitted without a name are named by a per-rank counter under this prefix
# (``Engine.auto_name``); such names never repeat, so the response cache never keeps them.
UNNAMED_PREFIX = "noname."


class RequestState(enum.Enum):
    """Where one submitted op stands in the negotiation on this rank."""

    UNREPORTED = "unreported"  # neither cached nor reported to the coordinator yet
    REPORTED = "reported"      # sent to the coordinator; waiting for its verdict
    CACHED = "cached"          # known to every rank as a cache bit: goes in the bit vector


class Report(NamedTuple):
    """What a rank tells the coordinator about one op it submitted that is not cached."""

    name: str
    signature: Any    # requests.Signature, or an errors.Refusal
    description: str  # what the rank submitted, for error messages
    group: int = 0    # the parts of one grouped op share it on their rank (0: not grouped)


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

    def __init__(self, capacity: "int | None" = None) -> None:
        # Bits the coordinator may hand out (only rank 0's cache decides); 0: nothing is cached.
        self.capacity = CACHE_CAPACITY if capacity is None else capacity
        self.entries: "dict[str, tuple[int, Any]]" = {}
        self.names: "list[str | None]" = []
        # Counts the changes that move a cached name's bit or the vector's length (an invalidation,
        # a name cached anew, a new word): what was learned from the bits before is stale then.
        # A name cached for the first time within the current words moves nothing.
        self.version = 0

    @property
    def words(self) -> int:
        return (len(self.names) + 63) // 64

    @property
    def enabled(self) -> bool:
        return self.capacity > 0

    def enable(self, capacity: int) -> None:
        """Hand out up to ``capacity`` bits from now on (every rank at the same point)."""
        self.capacity = capacity

    def disable(self) -> None:
        """Cache nothing from now on, and forget every name: what was learned from the bits is
        stale (``version``), and ops pending by their bit must go to the coordinator again."""
        self.capacity = 0
        self.entries.clear()
        self.names.clear()
        self.version += 1

    def lookup(self, name: str, meta: Any) -> int:
        """The cache bit of ``name`` submitted with ``meta``, or -1."""
        entry = self.entries.get(name)
        return entry[0] if entry is not None and entry[1] == meta else -1

    def mark(self, requests: "Iterable[Any]") -> "tuple[list[int], bool]":
        """Look up every pending request not yet placed: a cached one becomes CACHED with its
        bit. Returns the bits of every CACHED request and whether any is still unreported (it
        goes to the coordinator). ``requests``: objects with name, signature, state and bit."""
        bits: "list[int]" = []
        unreported_any = False
        lookup = self.lookup
        unreported, cached = RequestState.UNREPORTED, RequestState.CACHED
        for request in requests:
            state = request.state
            if state is unreported:
                bit = request.bit = lookup(request.name, request.signature)
                if bit < 0:
                    unreported_any = True
                    continue
                request.state = cached
                bits.append(bit)
            elif state is cached:
                bits.append(request.bit)
        return bits, unreported_any

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


def set_bits(words: np.ndarray, bits: "list[int]") -> None:
    """``set_bit`` for many bits at once (one NumPy call, not one per bit)."""
    if bits:
        flags = np.zeros(words.size * 64, dtype=np.bool_)
        flags[bits] = True
        words |= np.packbits(flags, bitorder="little").view(words.dtype)


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
        self.reported: "dict[str, dict[int, Report]]" = {}
        # (rank, group) -> the parts of that rank's grouped op still reported and undecided. When
        # one part fails, so do the rest: a rank that grouped more tensors than the others would
        # otherwise keep parts nobody else submits, which a later op of that name would meet.
        self.groups: "dict[tuple[int, int], set[str]]" = {}
        self.first_seen: "dict[str, float]" = {}
        self.warned: "set[str]" = set()
        # Cached ops pending on some ranks while others reported the same name afresh (new
        # arguments, or a refusal): those ranks wait on a cache bit the others never set, so
        # the next cycle must coordinate (``stall_check_due``) to invalidate the entry.
        self.conflicts = False
        # Told "stall warning" or "stall shutdown" when a round warns of a stall or gives up on one
        # (the flight recorder then asks the supervisor for every rank's dump); None: nobody listens.
        self.on_stall: "Callable[[str], None] | None" = None

    def note_partial(self, names: Sequence[str], now: float) -> None:
        """Cached ops pending on some ranks but not all (from the bit vectors)."""
        reported = self.reported
        for name in names:
            self.first_seen.setdefault(name, now)
            if name in reported:
                self.conflicts = True

    def forget(self, name: str) -> None:
        self.first_seen.pop(name, None)
        self.warned.discard(name)

    def _drop(self, name: str) -> "dict[int, Report]":
        """Remove ``name``'s reports (its op is decided, or ended); returns them."""
        by_rank = self.reported.pop(name, {})
        for rank, report in by_rank.items():
            if report.group:
                parts = self.groups.get((rank, report.group))
                if parts is not None:
                    parts.discard(name)
                    if not parts:
                        del self.groups[(rank, report.group)]
        return by_rank

    def _siblings(self, by_rank: "dict[int, Report]") -> "list[str]":
        """The other parts, still undecided, of the grouped ops these reports belong to."""
        names: "set[str]" = set()
        for rank, report in by_rank.items():
            if report.group:
                names |= self.groups.get((rank, report.group), set())
        return sorted(names)

    def stall_check_due(self, now: float) -> bool:
        """Whether the next cycle must coordinate: a stall to warn about or end, or a conflict."""
        if self.conflicts:
            return True
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
            for report in reports:
                report = Report(*report)
                name = report.name
                self.reported.setdefault(name, {})[rank] = report
                self.first_seen.setdefault(name, now)
                if report.group:
                    self.groups.setdefault((rank, report.group), set()).add(name)
        # Some ranks hold an op under its cached metadata, others reported it (now or in an
        # earlier round) under other metadata: drop the entry so every rank reports it afresh.
        for name in self.reported:
            if name in cache.entries and name in cached_anywhere:
                responses.append(Response(Verdict.INVALIDATE, name))
                invalidated.add(name)
        self.conflicts = False
        next_bit = len(cache.names)
        for name in list(self.reported):
            by_rank = self.reported.get(name)
            # Ranks that have joined (hvd.join()) never submit: the others decide.
            if by_rank is None or len(by_rank.keys() | joined) < self.size:
                continue
            self._drop(name)
            self.forget(name)
            metas = [by_rank[r].signature for r in sorted(by_rank)]
            refused = [r for r in sorted(by_rank) if isinstance(by_rank[r].signature, Refusal)]
            if refused:  # every rank raises the first refusing rank's class
                lines = "; ".join(f"rank {self.members[r]}: {by_rank[r].signature.text}" for r in refused)
                responses.append(Response(Verdict.REFUSED, name, meta=by_rank[refused[0]].signature, message=(
                    f"op {name!r} was refused at submission ({lines}), so no rank runs it; every rank "
                    f"raises that error: fix the arguments there")))
            elif all(m == metas[0] for m in metas):
                if name in cache.entries and name not in invalidated:
                    bit = cache.entries[name][0]  # same name, new metadata everywhere: update
                elif cache.cacheable(name) and next_bit < cache.capacity:
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
                self.forget(sibling)
                responses.append(dataclasses.replace(failed, name=sibling))
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
                # The reports end with the op: a rank that submits the name later starts afresh
                # (and stalls in turn) instead of completing the stale reports of ops that failed.
                self._drop(name)
            elif age > self.warn_seconds and name not in self.warned:
                stalled.append(text)
                self.warned.add(name)
        if stalled:
            log.warning("stall warning: " + "; ".join(stalled) + ". One rank may be stuck, or ranks submit "
                        "different ops; MTRAIN_STALL_SHUTDOWN_SECONDS=<s> makes this an error")
        if self.on_stall is not None and (stalled or responses):
            self.on_stall("stall warning" if stalled else "stall shutdown")
        return responses


class VectorLayout:
    """Where each part of the vector lies, for a cache of ``words`` words and ``size`` ranks."""

    __slots__ = ("words", "leaving_at", "busy_at", "joined_at", "length")

    def __init__(self, words: int, size: int) -> None:
        rank_words = (size + 63) // 64
        self.words = words  # the control word is at index ``words``
        self.leaving_at = words + 1
        self.busy_at = self.leaving_at + rank_words
        self.joined_at = self.busy_at + rank_words
        self.length = self.joined_at + rank_words


class Agreement(NamedTuple):
    """What every rank learns from one exchange (identical on every rank)."""

    control: Control
    ready: "list[int]"    # cache bits held by every rank that has not joined
    partial: "list[int]"  # cache bits held by some ranks but not all
    leaving: "list[int]"  # ranks (of the engine's communicator) shutting down
    busy: "list[int]"     # ranks with ops pending
    joined: "list[int]"   # ranks that have joined (hvd.join())


class Negotiator:
    """Builds this rank's vector, exchanges it over the control communicator, decodes the result."""

    def __init__(self, control: Any, rank: int, size: int) -> None:
        self._comm = control
        self._band: Any = None  # MPI.BAND, looked up at the first exchange (building and decoding need no MPI)
        self.rank, self.size = rank, size
        self._layouts: "dict[int, VectorLayout]" = {}
        # Reused by every exchange, by length: the buffer sent (the vectors are copied into it),
        # the one received (what the exchange returns views of), and a persistent all-reduce
        # of the one into the other (``MPI_Allreduce_init``, MPI 4: started each round, it skips
        # building the schedule that each ``Iallreduce`` builds anew, 0.5-0.9 us of the ~1.9 us
        # a round takes at 2 ranks on the test VM), or None where the library has none.
        self._rounds: "dict[int, tuple[np.ndarray, np.ndarray, Any]]" = {}

    def layout(self, words: int) -> VectorLayout:
        layout = self._layouts.get(words)
        if layout is None:
            layout = self._layouts[words] = VectorLayout(words, self.size)
        return layout

    def vector(self, layout: VectorLayout, cached: "list[int]", control: int, leaving: bool, busy: bool,
               joined: bool) -> "tuple[np.ndarray, np.ndarray]":
        """This rank's (AND half, OR half): ``cached`` bits, the control word, and this rank's
        leaving / busy / joined bits. A joined rank agrees to every cached op (its AND half has
        every cache bit set) yet holds none, so an op is ready once every other rank holds it."""
        mine = np.zeros(layout.length, dtype=np.uint64)
        set_bits(mine, cached)
        mine[layout.words] = np.uint64(control)
        if leaving:
            set_bit(mine[layout.leaving_at:layout.busy_at], self.rank)
        if busy:
            set_bit(mine[layout.busy_at:layout.joined_at], self.rank)
        if not joined:
            return mine, mine
        set_bit(mine[layout.joined_at:], self.rank)
        mine_and = mine.copy()
        mine_and[:layout.words] = ~np.uint64(0)
        return mine_and, mine

    def exchange(self, mine_and: np.ndarray, mine_or: np.ndarray) -> "tuple[np.ndarray, np.ndarray]":
        """Bitwise AND of every rank's ``mine_and`` and OR of every rank's ``mine_or``, from one
        BAND all-reduce of (x, ~y): (everywhere, anywhere), views valid until the next exchange."""
        half = mine_and.size
        send, recv, request = self._round(2 * half)
        send[:half] = mine_and
        np.invert(mine_or, out=send[half:])
        everywhere, inverted = self._run(send, recv, request)
        return everywhere, np.invert(inverted, out=inverted)

    @staticmethod
    def packed(vector: np.ndarray) -> np.ndarray:
        """What ``exchange(vector, vector)`` sends, made once (a steady batch sends it every step)."""
        return np.concatenate([vector, ~vector])

    def exchange_packed(self, packed: np.ndarray) -> "tuple[np.ndarray, np.ndarray]":
        """``exchange`` of an AND half and an inverted OR half already side by side in ``packed``,
        but the second view returned is the OR's complement, as exchanged (``SteadyBatch.agreed``
        compares it with what it expects as it is; ``anywhere`` makes it the OR, in place)."""
        send, recv, request = self._round(packed.size)
        send[...] = packed
        return self._run(send, recv, request)

    def _round(self, length: int) -> "tuple[np.ndarray, np.ndarray, Any]":
        """The buffers and the persistent request of an exchange of ``length`` words.
        ``MPI_Allreduce_init`` is collective: every rank makes the request of a new length in
        the same cycle, as every rank exchanges vectors of the same length in each cycle (the
        length follows the response cache, which is the same everywhere)."""
        found = self._rounds.get(length)
        if found is None:
            from mpi4py import MPI
            self._band = MPI.BAND
            send = np.zeros(length, dtype=np.uint64)
            recv = np.empty_like(send)
            try:
                request = self._comm.Allreduce_init(send, recv, op=MPI.BAND)
            except (AttributeError, NotImplementedError, MPI.Exception):  # an MPI before 4.0
                request = None
            found = self._rounds[length] = (send, recv, request)
        return found

    def _run(self, send: np.ndarray, recv: np.ndarray, request: Any) -> "tuple[np.ndarray, np.ndarray]":
        if request is None:
            request = self._comm.Iallreduce(send, recv, op=self._band)
        else:
            request.Start()
        # Spin briefly (peers usually arrive within microseconds, and a sleep here
        # lasts 60 us or more), then poll with a growing sleep rather than blocking:
        # a blocked Open MPI rank busy-spins a core that belongs to the user's
        # training thread while the other ranks are still computing.
        if not request.Test():
            spin_until = time.perf_counter() + SPIN_SECONDS
            naps = 0
            while not request.Test():
                if time.perf_counter() > spin_until:
                    naps += 1
                    time.sleep(min(1e-3, 2e-5 * naps))
        half = send.size // 2
        return recv[:half], recv[half:]

    @staticmethod
    def anywhere(inverted: np.ndarray) -> np.ndarray:
        """The OR half from the complement ``exchange_packed`` returns (in place)."""
        return np.invert(inverted, out=inverted)

    def close(self) -> None:
        """Free the persistent requests, before the communicator. One still active (an exchange
        that a failure or an interrupt left unfinished: freeing it would be erroneous) is left."""
        from mpi4py import MPI
        for _, _, request in self._rounds.values():
            if request is None:
                continue
            try:
                if request.Test():  # an inactive request tests complete at once
                    request.Free()
            except MPI.Exception:  # the communicator failed with a peer: nothing to free safely
                pass
        self._rounds.clear()

    @staticmethod
    def decode(layout: VectorLayout, everywhere: np.ndarray, anywhere: np.ndarray) -> Agreement:
        words = layout.words
        held_anywhere = anywhere[:words]
        return Agreement(
            control=Control(int(anywhere[words])),
            ready=bits_of(everywhere[:words] & held_anywhere),
            partial=bits_of(held_anywhere & ~everywhere[:words]),
            leaving=bits_of(anywhere[layout.leaving_at:layout.busy_at]),
            busy=bits_of(anywhere[layout.busy_at:layout.joined_at]),
            joined=bits_of(anywhere[layout.joined_at:]))


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
        cached = RequestState.CACHED
        for request, bit in zip(incoming, self.bits):
            request.state, request.bit = cached, bit
