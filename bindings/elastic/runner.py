"""``@hvd.elastic.run``: start a generation from the newest commit, leave when the hosts change.

An MPI world cannot grow or shrink, so mtrain's elastic driver runs the job as
generations, one ``mpirun`` per host set.  Inside a generation:

1. every rank reads the header of its host's snapshot (the commit it holds, -1: none);
2. the ranks exchange those numbers; the lowest rank holding the newest commit is the
   source (new hosts hold none; a host that missed the last commit holds an older one);
3. the source loads its snapshot and every rank takes that state (a broadcast), then
   ``state.sync()`` as in Horovod; rank 0 tells the driver ``ElasticResume``;
4. when the job resumed from a commit, the reset callbacks run (the host set changed);
5. ``func(state)`` runs; on ``HostsUpdatedInterrupt`` (raised on every rank at the same
   commit, whose snapshot is written) every rank exits with ``RESET_EXIT_STATUS`` and the
   driver starts the next generation.

Outside an elastic job it behaves as Horovod's: sync, run, and on a
``HostsUpdatedInterrupt`` reset and run again.  (Horovod also restores and retries on a
``HorovodInternalError``; with MPI a failed collective ends the job instead.)
"""
from __future__ import annotations

import functools
import sys
from typing import Any, Callable

import mtrain.ringreduce as rr
from mtrain.common.private import PrivatePathError
from mtrain.common.records.elastic import RESET_EXIT_STATUS, ElasticResume

from . import job, snapshot
from .state import HostsUpdatedInterrupt, State


def run(func: Callable[..., Any]) -> Callable[..., Any]:
    """Decorate the training function; its first argument is the elastic ``State``."""
    @functools.wraps(func)
    def wrapper(state: State, *args: Any, **kwargs: Any) -> Any:
        if not job.is_elastic():
            return _run_in_place(func, state, args, kwargs)
        try:
            resume_generation(state)
            return func(state, *args, **kwargs)
        except HostsUpdatedInterrupt:
            # Every rank got here at the same commit, and that commit's snapshot is on disk.
            sys.stdout.flush()
            sys.stderr.flush()
            sys.exit(RESET_EXIT_STATUS)  # looked up now: the runtime notes the status it is asked for
        except (PrivatePathError, snapshot.SnapshotRejected) as refused:
            # Another user's path where the snapshots go, or a snapshot this job did not sign:
            # said in one line (it names the path, its owner and mode), and the job ends.
            print(refused, file=sys.stderr, flush=True)
            sys.exit(1)
    return wrapper


def _run_in_place(func: Callable[..., Any], state: State, args: tuple, kwargs: dict) -> Any:
    skip_sync = False
    while True:
        if not skip_sync:
            state.sync()
        try:
            return func(state, *args, **kwargs)
        except HostsUpdatedInterrupt as interrupt:
            skip_sync = interrupt.skip_sync
            state.on_reset()


def newest_commit_source(commits: "list[int]") -> "tuple[int, int]":
    """(newest commit, lowest rank holding it) from every rank's commit (-1: none)."""
    newest = max(commits)
    return newest, commits.index(newest)


def resume_generation(state: State) -> int:
    """Bring every rank to the newest commit any host holds; returns that commit (-1: none)."""
    folder = job.state_folder()
    if rr.local_rank() == 0:
        snapshot.remove_leftovers(folder)
    key = job.secret()
    header = snapshot.read_header(folder, key)
    commits = rr.allgather_object(header.commit if header else -1, name="mtrain.elastic.commits")
    newest, source = newest_commit_source(commits)
    if newest >= 0:
        values = None
        if rr.rank() == source:
            found = snapshot.read(folder, key)
            if found is None or found[0].commit != newest:
                raise RuntimeError(f"the elastic snapshot in {folder} changed while a generation started "
                                   "(another job using the same folder?)")
            values = found[1]
        if source != 0:
            values = rr.broadcast_object(values, root_rank=source, name="mtrain.elastic.snapshot")
        if values is not None:  # source 0: the others get its state from sync() below
            state.load_committed(values)
        state.commit_number = newest
    state.sync()
    state.save()  # every rank's in-memory commit is now the synced state
    if rr.rank() == 0:
        sys.stderr.flush()
        line = ElasticResume(commit=newest, size=rr.size()).encode()
        buffer = getattr(sys.stderr, "buffer", None)
        if buffer is not None:
            buffer.write(line)
            buffer.flush()
        else:
            sys.stderr.write(line.decode())
            sys.stderr.flush()
    if newest >= 0:
        state.on_reset()
    return newest
