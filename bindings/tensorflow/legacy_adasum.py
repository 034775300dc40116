"""``DistributedOptimizer(op=Adasum)`` for a TF1 optimizer (Horovod's ``_DistributedAdasumOptimizer``
in ``horovod/tensorflow/__init__.py``): each rank applies its own gradients with the wrapped
optimizer, and every ``backward_passes_per_step``-th step the change of the variables since the
last such step (the delta) is combined over the ranks with Adasum and added to where they started::

    step 0:        start <- var                      (the common initial model)
    every step:    var <- wrapped optimizer's update of var
    every k-th:    start <- start + Adasum_r(var_r - start);  var <- start

Horovod's class builds this from per-variable hooks (``_apply_dense`` and friends), but its
``apply_gradients`` hands the step straight to the wrapped optimizer, whose own hooks run instead
of those (as its source reads, nothing would be combined). Here the delta step wraps the wrapped
optimizer's whole ``apply_gradients`` (its own slots, ``_prepare`` and ``_finish`` included): the
semantics the class describes. A graph only, as Horovod's (``tf.compat.v1.get_variable``);
the start values and the step counter are global variables, as Horovod's slot and counter are.
"""
from __future__ import annotations

from typing import Any, List, Optional

import tensorflow as tf

from mtrain.ringreduce import Adasum

from .compression import Compression
from .mpi_ops import grouped_allreduce

__all__ = ["DistributedAdasumLegacyOptimizer", "WrappingLegacyOptimizer"]


class WrappingLegacyOptimizer(tf.compat.v1.train.Optimizer):
    """A TF1 optimizer around ``wrapped``, whose slots and variables are the wrapped one's (both
    of Horovod's TF1 wrappers pass these through)."""

    def __init__(self, wrapped: tf.compat.v1.train.Optimizer, name: str, use_locking: bool) -> None:
        super().__init__(name=name, use_locking=use_locking)
        self._optimizer = wrapped

    def get_slot(self, *args: Any, **kwargs: Any) -> Any:
        """The wrapped optimizer's slot."""
        return self._optimizer.get_slot(*args, **kwargs)

    def get_slot_names(self, *args: Any, **kwargs: Any) -> List[str]:
        """The wrapped optimizer's slot names."""
        return self._optimizer.get_slot_names(*args, **kwargs)

    def variables(self, *args: Any, **kwargs: Any) -> List[Any]:
        """The wrapped optimizer's variables."""
        return self._optimizer.variables(*args, **kwargs)


class DistributedAdasumLegacyOptimizer(WrappingLegacyOptimizer):
    """A TF1 optimizer whose ranks combine their model deltas with Adasum every
    ``backward_passes_per_step`` steps (see the module's drawing)."""

    def __init__(self, optimizer: tf.compat.v1.train.Optimizer, name: Optional[str] = None,
                 use_locking: bool = False, compression: type = Compression.none,
                 backward_passes_per_step: int = 1) -> None:
        if tf.executing_eagerly():
            raise ValueError("op=Adasum with a TF1 optimizer needs a graph (as Horovod's): build the training "
                             "step in a tf.Graph, or use DistributedGradientTape(op=Adasum)")
        if backward_passes_per_step < 1:
            raise ValueError(f"backward_passes_per_step must be at least 1, got {backward_passes_per_step}")
        super().__init__(optimizer, name or f"DistributedDelta{type(optimizer).__name__}", use_locking)
        self._compression = compression
        self._passes = int(backward_passes_per_step)
        self._locking = use_locking

    def compute_gradients(self, *args: Any, **kwargs: Any) -> List[Any]:
        """The wrapped optimizer's own gradients: nothing is combined before the update."""
        return self._optimizer.compute_gradients(*args, **kwargs)

    def apply_gradients(self, grads_and_vars: Any, global_step: Any = None, name: Optional[str] = None) -> Any:
        """The wrapped optimizer's update; on every ``backward_passes_per_step``-th step the deltas
        combined with Adasum. Returns the op that runs one step."""
        grads_and_vars = list(grads_and_vars)
        variables = [v for g, v in grads_and_vars if g is not None]
        with tf.compat.v1.variable_scope(f"{self.get_name()}_adasum", reuse=tf.compat.v1.AUTO_REUSE):
            step = tf.compat.v1.get_variable("step_count", shape=(), dtype=tf.int64, trainable=False,
                                             initializer=tf.compat.v1.zeros_initializer())
            starts = [tf.compat.v1.get_variable(f"delta_start_{i}", shape=v.shape, dtype=v.dtype.base_dtype,
                                                trainable=False, initializer=tf.compat.v1.zeros_initializer())
                      for i, v in enumerate(variables)]
        # One name per optimizer in the outermost graph, built in the same order on every rank
        # (the combine runs inside a tf.cond branch, a graph of its own).
        graph = tf.compat.v1.get_default_graph()
        while getattr(graph, "outer_graph", None) is not None:
            graph = graph.outer_graph
        collective = graph.unique_name(f"{self.get_name()}_Adasum", mark_as_used=True)

        started = tf.cond(tf.equal(step, 0),
                          lambda: tf.group(*[s.assign(v, use_locking=self._locking) for s, v in zip(starts, variables)]),
                          tf.no_op)
        with tf.control_dependencies([started]):
            update = self._optimizer.apply_gradients(grads_and_vars, global_step=global_step, name=name)

        def combine() -> Any:
            deltas = [v.read_value() - s.read_value() for v, s in zip(variables, starts)]
            combined = grouped_allreduce(deltas, op=Adasum, compression=self._compression, name=collective)
            moved = [s.assign_add(d, use_locking=self._locking) for s, d in zip(starts, combined)]
            return tf.group(*[v.assign(m, use_locking=self._locking) for v, m in zip(variables, moved)])

        with tf.control_dependencies([update]):
            synced = tf.cond(tf.equal(step % self._passes, self._passes - 1), combine, tf.no_op) \
                if variables else tf.no_op()
        with tf.control_dependencies([synced]):
            return step.assign_add(1).op

