"""ringreduce: the collective runtime inside every mtrain rank."""
import os as _os

# A program started without a launcher (python train.py) is an MPI singleton: one rank, which
# needs no shared-memory transport, and Open MPI 5's singleton leaves that transport's 16 MiB
# segment in /dev/shm when it ends, whatever way.  Under mpirun (mtrain run's or one's own) the
# launcher's environment is there and nothing changes; a user's own OMPI_MCA_btl wins.
if not any(key in _os.environ for key in ("OMPI_COMM_WORLD_SIZE", "PMIX_RANK", "PMI_RANK", "PMI_SIZE")):
    _os.environ.setdefault("OMPI_MCA_btl", "self")
from .engine import EngineStats
from .requests import AllreduceOp, Handle, Signature
from .errors import EngineError, HorovodInternalError, InvalidArgumentError, JoinedError, MismatchError, ShutdownError, StallError
from .process_sets import ProcessSet, global_process_set
from .ops import Adasum, Average, Max, Min, Product, ReduceOp, Sum
from .runtime import (
    NotInitializedError,
    add_process_set,
    remove_process_set,
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
    init,
    is_initialized,
    join,
    local_rank,
    local_size,
    mpi_threads_supported,
    poll,
    process_set_by_id,
    rank,
    reducescatter,
    reducescatter_async,
    shutdown,
    size,
    start_timeline,
    stop_timeline,
    submit_allreduce,
    synchronize,
)

__all__ = [
    "Adasum", "Average", "Max", "Min", "Product", "ReduceOp", "Sum",
    "AllreduceOp", "EngineError", "EngineStats", "Handle", "Signature", "HorovodInternalError", "InvalidArgumentError", "JoinedError", "MismatchError", "NotInitializedError", "ShutdownError", "StallError",
    "allgather", "allgather_async", "allgather_object", "allreduce", "allreduce_", "allreduce_async",
    "allreduce_async_", "alltoall", "alltoall_async", "barrier", "broadcast", "broadcast_",
    "broadcast_async", "broadcast_async_", "broadcast_object", "cross_rank", "cross_size", "engine_stats",
    "grouped_allgather", "grouped_allgather_async", "grouped_allreduce", "grouped_allreduce_", "grouped_allreduce_async", "grouped_allreduce_async_",
    "grouped_reducescatter", "grouped_reducescatter_async", "is_homogeneous", "start_timeline", "stop_timeline",
    "ProcessSet", "add_process_set", "global_process_set", "remove_process_set",
    "init", "is_initialized", "join", "local_rank", "local_size", "mpi_threads_supported", "poll", "process_set_by_id", "rank",
    "reducescatter", "reducescatter_async", "shutdown", "size", "submit_allreduce", "synchronize",
]
