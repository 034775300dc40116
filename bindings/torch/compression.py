"""``hvd.Compression`` for torch tensors: the shared compressors with torch's cast."""
from __future__ import annotations

import torch

from .. import compression as _compression

__all__ = ["Compression"]


class Compression:
    """Gradient compression choices: ``Compression.none`` or ``Compression.fp16``."""
    none = _compression.NoneCompressor
    fp16 = _compression.fp16_compressor(
        cast=lambda t, dtype: t.to(dtype), is_floating=lambda t: t.is_floating_point(),
        dtype_of=lambda t: t.dtype, float16=torch.float16)
