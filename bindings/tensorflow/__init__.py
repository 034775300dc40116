"""TensorFlow adapter: ``import mtrain.tensorflow as hvd`` in place of ``import horovod.tensorflow as hvd``.

Ops take ``tf.Tensor``/``tf.Variable`` values, eagerly or inside ``tf.function``
(there they run as ``tf.numpy_function`` calls into the runtime). Keras lives
in ``mtrain.tensorflow.keras``.
"""
from __future__ import annotations

from typing import Any, Callable, List, Optional, Sequence

import numpy as np
import tensorflow as tf

import mtrain.ringreduce as rr
from mtrain.ringreduce import (  # noqa: F401  (re-exported: the Horovod API)
    Adasum, Average, Max, Min, MismatchError, NotInitializedError, Product, ReduceOp, Sum,
    cross_rank, cross_size, init, is_initialized, local_rank, local_size, mpi_threads_supported,
    rank, shutdown, size,
)

from ..gradient_op import check_gradient_op, resolve_op
from ..build_info import (  # noqa: F401  (re-exported: Horovod's build queries)
    ccl_built, cuda_built, ddl_built, gloo_built, gloo_enabled, mpi_built, mpi_enabled, nccl_built, rocm_built)
from .. import compression as _compression

__all__ = [
    "Adasum", "Average", "Compression", "DistributedGradientTape", "Max", "Min", "MismatchError",
    "NotInitializedError", "Product", "ReduceOp", "Sum", "allgather", "allgather_object", "allreduce",
    "alltoall", "barrier", "broadcast", "broadcast_", "broadcast_object", "broadcast_variables",
    "cross_rank", "cross_size", "grouped_allreduce", "init", "is_initialized", "local_rank",
    "local_size", "mpi_threads_supported", "rank", "reducescatter", "shutdown", "size",
]


class Compression:
    """Gradient compression choices: ``Compression.none`` or ``Compression.fp16``."""
    none = _compression.NoneCompressor
    fp16 = _compression.fp16_compressor(
        cast=lambda t, dtype: tf.cast(t, dtype), is_floating=lambda t: t.dtype.is_floating,
        dtype_of=lambda t: t.dtype, float16=tf.float16)


def barrier() -> None:
    rr.barrier()


def broadcast_object(obj: Any, root_rank: int = 0, session: Any = None, name: Optional[str] = None) -> Any:
    """``root_rank``'s picklable object, on every rank."""
    return rr.broadcast_object(obj, root_rank, name)


def allgather_object(obj: Any, session: Any = None, name: Optional[str] = None) -> list:
    """Every rank's picklable object, in rank order."""
    return rr.allgather_object(obj, name)


# -- tensors <-> NumPy ---------------------------------------------------------

def _dense(value: Any, what: str = "tensor") -> tf.Tensor:
    """A dense tensor on the CPU (IndexedSlices are densified, as Horovod's sparse_as_dense)."""
    if isinstance(value, tf.IndexedSlices):
        value = tf.convert_to_tensor(value)
    tensor = tf.convert_to_tensor(value)
    if tf.executing_eagerly() and "GPU" in (tensor.device or ""):
        raise NotImplementedError(f"{what} is on {tensor.device}: mtrain's GPU path is not there yet; "
                                  "place the computation on the CPU (with tf.device('/CPU:0'))")
    return tensor


def _call(fn: Callable[..., List[np.ndarray]], inputs: Sequence[tf.Tensor], out_dtypes: Sequence[tf.DType],
          shapes: Sequence[Any]) -> List[tf.Tensor]:
    """Run ``fn`` on the inputs' NumPy values: directly when eager, as a numpy_function in a graph."""
    if tf.executing_eagerly():
        outputs = fn(*[t.numpy() for t in inputs])
        return [tf.convert_to_tensor(np.asarray(o), dtype=d) for o, d in zip(outputs, out_dtypes)]
    outputs = tf.numpy_function(lambda *arrays: [np.asarray(o) for o in fn(*arrays)], list(inputs),
                                list(out_dtypes), stateful=True)
    for out, shape in zip(outputs, shapes):
        out.set_shape(shape)
    return list(outputs)


def _c(array: Any) -> np.ndarray:
    """C-contiguous, keeping 0-d arrays 0-d (np.ascontiguousarray would make them 1-d)."""
    return np.asarray(array, order="C")


