"""The TensorFlow ops: the collectives (each differentiable with Horovod's backward rule), the
process-set queries and the ``*_op`` tensors, eagerly or inside ``tf.function`` (there they run
as ``tf.numpy_function`` calls into the runtime; see ``_call``)."""
from __future__ import annotations

import itertools
import re
import weakref
from typing import Any, Callable, List, Optional, Sequence

import numpy as np
import tensorflow as tf

import mtrain.ringreduce as rr
from mtrain.ringreduce import Adasum, Average, MismatchError, ProcessSet, Sum, global_process_set

from ..gradient_op import resolve_op
from .compression import Compression

__all__ = [
    "allgather", "allgather_object", "allreduce", "alltoall", "barrier", "broadcast", "broadcast_",
    "broadcast_global_variables", "broadcast_object", "broadcast_object_fn", "broadcast_variables",
    "check_process_set", "dense_tensor", "grouped_allgather", "grouped_allreduce", "grouped_reducescatter", "join",
    "local_rank_op", "local_size_op", "process_set_included_op", "rank_op", "reducescatter", "set_size",
    "size_op",
]


def barrier(process_set: ProcessSet = global_process_set) -> None:
    """Wait until every rank of ``process_set`` reaches the barrier."""
    check_process_set(process_set)
    _eager_errors(lambda: rr.barrier(process_set=process_set))


def broadcast_object(obj: Any, root_rank: int = 0, session: Any = None, name: Optional[str] = None,
                     process_set: ProcessSet = global_process_set) -> Any:
    """``root_rank``'s picklable object, on every rank of ``process_set`` (``root_rank`` is a global rank)."""
    check_process_set(process_set)
    return _eager_errors(lambda: rr.broadcast_object(obj, root_rank, name, process_set=process_set))


def allgather_object(obj: Any, session: Any = None, name: Optional[str] = None,
                     process_set: ProcessSet = global_process_set) -> list:
    """Every rank's picklable object, in rank order within ``process_set``."""
    check_process_set(process_set)
    return _eager_errors(lambda: rr.allgather_object(obj, name, process_set=process_set))


def join() -> tf.Tensor:
    """This rank has run out of data (Horovod's ``join``): until every rank has joined, it takes part
    in the others' ops with zeros (allreduce) or no rows (allgather). Blocks until every rank has
    joined; returns the rank that joined last, as an int32 tensor (in a graph: when the op runs)."""
    return _int_op(lambda: _eager_errors(rr.join), None)


# -- process sets ------------------------------------------------------------------

def check_process_set(process_set: Any) -> ProcessSet:
    """``process_set`` if it is a registered ProcessSet; a clear error otherwise (before any op runs)."""
    if not isinstance(process_set, ProcessSet):
        raise _InvalidArgument(f"process_set must be an mtrain ProcessSet (hvd.ProcessSet, hvd.global_process_set), "
                               f"got {type(process_set).__name__}")
    if process_set.process_set_id is None:
        raise _InvalidArgument(f"{process_set} is not registered: pass it to hvd.init(process_sets=[...]) or "
                               "hvd.add_process_set() on every rank first")
    return process_set


def set_size(process_set: ProcessSet) -> int:
    """The number of ranks in ``process_set`` (what Average divides by)."""
    return int(check_process_set(process_set).size())


def _set_rank(process_set: ProcessSet) -> int:
    """This rank's position within ``process_set`` (the order of allgather results)."""
    return int(check_process_set(process_set).rank())


def _set_of_id(process_set_id: int) -> ProcessSet:
    """A handle on the registered set ``process_set_id`` (as Horovod's ``*_op(process_set_id=...)`` take)."""
    try:
        return rr.process_set_by_id(process_set_id)
    except rr.InvalidArgumentError as error:  # as TF's InvalidArgumentError too, as Horovod raises it
        raise _InvalidArgument(str(error)) from None


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


class _InvalidArgument(tf.errors.InvalidArgumentError, rr.InvalidArgumentError):
    """An op refused before it ran (a rank outside the op's process set, a root outside it, ...).

    What Horovod raises (``tf.errors.InvalidArgumentError``), and mtrain's own
    ``InvalidArgumentError`` (a RuntimeError and ValueError): the same class eagerly and in a graph.
    """

    def __init__(self, message: str) -> None:
        super().__init__(None, None, message)


