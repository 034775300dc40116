"""``hvd.Compression`` for TensorFlow tensors: the shared compressors with TensorFlow's cast."""
from __future__ import annotations

import tensorflow as tf

from .. import compression as _compression

__all__ = ["Compression"]


class Compression:
    """Gradient compression choices: ``Compression.none`` or ``Compression.fp16``."""
    none = _compression.NoneCompressor
    fp16 = _compression.fp16_compressor(
        cast=lambda t, dtype: tf.cast(t, dtype), is_floating=lambda t: t.dtype.is_floating,
        dtype_of=lambda t: t.dtype, float16=tf.float16)
