"""A tiny stand-in for ``keras.applications``' ResNet50: called the same way
(``TinyResNet(weights=None)``, softmax over 1000 classes), small enough for CPU tests."""
from __future__ import annotations

from typing import Optional

import keras


def TinyResNet(weights: Optional[str] = None, classes: int = 1000, width: int = 8) -> keras.Model:
    """A stem, one residual block with batch normalization, global pooling and a softmax classifier;
    any image size (height and width are left open)."""
    if weights is not None:
        raise ValueError(f"TinyResNet has no pretrained weights: pass weights=None, not {weights!r}")
    images = keras.Input(shape=(None, None, 3))
    x = keras.layers.Conv2D(width, 3, strides=2, padding="same", use_bias=False)(images)
    x = keras.layers.ReLU()(keras.layers.BatchNormalization()(x))
    y = keras.layers.Conv2D(width, 3, padding="same", use_bias=False)(x)
    y = keras.layers.ReLU()(keras.layers.BatchNormalization()(y))
    y = keras.layers.Conv2D(width, 3, padding="same", use_bias=False)(y)
    x = keras.layers.ReLU()(keras.layers.Add()([x, keras.layers.BatchNormalization()(y)]))
    x = keras.layers.GlobalAveragePooling2D()(x)
    return keras.Model(images, keras.layers.Dense(classes, activation="softmax")(x), name="tiny_resnet")
