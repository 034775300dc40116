"""The bridge between TensorFlow tensors and the runtime's NumPy collectives: eagerly a direct call,
in a graph a *submit* op and a *wait* op (see ``run_collective``), whose tickets one ``GraphBridge``
owns. Also the names graph ops go to the runtime with, and the int32 ops read when they run."""
from __future__ import annotations

import itertools
import re
import weakref
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Sequence

import numpy as np
import tensorflow as tf

from mtrain.ringreduce import MismatchError, ProcessSet

from .errors import RanksDisagreeError, eager_errors, failed_precondition_outputs

__all__ = ["Finish", "GraphBridge", "contiguous", "dense_tensor", "first_dim_unknown", "graph_name", "int_op",
           "run_collective"]

Finish = Callable[[], List[np.ndarray]]


# -- tensors <-> NumPy ---------------------------------------------------------

def dense_tensor(value: Any, what: str = "tensor") -> tf.Tensor:
    """A dense tensor on the CPU (IndexedSlices are densified, as Horovod's sparse_as_dense)."""
    if isinstance(value, tf.IndexedSlices):
        value = tf.convert_to_tensor(value)
    tensor = tf.convert_to_tensor(value)
    if tf.executing_eagerly() and "GPU" in (tensor.device or ""):
        raise NotImplementedError(f"{what} is on {tensor.device}: mtrain's GPU path is not there yet; "
                                  "place the computation on the CPU (with tf.device('/CPU:0'))")
    return tensor


def contiguous(array: Any) -> np.ndarray:
    """C-contiguous, keeping 0-d arrays 0-d (np.ascontiguousarray would make them 1-d)."""
    return np.asarray(array, order="C")


def first_dim_unknown(tensor: tf.Tensor) -> tf.TensorShape:
    """``tensor``'s static shape with its first dimension unknown (what an allgather or a scatter returns)."""
    return tf.TensorShape([None]).concatenate(tensor.shape[1:]) if tensor.shape.rank else tensor.shape


# -- submit and wait ---------------------------------------------------------------

class _LastSubmit(NamedTuple):
    """A graph's last submit op, and the control-flow context it was built in."""

    op: tf.Operation
    context: Any


class GraphBridge:
    """The submit and wait ops of graphs, and the collectives between the two, by ticket.

    A submit op hands its collective to the runtime and keeps what waits for the result under a
    fresh ticket; the wait op takes it back by that ticket. The submit ops of one graph run in
    the order they were built (each after the graph's previous one), the same on every rank.
    """

    def __init__(self) -> None:
        # Collectives submitted by a graph's submit ops, until their wait op takes them.
        self._submitted: Dict[int, Finish] = {}
        self._tickets = itertools.count(1)
        self._last_submit: "weakref.WeakKeyDictionary[Any, _LastSubmit]" = weakref.WeakKeyDictionary()

    def submit_op(self, submit: Callable[..., Finish], inputs: Sequence[tf.Tensor]) -> tf.Tensor:
        """The op that submits a collective and returns its ticket (an int64 scalar), run after the
        graph's previous submit op: the order the graph was built in, the same on every rank."""
        def run(*arrays: np.ndarray) -> np.ndarray:
            finish = submit(*arrays)
            ticket = next(self._tickets)
            self._submitted[ticket] = finish
            return np.int64(ticket)

        graph = tf.compat.v1.get_default_graph()
        context = graph._get_control_flow_context()  # TF1 loops drop control inputs from outside them
        previous = self._last_submit.get(graph)
        after = [previous.op] if previous is not None and previous.context is context else []
        with tf.control_dependencies(after):
            ticket = tf.numpy_function(run, list(inputs), tf.int64, stateful=True)
        ticket.set_shape([])
        self._last_submit[graph] = _LastSubmit(ticket.op, context)
        return ticket

    def wait(self, ticket: tf.Tensor) -> List[Any]:
        """The wait op's body (a ``tf.py_function``): the result of the collective submitted under
        ``ticket``; ranks that disagree fail the op with FailedPreconditionError, as Horovod's."""
        try:
            return [np.asarray(o) for o in self._submitted.pop(int(ticket))()]
        except MismatchError as error:
            return failed_precondition_outputs(str(error))


