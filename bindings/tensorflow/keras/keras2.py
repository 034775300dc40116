"""Keras 2: the ``DistributedOptimizer`` for ``tf_keras`` optimizers (what ``tf.keras`` is under
``TF_USE_LEGACY_KERAS=1``), both ``tf_keras.optimizers.Optimizer`` and ``tf_keras.optimizers.legacy``.

As in Horovod's ``horovod/_keras``, gradients are reduced where the optimizer computes them:
``minimize`` (hence ``fit``), ``compute_gradients`` and ``_compute_gradients`` (new and legacy
optimizers alike), ``get_gradients`` (legacy optimizers). ``apply_gradients`` applies what it is given, so a custom loop that computes its
own gradients reduces them with ``DistributedGradientTape``. With ``backward_passes_per_step=k``
the gradients are summed on the rank and reduced every k-th time, and ``apply_gradients`` only
applies on those steps (it counts ``iterations`` on the others): Horovod's
LocalGradientAggregationHelper.

This module never imports tf_keras: a tf_keras optimizer means the user has imported it already.
"""
from __future__ import annotations

from types import ModuleType
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Sequence

import tensorflow as tf

from mtrain.ringreduce import Average, ProcessSet, global_process_set
# Which Keras this process runs, for this module and the elastic state alike (re-exported here).
from mtrain.tf_keras_versions import (import_tf_keras, is_keras2_optimizer, legacy_base, legacy_keras_requested,
                                      optimizer_variables, tf_keras_installed)

from ..gradient_tape import divided, reduce_gradients, scaled, variable_key
from ..process_sets import set_size

__all__ = ["Settings", "default_settings", "distributed_class", "distributed_optimizer", "import_tf_keras",
           "is_keras2_optimizer", "legacy_hyper", "legacy_keras_requested", "loading_objects", "optimizer_variables",
           "slot_variables", "tf_keras_installed"]


def slot_variables(optimizer: Any, variables: Sequence[Any]) -> set:
    """The keys (``variable_key``) of the optimizer slots (Adam's moments, ...) that belong to ``variables``."""
    keys = set()
    if isinstance(optimizer, legacy_base()):
        for variable in variables:
            for slot_name in optimizer.get_slot_names():
                try:
                    keys.add(variable_key(optimizer.get_slot(variable, slot_name)))
                except KeyError:  # no such slot for this variable
                    pass
        return keys
    # The new tf_keras optimizers name a slot "<slot>/<variable's shared name>" (add_variable_from_reference):
    # the variable's name without its ":0" (tf.Variable._shared_name is that, spelled with the public name).
    owners = {v.name.split(":")[0] for v in variables}
    for slot in optimizer.variables():
        name = slot.name.split(":")[0]
        if "/" in name and name.split("/", 1)[1] in owners:
            keys.add(variable_key(slot))
    return keys


def legacy_hyper(optimizer: Any, name: str) -> Optional[float]:
    """The value of a legacy (OptimizerV2) optimizer's hyperparameter ``name``; None for any other
    optimizer, or when it has no such hyperparameter."""
    legacy = legacy_base()
    if legacy is None or not isinstance(optimizer, legacy) or name not in optimizer._hyper:
        return None
    value = optimizer._get_hyper(name)
    if callable(value):  # a learning-rate schedule
        return None
    return float(value.numpy() if hasattr(value, "numpy") else value)


class Settings(NamedTuple):
    """What one ``DistributedOptimizer`` call asked for; a class attribute of the class it makes, so that
    ``from_config`` (and ``load_model``) builds optimizers that reduce the same way."""

    op: Any
    gradient_predivide_factor: float
    compression: type
    sparse_as_dense: bool
    process_set: ProcessSet
    backward_passes_per_step: int
    average_aggregated_gradients: bool
    scale_local_gradients: bool


def default_settings(compression: type) -> Settings:
    """Horovod's defaults, as ``load_model`` wraps an optimizer."""
    return Settings(Average, 1.0, compression, False, global_process_set, 1, False, True)


