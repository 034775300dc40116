"""Keras 3 adapter: ``import mtrain.tensorflow.keras as hvd`` in place of ``import horovod.tensorflow.keras as hvd``.

``DistributedOptimizer`` wraps any Keras 3 optimizer so that ``model.fit`` (or a
custom loop's ``apply``) averages gradients over all ranks before they are
clipped and applied. Horovod stops at Keras 2; this is built for Keras 3.
"""
from __future__ import annotations

from typing import Any, Dict, Optional

import keras

from .. import (  # noqa: F401  (re-exported: the Horovod API)
    Adasum, Average, Compression, HorovodInternalError, Max, Min, MismatchError, NotInitializedError, ProcessSet,
    Product, ReduceOp, Sum, add_process_set, allgather, allgather_object, allreduce, alltoall, barrier, broadcast,
    broadcast_global_variables, broadcast_object, broadcast_variables, ccl_built, cross_rank, cross_size,
    cuda_built, ddl_built, global_process_set, gloo_built, gloo_enabled, grouped_allreduce, init,
    is_initialized, local_rank, local_size, mpi_built, mpi_enabled, mpi_threads_supported, nccl_built, rank,
    reducescatter, remove_process_set, rocm_built, shutdown, size, start_timeline, stop_timeline, sycl_built,
)
from ...gradient_op import check_gradient_op
from ..gradient_tape import divided, local_refs, reduce_gradients, variable_key
from ..mpi_ops import check_process_set, set_size
from . import callbacks  # noqa: F401

__all__ = [
    "Adasum", "Average", "Compression", "DistributedOptimizer", "HorovodInternalError", "Max", "Min",
    "MismatchError", "NotInitializedError", "PartialDistributedOptimizer", "ProcessSet", "Product", "ReduceOp",
    "Sum", "add_process_set", "allgather", "allgather_object", "allreduce", "alltoall", "barrier", "broadcast",
    "broadcast_global_variables", "broadcast_object", "broadcast_variables", "callbacks", "cross_rank",
    "cross_size", "global_process_set", "grouped_allreduce", "init", "is_initialized", "local_rank",
    "local_size", "mpi_threads_supported", "rank", "reducescatter", "remove_process_set", "shutdown", "size",
    "start_timeline", "stop_timeline",
    "ccl_built", "cuda_built", "ddl_built", "gloo_built", "gloo_enabled", "mpi_built", "mpi_enabled",
    "nccl_built", "rocm_built", "sycl_built", "elastic",
]


def __dir__() -> list:
    """The Horovod API only (``dir(hvd)``): no private helpers or imported modules."""
    return sorted(__all__)


class _DistributedOptimizer:
    """Mixed in before the wrapped optimizer's own class (see ``DistributedOptimizer``)."""

    def apply(self, grads: Any, trainable_variables: Any = None) -> Any:
        # A variable without a gradient on this rank takes part with zeros: Keras would
        # otherwise drop it here and the ranks would reduce different lists.
        variables = list(trainable_variables) if trainable_variables is not None else self._trainable_variables
        grads = [keras.ops.zeros_like(v) if g is None else g for g, v in zip(grads, variables)]
        return super().apply(grads, trainable_variables)  # type: ignore[misc]

    def register_local_var(self, var: Any) -> None:
        """Keep ``var``'s gradient on this rank (not reduced over ranks)."""
        self._mtrain_local.add(variable_key(var))

    def _backend_apply_gradients(self, grads: Any, trainable_variables: Any) -> Any:
        # Remember which variable each gradient belongs to: _clip_gradients only sees gradients.
        self._mtrain_applying = list(trainable_variables)
        try:
            return super()._backend_apply_gradients(grads, trainable_variables)  # type: ignore[misc]
        finally:
            self._mtrain_applying = None

    def _clip_gradients(self, grads: Any) -> Any:
        # Keras calls this once per update, with the final (accumulated, unscaled) gradients,
        # before clipping: the one place where averaging over ranks belongs.
        grads = list(grads)
        variables = getattr(self, "_mtrain_applying", None)
        local = self._mtrain_local
        if not local or variables is None or len(variables) != len(grads):
            shared = list(range(len(grads)))
        else:
            shared = [i for i, v in enumerate(variables) if variable_key(v) not in local]
        process_set = self._mtrain_process_set
        reduced = reduce_gradients([grads[i] for i in shared], [grads[i] for i in shared], self._mtrain_op,
                                    self._mtrain_predivide, self._mtrain_compression,
                                    "DistributedOptimizer.gradients", postscale=self._mtrain_postscale,
                                    process_set=process_set,
                                    sparse_as_dense=self._mtrain_sparse_as_dense) if shared else []
        out = list(grads)
        for i, g in zip(shared, reduced):
            out[i] = g
        if self._mtrain_scale_local and len(shared) != len(grads):
            # Horovod divides the local gradients by the size of the process set.
            size = set_size(process_set)
            out = [g if i in shared or g is None else divided(g, size) for i, g in enumerate(out)]
        return super()._clip_gradients(out)  # type: ignore[misc]


