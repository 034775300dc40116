"""The collectives with no gradient: each hands its inputs' NumPy values to the runtime through the
bridge (``run_collective``), named for a graph by ``graph_name``. ``gradients`` makes them
differentiable; their backward rules are made of these too."""
from __future__ import annotations

from typing import Any, List, Optional, Sequence

import numpy as np
import tensorflow as tf

import mtrain.ringreduce as rr
from mtrain.ringreduce import ProcessSet

from .bridge import Finish, contiguous, first_dim_unknown, graph_name, run_collective

__all__ = ["raw_alltoall", "raw_broadcast", "raw_grouped_allgather", "raw_grouped_allreduce",
           "raw_grouped_reducescatter"]


def raw_grouped_allreduce(inputs: Sequence[tf.Tensor], op: Any, name: Optional[str], prescale: float,
                          postscale: float, process_set: ProcessSet) -> List[tf.Tensor]:
    """Each input reduced over ``process_set``, in one submission."""
    name = graph_name(name, "allreduce", process_set)

    def reduce(*arrays: np.ndarray) -> Finish:
        arrays = [contiguous(a) for a in arrays]
        # The runtime scales as Horovod does (Average is one scaling by postscale / size).
        handle = rr.grouped_allreduce_async(arrays, op, name, prescale, postscale, process_set=process_set)
        return lambda: [r.reshape(a.shape) for r, a in zip(rr.synchronize(handle), arrays)]
    return run_collective(reduce, inputs, [t.dtype for t in inputs], [t.shape for t in inputs])


def raw_grouped_allgather(inputs: Sequence[tf.Tensor], name: Optional[str],
                          process_set: ProcessSet) -> List[tf.Tensor]:
    """Each input allgathered over ``process_set`` (a scalar as one row), in one submission."""
    name = graph_name(name, "allgather", process_set)

    def gather(*arrays: np.ndarray) -> Finish:
        names = [None if name is None else f"{name}.{i}" for i in range(len(arrays))]
        handles = [rr.allgather_async(contiguous(a), n, process_set=process_set) for a, n in zip(arrays, names)]
        return lambda: [rr.synchronize(h) for h in handles]
    shapes = [first_dim_unknown(t) if t.shape.rank != 0 else tf.TensorShape([None]) for t in inputs]
    return run_collective(gather, inputs, [t.dtype for t in inputs], shapes)  # a scalar is gathered as one row


def raw_broadcast(tensor: tf.Tensor, root_rank: int, name: Optional[str], process_set: ProcessSet) -> tf.Tensor:
    """``root_rank``'s value of ``tensor`` on every rank of ``process_set``."""
    name = graph_name(name, "broadcast", process_set)

    def fn(a: np.ndarray) -> Finish:
        handle = rr.broadcast_async(contiguous(a), root_rank, name, process_set=process_set)
        return lambda: [rr.synchronize(handle).reshape(a.shape)]
    return run_collective(fn, [tensor], [tensor.dtype], [tensor.shape])[0]


def raw_grouped_reducescatter(inputs: Sequence[tf.Tensor], op: Any, name: Optional[str], prescale: float,
                              postscale: float, process_set: ProcessSet) -> List[tf.Tensor]:
    """Each input reduce-scattered over ``process_set``, in one submission."""
    name = graph_name(name, "reducescatter", process_set)

    def scatter(*arrays: np.ndarray) -> Finish:
        names = [name if name is None or len(arrays) == 1 else f"{name}.{i}" for i in range(len(arrays))]
        # The runtime scales as Horovod does (pre- and postscale, Average as one scaling by
        # postscale / size), so the factors go to it as they are.
        handles = [rr.reducescatter_async(contiguous(a), op, n, prescale, postscale, process_set=process_set)
                   for a, n in zip(arrays, names)]
        return lambda: [rr.synchronize(h) for h in handles]
    return run_collective(scatter, inputs, [t.dtype for t in inputs], [first_dim_unknown(t) for t in inputs])


def raw_alltoall(tensor: tf.Tensor, splits: tf.Tensor, given: bool, name: Optional[str],
                 process_set: ProcessSet) -> List[tf.Tensor]:
    """The rows received and the received splits (int32); ``splits`` are used only when ``given``."""
    name = graph_name(name, "alltoall", process_set)

    def fn(a: np.ndarray, s: np.ndarray) -> Finish:
        handle = rr.alltoall_async(contiguous(a), s.tolist() if given else None, name, process_set=process_set)

        def finish() -> List[np.ndarray]:
            received, received_splits = rr.synchronize(handle)
            return [received, np.asarray(received_splits, dtype=np.int32)]
        return finish
    return run_collective(fn, [tensor, splits], [tensor.dtype, tf.int32], [first_dim_unknown(tensor), [None]])
