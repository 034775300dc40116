"""Keras adapter: ``import mtrain.tensorflow.keras as hvd`` in place of ``import horovod.tensorflow.keras as hvd``.

Both Keras generations, behind one API. ``DistributedOptimizer`` wraps a Keras 3 optimizer
(``keras.optimizers``) or a Keras 2 one (tf_keras, which ``tf.keras`` is under
``TF_USE_LEGACY_KERAS=1``, TensorFlow's path for Keras 2 code on TF >= 2.16), chosen by the
optimizer it is given; the Keras 2 side is ``keras2``. The callbacks and ``load_model`` follow
``tf.keras``. tf_keras is optional: without it, Keras 3 alone.
"""
from __future__ import annotations

import sys
from typing import Any, Dict, List, Optional

import keras

# Re-exported: the Horovod API, taken from where mtrain.tensorflow takes it (not from that package,
# whose DistributedOptimizer imports this one for a Keras optimizer: no cycle through its __init__).
from mtrain.ringreduce import (  # noqa: F401
    Adasum, Average, HorovodInternalError, Max, Min, MismatchError, NotInitializedError, ProcessSet, Product,
    ReduceOp, Sum, add_process_set, cross_rank, cross_size, global_process_set, init, is_initialized, local_rank,
    local_size, mpi_threads_supported, rank, remove_process_set, shutdown, size, start_timeline, stop_timeline,
    straggler_stats,
)

from ...build_info import (  # noqa: F401
    ccl_built, cuda_built, ddl_built, gloo_built, gloo_enabled, mpi_built, mpi_enabled, nccl_built, rocm_built,
    sycl_built,
)
from ..compression import Compression
from ..functions import (  # noqa: F401
    allgather_object, broadcast_global_variables, broadcast_object, broadcast_variables)
from ..mpi_ops import allgather, allreduce, alltoall, barrier, broadcast, grouped_allreduce, reducescatter  # noqa: F401
from ...gradient_op import check_gradient_op
from ..gradient_tape import divided, local_refs, reduce_gradients, scaled, variable_key
from ..process_sets import check_process_set, set_size
from . import callbacks, keras2  # noqa: F401

__all__ = [
    "Adasum", "Average", "Compression", "DistributedOptimizer", "HorovodInternalError", "Max", "Min",
    "MismatchError", "NotInitializedError", "PartialDistributedOptimizer", "ProcessSet", "Product", "ReduceOp",
    "Sum", "add_process_set", "allgather", "allgather_object", "allreduce", "alltoall", "barrier", "broadcast",
    "broadcast_global_variables", "broadcast_object", "broadcast_variables", "callbacks", "cross_rank",
    "cross_size", "global_process_set", "grouped_allreduce", "init", "is_initialized", "local_rank",
    "load_model", "local_size", "mpi_threads_supported", "rank", "reducescatter", "remove_process_set", "shutdown",
    "size", "start_timeline", "stop_timeline", "straggler_stats",
    "ccl_built", "cuda_built", "ddl_built", "gloo_built", "gloo_enabled", "mpi_built", "mpi_enabled",
    "nccl_built", "rocm_built", "sycl_built", "elastic",
]


def __dir__() -> list:
    """The Horovod API only (``dir(hvd)``): no private helpers or imported modules."""
    return sorted(__all__)