class _Aggregation:
    """Per-rank sums of ``backward_passes_per_step`` gradients and the count of passes so far.

    A plain object, not a Trackable: its variables stay out of the optimizer's checkpoints.
    """

    def __init__(self, passes: int) -> None:
        self.passes = passes
        self.backward_passes_per_step = passes  # Horovod's name (opt._agg_helper.backward_passes_per_step)
        with tf.init_scope():
            self.counter = tf.Variable(0, dtype=tf.int64, trainable=False, name="mtrain_aggregation_counter")
        self.sums: Optional[List[tf.Variable]] = None

    def add(self, grads: Sequence[Any], variables: Sequence[Any], sparse_as_dense: bool) -> List[tf.Tensor]:
        """Add one pass's gradients (a missing one as zeros); the sums so far."""
        dense = []
        for g, v in zip(grads, variables):
            if isinstance(g, tf.IndexedSlices):
                if not sparse_as_dense:
                    raise ValueError("IndexedSlices gradients (embeddings) cannot be aggregated over "
                                     "backward_passes_per_step > 1: pass sparse_as_dense=True")
                g = tf.convert_to_tensor(g)
            dense.append(tf.zeros_like(v) if g is None else g)
        if self.sums is None:
            with tf.init_scope():
                self.sums = [tf.Variable(tf.zeros(v.shape, g.dtype), trainable=False,
                                         name=f"mtrain_aggregated_{i}")
                             for i, (g, v) in enumerate(zip(dense, variables))]
        if len(self.sums) != len(dense):
            raise ValueError(f"backward_passes_per_step: this pass has {len(dense)} gradients, earlier passes "
                             f"had {len(self.sums)}; compute gradients for the same variables every pass")
        for total, g in zip(self.sums, dense):
            total.assign_add(g)
        self.counter.assign_add(1)
        return [total.read_value() for total in self.sums]

    def complete(self) -> tf.Tensor:
        return tf.equal(self.counter, self.passes)

    def applying(self) -> tf.Tensor:
        """True right after a completed aggregation (the step that applies)."""
        return tf.equal(self.counter, 0)

    def clear(self) -> List[Any]:
        """Back to no passes, the sums to zeros (not minus themselves: an inf gradient must not stay)."""
        ops = [self.counter.assign(0)]
        ops += [total.assign(tf.zeros_like(total)) for total in self.sums or []]
        return ops


