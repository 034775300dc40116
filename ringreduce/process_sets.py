"""Process sets: subsets of the ranks that run collectives among themselves.

A ``ProcessSet`` names its ranks (global ranks, sorted) or an mpi4py
communicator. ``init(process_sets=[...])`` registers sets at start-up;
``add_process_set`` and ``remove_process_set`` change them later; every rank
makes the same calls in the same order, members or not. Each registered set
has an id (0 is ``global_process_set``, every rank) and, on its members, its
own communicators and its own engine (``engine.py``): its own background
thread and negotiation, so ops on different sets never wait for each other.

Ops take ``process_set=``; a ``root_rank`` stays a global rank (as in Horovod),
while results such as an allgather's are ordered by rank within the set
(``ProcessSet.rank()``).
"""
from __future__ import annotations

from typing import Any, Optional, Sequence

from mpi4py import MPI


class ProcessSet:
    """A set of ranks that run collectives together (Horovod's ``hvd.ProcessSet``).

    ``ProcessSet([0, 2])`` or ``ProcessSet(comm)`` for an mpi4py communicator; pass it to
    ``init(process_sets=[...])`` or ``add_process_set``, then as ``process_set=`` to ops.
    """

    process_set_id: "int | None" = None
    ranks: "list[int] | None" = None
    mpi_comm: "MPI.Comm | None" = None

    def __init__(self, ranks_or_comm: "Sequence[int] | MPI.Comm") -> None:
        if isinstance(ranks_or_comm, MPI.Comm):
            self.mpi_comm = ranks_or_comm
            return
        try:
            ranks = list(ranks_or_comm)
        except TypeError:
            raise ValueError("ProcessSet takes a list of ranks or an mpi4py communicator, got "
                             f"{type(ranks_or_comm).__name__}") from None
        if any(isinstance(r, bool) or not isinstance(r, int) for r in ranks):
            raise ValueError(f"ProcessSet takes a list of integer ranks, got {ranks!r}")
        if len(set(ranks)) != len(ranks):
            raise ValueError(f"ProcessSet ranks must be distinct, got {ranks!r}")
        self.ranks = sorted(ranks)

    def _invalidate(self) -> None:
        self.process_set_id = None

    def size(self) -> Optional[int]:
        """Number of ranks in the set, or None before the set is registered."""
        if self.process_set_id is None:
            return None
        return _registry().state(self).size

    def rank(self) -> Optional[int]:
        """This process's rank within the set, or None before the set is registered.

        Ops still take global ranks (``root_rank``); this rank orders results such as an
        allgather's. Raises ValueError on a rank outside the set."""
        if self.process_set_id is None:
            return None
        state = _registry().state(self)
        if state.rank < 0:
            raise ValueError(f"this process (rank {state.global_rank}) is not part of {self}")
        return state.rank

    def included(self) -> Optional[bool]:
        """Whether this process belongs to the set, or None before the set is registered."""
        if self.ranks is None or self.process_set_id is None:
            return None
        return _registry().state(self).rank >= 0

    def __str__(self) -> str:
        return f"ProcessSet(process_set_id={self.process_set_id}, ranks={self.ranks}, mpi_comm={self.mpi_comm})"

    __repr__ = __str__


global_process_set = ProcessSet([])
global_process_set.process_set_id = 0

_registry_of: "Any" = None  # set by runtime.py: a callable returning the live registry


def _registry() -> Any:
    if _registry_of is None:  # pragma: no cover - runtime.py sets it on import
        raise RuntimeError("mtrain's runtime is not loaded")
    return _registry_of()
