"""The TensorFlow collectives of the Horovod API, each differentiable with Horovod's backward rule
(``gradients``), eagerly or inside ``tf.function`` (there they run as ``tf.numpy_function`` calls
into the runtime; see ``bridge.run_collective``).

Split as Horovod's ``horovod/tensorflow/`` is: ``bridge`` (tensors to the runtime and back, the
graph's submit and wait ops), ``raw_ops`` and ``gradients`` (the collectives without and with their
gradients), ``functions`` (broadcasting variables and objects, the ``*_op`` tensors),
``process_sets`` and ``errors``. This module gathers their public names, as Horovod's
``horovod.tensorflow.mpi_ops`` offers them.
"""
from __future__ import annotations

from typing import Any, List, Optional, Sequence

import tensorflow as tf

import mtrain.ringreduce as rr
from mtrain.ringreduce import Adasum, Average, ProcessSet, Sum, global_process_set

from ..gradient_op import resolve_op
from .bridge import dense_tensor, int_op
from .compression import Compression
from .errors import eager_errors
from .functions import (  # noqa: F401  (mtrain.tensorflow.mpi_ops keeps its names)
    allgather_object, broadcast_, broadcast_global_variables, broadcast_object, broadcast_object_fn,
    broadcast_variables, local_rank_op, local_size_op, process_set_included_op, rank_op, size_op,
)
from .gradients import (
    differentiable_alltoall, differentiable_broadcast, differentiable_grouped_allgather,
    differentiable_grouped_allreduce, differentiable_grouped_reducescatter, differentiable_sparse_allgather,
)
from .process_sets import check_process_set, set_size

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
    eager_errors(lambda: rr.barrier(process_set=process_set))


def join() -> tf.Tensor:
    """This rank has run out of data (Horovod's ``join``): until every rank has joined, it takes part
    in the others' ops with zeros (allreduce) or no rows (allgather). Blocks until every rank has
    joined; returns the rank that joined last, as an int32 tensor (in a graph: when the op runs)."""
    return int_op(lambda: eager_errors(rr.join), None)


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
    gathered = differentiable_sparse_allgather([dense_tensor(s.values, "IndexedSlices values") for s in slices],
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
        reduced = differentiable_grouped_allreduce([t for t, _ in pairs], op, name, prescale_factor,
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
    return differentiable_grouped_allgather(inputs, name, process_set) if inputs else []


def allgather(tensor: Any, name: Optional[str] = None, ignore_name_scope: bool = False,
              process_set: ProcessSet = global_process_set) -> tf.Tensor:
    """The tensors of the ranks of ``process_set`` concatenated along dimension 0, in set-rank order
    (first dimensions may differ)."""
    check_process_set(process_set)
    return differentiable_grouped_allgather([dense_tensor(tensor)], name, process_set)[0]


def broadcast(tensor: Any, root_rank: int, name: Optional[str] = None, ignore_name_scope: bool = False,
              process_set: ProcessSet = global_process_set) -> tf.Tensor:
    """``root_rank``'s value of ``tensor`` (a global rank, in ``process_set``), on every rank of the set."""
    check_process_set(process_set)
    return differentiable_broadcast(dense_tensor(tensor), root_rank, name, process_set)


def grouped_reducescatter(tensors: Sequence[Any], device_dense: str = "", compression: type = Compression.none,
                          op: Any = Average, process_set: ProcessSet = global_process_set,
                          prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                          name: Optional[str] = None, ignore_name_scope: bool = False) -> List[tf.Tensor]:
    """Each tensor reduce-scattered (see ``reducescatter``), submitted together."""
    check_process_set(process_set)
    pairs = [compression.compress(dense_tensor(t, f"tensors[{i}]")) for i, t in enumerate(tensors)]
    if not pairs:
        return []
    scattered = differentiable_grouped_reducescatter([t for t, _ in pairs], op, name, prescale_factor,
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
    received, received_splits = differentiable_alltoall(dense_tensor(tensor), splits_tensor, given, name,
                                                        process_set)
    return (received, received_splits) if given else received