class _DistributedOptimizer:
    """Mixed in before a tf_keras optimizer's own class (see ``distributed_optimizer``).

    The surface of Horovod's wrapped Keras optimizer (horovod/_keras/__init__.py), for the new and the
    legacy optimizers alike: ``compute_gradients`` and ``_compute_gradients`` (reduced),
    ``_aggregate_gradients`` (the base's own, across tf.distribute replicas only), ``register_local_var``,
    ``_agg_helper`` (None, or the aggregation with its ``counter``) and ``variables`` usable both as a
    list and as a call.
    """

    _mtrain_settings: Settings
    # apply_gradients takes experimental_aggregate_gradients (passed on), as Horovod's declares.
    _HAS_AGGREGATE_GRAD = True

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        settings = self._mtrain_settings
        self._mtrain_local: set = set()
        passes = settings.backward_passes_per_step
        self._mtrain_aggregation = _Aggregation(passes) if passes > 1 else None

    def register_local_var(self, var: Any) -> None:
        """Keep ``var``'s gradient on this rank (not reduced over ranks)."""
        self._mtrain_local.add(variable_key(var))

    @property
    def _agg_helper(self) -> Optional[_Aggregation]:
        """Horovod's name for the ``backward_passes_per_step`` aggregation (None when it is 1)."""
        return self._mtrain_aggregation

    @property
    def variables(self) -> "CallableList":
        # The new optimizers' ``variables`` is a list, the legacy ones' a method; Horovod's wrapper
        # answers both ways, and so do elastic states and user code that call or iterate it.
        base = super().variables  # type: ignore[misc]
        return CallableList(base() if callable(base) and not isinstance(base, list) else base)

    def compute_gradients(self, loss: Any, var_list: Any, tape: Any = None) -> List[Any]:
        """(gradient, variable) pairs of ``loss``, reduced over the ranks (the new optimizers' ``minimize``
        calls this; a legacy optimizer gets it too, as in Horovod)."""
        return self._compute_gradients(loss, var_list, None, tape)

    def _compute_gradients(self, loss: Any, var_list: Any, grad_loss: Any = None, tape: Any = None) -> List[Any]:
        """The legacy optimizers' ``minimize`` calls this; the new ones get it too (Horovod's tests call it)."""
        base = super()
        if hasattr(base, "_compute_gradients"):  # legacy (OptimizerV2)
            pairs = base._compute_gradients(loss, var_list, grad_loss, tape=tape)  # type: ignore[misc]
        else:
            if grad_loss is not None:
                raise ValueError("grad_loss is taken by the legacy (tf_keras.optimizers.legacy) optimizers only")
            pairs = base.compute_gradients(loss, var_list, tape=tape)  # type: ignore[misc]
        return self._mtrain_reduced_pairs(pairs)

    def _aggregate_gradients(self, grads_and_vars: Any) -> Any:
        """The base's aggregation across tf.distribute replicas (the reduction over ranks is done already)."""
        base = super()
        if hasattr(base, "_aggregate_gradients"):
            return base._aggregate_gradients(grads_and_vars)  # type: ignore[misc]
        return base.aggregate_gradients(grads_and_vars)  # type: ignore[misc]

    def apply_gradients(self, grads_and_vars: Any, *args: Any, **kwargs: Any) -> Any:
        aggregation = self._mtrain_aggregation
        if aggregation is None:
            return super().apply_gradients(grads_and_vars, *args, **kwargs)  # type: ignore[misc]
        grads_and_vars = list(grads_and_vars)
        parent = super()
        with tf.init_scope():
            iterations = self.iterations  # created here, not inside a branch of the cond below

        def apply() -> tf.Tensor:
            parent.apply_gradients(grads_and_vars, *args, **kwargs)  # type: ignore[misc]
            return tf.constant(True)

        def count() -> tf.Tensor:
            iterations.assign_add(1)
            return tf.constant(False)

        tf.cond(aggregation.applying(), apply, count)
        return iterations

    def _mtrain_reduced_pairs(self, grads_and_vars: Any) -> List[Any]:
        pairs = list(grads_and_vars)
        if not pairs:
            return pairs
        variables = [v for _, v in pairs]
        return list(zip(self._mtrain_reduce([g for g, _ in pairs], variables), variables))

    def _mtrain_reduce(self, grads: Sequence[Any], variables: Sequence[Any]) -> List[Any]:
        settings, aggregation = self._mtrain_settings, self._mtrain_aggregation
        if aggregation is None:
            return self._mtrain_allreduce(list(grads), list(variables), 1.0)
        sums = aggregation.add(grads, variables, settings.sparse_as_dense)
        scale = 1.0 / aggregation.passes if settings.average_aggregated_gradients else 1.0

        def reduce_and_clear() -> List[tf.Tensor]:
            reduced = self._mtrain_allreduce(sums, list(variables), scale)
            with tf.control_dependencies(reduced):
                cleared = aggregation.clear()
            with tf.control_dependencies(cleared):
                return [tf.identity(g) for g in reduced]

        return tf.cond(aggregation.complete(), reduce_and_clear, lambda: [tf.identity(g) for g in sums])

    def _mtrain_allreduce(self, grads: List[Any], variables: List[Any], scale: float) -> List[Any]:
        settings, local = self._mtrain_settings, self._mtrain_local
        shared = [i for i, v in enumerate(variables) if variable_key(v) not in local]
        reduced = reduce_gradients([grads[i] for i in shared], [variables[i] for i in shared], settings.op,
                                    settings.gradient_predivide_factor, settings.compression,
                                    "DistributedOptimizer.gradients", postscale=scale,
                                    process_set=settings.process_set,
                                    sparse_as_dense=settings.sparse_as_dense) if shared else []
        out = list(grads)
        for i, g in zip(shared, reduced):
            out[i] = g
        if len(shared) != len(grads):
            # Horovod divides the local gradients by the size of the process set.
            size = set_size(settings.process_set) if settings.scale_local_gradients else 1
            shared_set = set(shared)
            out = [g if i in shared_set or g is None else scaled(divided(g, size), scale)
                   for i, g in enumerate(out)]
        return out