class _DistributedOptimizer:
    """Mixed in before the wrapped optimizer's own class (see ``DistributedOptimizer``)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._mtrain_local = set()

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
        # Past Keras' attribute tracking (vars()): a tracked list would make the model's variables
        # the optimizer's too, and a saved optimizer would not load back.
        vars(self)["_mtrain_applying"] = list(trainable_variables)
        try:
            return super()._backend_apply_gradients(grads, trainable_variables)  # type: ignore[misc]
        finally:
            vars(self)["_mtrain_applying"] = None

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
        if len(shared) != len(grads):
            # Horovod divides the local gradients by the size of the process set; summed passes
            # (Keras averaged them) are scaled back like the reduced ones.
            size = set_size(process_set) if self._mtrain_scale_local else 1
            shared_set = set(shared)
            out = [g if i in shared_set or g is None else scaled(divided(g, size), self._mtrain_postscale)
                   for i, g in enumerate(out)]
        return super()._clip_gradients(out)  # type: ignore[misc]


def DistributedOptimizer(optimizer: Any, name: Optional[str] = None,
                         device_dense: str = "", device_sparse: str = "",
                         compression: type = Compression.none, sparse_as_dense: bool = False,
                         gradient_predivide_factor: float = 1.0, op: Any = Average,
                         backward_passes_per_step: int = 1, average_aggregated_gradients: bool = False,
                         num_groups: int = 0, groups: Any = None, process_set: ProcessSet = global_process_set,
                         scale_local_gradients: bool = True) -> Any:
    """Wrap a Keras optimizer so that gradients are averaged over the ranks of ``process_set`` (default:
    all ranks) before being applied; on a rank outside the set they stay its own, as in Horovod.

    Returns an optimizer of the same class name and configuration, whose ``from_config``
    makes optimizers that reduce the same way. ``tf.IndexedSlices`` gradients (embeddings)
    are allgathered and stay sparse, unless ``sparse_as_dense``. ``device_*``, ``num_groups``,
    ``groups`` are accepted for Horovod compatibility.

    The optimizer's generation chooses the path:

    - Keras 3 (``keras.optimizers.Optimizer``): ``isinstance`` holds and a built optimizer's
      variables are carried over. Gradients are reduced inside ``apply`` / ``apply_gradients``
      (hence ``fit``), before clipping. ``backward_passes_per_step=k`` is Keras' own gradient
      accumulation over k batches, reduced once.
    - Keras 2 (tf_keras, ``tf.keras`` under ``TF_USE_LEGACY_KERAS=1``; its new or its legacy
      optimizers): as in Horovod, gradients are reduced where the optimizer computes them
      (``minimize``, hence ``fit``; ``compute_gradients``; legacy ``_compute_gradients`` and
      ``get_gradients``), and ``backward_passes_per_step=k`` sums k passes on the rank, reduces
      every k-th and applies only then (see ``keras2``).

    In both, as in Horovod, the k aggregated gradients are summed unless
    ``average_aggregated_gradients=True``.
    """
    is_keras2 = keras2.is_keras2_optimizer(optimizer)
    if not is_keras2 and not isinstance(optimizer, keras.optimizers.Optimizer):
        raise TypeError(not_a_keras_optimizer(optimizer))
    if op == Adasum:  # Horovod's refusal (horovod/tensorflow/__init__.py DistributedOptimizer), and its class
        raise ValueError("op == Adasum is not supported yet with Keras; reduce with op=Average, or with "
                         "DistributedGradientTape(op=Adasum) in a custom training loop")
    op = check_gradient_op(op, gradient_predivide_factor)
    check_process_set(process_set)
    if not isinstance(backward_passes_per_step, int) or isinstance(backward_passes_per_step, bool) \
            or backward_passes_per_step < 1:
        raise ValueError(f"backward_passes_per_step must be a positive integer, got {backward_passes_per_step!r}")
    if is_keras2:
        settings = keras2.Settings(op, gradient_predivide_factor, compression, bool(sparse_as_dense), process_set,
                                   backward_passes_per_step, bool(average_aggregated_gradients),
                                   scale_local_gradients)
        return keras2.distributed_optimizer(optimizer, settings, name)
    if isinstance(optimizer, _DistributedOptimizer):
        raise ValueError("this optimizer is already a DistributedOptimizer; wrap the plain optimizer once")
    config = optimizer.get_config()
    if backward_passes_per_step > 1:
        if config.get("gradient_accumulation_steps"):
            raise ValueError("the optimizer already has gradient_accumulation_steps; set either that or "
                             "backward_passes_per_step, not both")
        config["gradient_accumulation_steps"] = backward_passes_per_step
    if name is not None:
        config["name"] = name
    summed = backward_passes_per_step > 1 and not average_aggregated_gradients
    cls = _keras3_class(type(optimizer), op, gradient_predivide_factor, compression,
                        float(backward_passes_per_step) if summed else 1.0, scale_local_gradients,
                        process_set, bool(sparse_as_dense))
    wrapped = cls.from_config(config)
    if optimizer.built:  # keep the state of an optimizer that has already stepped
        wrapped.build(optimizer._trainable_variables)
        for mine, theirs in zip(wrapped.variables, optimizer.variables):
            mine.assign(theirs)
    return wrapped


def _keras3_class(base: type, op: Any, predivide: float, compression: type, postscale: float, scale_local: bool,
                  process_set: ProcessSet, sparse_as_dense: bool) -> type:
    """``base`` (a Keras 3 optimizer class) with the reduction mixed in, named after it. The settings are
    the class's, so that its ``from_config`` (and ``load_model``) builds optimizers that reduce alike."""
    return type(base.__name__, (_DistributedOptimizer, base), {
        "__module__": base.__module__, "_mtrain_op": op, "_mtrain_predivide": predivide,
        "_mtrain_compression": compression, "_mtrain_postscale": postscale, "_mtrain_scale_local": scale_local,
        "_mtrain_process_set": process_set, "_mtrain_sparse_as_dense": sparse_as_dense})


