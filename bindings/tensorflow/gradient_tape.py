"""``DistributedGradientTape``: a ``tf.GradientTape`` whose gradients are reduced over the
ranks of a process set, and the gradient reduction the Keras optimizer shares with it."""
from __future__ import annotations

from typing import Any, List, Sequence

import tensorflow as tf

from mtrain.ringreduce import Average, ProcessSet, global_process_set

from ..gradient_op import check_gradient_op
from .compression import Compression
from .bridge import dense_tensor
from .mpi_ops import grouped_allreduce
from .process_sets import check_process_set, set_size

__all__ = ["DistributedGradientTape", "PartialDistributedGradientTape", "local_refs", "reduce_gradients",
           "divided", "scaled", "variable_key"]


def reduce_gradients(grads: Sequence[Any], variables: Sequence[Any], op: Any, gradient_predivide_factor: float,
                      compression: type, name: str, postscale: float = 1.0,
                      process_set: ProcessSet = global_process_set, sparse_as_dense: bool = False) -> List[Any]:
    """Average (or sum) gradients over the ranks of ``process_set``; a missing gradient takes part as zeros.

    ``tf.IndexedSlices`` (embedding gradients) stay sparse unless ``sparse_as_dense``, as in Horovod:
    their values and indices are allgathered. On a rank outside ``process_set`` the gradients stay
    this rank's own (only ``postscale`` applies), as Horovod's optimizers and tapes do.
    """
    grads = [tf.zeros_like(v) if g is None else g for g, v in zip(grads, variables)]
    grads = [g if isinstance(g, tf.IndexedSlices) and not sparse_as_dense else dense_tensor(g, "gradient")
             for g in grads]
    if not check_process_set(process_set).included():
        return [scaled(g, postscale) for g in grads]
    sparse = [i for i, g in enumerate(grads) if isinstance(g, tf.IndexedSlices)]
    dense = [i for i, g in enumerate(grads) if not isinstance(g, tf.IndexedSlices)]
    out: List[Any] = list(grads)
    if dense:
        pre, post = 1.0, postscale
        if op == Average:  # the runtime divides by size after the postscale
            pre, post = 1.0 / gradient_predivide_factor, postscale * gradient_predivide_factor
        reduced = grouped_allreduce([grads[i] for i in dense], compression=compression, op=op, prescale_factor=pre,
                                    postscale_factor=post, process_set=process_set, name=name)
        for i, g in zip(dense, reduced):
            out[i] = g
    if sparse:
        # Rows are gathered, not summed, so there is nothing for the predivide to protect (Horovod 0.28
        # refuses a predivide factor here instead, as it refuses any scale factor on IndexedSlices);
        # only the postscale (Keras' summed accumulation) changes the result.
        reduced = grouped_allreduce([grads[i] for i in sparse], op=op, process_set=process_set,
                                    name=f"{name}.sparse")
        for i, g in zip(sparse, reduced):
            out[i] = scaled(g, postscale)
    return out


def scaled(grad: Any, factor: float) -> Any:
    """``grad`` times ``factor``: a tensor, or an IndexedSlices (its values scaled)."""
    if factor == 1.0:
        return grad
    # tf.constant in the gradient's dtype: tf.cast(factor, ...) would round a Python float through float32.
    if isinstance(grad, tf.IndexedSlices):
        return tf.IndexedSlices(grad.values * tf.constant(factor, grad.values.dtype), grad.indices, grad.dense_shape)
    return grad * tf.constant(factor, grad.dtype)


def divided(grad: Any, divisor: int) -> Any:
    """``grad`` divided by ``divisor`` (how Horovod scales local gradients): a tensor, or an
    IndexedSlices (its values divided)."""
    if isinstance(grad, tf.IndexedSlices):
        return tf.IndexedSlices(grad.values / tf.cast(divisor, grad.values.dtype), grad.indices, grad.dense_shape)
    return grad / tf.cast(divisor, grad.dtype)


