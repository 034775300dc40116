"""The collectives made differentiable, each with Horovod's backward rule, so that ``tape.gradient``
(and Keras) differentiate through them. A backward op runs on the forward op's process set, as
Horovod's registered gradients do; an unnamed forward op leaves its backward ops unnamed too (the
graph names them, see ``bridge.graph_name``)."""
from __future__ import annotations

from typing import Any, Callable, List, Optional, Sequence

import tensorflow as tf

import mtrain.ringreduce as rr
from mtrain.ringreduce import Average, ProcessSet, Sum

from .bridge import dense_tensor
from .process_sets import set_rank, set_size
from .raw_ops import (
    raw_alltoall, raw_broadcast, raw_grouped_allgather, raw_grouped_allreduce, raw_grouped_reducescatter,
)

__all__ = ["differentiable", "differentiable_alltoall", "differentiable_broadcast",
           "differentiable_grouped_allgather", "differentiable_grouped_allreduce",
           "differentiable_grouped_reducescatter", "differentiable_sparse_allgather"]

# The backward rule of one collective: from the outputs' gradients (None where an output had
# none), the outputs and the inputs, one gradient per input (None for an input that has none).
Backward = Callable[[Sequence[Any], List[tf.Tensor], Sequence[tf.Tensor]], List[Any]]


def differentiable(forward: Callable[[Sequence[tf.Tensor]], List[tf.Tensor]], backward: Backward,
                   inputs: Sequence[tf.Tensor]) -> List[tf.Tensor]:
    """``forward(inputs)``, the outputs of one collective, with ``backward`` as their gradient
    (the one ``tf.custom_gradient`` wrapping every collective here shares)."""
    @tf.custom_gradient
    def collective(*xs: tf.Tensor) -> Any:
        outputs = forward(xs)

        def grad(*dys: Any) -> List[Any]:
            return backward(dys, outputs, xs)
        return outputs, grad
    return list(collective(*inputs))


def _grad_name(name: Optional[str]) -> Optional[str]:
    return None if name is None else f"{name}.grad"


def _zeros_for_missing(grads: Sequence[Any], outputs: Sequence[tf.Tensor]) -> List[tf.Tensor]:
    return [tf.zeros_like(o) if g is None else dense_tensor(g, "gradient") for g, o in zip(grads, outputs)]


def differentiable_grouped_allreduce(inputs: Sequence[tf.Tensor], op: Any, name: Optional[str],
                                     prescale: float, postscale: float,
                                     process_set: ProcessSet) -> List[tf.Tensor]:
    """``raw_grouped_allreduce``, differentiable."""
    def backward(dys: Sequence[Any], outputs: List[tf.Tensor], xs: Sequence[tf.Tensor]) -> List[Any]:
        # Horovod: the gradient of an allreduce is the same allreduce (op and scaling) of the gradient.
        return raw_grouped_allreduce(_zeros_for_missing(dys, outputs), op, _grad_name(name),
                                     prescale, postscale, process_set)
    return differentiable(lambda xs: raw_grouped_allreduce(xs, op, name, prescale, postscale, process_set),
                          backward, inputs)


def _my_rows(grad: tf.Tensor, x: tf.Tensor, name: Optional[str], process_set: ProcessSet) -> tf.Tensor:
    """This rank's block of rows of an allgathered tensor's gradient (blocks in set-rank order)."""
    rows = tf.reshape(x, [-1]) if x.shape.rank == 0 else x  # a scalar was gathered as one row
    counts = raw_grouped_allgather([tf.shape(rows, out_type=tf.int64)[:1]], name, process_set)[0]
    me = set_rank(process_set)
    start = tf.reduce_sum(counts[:me])
    return tf.reshape(grad[start:start + counts[me]], tf.shape(x))


def _allgather_backward(dys: Sequence[Any], outputs: Sequence[tf.Tensor], xs: Sequence[tf.Tensor],
                        name: Optional[str], process_set: ProcessSet) -> List[tf.Tensor]:
    """Horovod's allgather gradient: average the gradient over the set's ranks, keep the rows this
    rank contributed."""
    dys = _zeros_for_missing(dys, outputs)
    averaged = [raw_grouped_allreduce([dy], Average, None if name is None else f"{name}.grad.{i}",
                                      1.0, 1.0, process_set)[0] for i, dy in enumerate(dys)]
    return [_my_rows(g, x, None if name is None else f"{name}.grad.rows.{i}", process_set)
            for i, (g, x) in enumerate(zip(averaged, xs))]