def not_a_keras_optimizer(optimizer: Any) -> str:
    """The error for an object that is neither a Keras 3 nor a Keras 2 (tf_keras) optimizer."""
    message = (f"DistributedOptimizer wraps a Keras optimizer (keras.optimizers.Optimizer, or for Keras 2 a "
               f"tf_keras.optimizers.Optimizer or tf_keras.optimizers.legacy.Optimizer), got "
               f"{type(optimizer).__name__}")
    if not keras2.tf_keras_installed():
        message += "; tf_keras is not installed, so only Keras 3 optimizers can be wrapped (pip install tf_keras)"
    return message


def PartialDistributedOptimizer(optimizer: Any, name: Optional[str] = None,
                                device_dense: str = "", device_sparse: str = "",
                                compression: type = Compression.none, sparse_as_dense: bool = False,
                                gradient_predivide_factor: float = 1.0, op: Any = Average,
                                backward_passes_per_step: int = 1, average_aggregated_gradients: bool = False,
                                groups: Any = None, process_set: ProcessSet = global_process_set,
                                local_layers: Any = None,
                                scale_local_gradients: bool = True) -> Any:
    """A ``DistributedOptimizer`` (Keras 3 or Keras 2) that leaves the gradients of ``local_layers``'
    weights on each rank (model parallelism); with ``scale_local_gradients`` those are divided by the
    set's size."""
    wrapped = DistributedOptimizer(optimizer, name=name, device_dense=device_dense, device_sparse=device_sparse,
                                   compression=compression, sparse_as_dense=sparse_as_dense,
                                   gradient_predivide_factor=gradient_predivide_factor, op=op,
                                   backward_passes_per_step=backward_passes_per_step,
                                   average_aggregated_gradients=average_aggregated_gradients, groups=groups,
                                   process_set=process_set, scale_local_gradients=scale_local_gradients)
    local = local_refs(local_layers)
    wrapped._mtrain_local.update(local)
    return wrapped


def load_model(filepath: Any, custom_optimizers: Optional[List[type]] = None,
               custom_objects: Optional[Dict[str, Any]] = None, compression: type = Compression.none) -> Any:
    """Load a saved Keras model with its optimizer wrapped in a ``DistributedOptimizer`` (Horovod's
    ``load_model``), so that training resumes with the saved optimizer state.

    The model loads with ``tf.keras``: tf_keras under ``TF_USE_LEGACY_KERAS=1`` (Keras 2), Keras 3
    otherwise. Every optimizer of that Keras is wrapped; ``custom_optimizers`` names other optimizer
    classes to wrap; ``custom_objects`` is passed on (and wins over the wrapped names).
    """
    tf_keras = keras2.import_tf_keras() if keras2.legacy_keras_requested() else None
    if tf_keras is not None:
        objects = keras2.loading_objects(tf_keras, compression)
        generation = tf_keras
    else:
        objects = {cls.__name__: _loading_class(cls, compression) for cls in vars(keras.optimizers).values()
                   if isinstance(cls, type) and issubclass(cls, keras.optimizers.Optimizer)}
        generation = keras
    for cls in custom_optimizers or []:
        objects[cls.__name__] = _loading_class(cls, compression)
    objects.update(custom_objects or {})
    return generation.models.load_model(filepath, custom_objects=objects)


def _loading_class(base: type, compression: type) -> type:
    """``base`` wrapped with the default settings (and ``compression``), as ``load_model`` builds it."""
    if issubclass(base, keras.optimizers.Optimizer):
        return _keras3_class(base, Average, 1.0, compression, 1.0, True, global_process_set, False)
    return keras2.distributed_class(base, keras2.default_settings(compression))


from mtrain.elastic import tensorflow as elastic  # noqa: E402  (hvd.elastic)
