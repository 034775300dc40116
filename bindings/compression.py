"""Gradient compression, as in Horovod: ``Compression.none`` and ``Compression.fp16``.

A compressor turns a tensor into the tensor that is sent (``compress`` returns it
with a context) and back (``decompress``). The cast is the framework's, so each
adapter builds its ``Compression`` namespace from a ``cast`` and an
``is_floating`` function; user-written compressors subclass ``Compressor``.
"""
from __future__ import annotations

from typing import Any, Callable, Tuple


class Compressor:
    """Interface: subclass and override both static methods."""

    @staticmethod
    def compress(tensor: Any) -> Tuple[Any, Any]:
        raise NotImplementedError

    @staticmethod
    def decompress(tensor: Any, ctx: Any) -> Any:
        raise NotImplementedError


class NoneCompressor(Compressor):
    """Sends the tensor unchanged."""

    @staticmethod
    def compress(tensor: Any) -> Tuple[Any, Any]:
        return tensor, None

    @staticmethod
    def decompress(tensor: Any, ctx: Any) -> Any:
        return tensor


def fp16_compressor(cast: Callable[[Any, Any], Any], is_floating: Callable[[Any], bool],
                    dtype_of: Callable[[Any], Any], float16: Any) -> type:
    """A compressor class sending floating-point tensors as float16 (others unchanged)."""

    class FP16Compressor(Compressor):
        """Floating-point tensors travel as float16 and come back in their own dtype."""

        @staticmethod
        def compress(tensor: Any) -> Tuple[Any, Any]:
            if not is_floating(tensor):
                return tensor, None
            return cast(tensor, float16), dtype_of(tensor)

        @staticmethod
        def decompress(tensor: Any, ctx: Any) -> Any:
            return tensor if ctx is None else cast(tensor, ctx)

    return FP16Compressor
