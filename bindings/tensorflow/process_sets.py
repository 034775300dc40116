"""Process sets as the TensorFlow ops take them: checked before any op runs, looked up by id for
Horovod's ``*_op(process_set_id=...)``."""
from __future__ import annotations

from typing import Any

import tensorflow as tf

import mtrain.ringreduce as rr
from mtrain.ringreduce import ProcessSet

from .errors import InvalidArgument

__all__ = ["check_process_set", "set_of_id", "set_rank", "set_size"]


def check_process_set(process_set: Any) -> ProcessSet:
    """``process_set`` if it is a registered ProcessSet; a clear error otherwise (before any op runs)."""
    if not isinstance(process_set, ProcessSet):
        raise InvalidArgument(f"process_set must be an mtrain ProcessSet (hvd.ProcessSet, hvd.global_process_set), "
                              f"got {type(process_set).__name__}")
    if process_set.process_set_id is None:
        raise InvalidArgument(f"{process_set} is not registered: pass it to hvd.init(process_sets=[...]) or "
                              "hvd.add_process_set() on every rank first")
    if process_set.process_set_id != 0 and not tf.executing_eagerly():
        # An id the runtime does not know: refused while the graph is built, a ValueError as
        # Horovod's (eagerly the runtime refuses it the same way; in a graph it would be the op's
        # InvalidArgumentError only when it runs).
        set_of_id(process_set.process_set_id)
    return process_set


def set_size(process_set: ProcessSet) -> int:
    """The number of ranks in ``process_set`` (what Average divides by)."""
    return int(check_process_set(process_set).size())


def set_rank(process_set: ProcessSet) -> int:
    """This rank's position within ``process_set`` (the order of allgather results)."""
    return int(check_process_set(process_set).rank())


def set_of_id(process_set_id: int) -> ProcessSet:
    """A handle on the registered set ``process_set_id`` (as Horovod's ``*_op(process_set_id=...)`` take)."""
    try:
        return rr.process_set_by_id(process_set_id)
    except rr.InvalidArgumentError as error:  # as TF's InvalidArgumentError too, as Horovod raises it
        raise InvalidArgument(str(error)) from None
