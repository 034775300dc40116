"""``SyncBatchNormalization``: Keras batch normalization with batch statistics over all ranks."""
from __future__ import annotations

from typing import Any, Tuple

import keras
import tensorflow as tf

import mtrain.ringreduce as rr
from mtrain.ringreduce import Average

from .mpi_ops import allreduce


class SyncBatchNormalization(keras.layers.BatchNormalization):
    """BatchNormalization whose training-time mean and variance are those of the global batch.

    Each rank's mean and mean of squares are averaged over ranks (so every rank should
    feed batches of the same size, as in Horovod). Gradients flow through the averaging.
    """

    def __init__(self, *args: Any, fused: Any = None, **kwargs: Any) -> None:
        if fused:
            raise ValueError("SyncBatchNormalization does not support fused=True")
        super().__init__(*args, **kwargs)

    def _moments(self, inputs: Any, mask: Any) -> Tuple[Any, Any]:
        mean, variance = super()._moments(inputs, mask)
        if rr.size() == 1:
            return mean, variance
        both = allreduce(tf.stack([mean, variance + tf.square(mean)]), op=Average)
        global_mean, global_mean_of_squares = tf.unstack(both)
        return global_mean, global_mean_of_squares - tf.square(global_mean)
