"""Keras callbacks with Horovod's names and arguments, for Keras 3 and Keras 2.

As Horovod's derive from ``tf.keras.callbacks.Callback``, these derive from the Callback of
``tf.keras`` in this process: tf_keras' under ``TF_USE_LEGACY_KERAS=1`` (when tf_keras is
installed), Keras 3's otherwise. Each callback reads the optimizer it finds on the model.
"""
from __future__ import annotations

from typing import Any, Callable, Optional, Union

import keras
import numpy as np

import mtrain.ringreduce as rr

from ..gradient_tape import variable_key
from ..functions import broadcast_variables
from . import keras2


def _callback_base() -> type:
    """``tf.keras.callbacks.Callback`` as TensorFlow resolves it, without importing tf_keras otherwise."""
    if keras2.legacy_keras_requested():
        tf_keras = keras2.import_tf_keras()
        if tf_keras is not None:
            return tf_keras.callbacks.Callback
    return keras.callbacks.Callback


_Callback = _callback_base()


class BroadcastGlobalVariablesCallback(_Callback):
    """Broadcast the model's and the optimizer's variables from ``root_rank`` when training starts.

    Unlike Horovod (after the first batch), this runs before the first batch, so
    the first step already starts from identical weights on every rank.
    ``local_variables`` (variables or layers) keep each rank's own values.
    """

    def __init__(self, root_rank: int, device: str = "", local_variables: Any = None) -> None:
        super().__init__()
        self.root_rank = root_rank
        self.broadcast_done = False
        self.local_variables = set()
        self._local_slot_prefixes = []
        self._local_list = []
        for item in local_variables or []:
            for variable in getattr(item, "weights", [item]):
                self.local_variables.add(variable_key(variable))
                self._local_list.append(variable)
                if hasattr(variable, "path"):  # Keras 3 names a slot "<variable path with _>_<slot>"
                    self._local_slot_prefixes.append(variable.path.replace("/", "_") + "_")

    def _shared(self, variables: Any) -> list:
        return [v for v in variables if variable_key(v) not in self.local_variables]

    def _shared_slots(self, variables: Any) -> list:
        prefixes = tuple(self._local_slot_prefixes)
        return [v for v in variables if not (prefixes and str(v.name).startswith(prefixes))]

    def on_train_begin(self, logs: Optional[dict] = None) -> None:
        if self.broadcast_done:
            return
        broadcast_variables(self._shared(self.model.variables), self.root_rank)
        optimizer = getattr(self.model, "optimizer", None)
        if keras2.is_keras2_optimizer(optimizer):
            variables = keras2.optimizer_variables(optimizer, self.model.trainable_variables)
            local = keras2.slot_variables(optimizer, self._local_list)  # their moments stay local too
            broadcast_variables([v for v in variables if variable_key(v) not in local], self.root_rank)
        elif optimizer is not None:
            if not optimizer.built:
                optimizer.build(self.model.trainable_variables)
            # The optimizer state of local variables (Adam's moments, ...) stays local too.
            broadcast_variables(self._shared_slots(optimizer.variables), self.root_rank)
        self.broadcast_done = True


class MetricAverageCallback(_Callback):
    """At the end of every epoch, replace each metric in ``logs`` by its average over all ranks.

    Put it before callbacks that read the metrics (ModelCheckpoint, ReduceLROnPlateau, ...).
    """

    def __init__(self, device: str = "") -> None:
        super().__init__()

    def on_epoch_end(self, epoch: int, logs: Optional[dict] = None) -> None:
        if not logs:
            return
        names = sorted(k for k, v in logs.items() if np.ndim(v) == 0)
        values = np.array([float(logs[k]) for k in names], dtype=np.float64)
        averaged = rr.allreduce(values, op=rr.Average, name=f"MetricAverageCallback.{epoch}")
        for key, value in zip(names, averaged.tolist()):
            logs[key] = value


