"""ringreduce: the collective runtime inside every mtrain rank."""
from .collectives import MismatchError
from .ops import Adasum, Average, Max, Min, Product, ReduceOp, Sum
from .runtime import (
    NotInitializedError,
    allgather,
    allgather_object,
    allreduce,
    allreduce_,
    alltoall,
    barrier,
    broadcast,
    broadcast_,
    broadcast_object,
    cross_rank,
    cross_size,
    init,
    is_initialized,
    local_rank,
    local_size,
    mpi_threads_supported,
    rank,
    reducescatter,
    shutdown,
    size,
)

__all__ = [
    "Adasum", "Average", "Max", "Min", "Product", "ReduceOp", "Sum",
    "MismatchError", "NotInitializedError",
    "allgather", "allgather_object", "allreduce", "allreduce_", "alltoall", "barrier",
    "broadcast", "broadcast_", "broadcast_object", "cross_rank", "cross_size", "init",
    "is_initialized", "local_rank", "local_size", "mpi_threads_supported", "rank",
    "reducescatter", "shutdown", "size",
]