def differentiable_grouped_allgather(inputs: Sequence[tf.Tensor], name: Optional[str],
                                     process_set: ProcessSet) -> List[tf.Tensor]:
    """``raw_grouped_allgather``, differentiable."""
    def backward(dys: Sequence[Any], outputs: List[tf.Tensor], xs: Sequence[tf.Tensor]) -> List[Any]:
        return _allgather_backward(dys, outputs, xs, name, process_set)
    return differentiable(lambda xs: raw_grouped_allgather(xs, name, process_set), backward, inputs)


def differentiable_sparse_allgather(values: Sequence[tf.Tensor], indices: Sequence[tf.Tensor],
                                    name: Optional[str], process_set: ProcessSet) -> List[tf.Tensor]:
    """The values, then the indices, of IndexedSlices allgathered in one submission (one op in a
    graph, so no rank can block on one half while another waits on the other); differentiable in
    the values, as Horovod's two allgathers are."""
    count = len(values)

    def backward(dys: Sequence[Any], outputs: List[tf.Tensor], xs: Sequence[tf.Tensor]) -> List[Any]:
        return _allgather_backward(dys[:count], outputs[:count], xs[:count], name,
                                   process_set) + [None] * count  # integer indices have none
    return differentiable(lambda xs: raw_grouped_allgather(xs, name, process_set), backward,
                          [*values, *indices])


def differentiable_broadcast(tensor: tf.Tensor, root_rank: int, name: Optional[str],
                             process_set: ProcessSet) -> tf.Tensor:
    """``raw_broadcast``, differentiable."""
    def backward(dys: Sequence[Any], outputs: List[tf.Tensor], xs: Sequence[tf.Tensor]) -> List[Any]:
        # Horovod: the gradient averaged over the set goes to the root; the others get zeros.
        averaged = raw_grouped_allreduce(_zeros_for_missing(dys, outputs), Average, _grad_name(name),
                                         1.0, 1.0, process_set)[0]
        return [averaged if rr.rank() == root_rank else averaged * 0]
    return differentiable(lambda xs: [raw_broadcast(xs[0], root_rank, name, process_set)], backward, [tensor])[0]


def differentiable_grouped_reducescatter(inputs: Sequence[tf.Tensor], op: Any, name: Optional[str],
                                         prescale: float, postscale: float,
                                         process_set: ProcessSet) -> List[tf.Tensor]:
    """``raw_grouped_reducescatter``, differentiable."""
    def backward(dys: Sequence[Any], outputs: List[tf.Tensor], xs: Sequence[tf.Tensor]) -> List[Any]:
        # Horovod: allgather the gradient (times the set's size for Sum); the scale factors by the chain rule.
        factor = prescale * postscale * (set_size(process_set) if op == Sum else 1)
        # The factor as a constant of the gradient's dtype: tf.cast of a Python float rounds it through float32.
        dys = [dy * (tf.constant(factor, dy.dtype) if dy.dtype.is_floating else tf.cast(factor, dy.dtype))
               if factor != 1 else dy for dy in _zeros_for_missing(dys, outputs)]
        return [raw_grouped_allgather([dy], None if name is None else f"{name}.grad.{i}", process_set)[0]
                for i, dy in enumerate(dys)]
    return differentiable(lambda xs: raw_grouped_reducescatter(xs, op, name, prescale, postscale, process_set),
                          backward, inputs)


def differentiable_alltoall(tensor: tf.Tensor, splits: tf.Tensor, given: bool, name: Optional[str],
                            process_set: ProcessSet) -> List[tf.Tensor]:
    """``raw_alltoall``, differentiable in ``tensor`` (the splits are integers)."""
    def backward(dys: Sequence[Any], outputs: List[tf.Tensor], xs: Sequence[tf.Tensor]) -> List[Any]:
        # Horovod: send the gradient back the way the rows came.
        received, received_splits = outputs
        back, _ = raw_alltoall(_zeros_for_missing(dys[:1], [received])[0], received_splits, True,
                               _grad_name(name), process_set)
        return [back, None]
    return differentiable(lambda xs: raw_alltoall(xs[0], xs[1], given, name, process_set), backward,
                          [tensor, splits])