def _eager_errors(fn: Callable[[], Any]) -> Any:
    """``fn()``, with the runtime's argument errors raised as ``_InvalidArgument``."""
    try:
        return fn()
    except rr.InvalidArgumentError as error:
        if isinstance(error, tf.errors.OpError):
            raise
        raise _InvalidArgument(str(error)) from error


class _RanksDisagreeError(tf.errors.FailedPreconditionError, MismatchError):
    """Ranks passed incompatible arguments to one collective.

    Horovod programs catch ``tf.errors.FailedPreconditionError``; code written
    against mtrain catches ``MismatchError``: this is both (raised eagerly; see ``_call``).
    """

    def __init__(self, message: str) -> None:
        super().__init__(None, None, message)


Finish = Callable[[], List[np.ndarray]]


def _call(submit: Callable[..., Finish], inputs: Sequence[tf.Tensor], out_dtypes: Sequence[tf.DType],
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
    the submit ops of a graph run in the order they were built (see ``_submit_op``), the same
    on every rank, so the earliest collective not yet done has been submitted by every rank or
    will be by a thread that is free. (A tf.function runs its stateful ops in program order,
    one collective at a time, the same on every rank.)

    Eagerly, ranks that disagree raise FailedPreconditionError (Horovod's type, and a
    MismatchError). In a graph the error leaves through a numpy_function, where
    TensorFlow maps Python exceptions by class alone (py_func.cc, DoCallPyFunc: ValueError
    and TypeError -> InvalidArgumentError, StopIteration -> OutOfRange, MemoryError ->
    ResourceExhausted, NotImplementedError -> Unimplemented, anything else -> UnknownError;
    an OpError's own code is ignored, a TODO there, and tf.py_function shares that path):
    there it is an InvalidArgumentError with the same message. No TensorFlow op raises a
    chosen code with a chosen message, so only a compiled kernel could do better.
    """
    if tf.executing_eagerly():
        try:
            outputs = _eager_errors(lambda: submit(*[t.numpy() for t in inputs])())
        except MismatchError as error:
            if isinstance(error, tf.errors.OpError):
                raise
            raise _RanksDisagreeError(str(error)) from error
        return [tf.convert_to_tensor(np.asarray(o), dtype=d) for o, d in zip(outputs, out_dtypes)]
    ticket = _submit_op(submit, inputs)
    # Stateful, so that it is never pruned or merged, and so that a tf.function runs it in program
    # order with every other stateful op (a wait, then the next submit): a collective in a
    # tf.while_loop then waits for the previous iteration's, which has the same name.
    outputs = tf.numpy_function(_wait, [ticket], list(out_dtypes), stateful=True)
    for out, shape in zip(outputs, shapes):
        out.set_shape(shape)
    return list(outputs)


# Collectives submitted by a graph's submit ops, by ticket, until their wait op takes them.
_submitted: "dict[int, Finish]" = {}
_tickets = itertools.count(1)
# Per graph: its last submit op, and the control-flow context it was built in.
_last_submit: "weakref.WeakKeyDictionary[Any, tuple]" = weakref.WeakKeyDictionary()


def _submit_op(submit: Callable[..., Finish], inputs: Sequence[tf.Tensor]) -> tf.Tensor:
    """The op that submits a collective and returns its ticket (an int64 scalar), run after the
    graph's previous submit op: the order the graph was built in, the same on every rank."""
    def run(*arrays: np.ndarray) -> np.ndarray:
        finish = submit(*arrays)
        ticket = next(_tickets)
        _submitted[ticket] = finish
        return np.int64(ticket)

    graph = tf.compat.v1.get_default_graph()
    context = graph._get_control_flow_context()  # TF1 loops drop control inputs from outside them
    previous = _last_submit.get(graph)
    after = [previous[0]] if previous is not None and previous[1] is context else []
    with tf.control_dependencies(after):
        ticket = tf.numpy_function(run, list(inputs), tf.int64, stateful=True)
    ticket.set_shape([])
    _last_submit[graph] = (ticket.op, context)
    return ticket


def _wait(ticket: np.ndarray) -> List[np.ndarray]:
    return [np.asarray(o) for o in _submitted.pop(int(ticket))()]


def _graph_name(name: Optional[str], kind: str, process_set: ProcessSet) -> Optional[str]:
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


def _c(array: Any) -> np.ndarray:
    """C-contiguous, keeping 0-d arrays 0-d (np.ascontiguousarray would make them 1-d)."""
    return np.asarray(array, order="C")


def _first_dim_unknown(tensor: tf.Tensor) -> tf.TensorShape:
    return tf.TensorShape([None]).concatenate(tensor.shape[1:]) if tensor.shape.rank else tensor.shape


def _grad_name(name: Optional[str]) -> Optional[str]:
    return None if name is None else f"{name}.grad"


def _zeros_for_missing(grads: Sequence[Any], outputs: Sequence[tf.Tensor]) -> List[tf.Tensor]:
    return [tf.zeros_like(o) if g is None else dense_tensor(g, "gradient") for g, o in zip(grads, outputs)]


# -- the collectives, each with Horovod's backward rule ---------------------------
# Each ``_raw_*`` runs one collective with no gradient; the public functions wrap
# it in tf.custom_gradient so tape.gradient (and Keras) can differentiate through it.
# The backward op runs on the forward op's process set, as Horovod's registered gradients do.

def _raw_grouped_allreduce(inputs: Sequence[tf.Tensor], op: Any, name: Optional[str], prescale: float,
                           postscale: float, process_set: ProcessSet) -> List[tf.Tensor]:
    name = _graph_name(name, "allreduce", process_set)

    def reduce(*arrays: np.ndarray) -> Finish:
        arrays = [_c(a) for a in arrays]
        # The runtime scales as Horovod does (Average is one scaling by postscale / size).
        handle = rr.grouped_allreduce_async(arrays, op, name, prescale, postscale, process_set=process_set)
        return lambda: [r.reshape(a.shape) for r, a in zip(rr.synchronize(handle), arrays)]
    return _call(reduce, inputs, [t.dtype for t in inputs], [t.shape for t in inputs])


def _differentiable_grouped_allreduce(inputs: Sequence[tf.Tensor], op: Any, name: Optional[str],
                                      prescale: float, postscale: float,
                                      process_set: ProcessSet) -> List[tf.Tensor]:
    @tf.custom_gradient
    def reduce(*xs: tf.Tensor) -> Any:
        outputs = _raw_grouped_allreduce(xs, op, name, prescale, postscale, process_set)

        def grad(*dys: Any) -> List[tf.Tensor]:
            # Horovod: the gradient of an allreduce is the same allreduce (op and scaling) of the gradient.
            return _raw_grouped_allreduce(_zeros_for_missing(dys, outputs), op, _grad_name(name),
                                          prescale, postscale, process_set)
        return outputs, grad
    return list(reduce(*inputs))


def _raw_grouped_allgather(inputs: Sequence[tf.Tensor], name: Optional[str],
                           process_set: ProcessSet) -> List[tf.Tensor]:
    name = _graph_name(name, "allgather", process_set)

    def gather(*arrays: np.ndarray) -> Finish:
        names = [None if name is None else f"{name}.{i}" for i in range(len(arrays))]
        handles = [rr.allgather_async(_c(a), n, process_set=process_set) for a, n in zip(arrays, names)]
        return lambda: [rr.synchronize(h) for h in handles]
    shapes = [_first_dim_unknown(t) if t.shape.rank != 0 else tf.TensorShape([None]) for t in inputs]
    return _call(gather, inputs, [t.dtype for t in inputs], shapes)  # a scalar is gathered as one row


def _my_rows(grad: tf.Tensor, x: tf.Tensor, name: Optional[str], process_set: ProcessSet) -> tf.Tensor:
    """This rank's block of rows of an allgathered tensor's gradient (blocks in set-rank order)."""
    rows = tf.reshape(x, [-1]) if x.shape.rank == 0 else x  # a scalar was gathered as one row
    counts = _raw_grouped_allgather([tf.shape(rows, out_type=tf.int64)[:1]], name, process_set)[0]
    me = _set_rank(process_set)
    start = tf.reduce_sum(counts[:me])
    return tf.reshape(grad[start:start + counts[me]], tf.shape(x))


def _allgather_backward(dys: Sequence[Any], outputs: Sequence[tf.Tensor], xs: Sequence[tf.Tensor],
                        name: Optional[str], process_set: ProcessSet) -> List[tf.Tensor]:
    """Horovod's allgather gradient: average the gradient over the set's ranks, keep the rows this
    rank contributed."""
    dys = _zeros_for_missing(dys, outputs)
    averaged = [_raw_grouped_allreduce([dy], Average, None if name is None else f"{name}.grad.{i}",
                                       1.0, 1.0, process_set)[0] for i, dy in enumerate(dys)]
    return [_my_rows(g, x, None if name is None else f"{name}.grad.rows.{i}", process_set)
            for i, (g, x) in enumerate(zip(averaged, xs))]


def _differentiable_grouped_allgather(inputs: Sequence[tf.Tensor], name: Optional[str],
                                      process_set: ProcessSet) -> List[tf.Tensor]:
    @tf.custom_gradient
    def gather(*xs: tf.Tensor) -> Any:
        outputs = _raw_grouped_allgather(xs, name, process_set)

        def grad(*dys: Any) -> List[tf.Tensor]:
            return _allgather_backward(dys, outputs, xs, name, process_set)
        return outputs, grad
    return list(gather(*inputs))


def _differentiable_sparse_allgather(values: Sequence[tf.Tensor], indices: Sequence[tf.Tensor],
                                     name: Optional[str], process_set: ProcessSet) -> List[tf.Tensor]:
    """The values, then the indices, of IndexedSlices allgathered in one submission (one op in a
    graph, so no rank can block on one half while another waits on the other); differentiable in
    the values, as Horovod's two allgathers are."""
    count = len(values)

    @tf.custom_gradient
    def gather(*xs: tf.Tensor) -> Any:
        outputs = _raw_grouped_allgather(xs, name, process_set)

        def grad(*dys: Any) -> List[Optional[tf.Tensor]]:
            return _allgather_backward(dys[:count], outputs[:count], xs[:count], name,
                                       process_set) + [None] * count  # integer indices have none
        return outputs, grad
    return list(gather(*values, *indices))


def _raw_broadcast(tensor: tf.Tensor, root_rank: int, name: Optional[str], process_set: ProcessSet) -> tf.Tensor:
    name = _graph_name(name, "broadcast", process_set)

    def fn(a: np.ndarray) -> Finish:
        handle = rr.broadcast_async(_c(a), root_rank, name, process_set=process_set)
        return lambda: [rr.synchronize(handle).reshape(a.shape)]
    return _call(fn, [tensor], [tensor.dtype], [tensor.shape])[0]


def _raw_grouped_reducescatter(inputs: Sequence[tf.Tensor], op: Any, name: Optional[str], prescale: float,
                               postscale: float, process_set: ProcessSet) -> List[tf.Tensor]:
    name = _graph_name(name, "reducescatter", process_set)

    def scatter(*arrays: np.ndarray) -> Finish:
        names = [name if name is None or len(arrays) == 1 else f"{name}.{i}" for i in range(len(arrays))]
        # The runtime scales as Horovod does (pre- and postscale, Average as one scaling by
        # postscale / size), so the factors go to it as they are.
        handles = [rr.reducescatter_async(_c(a), op, n, prescale, postscale, process_set=process_set)
                   for a, n in zip(arrays, names)]
        return lambda: [rr.synchronize(h) for h in handles]
    return _call(scatter, inputs, [t.dtype for t in inputs], [_first_dim_unknown(t) for t in inputs])


def _differentiable_grouped_reducescatter(inputs: Sequence[tf.Tensor], op: Any, name: Optional[str],
                                          prescale: float, postscale: float,
                                          process_set: ProcessSet) -> List[tf.Tensor]:
    @tf.custom_gradient
    def scatter(*xs: tf.Tensor) -> Any:
        outputs = _raw_grouped_reducescatter(xs, op, name, prescale, postscale, process_set)

        def grad(*dys: Any) -> List[tf.Tensor]:
            # Horovod: allgather the gradient (times the set's size for Sum); the scale factors by the chain rule.
            factor = prescale * postscale * (set_size(process_set) if op == Sum else 1)
            dys = [dy * tf.cast(factor, dy.dtype) if factor != 1 else dy for dy in _zeros_for_missing(dys, outputs)]
            return [_raw_grouped_allgather([dy], None if name is None else f"{name}.grad.{i}", process_set)[0]
                    for i, dy in enumerate(dys)]
        return outputs, grad
    return list(scatter(*inputs))


def _raw_alltoall(tensor: tf.Tensor, splits: tf.Tensor, given: bool, name: Optional[str],
                  process_set: ProcessSet) -> List[tf.Tensor]:
    name = _graph_name(name, "alltoall", process_set)

    def fn(a: np.ndarray, s: np.ndarray) -> Finish:
        handle = rr.alltoall_async(_c(a), s.tolist() if given else None, name, process_set=process_set)

        def finish() -> List[np.ndarray]:
            received, received_splits = rr.synchronize(handle)
            return [received, np.asarray(received_splits, dtype=np.int32)]
        return finish
    return _call(fn, [tensor, splits], [tensor.dtype, tf.int32], [_first_dim_unknown(tensor), [None]])


# -- collectives -----------------------------------------------------------------
# Argument order as in Horovod 0.28 (``process_set`` included), so positional calls keep working.

def _check_sparse_reduction(op: Any, prescale: float, postscale: float) -> None:
    """Refuse, before anything runs, the reductions an allgather of IndexedSlices cannot do."""
    if op == Adasum:
        raise NotImplementedError("the Adasum reduction does not support sparse tensors (tf.IndexedSlices); "
                                  "pass sparse_as_dense=True to DistributedOptimizer or DistributedGradientTape, "
                                  "or densify with tf.convert_to_tensor")
    if op not in (Sum, Average):
        raise NotImplementedError(f"only Sum and Average reduce tf.IndexedSlices (an allgather of values and "
                                  f"indices), got {op!r}: densify with tf.convert_to_tensor first")
    if prescale != 1.0 or postscale != 1.0:
        raise NotImplementedError("prescale_factor and postscale_factor are not supported with tf.IndexedSlices: "
                                  "scale the slices' values yourself, or densify with tf.convert_to_tensor")


def _sparse_allreduce(slices: Sequence[tf.IndexedSlices], op: Any, name: Optional[str],
                      process_set: ProcessSet) -> List[tf.IndexedSlices]:
    """Horovod's reduction of IndexedSlices: every rank's rows (values and indices allgathered over
    ``process_set``; an index may repeat, and TensorFlow sums repeats when it applies or densifies
    them), values divided by the set's size for Average; ``dense_shape`` kept (None stays None)."""
    gathered = _differentiable_sparse_allgather([dense_tensor(s.values, "IndexedSlices values") for s in slices],
                                                [dense_tensor(s.indices, "IndexedSlices indices") for s in slices],
                                                name, process_set)
    values, indices = gathered[:len(slices)], gathered[len(slices):]
    if op == Average:  # Horovod's division by the size cast to the values' dtype (integers: a true division)
        values = [v / tf.cast(set_size(process_set), v.dtype) for v in values]
    return [tf.IndexedSlices(v, i, dense_shape=s.dense_shape) for v, i, s in zip(values, indices, slices)]


def grouped_allreduce(tensors: Sequence[Any], average: Optional[bool] = None, device_dense: str = "",
                      device_sparse: str = "", compression: type = Compression.none, op: Any = None,
                      prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                      process_set: ProcessSet = global_process_set, ignore_name_scope: bool = False,
                      name: Optional[str] = None) -> List[Any]:
    """Each tensor reduced over the ranks of ``process_set`` (default Average), as one fused unit.

    ``tf.IndexedSlices`` (embedding gradients) stay sparse, as in Horovod: their values and indices
    are allgathered (Sum or Average only, no scale factors, no compression; see ``_sparse_allreduce``).
    """
    op = resolve_op(average, op)
    check_process_set(process_set)
    sparse = [i for i, t in enumerate(tensors) if isinstance(t, tf.IndexedSlices)]
    dense = [i for i, t in enumerate(tensors) if not isinstance(t, tf.IndexedSlices)]
    out: List[Any] = [None] * len(tensors)
    if sparse:
        _check_sparse_reduction(op, prescale_factor, postscale_factor)
        # A name of its own: the dense tensors go to the runtime under ``name``.
        for i, s in zip(sparse, _sparse_allreduce([tensors[i] for i in sparse], op,
                                                  None if name is None else f"{name}.sparse", process_set)):
            out[i] = s
    pairs = [compression.compress(dense_tensor(tensors[i], f"tensors[{i}]")) for i in dense]
    if pairs:
        reduced = _differentiable_grouped_allreduce([t for t, _ in pairs], op, name, prescale_factor,
                                                    postscale_factor, process_set)
        for i, r, (_, ctx) in zip(dense, reduced, pairs):
            out[i] = compression.decompress(r, ctx)
    return out


def allreduce(tensor: Any, average: Optional[bool] = None, device_dense: str = "", device_sparse: str = "",
              compression: type = Compression.none, op: Any = None, prescale_factor: float = 1.0,
              postscale_factor: float = 1.0, name: Optional[str] = None,
              process_set: ProcessSet = global_process_set, ignore_name_scope: bool = False) -> Any:
    """``tensor`` reduced over the ranks of ``process_set`` (default Average, over the set's size); a
    ``tf.IndexedSlices`` comes back as one (see ``grouped_allreduce``)."""
    return grouped_allreduce([tensor], average, device_dense, device_sparse, compression, op, prescale_factor,
                             postscale_factor, process_set=process_set, name=name)[0]


def grouped_allgather(tensors: Sequence[Any], name: Optional[str] = None, ignore_name_scope: bool = False,
                      process_set: ProcessSet = global_process_set) -> List[tf.Tensor]:
    """Each tensor allgathered (see ``allgather``), submitted together."""
    check_process_set(process_set)
    inputs = [dense_tensor(t, f"tensors[{i}]") for i, t in enumerate(tensors)]
    return _differentiable_grouped_allgather(inputs, name, process_set) if inputs else []


def allgather(tensor: Any, name: Optional[str] = None, ignore_name_scope: bool = False,
              process_set: ProcessSet = global_process_set) -> tf.Tensor:
    """The tensors of the ranks of ``process_set`` concatenated along dimension 0, in set-rank order
    (first dimensions may differ)."""
    check_process_set(process_set)
    return _differentiable_grouped_allgather([dense_tensor(tensor)], name, process_set)[0]


def broadcast(tensor: Any, root_rank: int, name: Optional[str] = None, ignore_name_scope: bool = False,
              process_set: ProcessSet = global_process_set) -> tf.Tensor:
    """``root_rank``'s value of ``tensor`` (a global rank, in ``process_set``), on every rank of the set."""
    check_process_set(process_set)

    @tf.custom_gradient
    def send(x: tf.Tensor) -> Any:
        output = _raw_broadcast(x, root_rank, name, process_set)

        def grad(dy: Any) -> tf.Tensor:
            # Horovod: the gradient averaged over the set goes to the root; the others get zeros.
            averaged = _raw_grouped_allreduce(_zeros_for_missing([dy], [output]), Average, _grad_name(name),
                                              1.0, 1.0, process_set)[0]
            return averaged if rr.rank() == root_rank else averaged * 0
        return output, grad
    return send(dense_tensor(tensor))


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
    base = _graph_name(None, "broadcast_variables", process_set) or "broadcast_variables"

    def fn(*arrays: np.ndarray) -> Finish:
        handles = [rr.broadcast_async(_c(a), root_rank, f"{base}.{i}", process_set=process_set)
                   for i, a in enumerate(arrays)]
        return lambda: [rr.synchronize(h).reshape(a.shape) for h, a in zip(handles, arrays)]
    assigns = [variable.assign(value) for variable, value in
               zip(variables, _call(fn, values, [v.dtype for v in values], [v.shape for v in values]))]
    return None if tf.executing_eagerly() else tf.group(*assigns)


def broadcast_global_variables(root_rank: int) -> Any:
    """TF1 graphs: the op that broadcasts every global variable from ``root_rank``."""
    if tf.executing_eagerly():
        raise RuntimeError("broadcast_global_variables() does not work eagerly (there are no global "
                           "variables in TF2): use broadcast_variables(model.variables, root_rank) or "
                           "the Keras BroadcastGlobalVariablesCallback instead")
    return broadcast_variables(tf.compat.v1.global_variables(), root_rank)


def broadcast_object_fn(root_rank: int = 0, session: Any = None, name: Optional[str] = None,
                        process_set: ProcessSet = global_process_set) -> Callable[[Any], Any]:
    """A function that broadcasts its (picklable) argument from ``root_rank`` over ``process_set``."""
    return lambda obj: broadcast_object(obj, root_rank, session, name, process_set)


def grouped_reducescatter(tensors: Sequence[Any], device_dense: str = "", compression: type = Compression.none,
                          op: Any = Average, process_set: ProcessSet = global_process_set,
                          prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                          name: Optional[str] = None, ignore_name_scope: bool = False) -> List[tf.Tensor]:
    """Each tensor reduce-scattered (see ``reducescatter``), submitted together."""
    check_process_set(process_set)
    pairs = [compression.compress(dense_tensor(t, f"tensors[{i}]")) for i, t in enumerate(tensors)]
    if not pairs:
        return []
    scattered = _differentiable_grouped_reducescatter([t for t, _ in pairs], op, name, prescale_factor,
                                                      postscale_factor, process_set)
    return [compression.decompress(s, ctx) for s, (_, ctx) in zip(scattered, pairs)]


def reducescatter(tensor: Any, device_dense: str = "", compression: type = Compression.none, op: Any = Average,
                  name: Optional[str] = None, process_set: ProcessSet = global_process_set,
                  ignore_name_scope: bool = False, prescale_factor: float = 1.0,
                  postscale_factor: float = 1.0) -> tf.Tensor:
    """Reduce over the ranks of ``process_set``, keep this rank's rows (in set-rank order, the first
    ``rows % set size`` ranks get one extra)."""
    return grouped_reducescatter([tensor], device_dense, compression, op, process_set, prescale_factor,
                                 postscale_factor, name=name)[0]


def _splits_tensor(splits: Any) -> tf.Tensor:
    """Any integer sequence or tensor (int32 or int64, as Horovod's tests pass both) as int32."""
    tensor = tf.convert_to_tensor(splits)
    if not (tensor.dtype.is_integer or tensor.dtype == tf.bool):
        raise TypeError(f"alltoall splits must be integers, got dtype {tensor.dtype.name}")
    return tf.cast(tensor, tf.int32)


def alltoall(tensor: Any, splits: Any = None, name: Optional[str] = None, ignore_name_scope: bool = False,
             process_set: ProcessSet = global_process_set) -> Any:
    """Send ``splits[r]`` rows to the set's r-th rank (equal shares if None). Returns the received
    tensor, plus the received splits when ``splits`` is given (as Horovod)."""
    check_process_set(process_set)
    given = splits is not None
    splits_tensor = _splits_tensor(splits) if given else tf.zeros([0], tf.int32)

    @tf.custom_gradient
    def exchange(x: tf.Tensor, s: tf.Tensor) -> Any:
        received, received_splits = _raw_alltoall(x, s, given, name, process_set)

        def grad(dy: Any, d_splits: Any) -> Any:
            # Horovod: send the gradient back the way the rows came.
            back, _ = _raw_alltoall(_zeros_for_missing([dy], [received])[0], received_splits, True,
                                    _grad_name(name), process_set)
            return back, None
        return (received, received_splits), grad
    received, received_splits = exchange(dense_tensor(tensor), splits_tensor)
    return (received, received_splits) if given else received


def _int_op(value: Callable[[], int], name: Optional[str]) -> tf.Tensor:
    """An int32 scalar read when the op runs (graph execution time, as Horovod's ``*_op``)."""
    if tf.executing_eagerly():
        return tf.constant(value(), tf.int32, name=name)
    out = tf.numpy_function(lambda: np.int32(value()), [], tf.int32, stateful=True, name=name)
    out.set_shape([])
    return out


def rank_op(name: Optional[str] = None) -> tf.Tensor:
    """This process's rank, as an int32 tensor."""
    return _int_op(rr.rank, name)


def local_rank_op(name: Optional[str] = None) -> tf.Tensor:
    """This process's rank on its host, as an int32 tensor."""
    return _int_op(rr.local_rank, name)


def size_op(process_set_id: int = 0, name: Optional[str] = None) -> tf.Tensor:
    """The number of ranks in the process set ``process_set_id`` (0: every rank), as an int32 tensor."""
    return _int_op(lambda: set_size(_set_of_id(process_set_id)), name)


# Horovod's codes for process_set_included_op when there is no answer.
_PROCESS_SET_ERROR_INIT, _PROCESS_SET_ERROR_UNKNOWN_SET = -1, -3


def process_set_included_op(process_set_id: int = 0, name: Optional[str] = None) -> tf.Tensor:
    """1 if this rank belongs to the process set ``process_set_id``, else 0, as an int32 tensor; as in
    Horovod, -1 before ``init()`` and -3 for an unknown set."""
    def included() -> int:
        if not rr.is_initialized():
            return _PROCESS_SET_ERROR_INIT
        try:
            return int(bool(_set_of_id(process_set_id).included()))
        except rr.InvalidArgumentError:
            return _PROCESS_SET_ERROR_UNKNOWN_SET
    return _int_op(included, name)


def local_size_op(name: Optional[str] = None) -> tf.Tensor:
    """The number of ranks on this host, as an int32 tensor."""
    return _int_op(rr.local_size, name)
