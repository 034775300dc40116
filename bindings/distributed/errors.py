"""The error the DDP backend raises for a collective's refused arguments."""
from __future__ import annotations

__all__ = ["ArgumentError"]


class ArgumentError(ValueError, RuntimeError):
    """A collective's arguments were refused: a ValueError, and a RuntimeError as gloo raises
    (its checks are ``TORCH_CHECK``s), so code written for either keeps catching it."""