class _DistributedGradientTape(tf.GradientTape):
    """A GradientTape whose ``gradient()`` returns gradients reduced over the ranks of its process set.

    Gradients of sources registered as local (``register_local_source``, or the
    ``local_layers`` of ``PartialDistributedGradientTape``) are not reduced; with
    ``scale_local_gradients`` they are divided by the set's size, as Horovod does.
    """

    def register_local_source(self, source: tf.Variable) -> None:
        """Keep ``source``'s gradient on this rank (not reduced)."""
        self._mtrain_local.add(variable_key(source))

    def gradient(self, target: Any, sources: Any, output_gradients: Any = None,
                 unconnected_gradients: Any = tf.UnconnectedGradients.NONE) -> Any:
        grads = super().gradient(target, sources, output_gradients, unconnected_gradients)
        flat_sources, flat_grads = tf.nest.flatten(sources), tf.nest.flatten(grads)
        shared = [i for i, v in enumerate(flat_sources) if not self._is_local(v)]
        reduced = reduce_gradients([flat_grads[i] for i in shared], [flat_sources[i] for i in shared],
                                    self._mtrain_op, self._mtrain_predivide, self._mtrain_compression,
                                    "DistributedGradientTape.gradients",
                                    process_set=self._mtrain_process_set,
                                    sparse_as_dense=self._mtrain_sparse_as_dense) if shared else []
        out = list(flat_grads)
        for i, g in zip(shared, reduced):
            out[i] = g
        if self._mtrain_scale_local:
            for i, v in enumerate(flat_sources):
                if self._is_local(v) and out[i] is not None:
                    out[i] = divided(out[i], set_size(self._mtrain_process_set))
        return tf.nest.pack_sequence_as(grads, out)

    def _is_local(self, source: Any) -> bool:
        return variable_key(source) in self._mtrain_local


def variable_key(variable: Any) -> Any:
    """A hashable identity for a tf.Variable (its ``ref()``) or a Keras 3 Variable (the object)."""
    return variable.ref() if hasattr(variable, "ref") else id(variable)


def local_refs(local_layers: Any) -> set:
    """The keys (``variable_key``) of every weight of ``local_layers`` (a layer or a list of layers)."""
    if local_layers is None:
        return set()
    layers = local_layers if isinstance(local_layers, (list, tuple)) else [local_layers]
    refs = set()
    for layer in layers:
        if not hasattr(layer, "weights"):
            raise TypeError(f"local_layers must be Keras layers, got {type(layer).__name__}")
        refs.update(variable_key(w) for w in layer.weights)
    return refs


def _wrap_tape(gradtape: tf.GradientTape, op: Any, gradient_predivide_factor: float, compression: type,
               local: set, scale_local_gradients: bool, process_set: ProcessSet,
               sparse_as_dense: bool) -> tf.GradientTape:
    if not isinstance(gradtape, tf.GradientTape):
        raise TypeError(f"DistributedGradientTape wraps a tf.GradientTape, got {type(gradtape).__name__}")
    op = check_gradient_op(op, gradient_predivide_factor, adasum=True)  # Horovod's tape passes op= on
    tape = _DistributedGradientTape.__new__(_DistributedGradientTape)
    tape.__dict__.update(gradtape.__dict__)
    tape._mtrain_op, tape._mtrain_predivide, tape._mtrain_compression = op, gradient_predivide_factor, compression
    tape._mtrain_local, tape._mtrain_scale_local = set(local), scale_local_gradients
    tape._mtrain_process_set = check_process_set(process_set)
    tape._mtrain_sparse_as_dense = bool(sparse_as_dense)
    return tape


def DistributedGradientTape(gradtape: tf.GradientTape, device_dense: str = "", device_sparse: str = "",
                            compression: type = Compression.none, sparse_as_dense: bool = False,
                            op: Any = Average, gradient_predivide_factor: float = 1.0,
                            num_groups: int = 0, groups: Any = None, process_set: ProcessSet = global_process_set,
                            scale_local_gradients: bool = True) -> tf.GradientTape:
    """Wrap a ``tf.GradientTape`` so that ``gradient()`` averages over the ranks of ``process_set``.

    Gradients a rank did not produce (``None``) take part as zeros, so ranks never
    disagree on what is reduced; on a rank outside ``process_set`` they stay local (as
    Horovod). ``tf.IndexedSlices`` gradients (embeddings) are allgathered and stay sparse,
    unless ``sparse_as_dense`` (then they are densified and fused with the rest).
    ``device_*``, ``num_groups`` and ``groups`` are accepted for Horovod compatibility.
    """
    return _wrap_tape(gradtape, op, gradient_predivide_factor, compression, set(), scale_local_gradients,
                      process_set, sparse_as_dense)


def PartialDistributedGradientTape(gradtape: tf.GradientTape, device_dense: str = "", device_sparse: str = "",
                                   compression: type = Compression.none, sparse_as_dense: bool = False,
                                   op: Any = Average, gradient_predivide_factor: float = 1.0,
                                   num_groups: int = 0, groups: Any = None,
                                   process_set: ProcessSet = global_process_set, local_layers: Any = None,
                                   scale_local_gradients: bool = True) -> tf.GradientTape:
    """A ``DistributedGradientTape`` that leaves the gradients of ``local_layers``' weights on each rank
    (model parallelism); with ``scale_local_gradients`` those are divided by the set's size."""
    return _wrap_tape(gradtape, op, gradient_predivide_factor, compression, local_refs(local_layers),
                      scale_local_gradients, process_set, sparse_as_dense)