# -- collectives -----------------------------------------------------------------

def grouped_allreduce(tensors: Sequence[Any], average: Optional[bool] = None, device_dense: str = "",
                      device_sparse: str = "", compression: type = Compression.none, op: Any = None,
                      prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                      name: Optional[str] = None) -> List[tf.Tensor]:
    """Each tensor reduced over all ranks (default Average), as one fused unit."""
    op = resolve_op(average, op)
    pairs = [compression.compress(_dense(t, f"tensors[{i}]")) for i, t in enumerate(tensors)]
    inputs = [t for t, _ in pairs]
    if not inputs:
        return []

    def reduce(*arrays: np.ndarray) -> List[np.ndarray]:
        arrays = [_c(a) for a in arrays]
        results = rr.synchronize(rr.grouped_allreduce_async(arrays, op, name, prescale_factor, postscale_factor))
        return [r.reshape(a.shape) for r, a in zip(results, arrays)]
    reduced = _call(reduce, inputs, [t.dtype for t in inputs], [t.shape for t in inputs])
    return [compression.decompress(r, ctx) for r, (_, ctx) in zip(reduced, pairs)]


def allreduce(tensor: Any, average: Optional[bool] = None, device_dense: str = "", device_sparse: str = "",
              compression: type = Compression.none, op: Any = None, prescale_factor: float = 1.0,
              postscale_factor: float = 1.0, name: Optional[str] = None,
              ignore_name_scope: bool = False) -> tf.Tensor:
    """``tensor`` reduced over all ranks (default Average)."""
    return grouped_allreduce([tensor], average, device_dense, device_sparse, compression, op,
                             prescale_factor, postscale_factor, name)[0]


def allgather(tensor: Any, name: Optional[str] = None, ignore_name_scope: bool = False) -> tf.Tensor:
    """Every rank's tensor concatenated along dimension 0 (first dimensions may differ)."""
    tensor = _dense(tensor)
    fn = lambda a: [rr.synchronize(rr.allgather_async(_c(a), name))]  # noqa: E731
    shape = tf.TensorShape([None]).concatenate(tensor.shape[1:]) if tensor.shape.rank else tf.TensorShape([None])
    return _call(fn, [tensor], [tensor.dtype], [shape])[0]


def broadcast(tensor: Any, root_rank: int, name: Optional[str] = None,
              ignore_name_scope: bool = False) -> tf.Tensor:
    """``root_rank``'s value of ``tensor``, on every rank."""
    tensor = _dense(tensor)
    fn = lambda a: [rr.synchronize(rr.broadcast_async(_c(a), root_rank, name)).reshape(a.shape)]  # noqa: E731,E501
    return _call(fn, [tensor], [tensor.dtype], [tensor.shape])[0]


def broadcast_(variables: Sequence[tf.Variable], root_rank: int, name: Optional[str] = None) -> List[tf.Tensor]:
    """In place: every variable takes ``root_rank``'s value; returns their new values."""
    broadcast_variables(variables, root_rank)
    return [v.read_value() for v in variables]


def broadcast_variables(variables: Sequence[tf.Variable], root_rank: int) -> None:
    """Assign ``root_rank``'s value to every variable (model weights, optimizer slots, ...)."""
    variables = list(variables)
    if not variables:
        return
    values = [_dense(v, f"variables[{i}]") for i, v in enumerate(variables)]

    def fn(*arrays: np.ndarray) -> List[np.ndarray]:
        handles = [rr.broadcast_async(_c(a), root_rank, f"broadcast_variables.{i}")
                   for i, a in enumerate(arrays)]
        return [rr.synchronize(h).reshape(a.shape) for h, a in zip(handles, arrays)]
    for variable, value in zip(variables, _call(fn, values, [v.dtype for v in values], [v.shape for v in values])):
        variable.assign(value)


def reducescatter(tensor: Any, device_dense: str = "", compression: type = Compression.none, op: Any = Average,
                  name: Optional[str] = None, ignore_name_scope: bool = False, prescale_factor: float = 1.0,
                  postscale_factor: float = 1.0) -> tf.Tensor:
    """Reduce over ranks, keep this rank's rows (the first ``rows % size`` ranks get one extra)."""
    compressed, ctx = compression.compress(_dense(tensor))

    def fn(a: np.ndarray) -> List[np.ndarray]:
        a = _c(a) * np.asarray(prescale_factor, dtype=a.dtype) if prescale_factor != 1.0 \
            else _c(a)
        out = rr.synchronize(rr.reducescatter_async(a, op, name))
        return [out * np.asarray(postscale_factor, dtype=out.dtype) if postscale_factor != 1.0 else out]
    shape = tf.TensorShape([None]).concatenate(compressed.shape[1:]) if compressed.shape.rank else compressed.shape
    return compression.decompress(_call(fn, [compressed], [compressed.dtype], [shape])[0], ctx)


