"""TensorFlow / Keras elastic states and callbacks (``hvd.elastic`` in ``mtrain.tensorflow``
and ``mtrain.tensorflow.keras``, Horovod's names), for Keras 3 and for Keras 2 (tf_keras under
``TF_USE_LEGACY_KERAS=1``, its new and its legacy optimizers).

    state = hvd.elastic.KerasState(model, batch=0, epoch=0)
    callbacks = [hvd.elastic.CommitStateCallback(state, batches_per_commit=10),
                 hvd.elastic.UpdateBatchStateCallback(state), hvd.elastic.UpdateEpochStateCallback(state)]

Values are kept as NumPy copies and synced by broadcasting rank 0's (one object broadcast),
so a rank whose Keras optimizer has not built its variables yet (a new host) builds them.
As in Horovod (horovod/tensorflow/elastic.py), ``sync()`` keeps what it synced as the committed
state: a ``restore()`` after it goes back to rank 0's values, not to this rank's older ones.
The callbacks derive from ``tf.keras``' Callback in this process (tf_keras' under Keras 2).
"""
from __future__ import annotations

from typing import Any, Sequence

import keras
import numpy as np

import mtrain.ringreduce as rr
from mtrain import tf_keras_versions as keras2

from . import HorovodInternalError, HostsUpdatedInterrupt, ObjectState, State, run

__all__ = ["CommitStateCallback", "HorovodInternalError", "HostsUpdatedInterrupt", "KerasState", "ObjectState",
           "State", "TensorFlowKerasState", "TensorFlowState", "UpdateBatchStateCallback",
           "UpdateEpochStateCallback", "run"]


def _values(variables: Sequence[Any]) -> "list[np.ndarray]":
    return [np.array(variable.numpy() if hasattr(variable, "numpy") else variable, copy=True)
            for variable in variables]


def _optimizer_variables(optimizer: Any) -> "list[Any]":
    """An optimizer's variables: a list in Keras 3 and tf_keras' new optimizers, a method in its legacy ones."""
    variables = optimizer.variables
    return list(variables() if callable(variables) and not isinstance(variables, list) else variables)


def _built_optimizer_variables(optimizer: Any, trainable_variables: Sequence[Any]) -> "list[Any]":
    """The variables of ``optimizer`` once its slots for ``trainable_variables`` exist (a fresh optimizer
    creates them on its first step; a resumed one needs them now)."""
    if keras2.is_keras2_optimizer(optimizer):
        return keras2.optimizer_variables(optimizer, trainable_variables)
    if not getattr(optimizer, "built", True):
        optimizer.build(list(trainable_variables))
    return _optimizer_variables(optimizer)


def _keras_callback_base() -> type:
    """``tf.keras.callbacks.Callback`` as TensorFlow resolves it: tf_keras' under ``TF_USE_LEGACY_KERAS=1``
    (Keras 2's ``fit`` takes no Keras 3 callback), Keras 3's otherwise."""
    tf_keras = keras2.import_tf_keras() if keras2.legacy_keras_requested() else None
    return tf_keras.callbacks.Callback if tf_keras is not None else keras.callbacks.Callback


def _assign(variables: Sequence[Any], values: Sequence[np.ndarray], what: str) -> None:
    if len(variables) != len(values):
        raise ValueError(f"{what}: {len(values)} saved values for {len(variables)} variables "
                         "(was the model or optimizer rebuilt differently?)")
    for variable, value in zip(variables, values):
        variable.assign(value)


class TensorFlowState(ObjectState):
    """A list of ``tf.Variable``s plus plain attributes (TF2: pass the variables)."""

    def __init__(self, variables: "Sequence[Any] | None" = None, session: Any = None, **kwargs: Any) -> None:
        if variables is None:
            raise ValueError("TensorFlowState needs `variables` in TF2 (there are no global variables to find)")
        self.variables = list(variables)
        self._saved_variables = _values(self.variables)
        super().__init__(**kwargs)

    def save(self) -> None:
        self._saved_variables = _values(self.variables)
        super().save()

    def restore(self) -> None:
        _assign(self.variables, self._saved_variables, "TensorFlowState.restore")
        super().restore()

    def sync(self) -> None:
        _assign(self.variables, rr.broadcast_object(_values(self.variables), root_rank=0,
                                                    name="mtrain.elastic.tf.variables"), "TensorFlowState.sync")
        self._saved_variables = _values(self.variables)  # as Horovod: the synced values are the committed ones
        super().sync()

    def committed_values(self) -> Any:
        values = super().committed_values()
        values["variables"] = self._saved_variables
        return values

    def load_committed(self, values: Any) -> None:
        self._saved_variables = list(values["variables"])
        super().load_committed(values)


