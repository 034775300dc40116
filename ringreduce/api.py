"""The public functions of ``ringreduce``: thin wrappers over the runtime (runtime.py) and the
submit path (submit.py). Each checks nothing itself: the asynchronous ops submit through
``submit``, the synchronous ones wait on those, the point-to-point ones go to p2p.py.
"""
from __future__ import annotations

import pickle
from typing import Any, Sequence

import numpy as np

from mtrain.common.straggler_rows import StragglerRow
from mtrain.ringreduce import exits
from mtrain.ringreduce.core.ops import Average, ReduceOp
from mtrain.ringreduce.core.requests import Handle
from mtrain.ringreduce.engine.cycle import EngineStats
from mtrain.ringreduce.engine.submit import (
    submit_allgather,
    submit_allgather_object,
    submit_allreduce,
    submit_alltoall,
    submit_barrier,
    submit_broadcast,
    submit_broadcast_object,
    submit_grouped_allgather,
    submit_grouped_allreduce,
    submit_grouped_reducescatter,
    submit_reducescatter,
)
from mtrain.ringreduce.observe import steps
from mtrain.ringreduce.process_sets import ProcessSet, current, global_process_set
from mtrain.ringreduce.transport import comm as comm_module
from mtrain.ringreduce.transport import p2p


def rank() -> int:
    return current().rank


def size() -> int:
    return current().size


def local_rank() -> int:
    return current().local_rank


def local_size() -> int:
    return current().local_size


def cross_rank() -> int:
    return current().cross_rank


def cross_size() -> int:
    return current().cross_size


def is_homogeneous() -> bool:
    """True when every host runs the same number of ranks (Horovod's ``is_homogeneous``)."""
    return current().homogeneous


def start_timeline(file_path: str, mark_cycles: bool = False) -> None:
    """Start recording the Chrome-trace timeline (call it on every rank: each records its own
    events, rank 0 writes them all to ``file_path``). Replaces a timeline already running."""
    if not isinstance(file_path, str) or not file_path:
        raise ValueError(f"start_timeline needs a file path, got {file_path!r}")
    current().engine.start_timeline(file_path, bool(mark_cycles))


def stop_timeline() -> None:
    """Stop writing the timeline and close its file (a valid JSON array). No-op when none runs."""
    current().engine.stop_timeline()


def engine_stats(process_set: ProcessSet = global_process_set) -> EngineStats:
    """What this rank's engine for ``process_set`` did so far: batches planned afresh and by a
    kept plan, cycles that ran a steady batch with no per-op work (or fell back), cycles a waiting
    thread ran itself, and lone all-reduces run in their own memory (``EngineStats``)."""
    return current().member(process_set).engine.stats()


def straggler_stats() -> "list[StragglerRow]":
    """Which rank is slow: one row per rank over its newest measured steps (up to 4096): host,
    steps, median compute and wait per step, the share of steps it submitted last, and whether
    it is more than MTRAIN_STRAGGLER_THRESHOLD_PERCENT (default 20) slower than the median rank.

    A collective on the job's ranks: every rank must call it (each returns the same table). With
    MTRAIN_STRAGGLER_REPORT_DISABLE=1 (``mtrain run --no-straggler-report``) nothing is measured,
    and the table is empty."""
    gathered = allgather_object(steps.measured(current().engine.steps), name="mtrain.straggler_stats")
    return steps.straggler_rows(gathered)


def mpi_threads_supported() -> bool:
    current()  # NotInitializedError before init()
    return comm_module.threading_level_ok()


# -- asynchronous API -------------------------------------------------------
# Every op returns a Handle at once; synchronize(handle) waits and returns the
# result or raises the op's error. Ops are matched across ranks by name, so
# ranks may submit in different orders; unnamed ops must come in the same order.
# An op whose arguments are refused here raises at once on this rank, and the
# ranks that submitted it raise the same class (submit.py).


def poll(handle: Handle) -> bool:
    """True once ``handle``'s op has finished (successfully or not)."""
    return handle.done()


def synchronize(handle: Handle) -> Any:
    """Wait for ``handle``'s op; return its result or raise its error."""
    return handle.wait()


def allreduce_async(array: np.ndarray, op: ReduceOp = Average, name: "str | None" = None,
                    prescale_factor: float = 1.0, postscale_factor: float = 1.0, process_set: ProcessSet = global_process_set) -> Handle:
    """Start an all-reduce into a new array; ``synchronize`` returns it."""
    return submit_allreduce(array, op, name, prescale_factor, postscale_factor, False, process_set)


def allreduce_async_(array: np.ndarray, op: ReduceOp = Average, name: "str | None" = None,
                     prescale_factor: float = 1.0, postscale_factor: float = 1.0, process_set: ProcessSet = global_process_set) -> Handle:
    """Start an in-place all-reduce of ``array``; ``synchronize`` returns ``array``."""
    return submit_allreduce(array, op, name, prescale_factor, postscale_factor, True, process_set)