_graph_bridge = GraphBridge()


def run_collective(submit: Callable[..., Finish], inputs: Sequence[tf.Tensor], out_dtypes: Sequence[tf.DType],
                   shapes: Sequence[Any]) -> List[tf.Tensor]:
    """Run a collective on the inputs' NumPy values: ``submit(*arrays)`` hands it to the runtime
    and returns what waits for its result. Eagerly both happen here; in a graph they are two ops.

    In a graph, one op that submitted and then waited would hold one of TensorFlow's inter-op
    threads for as long as the other ranks take to submit the same collective. In a TF1 graph
    run by a session (no automatic control dependencies), ranks whose threads picked
    independent collectives in different orders would then each hold every thread in a
    collective the others cannot reach for want of a thread: a job that hangs (Horovod's ops
    are asynchronous kernels, which hold no thread while they wait). So a *submit* op hands
    the collective over and returns at once, and a separate *wait* op blocks for the result;
    the submit ops of a graph run in the order they were built (see ``GraphBridge.submit_op``),
    the same on every rank, so the earliest collective not yet done has been submitted by every
    rank or will be by a thread that is free. (A tf.function runs its stateful ops in program
    order, one collective at a time, the same on every rank.)

    Ranks that disagree raise FailedPreconditionError (Horovod's type): eagerly one that is
    also a MismatchError; in a graph the wait op (a ``tf.py_function``) fails with that code
    (see ``errors.failed_precondition_outputs``: TensorFlow gives a Python exception raised
    there a code by its class alone, a ValueError such as MismatchError INVALID_ARGUMENT).
    """
    if tf.executing_eagerly():
        try:
            outputs = eager_errors(lambda: submit(*[t.numpy() for t in inputs])())
        except MismatchError as error:
            if isinstance(error, tf.errors.OpError):
                raise
            raise RanksDisagreeError(str(error)) from error
        return [tf.convert_to_tensor(np.asarray(o), dtype=d) for o, d in zip(outputs, out_dtypes)]
    ticket = _graph_bridge.submit_op(submit, inputs)
    # Stateful, so that it is never pruned or merged, and so that a tf.function runs it in program
    # order with every other stateful op (a wait, then the next submit): a collective in a
    # tf.while_loop then waits for the previous iteration's, which has the same name.
    # (A py_function, always stateful, where the submit op is a numpy_function: only a
    # py_function can fail with FailedPrecondition, see ``GraphBridge.wait``.)
    outputs = tf.py_function(_graph_bridge.wait, [ticket], list(out_dtypes))
    for out, shape in zip(outputs, shapes):
        out.set_shape(shape)
    return list(outputs)


# -- names and int32 ops -------------------------------------------------------------

def graph_name(name: Optional[str], kind: str, process_set: ProcessSet) -> Optional[str]:
    """The name an op goes to the runtime with.

    Eagerly, ops run in program order, and the runtime names unnamed ones by a counter that
    every rank of the set advances alike. In a graph, TensorFlow's inter-op threads run
    independent ops in any order, different on each rank, so that counter would pair different
    tensors; as Horovod names an unnamed op from its graph node, it is named here when the graph
    is built: the graph (its function's name, without TensorFlow's numeric suffixes) and a name
    unique in it, counted per kind and process set (a rank outside a set builds none of its
    ops, and must not shift the names of the sets it is in).
    """
    if name is not None or tf.executing_eagerly():
        return name
    graph = tf.compat.v1.get_default_graph()
    scope = _NUMERIC_SUFFIX.sub("", getattr(graph, "name", "") or "") or "graph"
    base = f"mtrain_{kind}_set{process_set.process_set_id}"
    return f"{scope}/{graph.unique_name(base, mark_as_used=True)}"


_NUMERIC_SUFFIX = re.compile(r"(_\d+)+$")


def int_op(value: Callable[[], int], name: Optional[str]) -> tf.Tensor:
    """An int32 scalar read when the op runs (graph execution time, as Horovod's ``*_op``)."""
    if tf.executing_eagerly():
        return tf.constant(value(), tf.int32, name=name)
    out = tf.numpy_function(lambda: np.int32(value()), [], tf.int32, stateful=True, name=name)
    out.set_shape([])
    return out