class LearningRateScheduleCallback(_Callback):
    """Set the learning rate to ``initial_lr * multiplier(epoch)`` between ``start_epoch`` and ``end_epoch``.

    ``multiplier`` is a number or a function of the (fractional, when not
    ``staircase``) epoch. With ``momentum_correction``, as in Horovod, a Keras 2 legacy
    optimizer's momentum is scaled by new/old learning rate for the batch that follows a change
    (Goyal et al.), then restored. Keras 3 and the new tf_keras optimizers compile momentum as a
    constant, so there it is not adjusted.
    """

    def __init__(self, initial_lr: float, multiplier: Union[float, Callable[[float], float]],
                 start_epoch: int = 0, end_epoch: Optional[int] = None, staircase: bool = True,
                 momentum_correction: bool = True, steps_per_epoch: Optional[int] = None) -> None:
        super().__init__()
        self.initial_lr = initial_lr
        self.multiplier = multiplier if callable(multiplier) else (lambda epoch: multiplier)
        self.start_epoch, self.end_epoch = start_epoch, end_epoch
        self.staircase = staircase
        self.momentum_correction = momentum_correction
        self.steps_per_epoch = steps_per_epoch
        self.current_epoch = 0
        self.restore_momentum: Optional[float] = None

    def _active(self, epoch: int) -> bool:
        return epoch >= self.start_epoch and (self.end_epoch is None or epoch < self.end_epoch)

    def _set(self, epoch: float) -> None:
        optimizer = self.model.optimizer
        new_lr = self.initial_lr * self.multiplier(epoch)
        momentum = keras2.legacy_hyper(optimizer, "momentum") if self.momentum_correction else None
        if momentum is not None:
            old_lr = keras2.legacy_hyper(optimizer, "learning_rate")
            if self.restore_momentum is None:
                self.restore_momentum = momentum
            if old_lr:
                optimizer.momentum = self.restore_momentum * new_lr / old_lr
        optimizer.learning_rate = new_lr

    def on_train_batch_end(self, batch: int, logs: Optional[dict] = None) -> None:
        if self.restore_momentum is not None:
            self.model.optimizer.momentum = self.restore_momentum
            self.restore_momentum = None

    def on_train_begin(self, logs: Optional[dict] = None) -> None:
        if self.steps_per_epoch is None:
            self.steps_per_epoch = (self.params or {}).get("steps")
        if not self.staircase and not self.steps_per_epoch:
            raise ValueError(f"{type(self).__name__} needs steps_per_epoch when Keras cannot tell "
                             "the number of steps (pass steps_per_epoch=...)")

    def on_epoch_begin(self, epoch: int, logs: Optional[dict] = None) -> None:
        self.current_epoch = epoch
        if self._active(epoch) and self.staircase:
            self._set(epoch)

    def on_train_batch_begin(self, batch: int, logs: Optional[dict] = None) -> None:
        if self._active(self.current_epoch) and not self.staircase:
            self._set(self.current_epoch + batch / self.steps_per_epoch)


class LearningRateWarmupCallback(LearningRateScheduleCallback):
    """Ramp the learning rate from ``initial_lr / size`` to ``initial_lr`` over ``warmup_epochs``,
    batch by batch (Goyal et al., "Accurate, Large Minibatch SGD"), as Horovod's callback."""

    def __init__(self, initial_lr: float, warmup_epochs: int = 5, momentum_correction: bool = True,
                 steps_per_epoch: Optional[int] = None, verbose: int = 0) -> None:
        if warmup_epochs <= 0:
            raise ValueError(f"warmup_epochs must be positive, got {warmup_epochs!r}")
        self.warmup_epochs, self.verbose = warmup_epochs, verbose

        def multiplier(epoch: float) -> float:
            n = rr.size()
            return 1.0 / n * (epoch * (n - 1) / warmup_epochs + 1)
        super().__init__(initial_lr, multiplier, start_epoch=0, end_epoch=warmup_epochs, staircase=False,
                         momentum_correction=momentum_correction, steps_per_epoch=steps_per_epoch)

    def on_epoch_end(self, epoch: int, logs: Optional[dict] = None) -> None:
        if epoch == self.end_epoch - 1:
            self.model.optimizer.learning_rate = self.initial_lr  # exactly, not the last batch's ramp value
            if self.verbose > 0 and rr.rank() == 0:
                print(f"\nEpoch {epoch + 1}: finished gradual learning rate warmup to {self.initial_lr:g}.")