def grouped_allreduce_async(arrays: "Sequence[np.ndarray]", op: ReduceOp = Average, name: "str | None" = None,
                            prescale_factor: float = 1.0, postscale_factor: float = 1.0, process_set: ProcessSet = global_process_set) -> Handle:
    """Start all-reduces of several arrays as one unit; ``synchronize`` returns a list of new arrays."""
    return submit_grouped_allreduce(arrays, op, name, prescale_factor, postscale_factor, False, process_set)


def grouped_allreduce_async_(arrays: "Sequence[np.ndarray]", op: ReduceOp = Average,
                             name: "str | None" = None, prescale_factor: float = 1.0,
                             postscale_factor: float = 1.0, process_set: ProcessSet = global_process_set) -> Handle:
    """In-place grouped all-reduce; ``synchronize`` returns the list of the same arrays."""
    return submit_grouped_allreduce(arrays, op, name, prescale_factor, postscale_factor, True, process_set)


def allgather_async(array: np.ndarray, name: "str | None" = None, process_set: ProcessSet = global_process_set) -> Handle:
    return submit_allgather(array, name, process_set)


def grouped_allgather_async(arrays: "Sequence[np.ndarray]", name: "str | None" = None, process_set: ProcessSet = global_process_set) -> Handle:
    """Start all-gathers of several arrays as one unit; ``synchronize`` returns a list."""
    return submit_grouped_allgather(arrays, name, process_set)


def broadcast_async(array: np.ndarray, root_rank: int, name: "str | None" = None, process_set: ProcessSet = global_process_set) -> Handle:
    return submit_broadcast(array, root_rank, name, process_set, in_place=False)


def broadcast_async_(array: np.ndarray, root_rank: int, name: "str | None" = None, process_set: ProcessSet = global_process_set) -> Handle:
    return submit_broadcast(array, root_rank, name, process_set, in_place=True)


def reducescatter_async(array: np.ndarray, op: ReduceOp = Average, name: "str | None" = None,
                        prescale_factor: float = 1.0, postscale_factor: float = 1.0, process_set: ProcessSet = global_process_set) -> Handle:
    """Start a reduce-scatter; ``synchronize`` returns this rank's rows of the reduction."""
    return submit_reducescatter(array, op, name, prescale_factor, postscale_factor, process_set)


def grouped_reducescatter_async(arrays: "Sequence[np.ndarray]", op: ReduceOp = Average,
                                name: "str | None" = None, prescale_factor: float = 1.0,
                                postscale_factor: float = 1.0, process_set: ProcessSet = global_process_set) -> Handle:
    """Start reduce-scatters of several arrays as one unit; ``synchronize`` returns a list."""
    return submit_grouped_reducescatter(arrays, op, name, prescale_factor, postscale_factor, process_set)


def alltoall_async(array: np.ndarray, splits: "Sequence[int] | None" = None,
                   name: "str | None" = None, process_set: ProcessSet = global_process_set) -> Handle:
    """Start an all-to-all; ``synchronize`` returns ``(received, received_splits)``."""
    return submit_alltoall(array, splits, name, process_set)


# -- synchronous API: the asynchronous one, waited on ----------------------


def allreduce(array: np.ndarray, op: ReduceOp = Average, name: "str | None" = None,
              prescale_factor: float = 1.0, postscale_factor: float = 1.0, process_set: ProcessSet = global_process_set) -> np.ndarray:
    """A new array: the elementwise reduction of ``array`` over all ranks (default Average)."""
    return synchronize(allreduce_async(array, op, name, prescale_factor, postscale_factor, process_set))


def allreduce_(array: np.ndarray, op: ReduceOp = Average, name: "str | None" = None,
               prescale_factor: float = 1.0, postscale_factor: float = 1.0, process_set: ProcessSet = global_process_set) -> np.ndarray:
    """In-place all-reduce: ``array`` is overwritten with the result and returned."""
    return synchronize(allreduce_async_(array, op, name, prescale_factor, postscale_factor, process_set))


def grouped_allreduce(arrays: "Sequence[np.ndarray]", op: ReduceOp = Average, name: "str | None" = None,
                      prescale_factor: float = 1.0, postscale_factor: float = 1.0, process_set: ProcessSet = global_process_set) -> list:
    return synchronize(grouped_allreduce_async(arrays, op, name, prescale_factor, postscale_factor, process_set))


def grouped_allreduce_(arrays: "Sequence[np.ndarray]", op: ReduceOp = Average, name: "str | None" = None,
                       prescale_factor: float = 1.0, postscale_factor: float = 1.0, process_set: ProcessSet = global_process_set) -> list:
    return synchronize(grouped_allreduce_async_(arrays, op, name, prescale_factor, postscale_factor, process_set))


def allgather(array: np.ndarray, name: "str | None" = None, process_set: ProcessSet = global_process_set) -> np.ndarray:
    """Every rank's array concatenated along the first dimension, in rank order."""
    return synchronize(allgather_async(array, name, process_set))


def grouped_allgather(arrays: "Sequence[np.ndarray]", name: "str | None" = None, process_set: ProcessSet = global_process_set) -> list:
    return synchronize(grouped_allgather_async(arrays, name, process_set))