_CLASSES: Dict[type, type] = {}


def DistributedOptimizer(optimizer: keras.optimizers.Optimizer, name: Optional[str] = None,
                         device_dense: str = "", device_sparse: str = "",
                         compression: type = Compression.none, sparse_as_dense: bool = False,
                         gradient_predivide_factor: float = 1.0, op: Any = Average,
                         backward_passes_per_step: int = 1, average_aggregated_gradients: bool = False,
                         num_groups: int = 0, groups: Any = None, process_set: ProcessSet = global_process_set,
                         scale_local_gradients: bool = True) -> keras.optimizers.Optimizer:
    """Wrap a Keras 3 optimizer so that gradients are averaged over the ranks of ``process_set`` (default:
    all ranks) before being applied; on a rank outside the set they stay its own, as in Horovod.

    Returns an optimizer of the same class and configuration (``isinstance`` holds;
    a built optimizer's variables are carried over). ``backward_passes_per_step=k``
    accumulates k batches locally (Keras' own gradient accumulation) and reduces
    once; as in Horovod the k gradients are summed unless
    ``average_aggregated_gradients=True``. ``tf.IndexedSlices`` gradients (embeddings)
    are allgathered and stay sparse, unless ``sparse_as_dense``. ``device_*``,
    ``num_groups``, ``groups`` are accepted for Horovod compatibility.
    """
    if not isinstance(optimizer, keras.optimizers.Optimizer):
        raise TypeError(f"DistributedOptimizer wraps a Keras 3 optimizer (keras.optimizers.Optimizer), "
                        f"got {type(optimizer).__name__}")
    if isinstance(optimizer, _DistributedOptimizer):
        raise ValueError("this optimizer is already a DistributedOptimizer; wrap the plain optimizer once")
    op = check_gradient_op(op, gradient_predivide_factor)
    check_process_set(process_set)
    if not isinstance(backward_passes_per_step, int) or isinstance(backward_passes_per_step, bool) \
            or backward_passes_per_step < 1:
        raise ValueError(f"backward_passes_per_step must be a positive integer, got {backward_passes_per_step!r}")
    config = optimizer.get_config()
    if backward_passes_per_step > 1:
        if config.get("gradient_accumulation_steps"):
            raise ValueError("the optimizer already has gradient_accumulation_steps; set either that or "
                             "backward_passes_per_step, not both")
        config["gradient_accumulation_steps"] = backward_passes_per_step
    if name is not None:
        config["name"] = name
    base = type(optimizer)
    cls = _CLASSES.get(base)
    if cls is None:
        cls = _CLASSES[base] = type(base.__name__, (_DistributedOptimizer, base), {"__module__": base.__module__})
    wrapped = cls.from_config(config)
    wrapped._mtrain_op = op
    wrapped._mtrain_predivide = gradient_predivide_factor
    wrapped._mtrain_compression = compression
    summed = backward_passes_per_step > 1 and not average_aggregated_gradients
    wrapped._mtrain_postscale = float(backward_passes_per_step) if summed else 1.0
    wrapped._mtrain_local, wrapped._mtrain_scale_local = set(), scale_local_gradients
    wrapped._mtrain_process_set = process_set
    wrapped._mtrain_sparse_as_dense = bool(sparse_as_dense)
    if optimizer.built:  # keep the state of an optimizer that has already stepped
        wrapped.build(optimizer._trainable_variables)
        for mine, theirs in zip(wrapped.variables, optimizer.variables):
            mine.assign(theirs)
    return wrapped


def PartialDistributedOptimizer(optimizer: keras.optimizers.Optimizer, name: Optional[str] = None,
                                device_dense: str = "", device_sparse: str = "",
                                compression: type = Compression.none, sparse_as_dense: bool = False,
                                gradient_predivide_factor: float = 1.0, op: Any = Average,
                                backward_passes_per_step: int = 1, average_aggregated_gradients: bool = False,
                                groups: Any = None, process_set: ProcessSet = global_process_set,
                                local_layers: Any = None,
                                scale_local_gradients: bool = True) -> keras.optimizers.Optimizer:
    """A ``DistributedOptimizer`` that leaves the gradients of ``local_layers``' weights on each rank
    (model parallelism); with ``scale_local_gradients`` those are divided by the set's size."""
    wrapped = DistributedOptimizer(optimizer, name=name, device_dense=device_dense, device_sparse=device_sparse,
                                   compression=compression, sparse_as_dense=sparse_as_dense,
                                   gradient_predivide_factor=gradient_predivide_factor, op=op,
                                   backward_passes_per_step=backward_passes_per_step,
                                   average_aggregated_gradients=average_aggregated_gradients, groups=groups,
                                   process_set=process_set, scale_local_gradients=scale_local_gradients)
    wrapped._mtrain_local = local_refs(local_layers)
    return wrapped


from mtrain.elastic import tensorflow as elastic  # noqa: E402  (hvd.elastic)
