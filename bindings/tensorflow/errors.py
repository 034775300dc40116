"""The errors the TensorFlow ops raise: each both Horovod's TensorFlow type and mtrain's own, so that
programs written against either catch it."""
from __future__ import annotations

from typing import Any, Callable, List

import tensorflow as tf

import mtrain.ringreduce as rr
from mtrain.ringreduce import MismatchError

__all__ = ["InvalidArgument", "RanksDisagreeError", "eager_errors", "failed_precondition_outputs"]


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
    catches ``MismatchError``: this is both, eagerly. In a graph TensorFlow makes the exception
    from the op's status code, so there it is a plain ``FailedPreconditionError`` (see
    ``failed_precondition_outputs``).
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


class _NotATensor:
    """What a ``tf.py_function`` body returns in place of its outputs to fail its op with
    FAILED_PRECONDITION (see ``failed_precondition_outputs``).

    A py_function passes each output through ``tf.convert_to_tensor``, which hands back
    whatever an object's ``__tf_tensor__`` returns, unchecked, and then through a device copy
    (``_copy``); this object survives both as itself.
    """

    backing_device = None

    def __tf_tensor__(self, dtype: Any = None, name: Any = None) -> "_NotATensor":
        return self

    def _copy(self) -> "_NotATensor":
        return self


def failed_precondition_outputs(message: str) -> List[Any]:
    """Outputs for a ``tf.py_function`` body that fail its op with ``tf.errors.FailedPreconditionError``
    carrying ``message``: Horovod's error class for ranks that disagree, in a graph.

    A graph op's error class is its status code, and a Python exception raised in a py_function
    gets its code from its class alone (TensorFlow's py_func.cc: ValueError and TypeError are
    INVALID_ARGUMENT, most others UNKNOWN), never FAILED_PRECONDITION, and no stock op fails with
    a code and a message both chosen when it runs. The one FAILED_PRECONDITION a py_function
    reports is for an output that is not a tensor, with the output's type name in its message:
    so the output is an object of a class named for the message ("Expected EagerTensor, found
    PyObject of type: <message>"). The binding's tests check that this still holds.
    """
    carrier = type("\n" + message.replace("\0", " "), (_NotATensor,), {})  # a class name may hold any text but NUL
    return [carrier()]
