"""``backward_passes_per_step`` for a TF1 optimizer in a graph (Horovod's
``LocalGradientAggregationHelper``, its legacy-optimizer side): each step's gradients are added to
local sums, and every ``backward_passes_per_step``-th step the sums are reduced over the ranks and
applied; the steps between apply nothing (but still advance ``global_step``).

The sums and the step counter are ``tf.compat.v1.GraphKeys.LOCAL_VARIABLES``, as Horovod's:
``tf.compat.v1.local_variables_initializer()`` (or a MonitoredTrainingSession) initializes them.
"""
from __future__ import annotations

from typing import Any, Callable, List, Sequence

import tensorflow as tf

__all__ = ["GraphGradientAggregation"]

Reduce = Callable[[List[Any], List[Any]], List[Any]]


class GraphGradientAggregation:
    """Local sums of a graph's gradients, reduced and applied every ``passes`` steps."""

    def __init__(self, passes: int, average: bool, sparse_as_dense: bool, name: str) -> None:
        if passes < 1:
            raise ValueError(f"backward_passes_per_step must be at least 1, got {passes}")
        if tf.executing_eagerly():
            raise ValueError("backward_passes_per_step > 1 with a TF1 optimizer needs a graph (as Horovod's): "
                             "build the training step in a tf.Graph, or use DistributedGradientTape")
        self._passes, self._average, self._sparse_as_dense = passes, average, sparse_as_dense
        self._scope = f"aggregation_variables_{name}"
        self._counter: Any = None

    def _dense(self, grad: Any) -> Any:
        if isinstance(grad, tf.IndexedSlices):
            if not self._sparse_as_dense:
                raise ValueError("IndexedSlices gradients with backward_passes_per_step > 1 need sparse_as_dense=True")
            return tf.convert_to_tensor(grad)
        return grad

    def compute_gradients(self, grads: Sequence[Any], variables: Sequence[Any], reduce: Reduce) -> List[Any]:
        """This step's gradients added to the sums; on every ``passes``-th step the sums reduced by
        ``reduce`` (divided by ``passes`` when averaging), on the others this step's own gradients.
        A None gradient stays None."""
        grads = [None if g is None else self._dense(g) for g in grads]
        present = [i for i, g in enumerate(grads) if g is not None]
        local = [tf.compat.v1.GraphKeys.LOCAL_VARIABLES]
        with tf.compat.v1.variable_scope(self._scope, reuse=tf.compat.v1.AUTO_REUSE):
            counter = tf.compat.v1.get_variable("aggregation_counter", shape=(), dtype=tf.int32, trainable=False,
                                                initializer=tf.compat.v1.zeros_initializer(), collections=local)
            sums = [tf.compat.v1.get_variable(str(i), initializer=tf.zeros(grads[i].shape, grads[i].dtype),
                                              trainable=False, collections=local) for i in present]
        self._counter = counter
        # A new round starts from zero sums.
        cleared = tf.cond(tf.equal(counter, 0), lambda: tf.group(*[s.assign(tf.zeros_like(s)) for s in sums]),
                          tf.no_op)
        with tf.control_dependencies([cleared]):
            added = [s.assign_add(grads[i]) for s, i in zip(sums, present)]
        with tf.control_dependencies(added):
            counted = counter.assign_add(1)

        def reduce_sums() -> List[Any]:
            reduced = reduce([s.read_value() for s in sums], [variables[i] for i in present])
            with tf.control_dependencies(reduced):
                reset = counter.assign(0)  # the step that applies: apply_gradients reads 0
            with tf.control_dependencies([reset]):
                divisor = self._passes if self._average else 1
                return [tf.identity(r) / tf.cast(divisor, r.dtype) for r in reduced]

        if not present:
            return list(grads)
        with tf.control_dependencies([counted]):
            out = tf.cond(tf.equal(counted, self._passes), reduce_sums,
                          lambda: [tf.identity(grads[i]) for i in present])
        out = list(out) if isinstance(out, (list, tuple)) else [out]
        result: List[Any] = [None] * len(grads)
        for i, g in zip(present, out):
            result[i] = g
        return result

    def apply_gradients(self, apply: Callable[[], Any], grads_and_vars: Sequence[Any], global_step: Any) -> Any:
        """``apply()`` on the steps that reduced the sums; on the others only ``global_step`` advances."""
        if self._counter is None:
            raise ValueError("apply_gradients needs compute_gradients first when backward_passes_per_step > 1")
        counter = self._counter
        inputs = [t for pair in grads_and_vars for t in pair if t is not None]
        with tf.control_dependencies([tf.group(*inputs)]):
            applied = tf.cond(tf.equal(counter, 0), apply, tf.no_op)

        def advance() -> Any:
            if global_step is None:
                return tf.no_op()
            return tf.group(global_step.assign_add(tf.constant(1, global_step.dtype.base_dtype), use_locking=True))

        with tf.control_dependencies([applied]):
            return tf.cond(tf.equal(counter, 0), tf.no_op, advance)
