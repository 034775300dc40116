"""ringreduce: the collective runtime inside every mtrain rank."""
import os as _os


def _init_mpi() -> None:
    """Import mpi4py's MPI, which initializes MPI.  A program started without a launcher
    (python train.py) is an MPI singleton: one rank, which needs no shared-memory transport,
    and Open MPI 5's singleton leaves that transport's 16 MiB segment in /dev/shm when it ends,
    whatever way.  So a singleton's MPI_Init sees btl "self" (a user's own OMPI_MCA_btl wins),
    and the setting is gone again before the program starts anything (a job of its own)."""
    launched = any(key in _os.environ for key in ("OMPI_COMM_WORLD_SIZE", "PMIX_RANK", "PMI_RANK", "PMI_SIZE"))
    if launched or "OMPI_MCA_btl" in _os.environ:
        from mpi4py import MPI  # noqa: F401
        return
    _os.environ["OMPI_MCA_btl"] = "self"
    try:
        from mpi4py import MPI  # noqa: F401,F811  (MPI_Init reads it here)
    finally:
        del _os.environ["OMPI_MCA_btl"]


_init_mpi()
from .engine import EngineStats
from .requests import AllreduceOp, Handle, Signature
from .errors import EngineError, HorovodInternalError, InvalidArgumentError, JoinedError, MismatchError, ShutdownError, StallError
from .process_sets import ProcessSet, global_process_set
from .ops import Adasum, Average, Max, Min, Product, ReduceOp, Sum
from .runtime import (
    NotInitializedError,
    add_process_set,
    init,
    is_initialized,
    private_process_set,
    process_set_by_id,
    remove_process_set,
    shutdown,
)
from .api import (
    allgather,
    allgather_async,
    allgather_object,
    allreduce,
    allreduce_,
    allreduce_async,
    allreduce_async_,
    alltoall,
    alltoall_async,
    barrier,
    broadcast,
    broadcast_,
    broadcast_async,
    broadcast_async_,
    broadcast_object,
    cross_rank,
    cross_size,
    engine_stats,
    grouped_allgather,
    grouped_allgather_async,
    grouped_allreduce,
    grouped_allreduce_,
    grouped_allreduce_async,
    grouped_allreduce_async_,
    grouped_reducescatter,
    grouped_reducescatter_async,
    is_homogeneous,
    join,
    local_rank,
    local_size,
    mpi_threads_supported,
    poll,
    rank,
    recv,
    recv_async,
    reducescatter,
    reducescatter_async,
    send,
    send_async,
    size,
    start_timeline,
    stop_timeline,
    straggler_stats,
    synchronize,
)
from .submit import submit_allreduce

__all__ = [
    "Adasum", "Average", "Max", "Min", "Product", "ReduceOp", "Sum",
    "AllreduceOp", "EngineError", "EngineStats", "Handle", "Signature", "HorovodInternalError", "InvalidArgumentError", "JoinedError", "MismatchError", "NotInitializedError", "ShutdownError", "StallError",
    "allgather", "allgather_async", "allgather_object", "allreduce", "allreduce_", "allreduce_async",
    "allreduce_async_", "alltoall", "alltoall_async", "barrier", "broadcast", "broadcast_",
    "broadcast_async", "broadcast_async_", "broadcast_object", "cross_rank", "cross_size", "engine_stats",
    "grouped_allgather", "grouped_allgather_async", "grouped_allreduce", "grouped_allreduce_", "grouped_allreduce_async", "grouped_allreduce_async_",
    "grouped_reducescatter", "grouped_reducescatter_async", "is_homogeneous", "start_timeline", "stop_timeline", "straggler_stats",
    "ProcessSet", "add_process_set", "global_process_set", "remove_process_set",
    "init", "is_initialized", "join", "local_rank", "local_size", "mpi_threads_supported", "poll", "private_process_set", "process_set_by_id", "rank",
    "recv", "recv_async", "reducescatter", "reducescatter_async", "send", "send_async", "shutdown", "size", "submit_allreduce", "synchronize",
]