def grouped_reducescatter(arrays: "Sequence[np.ndarray]", op: ReduceOp = Average, name: "str | None" = None,
                          prescale_factor: float = 1.0, postscale_factor: float = 1.0, process_set: ProcessSet = global_process_set) -> list:
    return synchronize(grouped_reducescatter_async(arrays, op, name, prescale_factor, postscale_factor, process_set))


def broadcast(array: np.ndarray, root_rank: int, name: "str | None" = None, process_set: ProcessSet = global_process_set) -> np.ndarray:
    """A new array holding ``root_rank``'s values."""
    return synchronize(broadcast_async(array, root_rank, name, process_set))


def broadcast_(array: np.ndarray, root_rank: int, name: "str | None" = None, process_set: ProcessSet = global_process_set) -> np.ndarray:
    """In-place broadcast: ``array`` is overwritten with ``root_rank``'s values."""
    return synchronize(broadcast_async_(array, root_rank, name, process_set))


def reducescatter(array: np.ndarray, op: ReduceOp = Average, name: "str | None" = None,
                  prescale_factor: float = 1.0, postscale_factor: float = 1.0, process_set: ProcessSet = global_process_set) -> np.ndarray:
    """Reduce over ranks, then keep this rank's share of the first dimension."""
    return synchronize(reducescatter_async(array, op, name, prescale_factor, postscale_factor, process_set))


def alltoall(array: np.ndarray, splits: "Sequence[int] | None" = None, name: "str | None" = None, process_set: ProcessSet = global_process_set):
    """Scatter rows to every rank and gather theirs. Returns the received array, or
    ``(received, received_splits)`` when ``splits`` is given (as Horovod does)."""
    received, received_splits = synchronize(alltoall_async(array, splits, name, process_set))
    return received if splits is None else (received, received_splits)


def barrier(process_set: ProcessSet = global_process_set) -> None:
    """Wait until every rank of ``process_set`` reaches the barrier."""
    synchronize(submit_barrier(process_set))


def broadcast_object(obj: Any, root_rank: int = 0, name: "str | None" = None, process_set: ProcessSet = global_process_set) -> Any:
    """``root_rank``'s picklable object, on every rank."""
    # Pickled (submit.py) and unpickled here, in the caller's thread: the engine moves bytes only.
    return pickle.loads(synchronize(submit_broadcast_object(obj, root_rank, name, process_set)))


def allgather_object(obj: Any, name: "str | None" = None, process_set: ProcessSet = global_process_set) -> list:
    """A list of every rank's picklable object, in rank order."""
    payloads = synchronize(submit_allgather_object(obj, name, process_set))
    return [pickle.loads(payload) for payload in payloads]


# -- point-to-point (p2p.py) ------------------------------------------------------
# Global ranks, as root_rank; matched in order per (source, dest, tag) within a process set.

def send_async(array: np.ndarray, dest: int, tag: int = 0, process_set: ProcessSet = global_process_set) -> p2p.Transfer:
    """Start sending ``array`` to rank ``dest``; ``synchronize`` waits until the array may be reused."""
    exits.forget_status()
    return p2p.start_send(current().member(process_set), array, dest, tag)


def recv_async(array: np.ndarray, source: int, tag: int = 0, process_set: ProcessSet = global_process_set) -> p2p.Transfer:
    """Start receiving rank ``source``'s send (same tag) into ``array``; ``synchronize`` returns ``array``.
    The send must have the same dtype and number of elements (else a ``MismatchError`` here)."""
    exits.forget_status()
    return p2p.start_recv(current().member(process_set), array, source, tag)


def send(array: np.ndarray, dest: int, tag: int = 0, process_set: ProcessSet = global_process_set) -> None:
    """Send ``array`` to rank ``dest`` and wait until it may be reused."""
    exits.forget_status()
    # The caller waits, so it drives the transfer itself: the mover thread is not woken.
    synchronize(p2p.start_send(current().member(process_set), array, dest, tag, wake=False))


def recv(array: np.ndarray, source: int, tag: int = 0, process_set: ProcessSet = global_process_set) -> np.ndarray:
    """Receive rank ``source``'s send into ``array``; returns ``array``."""
    exits.forget_status()
    return synchronize(p2p.start_recv(current().member(process_set), array, source, tag, wake=False))


def join() -> int:
    """This rank has run out of data (Horovod's ``join``): until every rank has joined, it takes
    part in the ops the other ranks still submit: all-reduces and reduce-scatters count it as
    zeros (the identity for Min, Max and Product), allgathers and alltoalls get no rows from it,
    a broadcast from it raises on the ranks that submitted the broadcast. Blocks until every
    rank has joined; returns the rank that joined last.

    A rank joins every process set it belongs to at once, so a set's op that another member
    still runs completes with this rank standing in, as on the global set."""
    registry = current()
    exits.forget_status()
    handles = [state.engine.submit_join() for set_id, state in sorted(registry.sets.items())
               if set_id != 0 and state.engine is not None]
    last = synchronize(registry.engine.submit_join())
    for handle in handles:
        synchronize(handle)
    return last
