"""mpi4py's ``MPI`` module for the runtime, imported when MPI must start and not before.

Importing ``mpi4py.MPI`` runs ``MPI_Init``.  So no module of the runtime imports it when it is
imported itself: each binds ``MPI = mpi.deferred(__name__)``, a stand-in that ``start()``
replaces in every such module with mpi4py's own module.  After that the modules' ``MPI`` is
mpi4py's, looked up as any global (nothing on the hot path goes through the stand-in).  A use
before ``start()`` starts MPI then, as an import of mpi4py would.

When MPI starts:

* in a process an MPI launcher started (mpirun, ``mtrain run``, srun: ``launched()``), when the
  runtime is imported (``ringreduce/__init__.py`` calls ``start_if_launched``).  ``MPI_Init`` is
  collective there (Open MPI's PMIx fence waits for every process of the job), so every rank
  joins MPI as soon as it imports mtrain: a rank that calls ``init()`` late, never (an
  ``init(comm=[...])`` of the other ranks), or leaves before it, is still a rank the others meet
  in MPI, and the others wait for it in ``init()``, where the supervisor sees them
  (records.phase.PhaseNote), not in an ``MPI_Init`` nobody can see into;
* anywhere else (``python train.py``, a test collector, ``mtrain check``, a tool that wants a
  type), at ``init()``, and not at all for a program that only imports.

A program that imports mpi4py itself, before or after ``import mtrain``, gets MPI initialised as
it always does, and ``start()`` then finds that MPI.
"""
from __future__ import annotations

import os
import sys
from types import ModuleType
from typing import Any

_LAUNCHED = ("OMPI_COMM_WORLD_SIZE", "PMIX_RANK", "PMI_RANK", "PMI_SIZE")
_importers: "list[str]" = []  # the modules whose ``MPI`` start() binds


class _Deferred:
    """The ``MPI`` of a runtime module until ``start()``: its first attribute starts MPI."""

    def __getattr__(self, name: str) -> Any:
        return getattr(start(), name)

    def __repr__(self) -> str:
        return "<mpi4py.MPI, imported at mtrain's init()>"


_DEFERRED = _Deferred()


def deferred(module: str) -> Any:
    """The ``MPI`` for module ``module``: mpi4py's once started, else the stand-in."""
    started = sys.modules.get("mpi4py.MPI")
    if started is not None:
        return started
    _importers.append(module)
    return _DEFERRED


def launched() -> bool:
    """Whether an MPI launcher started this process (its variables are in the environment)."""
    return any(key in os.environ for key in _LAUNCHED)


def start_if_launched() -> None:
    """Start MPI now if an MPI launcher started this process (see the module's docstring)."""
    if launched():
        start()


def start() -> ModuleType:
    """Import mpi4py's MPI (which initialises MPI unless the program did) and bind it everywhere.

    A program started without a launcher (``python train.py``) is an MPI singleton: one rank,
    which needs no shared-memory transport, and Open MPI 5's singleton leaves that transport's
    16 MiB segment in /dev/shm when it ends, whatever way.  So a singleton's MPI_Init sees btl
    "self" (a user's own OMPI_MCA_btl wins), and the setting is gone again before the program
    starts anything (a job of its own)."""
    if "mpi4py.MPI" in sys.modules:
        from mpi4py import MPI
    elif launched() or "OMPI_MCA_btl" in os.environ:
        from mpi4py import MPI
    else:
        os.environ["OMPI_MCA_btl"] = "self"
        try:
            from mpi4py import MPI  # (MPI_Init reads it here)
        finally:
            del os.environ["OMPI_MCA_btl"]
    while _importers:
        module = sys.modules.get(_importers.pop())
        if module is not None and getattr(module, "MPI", None) is _DEFERRED:
            module.MPI = MPI
    return MPI
