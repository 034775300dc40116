"""Model and optimizer state made equal on every rank: ``broadcast_parameters`` and
``broadcast_optimizer_state`` (objects: the runtime's ``broadcast_object``)."""
from __future__ import annotations

from typing import Any, Dict, Iterable, List, Optional, Union

import torch

from mtrain.ringreduce import ProcessSet, broadcast_object, global_process_set, rank

from .bridge import check_tensor
from .mpi_ops import broadcast_async_

__all__ = ["broadcast_optimizer_state", "broadcast_parameters"]


def broadcast_parameters(params: Union[Dict[str, torch.Tensor], Iterable[Any]], root_rank: int,
                         prefix: Optional[str] = None, process_set: ProcessSet = global_process_set) -> None:
    """Overwrite every rank's parameters with ``root_rank``'s.

    ``params``: ``model.state_dict()``, ``model.named_parameters()`` or a list of tensors.
    """
    if isinstance(params, dict):
        items = sorted(params.items())
    elif isinstance(params, Iterable) and not isinstance(params, (str, torch.Tensor)):
        items = [p if isinstance(p, tuple) else (None, p) for p in params]
    else:
        raise ValueError(f"invalid params of type {type(params).__name__}: pass model.state_dict(), "
                         "model.named_parameters() or a list of tensors")
    label = prefix if prefix is not None else "broadcast_parameters."
    handles = [broadcast_async_(p, root_rank, None if name is None else f"{label}{name}", process_set)
               for name, p in items if isinstance(p, torch.Tensor)]
    for handle in handles:
        handle.wait()


class _TensorSpec:
    """Stands for a tensor in the picklable skeleton of a state dict."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.shape, self.dtype = tuple(tensor.shape), tensor.dtype
        # Received into the same kind of memory as root's: ranks must agree on each op's backend.
        self.cuda = tensor.is_cuda


def _skeleton(value: Any, tensors: List[torch.Tensor]) -> Any:
    if isinstance(value, torch.Tensor):
        tensors.append(check_tensor(value, "optimizer state"))
        return _TensorSpec(value)
    if isinstance(value, dict):
        return {k: _skeleton(v, tensors) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_skeleton(v, tensors) for v in value)
    return value


def _fill(value: Any, tensors: List[torch.Tensor]) -> Any:
    if isinstance(value, _TensorSpec):
        device = torch.device("cuda", torch.cuda.current_device()) if value.cuda else None
        tensors.append(torch.empty(value.shape, dtype=value.dtype, device=device))
        return tensors[-1]
    if isinstance(value, dict):
        return {k: _fill(v, tensors) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_fill(v, tensors) for v in value)
    return value


def broadcast_optimizer_state(optimizer: torch.optim.Optimizer, root_rank: int, model: Any = None,
                              process_set: ProcessSet = global_process_set) -> None:
    """Make every rank's optimizer state and hyperparameters equal ``root_rank``'s.

    Works whether or not any rank has stepped: when ``root_rank`` has no state yet,
    every rank ends with none (exactly root's state), instead of Horovod's
    zero-gradient step, which advances Adam's step count and applies weight decay.
    On a rank whose optimizer had no state, each parameter that requires a gradient
    and has none is left with a zero one, as Horovod leaves it (sparse for
    ``SparseAdam``, and for the sparse embeddings of ``model`` when given).
    """
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"expected a torch.optim.Optimizer, got {type(optimizer).__name__}")
    state = optimizer.state_dict()
    if not state["state"]:
        _zero_missing_gradients(optimizer, model)
    root_tensors: List[torch.Tensor] = []
    skeleton = broadcast_object(_skeleton(state, root_tensors) if rank() == root_rank else None,
                                root_rank, name="broadcast_optimizer_state.skeleton", process_set=process_set)
    tensors: List[torch.Tensor] = []
    received = _fill(skeleton, tensors)
    if rank() == root_rank:
        tensors = root_tensors
    handles = [broadcast_async_(t, root_rank, f"broadcast_optimizer_state.{i}", process_set)
               for i, t in enumerate(tensors)]
    for handle in handles:
        handle.wait()
    if rank() != root_rank:
        optimizer.load_state_dict(received)


def _zero_missing_gradients(optimizer: torch.optim.Optimizer, model: Any) -> None:
    """Horovod's broadcast_optimizer_state (horovod/torch/functions.py) gives a stateless optimizer's
    parameters zero gradients before its initializing step; programs written for it may read
    ``p.grad`` afterwards. We take no step, but leave the gradients as it does (and keep any that exist)."""
    sparse = {id(p) for m in (model.modules() if model is not None else ())
              if isinstance(m, torch.nn.Embedding) and m.sparse for p in m.parameters()}
    all_sparse = isinstance(optimizer, torch.optim.SparseAdam)
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p.requires_grad and p.grad is None:
                zero = torch.zeros_like(p, memory_format=torch.contiguous_format)
                p.grad = zero.to_sparse() if all_sparse or id(p) in sparse else zero