class TensorFlowKerasState(ObjectState):
    """A Keras model's weights and its optimizer's variables, plus plain attributes."""

    def __init__(self, model: Any, optimizer: Any = None, backend: Any = None, **kwargs: Any) -> None:
        if not getattr(model, "built", True):
            raise ValueError("KerasState: the model must be built first; run model.build(input_shape) "
                             "(or call it on a batch)")
        self.model = model
        self.optimizer = optimizer if optimizer is not None else getattr(model, "optimizer", None)
        self._saved_model = self._model_values()
        self._saved_optimizer = self._optimizer_values()
        super().__init__(**kwargs)

    def _model_values(self) -> "list[np.ndarray]":
        return _values(self.model.weights)

    def _optimizer_values(self) -> "list[np.ndarray]":
        return _values(_optimizer_variables(self.optimizer)) if self.optimizer is not None else []

    def _load(self, model_values: "list[np.ndarray]", optimizer_values: "list[np.ndarray]", what: str) -> None:
        _assign(self.model.weights, model_values, f"{what} (model)")
        if self.optimizer is None:
            return
        variables = _optimizer_variables(self.optimizer)
        if optimizer_values and len(variables) != len(optimizer_values):
            # A fresh optimizer creates its slots on its first step; this one resumes a trained one.
            variables = _built_optimizer_variables(self.optimizer, self.model.trainable_variables)
        if optimizer_values or variables:
            _assign(variables, optimizer_values, f"{what} (optimizer)")

    def save(self) -> None:
        self._saved_model = self._model_values()
        self._saved_optimizer = self._optimizer_values()
        super().save()

    def restore(self) -> None:
        self._load(self._saved_model, self._saved_optimizer, "restore")
        super().restore()

    def sync(self) -> None:
        model_values, optimizer_values = rr.broadcast_object(
            (self._model_values(), self._optimizer_values()), root_rank=0, name="mtrain.elastic.keras.variables")
        self._load(model_values, optimizer_values, "sync")
        # As Horovod: the synced values are the committed ones (a restore() goes back to them).
        self._saved_model, self._saved_optimizer = model_values, optimizer_values
        super().sync()

    def committed_values(self) -> Any:
        values = super().committed_values()
        values["model"], values["optimizer"] = self._saved_model, self._saved_optimizer
        return values

    def load_committed(self, values: Any) -> None:
        self._saved_model, self._saved_optimizer = list(values["model"]), list(values["optimizer"])
        super().load_committed(values)


class KerasState(TensorFlowKerasState):
    """Horovod's ``horovod.keras.elastic.KerasState``: the same state under the Keras name."""

    def __init__(self, model: Any, optimizer: Any = None, **kwargs: Any) -> None:
        super().__init__(model, optimizer=optimizer, **kwargs)


_KerasCallback = _keras_callback_base()


class CommitStateCallback(_KerasCallback):
    """Commit the state every `batches_per_commit` batches and at the end of every epoch."""

    def __init__(self, state: State, batches_per_commit: int = 1) -> None:
        super().__init__()
        self.state = state
        self.batches_per_commit = batches_per_commit
        self.batches_remaining = batches_per_commit

    def on_train_begin(self, logs: Any = None) -> None:
        self.batches_remaining = self.batches_per_commit  # every rank counts from the same point

    def on_batch_end(self, batch: int, logs: Any = None) -> None:
        self.batches_remaining -= 1
        if self.batches_remaining == 0:
            self.state.commit()
            self.batches_remaining = self.batches_per_commit

    def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
        self.state.commit()


class UpdateBatchStateCallback(_KerasCallback):
    """Keep ``state.batch`` at the last finished batch (0 after an epoch), and shorten the
    resumed epoch by the batches already done when Keras reports its step count."""

    def __init__(self, state: State) -> None:
        super().__init__()
        self.state = state
        self.steps_per_epoch: "int | None" = None

    def on_train_begin(self, logs: Any = None) -> None:
        self.steps_per_epoch = None

    def on_epoch_begin(self, epoch: int, logs: Any = None) -> None:
        params = getattr(self, "params", None) or {}
        if params.get("steps"):
            if self.steps_per_epoch is None:
                self.steps_per_epoch = params["steps"]
            params["steps"] = self.steps_per_epoch - self.state.batch

    def on_batch_end(self, batch: int, logs: Any = None) -> None:
        self.state.batch = batch

    def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
        self.state.batch = 0


class UpdateEpochStateCallback(_KerasCallback):
    """Keep ``state.epoch`` at the number of epochs finished, counted across resets
    (Keras counts each ``fit`` from 0; the state carries the epochs of earlier generations)."""

    def __init__(self, state: State) -> None:
        super().__init__()
        self.state = state
        self.initial_epoch = state.epoch

    def on_train_begin(self, logs: Any = None) -> None:
        self.initial_epoch = self.state.epoch

    def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
        self.state.epoch = self.initial_epoch + epoch + 1  # +1: a reset after this epoch starts the next
