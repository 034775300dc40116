"""``DistributedOptimizer`` for a TF1 optimizer (``tf.compat.v1.train.Optimizer``): Horovod's legacy
path, a graph built and run in a ``tf.compat.v1.Session`` (or, eagerly, ``minimize`` with a callable
loss). ``compute_gradients`` reduces the wrapped optimizer's gradients over the ranks of the process
set; ``apply_gradients``, the slots and the variables are the wrapped optimizer's."""
from __future__ import annotations

import warnings
from typing import Any, List, Optional, Tuple

import tensorflow as tf

from mtrain.ringreduce import Adasum, Average, ProcessSet, global_process_set

from ..gradient_op import check_gradient_op
from .compression import Compression
from .gradient_tape import divided, reduce_gradients, variable_key
from .legacy_adasum import DistributedAdasumLegacyOptimizer, WrappingLegacyOptimizer
from .legacy_aggregation import GraphGradientAggregation
from .process_sets import check_process_set, set_size

__all__ = ["DistributedLegacyOptimizer", "is_legacy_optimizer"]


def is_legacy_optimizer(optimizer: Any) -> bool:
    """Whether ``optimizer`` is a TF1 optimizer (``tf.compat.v1.train.Optimizer``)."""
    return isinstance(optimizer, tf.compat.v1.train.Optimizer)


class DistributedLegacyOptimizer(WrappingLegacyOptimizer):
    """A TF1 optimizer whose gradients are reduced over the ranks of ``process_set`` before they
    are applied (Horovod's ``_DistributedOptimizer``).

    A gradient that is None stays None and is not reduced (as Horovod's). On a rank outside
    ``process_set`` the gradients stay this rank's own. Variables registered with
    ``register_local_var`` keep their own gradients, divided by the set's size when
    ``scale_local_gradients``. With ``backward_passes_per_step`` > 1 (in a graph only, as Horovod's)
    gradients are summed locally and reduced and applied every that many steps
    (``legacy_aggregation``).
    """

    def __init__(self, optimizer: tf.compat.v1.train.Optimizer, name: Optional[str] = None,
                 use_locking: bool = False, compression: type = Compression.none, sparse_as_dense: bool = False,
                 op: Any = Average, gradient_predivide_factor: float = 1.0,
                 process_set: ProcessSet = global_process_set, scale_local_gradients: bool = True,
                 backward_passes_per_step: int = 1, average_aggregated_gradients: bool = False) -> None:
        super().__init__(optimizer, name or f"Distributed{type(optimizer).__name__}", use_locking)
        self._op = check_gradient_op(op, gradient_predivide_factor)
        self._predivide = gradient_predivide_factor
        self._compression = compression
        self._sparse_as_dense = bool(sparse_as_dense)
        self.process_set = check_process_set(process_set)
        self.scale_local_gradients = scale_local_gradients
        self._local_vars: set = set()
        self._aggregation = None
        if backward_passes_per_step != 1:
            self._aggregation = GraphGradientAggregation(backward_passes_per_step, average_aggregated_gradients,
                                                         self._sparse_as_dense, self.get_name())

    def register_local_var(self, var: Any) -> None:
        """Keep ``var``'s gradient on this rank (not reduced over ranks)."""
        self._local_vars.add(variable_key(var))

    def compute_gradients(self, *args: Any, **kwargs: Any) -> List[Tuple[Any, Any]]:
        """The wrapped optimizer's ``compute_gradients``, each gradient reduced over the process set."""
        pairs = list(self._optimizer.compute_gradients(*args, **kwargs))
        grads, variables = [g for g, _ in pairs], [v for _, v in pairs]
        if self._aggregation is not None:
            grads = self._aggregation.compute_gradients(grads, variables, self._reduce)
        else:
            grads = self._reduce(grads, variables)
        return list(zip(grads, variables))

    def _reduce(self, grads: List[Any], variables: List[Any]) -> List[Any]:
        """``grads`` reduced over the process set; local variables' divided by its size; None kept."""
        local = [variable_key(v) in self._local_vars for v in variables]
        shared = [i for i, g in enumerate(grads) if g is not None and not local[i]]
        out = list(grads)
        if shared:
            name = f"{self.get_name()}_Allreduce"
            if not tf.executing_eagerly():
                # A graph may hold several optimizers' reductions, and its ops run in any order:
                # each gets a name of its own, built in the same order on every rank, unique in
                # the outermost graph (a tf.cond branch, where the aggregated gradients are
                # reduced, is a graph of its own).
                graph = tf.compat.v1.get_default_graph()
                while getattr(graph, "outer_graph", None) is not None:
                    graph = graph.outer_graph
                name = graph.unique_name(name, mark_as_used=True)
            reduced = reduce_gradients([grads[i] for i in shared], [variables[i] for i in shared], self._op,
                                       self._predivide, self._compression, name, process_set=self.process_set,
                                       sparse_as_dense=self._sparse_as_dense)
            for i, g in zip(shared, reduced):
                out[i] = g
        if self.scale_local_gradients:
            for i, is_local in enumerate(local):
                if is_local and out[i] is not None:
                    out[i] = divided(out[i], set_size(self.process_set))
        return out

    def apply_gradients(self, grads_and_vars: Any, global_step: Any = None, name: Optional[str] = None) -> Any:
        """The wrapped optimizer's ``apply_gradients`` (with ``backward_passes_per_step`` > 1, on the
        steps that reduced the sums only)."""
        grads_and_vars = list(grads_and_vars)
        apply = lambda: self._optimizer.apply_gradients(grads_and_vars, global_step=global_step,  # noqa: E731
                                                        name=name)
        if self._aggregation is None:
            return apply()
        return self._aggregation.apply_gradients(apply, grads_and_vars, global_step)



def legacy_distributed_optimizer(optimizer: tf.compat.v1.train.Optimizer, name: Optional[str], use_locking: bool,
                                 compression: type, sparse_as_dense: bool, backward_passes_per_step: int, op: Any,
                                 gradient_predivide_factor: float, average_aggregated_gradients: bool,
                                 num_groups: int, groups: Any, process_set: ProcessSet,
                                 scale_local_gradients: bool) -> tf.compat.v1.train.Optimizer:
    """``hvd.DistributedOptimizer`` for a TF1 optimizer, its arguments checked as Horovod checks them."""
    if op == Adasum and average_aggregated_gradients:
        raise ValueError("Adasum does not support average_aggregated_gradients == True")
    if num_groups != 0:
        warnings.warn("num_groups is deprecated: pass groups=", DeprecationWarning, stacklevel=3)
        groups = num_groups if groups is None else groups
    # Groups only choose which gradients share a submission: the values are the same, and all
    # of one call's gradients are reduced in one submission here.
    if groups is not None and not (isinstance(groups, list) or groups > 0):
        raise ValueError("groups must be a positive integer or a list of lists of tf.Variable, "
                         f"got {groups!r}")
    if op == Adasum:  # Horovod's _DistributedAdasumOptimizer: the model deltas are combined, not the gradients
        check_gradient_op(op, gradient_predivide_factor, adasum=True)  # a predivide factor needs op=Average
        if process_set.process_set_id != 0:
            raise NotImplementedError("Adasum does not support process sets yet")
        return DistributedAdasumLegacyOptimizer(optimizer, name, use_locking, compression, backward_passes_per_step)
    return DistributedLegacyOptimizer(optimizer, name, use_locking, compression, sparse_as_dense, op,
                                      gradient_predivide_factor, process_set, scale_local_gradients,
                                      backward_passes_per_step, average_aggregated_gradients)
