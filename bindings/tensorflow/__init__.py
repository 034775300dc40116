"""TensorFlow adapter: ``import mtrain.tensorflow as hvd`` in place of ``import horovod.tensorflow as hvd``.

Ops take ``tf.Tensor``/``tf.Variable`` values, eagerly or inside ``tf.function``
(there they run as Python ops, ``tf.numpy_function`` and ``tf.py_function``, calling into the runtime). Every collective
is differentiable with Horovod's backward rule (see ``gradients``), and
ranks that disagree raise ``tf.errors.FailedPreconditionError``, eagerly and in graphs (see
``bridge.run_collective``). Keras lives in ``mtrain.tensorflow.keras``.

Process sets are Horovod's: ``init(process_sets=[...])`` or ``add_process_set``, then
``process_set=`` on every op (and on the tape and optimizer). ``root_rank`` stays a
global rank; Average divides by the set's size; a rank outside the set gets
``tf.errors.InvalidArgumentError``. ``join()`` returns the rank that joined last.

The collectives are ``mpi_ops``, the helpers on them (broadcasting variables and objects, the
``*_op`` tensors) ``functions``; ``DistributedGradientTape`` and the gradient reduction the Keras
optimizer shares are ``gradient_tape``; ``SyncBatchNormalization`` is ``sync_batch_norm``; the
``DistributedOptimizer`` of a TF1 optimizer is ``legacy_optimizer``.
"""
from __future__ import annotations

from typing import Any, List, Optional

from mtrain.ringreduce import (  # noqa: F401  (re-exported: the Horovod API)
    Adasum, Average, HorovodInternalError, Max, Min, MismatchError, NotInitializedError, ProcessSet, Product,
    ReduceOp, Sum, add_process_set, cross_rank, cross_size, global_process_set, init, is_homogeneous,
    is_initialized, local_rank, local_size, mpi_threads_supported, rank, remove_process_set, shutdown, size,
    start_timeline, stop_timeline, straggler_stats,
)

from ..build_info import (  # noqa: F401  (re-exported: Horovod's build queries)
    ccl_built, cuda_built, ddl_built, gloo_built, gloo_enabled, mpi_built, mpi_enabled, nccl_built, rocm_built,
    sycl_built)
from .compression import Compression
from .gradient_tape import DistributedGradientTape, PartialDistributedGradientTape  # noqa: F401
from .functions import (  # noqa: F401
    allgather_object, broadcast_, broadcast_global_variables, broadcast_object, broadcast_object_fn,
    broadcast_variables, local_rank_op, local_size_op, process_set_included_op, rank_op, size_op,
)
from .mpi_ops import (  # noqa: F401
    allgather, allreduce, alltoall, barrier, broadcast, grouped_allgather, grouped_allreduce, grouped_reducescatter,
    join, reducescatter,
)
from .sync_batch_norm import SyncBatchNormalization  # noqa: F401
# Horovod's hvd has it, and its tests call it.
from tensorflow import executing_eagerly as _executing_eagerly  # noqa: F401,E402

__all__ = [
    "Adasum", "Average", "Compression", "DistributedGradientTape", "DistributedOptimizer",
    "HorovodInternalError", "Max", "Min", "MismatchError", "NotInitializedError",
    "PartialDistributedGradientTape", "ProcessSet", "Product", "ReduceOp", "Sum", "SyncBatchNormalization",
    "add_process_set", "allgather", "allgather_object", "allreduce", "alltoall", "barrier", "broadcast",
    "broadcast_", "broadcast_global_variables", "broadcast_object", "broadcast_object_fn", "broadcast_variables",
    "cross_rank", "cross_size", "global_process_set", "grouped_allgather", "grouped_allreduce",
    "grouped_reducescatter", "init", "is_homogeneous", "is_initialized", "join", "local_rank", "local_rank_op",
    "local_size", "local_size_op", "mpi_threads_supported", "process_set_included_op", "rank", "rank_op",
    "reducescatter", "remove_process_set", "shutdown", "size", "size_op", "start_timeline", "stop_timeline", "straggler_stats",
    "ccl_built", "cuda_built", "ddl_built", "gloo_built", "gloo_enabled", "mpi_built", "mpi_enabled",
    "nccl_built", "rocm_built", "sycl_built", "elastic",
]


def __dir__() -> List[str]:
    """The Horovod API only (``dir(hvd)``): no private helpers or imported modules."""
    return sorted(__all__)


def DistributedOptimizer(optimizer: Any, name: Optional[str] = None, use_locking: bool = False,
                         device_dense: str = "", device_sparse: str = "", compression: type = Compression.none,
                         sparse_as_dense: bool = False, backward_passes_per_step: int = 1, op: Any = Average,
                         gradient_predivide_factor: float = 1.0, average_aggregated_gradients: bool = False,
                         num_groups: int = 0, groups: Any = None, process_set: ProcessSet = global_process_set,
                         scale_local_gradients: bool = True) -> Any:
    """Wrap an optimizer so that gradients are averaged over the ranks of ``process_set``: a Keras
    optimizer (as Horovod does in TF2, this is ``mtrain.tensorflow.keras.DistributedOptimizer``), or a
    TF1 ``tf.compat.v1.train`` optimizer (Horovod's legacy path, see ``legacy_optimizer``)."""
    import keras

    from .keras import keras2, not_a_keras_optimizer
    from .legacy_optimizer import is_legacy_optimizer, legacy_distributed_optimizer
    if is_legacy_optimizer(optimizer):
        return legacy_distributed_optimizer(
            optimizer, name, use_locking, compression, sparse_as_dense, backward_passes_per_step, op,
            gradient_predivide_factor, average_aggregated_gradients, num_groups, groups, process_set,
            scale_local_gradients)
    if not isinstance(optimizer, keras.optimizers.Optimizer) and not keras2.is_keras2_optimizer(optimizer):
        raise TypeError(f"{not_a_keras_optimizer(optimizer)}; a TF1 tf.compat.v1.train.Optimizer is wrapped "
                        "too: pass one of those, or use DistributedGradientTape")
    from .keras import DistributedOptimizer as keras_distributed_optimizer
    return keras_distributed_optimizer(
        optimizer, name=name, device_dense=device_dense, device_sparse=device_sparse, compression=compression,
        sparse_as_dense=sparse_as_dense, gradient_predivide_factor=gradient_predivide_factor, op=op,
        backward_passes_per_step=backward_passes_per_step,
        average_aggregated_gradients=average_aggregated_gradients, num_groups=num_groups, groups=groups,
        process_set=process_set, scale_local_gradients=scale_local_gradients)


from mtrain.elastic import tensorflow as elastic  # noqa: E402  (hvd.elastic)
