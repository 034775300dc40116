"""The helpers built on the collectives, as Horovod's ``horovod/tensorflow/functions.py``: broadcasting
variables and picklable objects, gathering objects; and the ``*_op`` tensors (rank, sizes, set
membership) read when the op runs."""
from __future__ import annotations

from typing import Any, Callable, List, Optional, Sequence

import numpy as np
import tensorflow as tf

import mtrain.ringreduce as rr
from mtrain.ringreduce import ProcessSet, global_process_set

from .bridge import Finish, contiguous, dense_tensor, graph_name, int_op, run_collective
from .errors import eager_errors
from .process_sets import check_process_set, set_of_id, set_size

__all__ = [
    "allgather_object", "broadcast_", "broadcast_global_variables", "broadcast_object", "broadcast_object_fn",
    "broadcast_variables", "local_rank_op", "local_size_op", "process_set_included_op", "rank_op", "size_op",
]


# -- picklable objects -------------------------------------------------------------

def broadcast_object(obj: Any, root_rank: int = 0, session: Any = None, name: Optional[str] = None,
                     process_set: ProcessSet = global_process_set) -> Any:
    """``root_rank``'s picklable object, on every rank of ``process_set`` (``root_rank`` is a global rank)."""
    check_process_set(process_set)
    return eager_errors(lambda: rr.broadcast_object(obj, root_rank, name, process_set=process_set))


def allgather_object(obj: Any, session: Any = None, name: Optional[str] = None,
                     process_set: ProcessSet = global_process_set) -> list:
    """Every rank's picklable object, in rank order within ``process_set``."""
    check_process_set(process_set)
    return eager_errors(lambda: rr.allgather_object(obj, name, process_set=process_set))


def broadcast_object_fn(root_rank: int = 0, session: Any = None, name: Optional[str] = None,
                        process_set: ProcessSet = global_process_set) -> Callable[[Any], Any]:
    """A function that broadcasts its (picklable) argument from ``root_rank`` over ``process_set``."""
    return lambda obj: broadcast_object(obj, root_rank, session, name, process_set)


# -- variables -------------------------------------------------------------------------

def broadcast_(variables: Sequence[tf.Variable], root_rank: int, name: Optional[str] = None,
               process_set: ProcessSet = global_process_set) -> List[tf.Tensor]:
    """In place: every variable takes ``root_rank``'s value; returns their new values."""
    broadcast_variables(variables, root_rank, process_set=process_set)
    return [v.read_value() for v in variables]


def broadcast_variables(variables: Sequence[tf.Variable], root_rank: int,
                        process_set: ProcessSet = global_process_set, inplace: bool = False) -> Any:
    """Assign ``root_rank``'s value to every variable (model weights, optimizer slots, ...) on the
    ranks of ``process_set``. ``inplace`` is accepted for Horovod (the assignment is in place anyway).

    In a TF1-style graph this returns the op that does it; eagerly it is done on return.
    """
    check_process_set(process_set)
    variables = list(variables)
    if not variables:
        return None if tf.executing_eagerly() else tf.no_op()
    values = [dense_tensor(v, f"variables[{i}]") for i, v in enumerate(variables)]

    # Two calls in one graph (the model's variables, then the optimizer's) may be in flight at
    # once, so there each call's names are its own.
    base = graph_name(None, "broadcast_variables", process_set) or "broadcast_variables"

    def fn(*arrays: np.ndarray) -> Finish:
        handles = [rr.broadcast_async(contiguous(a), root_rank, f"{base}.{i}", process_set=process_set)
                   for i, a in enumerate(arrays)]
        return lambda: [rr.synchronize(h).reshape(a.shape) for h, a in zip(handles, arrays)]
    assigns = [variable.assign(value) for variable, value in
               zip(variables, run_collective(fn, values, [v.dtype for v in values], [v.shape for v in values]))]
    return None if tf.executing_eagerly() else tf.group(*assigns)


def broadcast_global_variables(root_rank: int) -> Any:
    """TF1 graphs: the op that broadcasts every global variable from ``root_rank``."""
    if tf.executing_eagerly():
        raise RuntimeError("broadcast_global_variables() does not work eagerly (there are no global "
                           "variables in TF2): use broadcast_variables(model.variables, root_rank) or "
                           "the Keras BroadcastGlobalVariablesCallback instead")
    return broadcast_variables(tf.compat.v1.global_variables(), root_rank)


# -- the *_op tensors ----------------------------------------------------------------------

def rank_op(name: Optional[str] = None) -> tf.Tensor:
    """This process's rank, as an int32 tensor."""
    return int_op(rr.rank, name)


def local_rank_op(name: Optional[str] = None) -> tf.Tensor:
    """This process's rank on its host, as an int32 tensor."""
    return int_op(rr.local_rank, name)


def size_op(process_set_id: int = 0, name: Optional[str] = None) -> tf.Tensor:
    """The number of ranks in the process set ``process_set_id`` (0: every rank), as an int32 tensor."""
    return int_op(lambda: set_size(set_of_id(process_set_id)), name)


# Horovod's codes for process_set_included_op when there is no answer.
_PROCESS_SET_ERROR_INIT, _PROCESS_SET_ERROR_UNKNOWN_SET = -1, -3


def process_set_included_op(process_set_id: int = 0, name: Optional[str] = None) -> tf.Tensor:
    """1 if this rank belongs to the process set ``process_set_id``, else 0, as an int32 tensor; as in
    Horovod, -1 before ``init()`` and -3 for an unknown set."""
    def included() -> int:
        if not rr.is_initialized():
            return _PROCESS_SET_ERROR_INIT
        try:
            return int(bool(set_of_id(process_set_id).included()))
        except rr.InvalidArgumentError:
            return _PROCESS_SET_ERROR_UNKNOWN_SET
    return int_op(included, name)


def local_size_op(name: Optional[str] = None) -> tf.Tensor:
    """The number of ranks on this host, as an int32 tensor."""
    return int_op(rr.local_size, name)
