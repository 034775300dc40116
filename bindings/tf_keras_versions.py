"""Which Keras a TensorFlow program runs (Keras 3, or Keras 2 as ``tf_keras`` under
``TF_USE_LEGACY_KERAS=1``), and a Keras 2 optimizer's variables: shared by the Keras binding
(``mtrain.tensorflow.keras.keras2``) and the elastic state (``mtrain.elastic.tensorflow``), which
the Keras package itself imports, so this lives outside both.

This module never imports tf_keras unless asked (``import_tf_keras``).
"""
from __future__ import annotations

import importlib.util
import os
import sys
from types import ModuleType
from typing import Any, List, Optional, Sequence

import tensorflow as tf

__all__ = ["import_tf_keras", "is_keras2_optimizer", "legacy_base", "legacy_keras_requested", "optimizer_variables",
           "tf_keras_installed"]


def legacy_keras_requested() -> bool:
    """Whether ``tf.keras`` is tf_keras in this process: TensorFlow's own rule (``TF_USE_LEGACY_KERAS``)."""
    return os.environ.get("TF_USE_LEGACY_KERAS") in ("true", "True", "1")


def import_tf_keras() -> Optional[ModuleType]:
    """tf_keras, or None when it is not installed."""
    try:
        import tf_keras
    except ImportError:
        return None
    return tf_keras


def tf_keras_installed() -> bool:
    """Whether tf_keras can be imported (without importing it)."""
    if "tf_keras" in sys.modules:
        return sys.modules["tf_keras"] is not None
    return importlib.util.find_spec("tf_keras") is not None


def legacy_base() -> Optional[type]:
    """tf_keras' legacy optimizer base class, or None when tf_keras is not imported."""
    tf_keras = sys.modules.get("tf_keras")
    return None if tf_keras is None else tf_keras.optimizers.legacy.Optimizer


def is_keras2_optimizer(optimizer: Any) -> bool:
    """Whether ``optimizer`` is a tf_keras optimizer (new or legacy)."""
    tf_keras = sys.modules.get("tf_keras")
    return tf_keras is not None and isinstance(
        optimizer, (tf_keras.optimizers.Optimizer, tf_keras.optimizers.legacy.Optimizer))


def optimizer_variables(optimizer: Any, trainable_variables: Sequence[Any]) -> List[Any]:
    """A tf_keras optimizer's variables, its slots created first for ``trainable_variables``."""
    with tf.init_scope():
        if isinstance(optimizer, legacy_base()):
            optimizer._create_all_weights(list(trainable_variables))
        else:
            optimizer.build(list(trainable_variables))
    return list(optimizer.variables())
