"""How the DDP backend runs each torch ``ReduceOp``: on the runtime's all-reduce, or gathered
and folded with NumPy (the bitwise ops, which the runtime's all-reduce does not have)."""
from __future__ import annotations

from typing import Any, NamedTuple, Optional, Sequence

import numpy as np
import torch
import torch.distributed as dist

import mtrain.ringreduce as rr

from .errors import ArgumentError

__all__ = ["BITWISE_OPS", "REDUCE_OPS", "Reduction", "options_op", "reduction_for"]

REDUCE_OPS = {
    dist.ReduceOp.SUM: rr.Sum,
    dist.ReduceOp.AVG: rr.Average,
    dist.ReduceOp.MIN: rr.Min,
    dist.ReduceOp.MAX: rr.Max,
    dist.ReduceOp.PRODUCT: rr.Product,
}

# Folded from every rank's tensor (gathered): the runtime's all-reduce has no bitwise ops.
BITWISE_OPS = {
    dist.ReduceOp.BAND: np.bitwise_and,
    dist.ReduceOp.BOR: np.bitwise_or,
    dist.ReduceOp.BXOR: np.bitwise_xor,
}


class Reduction(NamedTuple):
    """A torch ReduceOp as this backend runs it: on the runtime's all-reduce (``op``), or gathered
    and folded with a NumPy ufunc (``fold``)."""

    name: str
    op: Optional[rr.ReduceOp]
    fold: Optional[np.ufunc]


def reduction_for(torch_op: Any, tensors: Sequence[torch.Tensor], what: str) -> Reduction:
    """``torch_op`` checked against the tensors it reduces; a one-line error says what to use instead."""
    reduction = None
    for key, op in REDUCE_OPS.items():
        if torch_op == key:
            reduction = Reduction(key.name, op, None)
    for key, fold in BITWISE_OPS.items():
        if torch_op == key:
            reduction = Reduction(key.name, None, fold)
    if reduction is None:
        if torch_op == dist.ReduceOp.PREMUL_SUM:
            raise ArgumentError(f"{what}: ReduceOp.PREMUL_SUM is not supported by the mtrain backend (nor by "
                                "gloo): multiply the tensor by the factor, then reduce with ReduceOp.SUM")
        supported = ", ".join(f"ReduceOp.{k.name}" for k in list(REDUCE_OPS) + list(BITWISE_OPS))
        raise ArgumentError(f"{what}: the mtrain backend does not support {torch_op!r}; use one of "
                            f"{supported}, or a gloo process group")
    for i, tensor in enumerate(tensors):
        if tensor.is_complex() and reduction.op not in (rr.Sum, rr.Average):
            raise ArgumentError(f"{what}: tensor {i} is complex: only ReduceOp.SUM and ReduceOp.AVG are defined "
                                "for complex tensors")
        if reduction.fold is not None and (tensor.is_floating_point() or tensor.is_complex()):
            raise ArgumentError(f"{what}: cannot use ReduceOp.{reduction.name} with non-integral dtype "
                                f"{tensor.dtype}; bitwise ops take integer and bool tensors")
    return reduction


def options_op(opts: Any) -> Any:
    """The ReduceOp of a collective's options (SUM when torch passes none)."""
    return dist.ReduceOp.SUM if opts is None else opts.reduceOp
