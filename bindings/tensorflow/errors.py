"""The errors the TensorFlow ops raise: each both Horovod's TensorFlow type and mtrain's own, so that
programs written against either catch it."""
from __future__ import annotations

from typing import Any, Callable

import tensorflow as tf

import mtrain.ringreduce as rr
from mtrain.ringreduce import MismatchError

__all__ = ["InvalidArgument", "RanksDisagreeError", "eager_errors"]


class InvalidArgument(tf.errors.InvalidArgumentError, rr.InvalidArgumentError):
    """An op refused before it ran (a rank outside the op's process set, a root outside it, ...).

    What Horovod raises (``tf.errors.InvalidArgumentError``), and mtrain's own
    ``InvalidArgumentError`` (a RuntimeError and ValueError): the same class eagerly and in a graph.
    """

    def __init__(self, message: str) -> None:
        super().__init__(None, None, message)


class RanksDisagreeError(tf.errors.FailedPreconditionError, MismatchError):
    """Ranks passed incompatible arguments to one collective.

    Horovod programs catch ``tf.errors.FailedPreconditionError``; code written against mtrain
    catches ``MismatchError``: this is both (raised eagerly; see ``bridge.run_collective``).
    """

    def __init__(self, message: str) -> None:
        super().__init__(None, None, message)


def eager_errors(fn: Callable[[], Any]) -> Any:
    """``fn()``, with the runtime's argument errors raised as ``InvalidArgument``."""
    try:
        return fn()
    except rr.InvalidArgumentError as error:
        if isinstance(error, tf.errors.OpError):
            raise
        raise InvalidArgument(str(error)) from error
