"""The negotiation vector: one small all-reduce per cycle tells every rank what every rank holds.

Once an op name has run, every rank knows it as bit ``b`` of the response cache
(``cache.py``).  Each cycle every rank contributes the bits of the cached ops it has pending, and
their complement, to one tiny ``MPI_Allreduce(BAND)``: the first half gives the ops pending
*everywhere* (ready), the complement the ops pending *anywhere* (for the stall inspector), and a
control word carries "someone has uncached ops", "someone is shutting down" and "stall check".
Training steps that repeat the same names need no coordinator round.

This module is the one owner of the vector: its layout (``VectorLayout``), how a rank fills it
(``Negotiator.vector``), the exchange (``Negotiator.exchange``) and what the exchanged halves
mean (``Negotiator.decode`` → ``Agreement``).  The steady batch (``steady.py``) keeps a vector
built by the same ``Negotiator.vector``::

    | cache bits (words × 64) | control | leaving (rank bits) | busy (rank bits) | joined (rank bits) |

Each rank sends (its vector for the AND, the complement of its vector for the OR) in one BAND
all-reduce: AND over the cache bits gives the ops held everywhere, OR gives the ops held
anywhere, the control word and the rank bits are read from the OR.
"""
from __future__ import annotations

import enum
import time
from typing import Any, NamedTuple

import numpy as np


class Control(enum.IntFlag):
    """The control word of the vector: news that makes every rank take the slow path."""

    NONE = 0
    UNREPORTED = 1   # "I have ops the coordinator has not seen"
    SHUTDOWN = 2     # "I am shutting down"
    STALL_CHECK = 4  # rank 0 asks every rank for its pending list


# How long the exchange spins on its all-reduce before it starts to sleep.
SPIN_SECONDS = 300e-6


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
        # building the schedule that each ``Iallreduce`` builds anew: docs/benchmarks.md), or None
        # where the library has none.
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