class _DistributedNewOptimizer(_DistributedOptimizer):
    """For the new tf_keras optimizers, whose ``minimize`` calls ``compute_gradients``."""


class _DistributedLegacyOptimizer(_DistributedOptimizer):
    """For ``tf_keras.optimizers.legacy`` optimizers (OptimizerV2), whose ``minimize`` calls
    ``_compute_gradients``, and whose ``get_gradients`` graph code calls."""

    def get_gradients(self, loss: Any, params: Any) -> List[Any]:
        return self._mtrain_reduce(super().get_gradients(loss, params), params)  # type: ignore[misc]


class CallableList(list):
    """A list that also answers ``()`` with itself: ``opt.variables`` and ``opt.variables()`` alike."""

    def __call__(self) -> "CallableList":
        return self


def distributed_optimizer(optimizer: Any, settings: Settings, name: Optional[str]) -> Any:
    """An optimizer of ``optimizer``'s class (same name, same configuration) that reduces its gradients
    as ``settings`` says. Like Horovod, the new optimizer starts without the old one's slots."""
    if isinstance(optimizer, _DistributedOptimizer):
        raise ValueError("this optimizer is already a DistributedOptimizer; wrap the plain optimizer once")
    cls = distributed_class(type(optimizer), settings)
    config = optimizer.get_config()
    if name is not None:
        config["name"] = name
    return cls.from_config(config)


def distributed_class(base: type, settings: Settings) -> type:
    """``base`` (a tf_keras optimizer class) with the reduction mixed in, named after it (so saved models
    load without mtrain)."""
    legacy = legacy_base()
    mixin = _DistributedLegacyOptimizer if legacy is not None and issubclass(base, legacy) \
        else _DistributedNewOptimizer
    return type(base.__name__, (mixin, base), {"__module__": base.__module__, "_mtrain_settings": settings})


def loading_objects(tf_keras: ModuleType, compression: type) -> Dict[str, Any]:
    """``load_model``'s custom objects for tf_keras' own optimizers: each name wrapped with default settings.

    tf_keras looks its own optimizers up by lower-case name, one name for the new and the legacy class
    (Adam, legacy Adam): the config's ``is_legacy_optimizer`` tells which was saved.
    """
    settings = default_settings(compression)
    classes: Dict[str, Dict[bool, type]] = {}
    for legacy, module, base in ((False, tf_keras.optimizers, tf_keras.optimizers.Optimizer),
                                 (True, tf_keras.optimizers.legacy, tf_keras.optimizers.legacy.Optimizer)):
        for cls in vars(module).values():
            if isinstance(cls, type) and issubclass(cls, base) and cls is not base:
                classes.setdefault(cls.__name__.lower(), {})[legacy] = cls

    def loader(choices: Dict[bool, type]) -> Callable[..., Any]:
        def load(**config: Any) -> Any:
            legacy = bool(config.get("is_legacy_optimizer", True)) and True in choices
            if legacy:
                config.pop("is_legacy_optimizer", None)
            cls = choices[legacy] if legacy in choices else next(iter(choices.values()))
            return distributed_class(cls, settings).from_config(config)
        return load

    return {name: loader(choices) for name, choices in classes.items()}
