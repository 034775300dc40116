"""PyTorch adapter: ``import mtrain.torch as hvd`` in place of ``import horovod.torch as hvd``.

Split as Horovod's ``horovod/torch/`` is: ``mpi_ops`` (the collectives and their autograd
functions), ``optimizer`` (``DistributedOptimizer``), ``functions`` (broadcasting model and
optimizer state), ``sync_batch_norm`` (``SyncBatchNorm``), ``elastic`` (``hvd.elastic``, on
the framework-free ``mtrain.elastic``). Tensors cross to the runtime through ``bridge``
(shared with the DDP backend, ``mtrain.distributed``); the per-gradient in-place all-reduce,
with its views kept from step to step, is ``inplace``.
"""
from __future__ import annotations

from typing import List

import torch

from mtrain.ringreduce.transport import cuda as _cuda
from mtrain.ringreduce import (  # noqa: F401  (re-exported: the Horovod API)
    Adasum, Average, HorovodInternalError, Max, Min, MismatchError, NotInitializedError, ProcessSet, Product,
    ReduceOp, Sum, add_process_set, allgather_object, barrier, broadcast_object, cross_rank, cross_size,
    global_process_set, init, is_homogeneous, is_initialized, local_rank, local_size, mpi_threads_supported,
    rank, remove_process_set, shutdown, size, start_timeline, stop_timeline, straggler_stats,
)

from ..build_info import (  # noqa: F401  (re-exported: Horovod's build queries)
    ccl_built, cuda_built, ddl_built, gloo_built, gloo_enabled, mpi_built, mpi_enabled, nccl_built, rocm_built,
    sycl_built)
from ..handles import DeferredHandle, FrameworkHandle, FrameworkHandleBase, poll, synchronize  # noqa: F401
from . import elastic  # noqa: F401  (hvd.elastic, as Horovod's subpackage)
from .compression import Compression
from .functions import broadcast_optimizer_state, broadcast_parameters  # noqa: F401
from .mpi_ops import (  # noqa: F401
    allgather, allgather_async, allreduce, allreduce_, allreduce_async, allreduce_async_, alltoall, alltoall_async,
    broadcast, broadcast_, broadcast_async, broadcast_async_, grouped_allgather, grouped_allgather_async,
    grouped_allreduce, grouped_allreduce_, grouped_allreduce_async, grouped_allreduce_async_,
    grouped_reducescatter, grouped_reducescatter_async, join, recv, recv_async, reducescatter, reducescatter_async,
    send, send_async, sparse_allreduce_async,
)
from .optimizer import DistributedOptimizer  # noqa: F401
from .sync_batch_norm import SyncBatchNorm  # noqa: F401

__all__ = [
    "Adasum", "Average", "Compression", "DistributedOptimizer", "HorovodInternalError", "Max", "Min",
    "MismatchError", "NotInitializedError", "ProcessSet", "Product", "ReduceOp", "Sum", "add_process_set",
    "global_process_set", "join", "remove_process_set",
    "allgather", "allgather_async", "allgather_object", "allreduce", "allreduce_", "allreduce_async",
    "allreduce_async_", "alltoall", "alltoall_async", "barrier", "broadcast", "broadcast_", "broadcast_async",
    "broadcast_async_", "broadcast_object", "broadcast_optimizer_state", "broadcast_parameters",
    "ccl_built", "cross_rank", "cross_size", "cuda_built", "ddl_built", "gloo_built", "gloo_enabled",
    "grouped_allgather", "grouped_allgather_async", "grouped_allreduce", "grouped_allreduce_",
    "grouped_allreduce_async", "grouped_allreduce_async_", "grouped_reducescatter",
    "grouped_reducescatter_async", "init", "is_homogeneous", "is_initialized", "local_rank", "local_size",
    "mpi_built", "mpi_enabled", "mpi_threads_supported", "nccl_built", "poll", "rank", "recv", "recv_async",
    "reducescatter", "reducescatter_async", "rocm_built", "send", "send_async", "shutdown", "size", "sparse_allreduce_async", "start_timeline", "straggler_stats",
    "sycl_built",
    "SyncBatchNorm",
    "stop_timeline", "synchronize",
]


def __dir__() -> List[str]:
    """The Horovod API only: no private helpers or submodules (``dir(hvd)``), but the
    ``hvd.elastic`` namespace, as Horovod's subpackage."""
    return sorted(__all__ + [name for name in ("elastic",) if name in globals()])


def _follow_runtime_device(device_id: int) -> None:
    """init() picked this rank's GPU for CuPy: make it torch's current device too."""
    if torch.cuda.is_available():
        torch.cuda.set_device(device_id)


_cuda.on_device_bound(_follow_runtime_device)
