"""ringreduce: the collective runtime inside every mtrain rank."""
from mtrain.ringreduce.transport import mpi as _mpi

# Outside a launched job, importing the runtime starts no MPI (init() does); inside one, every
# rank joins MPI here, since MPI_Init waits for every rank of the job (transport/mpi.py).
_mpi.start_if_launched()
from mtrain.ringreduce.engine.cycle import EngineStats
from mtrain.ringreduce.core.requests import AllreduceOp, Handle, Signature
from mtrain.ringreduce.core.errors import (
    EngineError,
    HorovodInternalError,
    InvalidArgumentError,
    JoinedError,
    MismatchError,
    NotInitializedError,
    ShutdownError,
    StallError,
)
from mtrain.ringreduce.process_sets import ProcessSet, global_process_set
from mtrain.ringreduce.core.ops import Adasum, Average, Max, Min, Product, ReduceOp, Sum
from mtrain.ringreduce.runtime import (
    add_process_set,
    init,
    is_initialized,
    private_process_set,
    process_set_by_id,
    remove_process_set,
    shutdown,
)
from mtrain.ringreduce.api import (
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
from mtrain.ringreduce.engine.submit import submit_allreduce

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
