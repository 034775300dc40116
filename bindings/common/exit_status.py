"""A rank's exit status, from the rank runner that learns it to the runtime's exit handler.

The interpreter does not tell exit handlers its status.  Under ``mtrain run`` a rank's program
runs through ``mtrain.launcher.pymain``, which notes the status of whatever leaves the main
module (``set_final``); the runtime's exit handler (``mtrain.ringreduce.exits``) reads it here
(``final_status``).  ``abort_mpi_at_exit`` is the one place that turns an error status into
``MPI_Abort``: Open MPI 5's ``MPI_Finalize`` waits for every rank, so a rank that ends with an
error must abort or it waits for as long as the others train.

Stdlib only, and it never starts MPI: it only looks at an ``mpi4py.MPI`` the program imported.
"""
from __future__ import annotations

import os
import sys
from typing import Any

from mtrain.common.records.elastic import ENV_ELASTIC, RESET_EXIT_STATUS

_final: "int | None" = None  # the status the program ended with (None: still running, or not run by pymain)


def final_status() -> "int | None":
    """The exit status of the program the rank runner ran, once it has ended (else None)."""
    return _final


def set_final(status: int) -> None:
    """The rank runner's note: the program ended with ``status``."""
    global _final
    _final = status


def status_of(code: Any) -> int:
    """The process status ``SystemExit(code)`` ends with (as the interpreter computes it)."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    return 1  # a message: printed, then status 1


def abort_mpi_at_exit(status: int) -> bool:
    """Make an error ``status`` end MPI with ``MPI_Abort(status)`` at exit instead of waiting in
    ``MPI_Finalize`` for the other ranks; True when it did.  Status 0, and the status every rank of
    an elastic job leaves with to start the next generation together, finalize as usual."""
    if not status or (status == RESET_EXIT_STATUS and os.environ.get(ENV_ELASTIC)):
        return False
    mpi = sys.modules.get("mpi4py.MPI")  # the program's own MPI, if it started one: never start one here
    if mpi is None or not mpi.Is_initialized() or mpi.Is_finalized():
        return False
    mpi._set_abort_status(status)  # mpi4py's exit hook then calls MPI_Abort(status), not MPI_Finalize
    return True
