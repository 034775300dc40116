"""MPI setup: the world, local (same host) and cross (same local rank) communicators."""
from __future__ import annotations

import dataclasses
import socket
import sys
import time
import traceback

from mtrain.common.records.error_report import FailureCause, report_error, supervised
from mtrain.common.records.exit_record import ExitRecord, own_failure_line
from mtrain.common.records.user_frames import user_line
from mtrain.ringreduce import exits

# The background engine makes every MPI call of the runtime from one thread that
# is not the main thread: that needs MPI_THREAD_SERIALIZED. mpi4py asks for
# MULTIPLE by default, which also lets user code call MPI from its own threads.
from mtrain.ringreduce.transport import mpi

MPI = mpi.deferred(__name__)  # mpi4py's MPI from init() on (importing the runtime starts no MPI)


@dataclasses.dataclass(frozen=True)
class Communicators:
    """Private duplicates of the user's communicator, so our messages never meet theirs.

    ``p2p`` carries the point-to-point transfers (``p2p.py``) of the set these are made for, and
    nothing else: its tags are the users' own."""

    world: MPI.Comm
    local: MPI.Comm
    cross: MPI.Comm
    p2p: MPI.Comm

    def free(self) -> None:
        for comm in (self.p2p, self.cross, self.local, self.world):
            if comm != MPI.COMM_NULL:
                comm.Free()


def create(parent: "MPI.Comm | None" = None) -> Communicators:
    """Split ``parent`` (default COMM_WORLD) into world/local/cross communicators.

    ``local`` groups the ranks that share memory (MPI's own notion of a host),
    ``cross`` groups the ranks with the same local rank across hosts.
    """
    world = (parent or MPI.COMM_WORLD).Dup()
    local = world.Split_type(MPI.COMM_TYPE_SHARED, key=world.Get_rank())
    cross = world.Split(color=local.Get_rank(), key=world.Get_rank())
    return Communicators(world=world, local=local, cross=cross, p2p=world.Dup())


def threading_level_ok() -> bool:
    return MPI.Query_thread() >= MPI.THREAD_SERIALIZED


_installed = False


def install_abort_on_exception() -> None:
    """An uncaught exception in any rank aborts the whole job instead of hanging the rest.

    The traceback is printed first, then a line naming the rank (and, for a failure caused by
    ranks that left first, those ranks), so the report names the culprit.
    """
    global _installed
    if _installed:
        return
    _installed = True
    previous_hook = sys.excepthook

    def abort_hook(kind, value, tb):  # type: ignore[no-untyped-def]
        if kind is KeyboardInterrupt or MPI.COMM_WORLD.Get_size() == 1:
            if kind is KeyboardInterrupt:
                exits.note_keyboard_interrupt()  # end the job at exit, not wait for the others
            previous_hook(kind, value, tb)
            return
        rank = MPI.COMM_WORLD.Get_rank()
        # Tell the launcher whether this failure began here or was caused by a rank that left.
        peers = getattr(value, "peers", None)
        cause = FailureCause.PEER if peers else FailureCause.OWN
        report_error(f"{kind.__name__}: {value}", cause)
        text = "".join(traceback.format_exception(kind, value, tb))
        # The real stderr: a hook that called this one (torch.distributed's, say) may have pointed
        # sys.stderr at a buffer it prints only after this hook returns, and Abort never returns.
        stream = sys.__stderr__ or sys.stderr
        why = (f" because rank(s) {sorted(peers)} left or failed first (the job's report names the first failure)"
               if peers else "")
        # The traceback first, this rank's verdict on it last, where one reads first (and where a
        # line is not lost: the first line of this burst, right after the runner's ENDED note,
        # sometimes does not reach the job's output on a loaded machine; cause not yet found).
        stream.write(f"{text}mtrain: rank {rank} raised the uncaught exception above{why}; aborting the job\n")
        if not supervised() and not peers:  # no mtrain run to name the first failure: say it here
            stream.write(own_failure_line(ExitRecord(rank, socket.gethostname(), 1, False, time.time(),
                                                     report=f"{kind.__name__}: {value}", where=user_line(tb))))
        stream.flush()
        MPI.COMM_WORLD.Abort(1)

    sys.excepthook = abort_hook
