"""How a rank leaves the job, so that every way of leaving ends the job or finishes it cleanly.

Open MPI 5's ``MPI_Finalize`` waits (a PMIx fence) until every other rank
finalizes too.  A rank that ends with an error status while the others are
busy outside MPI (loading data, evaluating, checkpointing) would wait there
forever, and the launcher would never see its status.  So, at exit:

* an error status (``sys.exit(7)``, ``exit("message")``, an uncaught
  ``KeyboardInterrupt``) makes mpi4py end MPI with ``MPI_Abort(status)``
  instead of ``MPI_Finalize``: Open MPI stops the other ranks at once, and the
  rank's own status is what the launcher reports (the engine is not shut down
  politely first: the other ranks would fail on that news and race the abort);
* status 0 shuts the engine down, so that ops other ranks still have in
  flight, or submit later, fail with a ``ShutdownError`` naming this rank,
  then finalizes as usual, waiting for the ranks still at work.

The interpreter does not tell exit handlers its exit status.  Under ``mtrain run``
a rank's Python program runs through ``mtrain.launcher.pymain``, which notes the status
of whatever leaves the main module (``raise SystemExit(n)``, an exception, a thread's
SystemExit raised again in the main thread): however the program spells its exit, the
handler reads it there.  A program started otherwise (plain ``mpirun python ...``) has
only what ``sys.exit`` (and the ``exit``/``quit`` builtins), wrapped here, noted in the
main thread; a program that catches that SystemExit and goes on (argparse errors inside
``try``) has the note forgotten at its next ``init()`` or collective.  An uncaught
exception never gets here: the abort hook in ``transport/comm.py`` ends the job first.
"""
from __future__ import annotations

import atexit
import builtins
import signal
import socket
import sys
import threading
import time
from typing import Any, Callable

from mtrain.common import exit_status
from mtrain.common.exit_status import status_of
from mtrain.common.records.error_report import supervised
from mtrain.common.records.exit_record import ExitRecord, own_failure_line

_requested: "int | None" = None   # the status sys.exit() was last asked for
_installed = False


def note_status(status: int) -> None:
    global _requested
    _requested = status


def noted_status() -> "int | None":
    """The status ``sys.exit`` (or ``exit``/``quit``) was last asked for in the main thread and
    not forgotten since; None when none is noted."""
    return _requested


def forget_status() -> None:
    """The program went on (it caught the SystemExit): the status noted is not its exit status."""
    global _requested
    _requested = None


def _noting(original: Callable[..., Any]) -> Callable[..., Any]:
    def leave(code: Any = None) -> Any:
        # Only the main thread's SystemExit ends the process (a worker thread's ends that thread).
        if threading.current_thread() is threading.main_thread():
            note_status(status_of(code))
        return original(code)

    leave.__wrapped__ = original  # type: ignore[attr-defined]
    leave.__doc__ = original.__doc__
    return leave


def install(shutdown: Callable[[], None]) -> None:
    """Track exit statuses and run `leave` at exit (once per process)."""
    global _installed
    forget_status()
    if _installed:
        return
    _installed = True
    sys.exit = _noting(sys.exit)
    for name in ("exit", "quit"):
        if hasattr(builtins, name):
            setattr(builtins, name, _noting(getattr(builtins, name)))
    atexit.register(leave, shutdown)


def leave(shutdown: Callable[[], None]) -> None:
    """The exit handler: an error status ends the whole job; status 0 leaves politely."""
    status = exit_status.final_status()
    if status is None:  # not run by mtrain's runner: what sys.exit noted, if anything
        status = _requested or 0
    if exit_status.abort_mpi_at_exit(status):  # MPI_Abort at the interpreter's end: nothing polite first
        if not supervised():  # no mtrain run to name the first failure: say it here
            rank = sys.modules["mpi4py.MPI"].COMM_WORLD.Get_rank()
            sys.stderr.write(own_failure_line(ExitRecord(rank, socket.gethostname(), status, False, time.time())))
            sys.stderr.flush()
        return
    shutdown()


def note_keyboard_interrupt() -> None:
    """An uncaught Ctrl-C ends the rank with the status of SIGINT."""
    note_status(128 + signal.SIGINT)