def alltoall(tensor: Any, splits: Any = None, name: Optional[str] = None, ignore_name_scope: bool = False) -> Any:
    """Send ``splits[r]`` rows to rank r (equal shares if None). Returns the received tensor,
    plus the received splits when ``splits`` is given (as Horovod)."""
    tensor = _dense(tensor)
    given = splits is not None
    splits_tensor = tf.cast(tf.convert_to_tensor(splits if given else [], dtype=tf.int64), tf.int32)

    def fn(a: np.ndarray, s: np.ndarray) -> List[np.ndarray]:
        received, received_splits = rr.synchronize(rr.alltoall_async(_c(a), s.tolist() if given else None, name))
        return [received, np.asarray(received_splits, dtype=np.int32)]
    shape = tf.TensorShape([None]).concatenate(tensor.shape[1:]) if tensor.shape.rank else tensor.shape
    received, received_splits = _call(fn, [tensor, splits_tensor], [tensor.dtype, tf.int32], [shape, [None]])
    return (received, received_splits) if given else received


# -- DistributedGradientTape ---------------------------------------------------

def _reduce_gradients(grads: Sequence[Any], variables: Sequence[Any], op: Any, gradient_predivide_factor: float,
                      compression: type, name: str, postscale: float = 1.0) -> List[tf.Tensor]:
    """Average (or sum) gradients over ranks; a missing gradient takes part as zeros."""
    grads = [tf.zeros_like(v) if g is None else _dense(g, "gradient") for g, v in zip(grads, variables)]
    pre, post = 1.0, postscale
    if op == Average:  # the runtime divides by size after the postscale
        pre, post = 1.0 / gradient_predivide_factor, postscale * gradient_predivide_factor
    return grouped_allreduce(grads, compression=compression, op=op, prescale_factor=pre,
                             postscale_factor=post, name=name)


check_op = check_gradient_op  # the Keras wrapper imports it from here


class _DistributedGradientTape(tf.GradientTape):
    """A GradientTape whose ``gradient()`` returns gradients reduced over all ranks."""

    def gradient(self, target: Any, sources: Any, output_gradients: Any = None,
                 unconnected_gradients: Any = tf.UnconnectedGradients.NONE) -> Any:
        grads = super().gradient(target, sources, output_gradients, unconnected_gradients)
        flat_sources, flat_grads = tf.nest.flatten(sources), tf.nest.flatten(grads)
        reduced = _reduce_gradients(flat_grads, flat_sources, self._mtrain_op, self._mtrain_predivide,
                                    self._mtrain_compression, "DistributedGradientTape.gradients")
        return tf.nest.pack_sequence_as(grads, reduced)


def DistributedGradientTape(gradtape: tf.GradientTape, device_dense: str = "", device_sparse: str = "",
                            compression: type = Compression.none, sparse_as_dense: bool = False,
                            op: Any = Average, gradient_predivide_factor: float = 1.0,
                            num_groups: int = 0, groups: Any = None) -> tf.GradientTape:
    """Wrap a ``tf.GradientTape`` so that ``gradient()`` averages over all ranks.

    Gradients a rank did not produce (``None``) take part as zeros, so ranks never
    disagree on what is reduced. ``device_*``, ``sparse_as_dense``, ``num_groups`` and
    ``groups`` are accepted for Horovod compatibility: gradients are always dense and fused.
    """
    if not isinstance(gradtape, tf.GradientTape):
        raise TypeError(f"DistributedGradientTape wraps a tf.GradientTape, got {type(gradtape).__name__}")
    op = check_op(op, gradient_predivide_factor)
    tape = _DistributedGradientTape.__new__(_DistributedGradientTape)
    tape.__dict__.update(gradtape.__dict__)
    tape._mtrain_op, tape._mtrain_predivide, tape._mtrain_compression = op, gradient_predivide_factor, compression
    return tape
