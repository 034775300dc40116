"""The collectives on torch tensors, each with its autograd function (Horovod's backward rules).

Each public op runs an autograd Function only when its input needs a gradient; a tensor
without requires_grad takes the plain path (no per-op autograd work). Tensors cross to the
runtime through ``bridge`` (which also checks what they take); the per-gradient in-place
all-reduce is ``inplace``'s.
"""
from __future__ import annotations

from typing import Any, List, Optional, Sequence, Tuple

import numpy as np
import torch

import mtrain.ringreduce as rr
from mtrain.ringreduce import Average, ProcessSet, Sum, global_process_set, rank

from ..gradient_op import resolve_op
from ..handles import DeferredHandle, FrameworkHandle, synchronize
from .bridge import check_tensor, check_tensors, from_numpy, numpy_view
from .compression import Compression
from .inplace import InPlaceHandle, allreduce_in_place, inplace_buffer, named_views

__all__ = [
    "allgather", "allgather_async", "allreduce", "allreduce_", "allreduce_async", "allreduce_async_",
    "alltoall", "alltoall_async", "broadcast", "broadcast_", "broadcast_async", "broadcast_async_",
    "grouped_allgather", "grouped_allgather_async", "grouped_allreduce",
    "grouped_allreduce_", "grouped_allreduce_async", "grouped_allreduce_async_", "grouped_reducescatter",
    "grouped_reducescatter_async", "join", "recv", "recv_async", "reducescatter", "reducescatter_async", "send",
    "send_async", "sparse_allreduce_async",
]


# -- all-reduce --------------------------------------------------------------

def allreduce_async(tensor: torch.Tensor, average: Optional[bool] = None, name: Optional[str] = None,
                    op: Any = None, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
        process_set: ProcessSet = global_process_set) -> FrameworkHandle:
    """Start an all-reduce of ``tensor`` into a new tensor; ``synchronize`` returns it."""
    array = numpy_view(check_tensor(tensor))
    inner = rr.allreduce_async(array, resolve_op(average, op), name, prescale_factor, postscale_factor,
                               process_set=process_set)
    return FrameworkHandle(inner, lambda result: from_numpy(result).reshape(tensor.shape))


def allreduce_async_(tensor: torch.Tensor, average: Optional[bool] = None, name: Optional[str] = None,
                     op: Any = None, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
        process_set: ProcessSet = global_process_set) -> FrameworkHandle:
    """Start an in-place all-reduce of ``tensor``; ``synchronize`` returns ``tensor``."""
    op = Average if op is None and average is None else resolve_op(average, op)
    if name is not None:
        # The per-gradient path of a training loop: a tensor all-reduced under this name
        # before, its view kept (and so checked) then.
        handle = named_views.submit(name, tensor, op, name, prescale_factor, postscale_factor, process_set)
        if handle is not None:
            return handle
    return allreduce_in_place(check_tensor(tensor), name, op, prescale_factor, postscale_factor, process_set)


def allreduce(tensor: torch.Tensor, average: Optional[bool] = None, name: Optional[str] = None,
              compression: type = Compression.none, op: Any = None,
              prescale_factor: float = 1.0, postscale_factor: float = 1.0,
        process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """A new tensor: ``tensor`` reduced over all ranks (default Average). Differentiable."""
    op = resolve_op(average, op)
    compressed, ctx = compression.compress(check_tensor(tensor))
    if tensor.requires_grad and torch.is_grad_enabled():
        reduced = _AllreduceFunction.apply(compressed, op, name, prescale_factor, postscale_factor, process_set)
    else:
        reduced = synchronize(allreduce_async(compressed, None, name, op, prescale_factor, postscale_factor,
                                               process_set))
    return compression.decompress(reduced, ctx)


def allreduce_(tensor: torch.Tensor, average: Optional[bool] = None, name: Optional[str] = None,
               op: Any = None, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
        process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """In-place all-reduce: ``tensor`` is overwritten with the result and returned."""
    return synchronize(allreduce_async_(tensor, average, name, op, prescale_factor, postscale_factor, process_set))


class _AllreduceFunction(torch.autograd.Function):
    """All-reduce whose gradient is the same all-reduce of the incoming gradient (as Horovod)."""

    @staticmethod
    def forward(ctx, tensor, op, name, prescale_factor, postscale_factor, process_set):  # type: ignore[override]
        ctx.args = (op, prescale_factor, postscale_factor, process_set)
        return synchronize(allreduce_async(tensor, None, name, op, prescale_factor, postscale_factor, process_set))

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        op, pre, post, process_set = ctx.args
        reduced = synchronize(allreduce_async(grad.contiguous(), None, None, op, pre, post, process_set))
        return reduced, None, None, None, None, None


def grouped_allreduce_async(tensors: Sequence[torch.Tensor], average: Optional[bool] = None,
                            name: Optional[str] = None, op: Any = None, prescale_factor: float = 1.0,
                            postscale_factor: float = 1.0,
        process_set: ProcessSet = global_process_set) -> FrameworkHandle:
    """Start all-reduces of several tensors as one unit; ``synchronize`` returns new tensors."""
    arrays = [numpy_view(t) for t in check_tensors(tensors)]
    inner = rr.grouped_allreduce_async(arrays, resolve_op(average, op), name, prescale_factor, postscale_factor,
                                       process_set=process_set)
    return FrameworkHandle(inner, lambda results: [from_numpy(r).reshape(t.shape) for r, t in zip(results, tensors)])


def grouped_allreduce_async_(tensors: Sequence[torch.Tensor], average: Optional[bool] = None,
                             name: Optional[str] = None, op: Any = None, prescale_factor: float = 1.0,
                             postscale_factor: float = 1.0,
        process_set: ProcessSet = global_process_set) -> FrameworkHandle:
    """In-place grouped all-reduce; ``synchronize`` returns the same tensors."""
    tensors = check_tensors(tensors)
    if all(t.is_cpu and t.is_contiguous() for t in tensors):  # written in place: nothing to land
        inner = rr.grouped_allreduce_async_([numpy_view(t) for t in tensors], resolve_op(average, op), name,
                                            prescale_factor, postscale_factor, process_set=process_set)
        return InPlaceHandle(inner, tensors)
    pairs = [inplace_buffer(t) for t in tensors]
    inner = rr.grouped_allreduce_async_([b for b, _ in pairs], resolve_op(average, op), name,
                                        prescale_factor, postscale_factor, process_set=process_set)
    return FrameworkHandle(inner, lambda results: [land(r) for (_, land), r in zip(pairs, results)])


def grouped_allreduce(tensors: Sequence[torch.Tensor], average: Optional[bool] = None,
                      name: Optional[str] = None, compression: type = Compression.none, op: Any = None,
                      prescale_factor: float = 1.0, postscale_factor: float = 1.0,
        process_set: ProcessSet = global_process_set) -> List[torch.Tensor]:
    """New tensors: each of ``tensors`` reduced over all ranks, as one fused unit."""
    compressed = [compression.compress(check_tensor(t, f"tensors[{i}]")) for i, t in enumerate(tensors)]
    inputs = [t for t, _ in compressed]
    op = resolve_op(average, op)
    if _wants_grad(inputs):
        reduced = list(_GroupedAllreduceFunction.apply(op, name, prescale_factor, postscale_factor, process_set,
                                                       *inputs))
    else:
        reduced = synchronize(grouped_allreduce_async(inputs, None, name, op, prescale_factor, postscale_factor,
                                                       process_set))
    return [compression.decompress(r, ctx) for r, (_, ctx) in zip(reduced, compressed)]


class _GroupedAllreduceFunction(torch.autograd.Function):
    """Grouped all-reduce whose gradients are the same grouped all-reduce of the incoming ones."""

    @staticmethod
    def forward(ctx, op, name, prescale_factor, postscale_factor, process_set, *tensors):  # type: ignore[override]
        ctx.args = (op, prescale_factor, postscale_factor, process_set)
        return tuple(synchronize(grouped_allreduce_async(tensors, None, name, op, prescale_factor,
                                                         postscale_factor, process_set)))

    @staticmethod
    def backward(ctx, *grads):  # type: ignore[override]
        op, pre, post, process_set = ctx.args
        reduced = synchronize(grouped_allreduce_async([g.contiguous() for g in grads], None, None, op, pre, post,
                                                      process_set))
        return (None, None, None, None, None, *reduced)


def grouped_allreduce_(tensors: Sequence[torch.Tensor], average: Optional[bool] = None,
                       name: Optional[str] = None, op: Any = None, prescale_factor: float = 1.0,
                       postscale_factor: float = 1.0,
        process_set: ProcessSet = global_process_set) -> List[torch.Tensor]:
    return synchronize(grouped_allreduce_async_(tensors, average, name, op, prescale_factor, postscale_factor,
                                                process_set))


# -- other collectives --------------------------------------------------------

def _wants_grad(tensors: Sequence[torch.Tensor]) -> bool:
    return torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad for t in tensors)


def allgather_async(tensor: torch.Tensor, name: Optional[str] = None,
        process_set: ProcessSet = global_process_set) -> FrameworkHandle:
    return FrameworkHandle(rr.allgather_async(numpy_view(check_tensor(tensor)), name, process_set=process_set), from_numpy)


def allgather(tensor: torch.Tensor, name: Optional[str] = None,
        process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """Every rank's tensor concatenated along dimension 0 (first dimensions may differ). Differentiable."""
    if getattr(tensor, "requires_grad", False) and torch.is_grad_enabled():
        return _AllgatherFunction.apply(check_tensor(tensor), name, process_set)
    return synchronize(allgather_async(tensor, name, process_set))


def grouped_allgather_async(tensors: Sequence[torch.Tensor], name: Optional[str] = None,
        process_set: ProcessSet = global_process_set) -> FrameworkHandle:
    """Start all-gathers of several tensors as one unit; ``synchronize`` returns a list."""
    arrays = [numpy_view(check_tensor(t, f"tensors[{i}]")) for i, t in enumerate(tensors)]
    return FrameworkHandle(rr.grouped_allgather_async(arrays, name, process_set=process_set),
                  lambda results: [from_numpy(r) for r in results])


def grouped_allgather(tensors: Sequence[torch.Tensor], name: Optional[str] = None,
        process_set: ProcessSet = global_process_set) -> List[torch.Tensor]:
    """``allgather`` of each tensor, as one unit. Differentiable."""
    tensors = list(tensors)
    if _wants_grad(tensors):
        return list(_GroupedAllgatherFunction.apply(name, process_set, *tensors))
    return synchronize(grouped_allgather_async(tensors, name, process_set))


def _gathered_slices(grads: Sequence[torch.Tensor], rows: Sequence[int],
                     shapes: Sequence[torch.Size], process_set: ProcessSet = global_process_set) -> List[torch.Tensor]:
    """Backward of an all-gather, as Horovod's (``HorovodAllgather.backward``): this rank's rows of
    the gradient *averaged* over the set, i.e. the true gradient of the summed losses divided by
    the set's size (Horovod's choice, kept so that a ported model trains with the same step size)."""
    averaged = synchronize(grouped_allreduce_async([g.contiguous() for g in grads], op=Average,
                                                   process_set=process_set))
    every_rows = synchronize(allgather_async(torch.tensor([list(rows)], dtype=torch.int64),
                                             process_set=process_set))  # set size x k
    offsets = every_rows[:process_set.rank()].sum(dim=0).tolist()
    return [a.narrow(0, int(o), r).reshape(shape) for a, o, r, shape in zip(averaged, offsets, rows, shapes)]


class _AllgatherFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, name, process_set):  # type: ignore[override]
        ctx.rows, ctx.shape = (tensor.shape[0] if tensor.dim() else 1), tensor.shape
        ctx.process_set = process_set
        return synchronize(allgather_async(tensor, name, process_set))

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        return _gathered_slices([grad], [ctx.rows], [ctx.shape], ctx.process_set)[0], None, None


class _GroupedAllgatherFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, name, process_set, *tensors):  # type: ignore[override]
        ctx.rows = [t.shape[0] if t.dim() else 1 for t in tensors]
        ctx.shapes = [t.shape for t in tensors]
        ctx.process_set = process_set
        return tuple(synchronize(grouped_allgather_async(tensors, name, process_set)))

    @staticmethod
    def backward(ctx, *grads):  # type: ignore[override]
        return (None, None, *_gathered_slices(grads, ctx.rows, ctx.shapes, ctx.process_set))


def broadcast_async(tensor: torch.Tensor, root_rank: int, name: Optional[str] = None,
        process_set: ProcessSet = global_process_set) -> FrameworkHandle:
    return FrameworkHandle(rr.broadcast_async(numpy_view(check_tensor(tensor)), root_rank, name, process_set=process_set),
                  lambda result: from_numpy(result).reshape(tensor.shape))


def broadcast_async_(tensor: torch.Tensor, root_rank: int, name: Optional[str] = None,
        process_set: ProcessSet = global_process_set) -> FrameworkHandle:
    buffer, land = inplace_buffer(check_tensor(tensor))
    return FrameworkHandle(rr.broadcast_async_(buffer, root_rank, name, process_set=process_set), land)


def broadcast(tensor: torch.Tensor, root_rank: int, name: Optional[str] = None,
        process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """A new tensor holding ``root_rank``'s values. Differentiable."""
    if getattr(tensor, "requires_grad", False) and torch.is_grad_enabled():
        return _BroadcastFunction.apply(check_tensor(tensor), root_rank, name, process_set)
    return synchronize(broadcast_async(tensor, root_rank, name, process_set))


class _BroadcastFunction(torch.autograd.Function):
    """Backward as Horovod's ``HorovodBroadcast.backward``: the gradient averaged over the set
    lands on the root; every other rank gets zeros."""

    @staticmethod
    def forward(ctx, tensor, root_rank, name, process_set):  # type: ignore[override]
        ctx.root_rank, ctx.process_set = root_rank, process_set
        return synchronize(broadcast_async(tensor, root_rank, name, process_set))

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        averaged = synchronize(allreduce_async(grad.contiguous(), op=Average, process_set=ctx.process_set))
        if rank() != ctx.root_rank:  # root_rank is a global rank, as rank() is
            averaged = torch.zeros_like(averaged)
        return averaged, None, None, None


def broadcast_(tensor: torch.Tensor, root_rank: int, name: Optional[str] = None,
        process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """In place: ``tensor`` takes ``root_rank``'s values and is returned."""
    return synchronize(broadcast_async_(tensor, root_rank, name, process_set))


# -- point-to-point (mtrain's own; Horovod has none) ------------------------------------
# Ranks are global ranks, as root_rank is; the k-th send from a rank to another with a tag
# meets the k-th recv there (within ``process_set``). CPU tensors, and CUDA tensors staged
# through host memory.

def _p2p_tensor(tensor: Any, what: str) -> torch.Tensor:
    return check_tensor(tensor, what)


def send_async(tensor: torch.Tensor, dest: int, tag: int = 0,
               process_set: ProcessSet = global_process_set) -> FrameworkHandle:
    """Start sending ``tensor`` to rank ``dest``; ``synchronize`` returns once it may be changed."""
    view = numpy_view(_p2p_tensor(tensor, "send tensor").contiguous())
    return FrameworkHandle(rr.send_async(view, dest, tag, process_set), lambda _: None)


def recv_async(tensor: torch.Tensor, source: int, tag: int = 0,
               process_set: ProcessSet = global_process_set) -> FrameworkHandle:
    """Start receiving rank ``source``'s send into ``tensor`` (same dtype and number of
    elements); ``synchronize`` returns ``tensor``."""
    buffer, land = inplace_buffer(_p2p_tensor(tensor, "recv tensor"))

    def finish(result: Any) -> torch.Tensor:
        land(result)
        return tensor
    return FrameworkHandle(rr.recv_async(buffer, source, tag, process_set), finish)


def send(tensor: torch.Tensor, dest: int, tag: int = 0, process_set: ProcessSet = global_process_set) -> None:
    """Send ``tensor`` to rank ``dest`` (blocks until it may be changed)."""
    rr.send(numpy_view(_p2p_tensor(tensor, "send tensor").contiguous()), dest, tag, process_set)


def recv(tensor: torch.Tensor, source: int, tag: int = 0,
         process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """Receive rank ``source``'s send into ``tensor`` and return it."""
    buffer, land = inplace_buffer(_p2p_tensor(tensor, "recv tensor"))
    land(rr.recv(buffer, source, tag, process_set))
    return tensor


def reducescatter_async(tensor: torch.Tensor, name: Optional[str] = None, op: Any = Average,
                        process_set: ProcessSet = global_process_set, prescale_factor: float = 1.0,
                        postscale_factor: float = 1.0) -> FrameworkHandle:
    """Start ``reducescatter``. Horovod's parameter order: ``process_set`` before the scale factors
    here and in the other reduce-scatters (its all-reduces put it last)."""
    array = numpy_view(check_tensor(tensor))
    return FrameworkHandle(rr.reducescatter_async(array, op, name, prescale_factor, postscale_factor,
                                                   process_set=process_set), from_numpy)


def reducescatter(tensor: torch.Tensor, name: Optional[str] = None, compression: type = Compression.none,
                  op: Any = Average, process_set: ProcessSet = global_process_set, prescale_factor: float = 1.0,
                  postscale_factor: float = 1.0) -> torch.Tensor:
    """Reduce over ranks, keep this rank's rows (the first ``rows % size`` ranks get one extra).
    Differentiable."""
    compressed, ctx = compression.compress(check_tensor(tensor))
    if tensor.requires_grad and torch.is_grad_enabled():
        reduced = _ReducescatterFunction.apply(compressed, name, op, prescale_factor, postscale_factor, process_set)
    else:
        reduced = synchronize(reducescatter_async(compressed, name, op, process_set, prescale_factor,
                                                   postscale_factor))
    return compression.decompress(reduced, ctx)


def grouped_reducescatter_async(tensors: Sequence[torch.Tensor], name: Optional[str] = None, op: Any = Average,
                                process_set: ProcessSet = global_process_set, prescale_factor: float = 1.0,
                                postscale_factor: float = 1.0) -> FrameworkHandle:
    """Start reduce-scatters of several tensors as one unit; ``synchronize`` returns a list."""
    arrays = [numpy_view(check_tensor(t, f"tensors[{i}]")) for i, t in enumerate(tensors)]
    inner = rr.grouped_reducescatter_async(arrays, op, name, prescale_factor, postscale_factor,
                                             process_set=process_set)
    return FrameworkHandle(inner, lambda results: [from_numpy(r) for r in results])


def grouped_reducescatter(tensors: Sequence[torch.Tensor], name: Optional[str] = None,
                          compression: type = Compression.none, op: Any = Average,
                          process_set: ProcessSet = global_process_set, prescale_factor: float = 1.0,
                          postscale_factor: float = 1.0) -> List[torch.Tensor]:
    """``reducescatter`` of each tensor, as one unit. Differentiable."""
    compressed = [compression.compress(check_tensor(t, f"tensors[{i}]")) for i, t in enumerate(tensors)]
    inputs = [t for t, _ in compressed]
    if _wants_grad(inputs):
        reduced = list(_GroupedReducescatterFunction.apply(name, op, prescale_factor, postscale_factor, process_set,
                                                           *inputs))
    else:
        reduced = synchronize(grouped_reducescatter_async(inputs, name, op, process_set, prescale_factor,
                                                           postscale_factor))
    return [compression.decompress(r, ctx) for r, (_, ctx) in zip(reduced, compressed)]


def _reducescatter_backward(grads: Sequence[torch.Tensor], op: Any, pre: float, post: float,
                            process_set: ProcessSet = global_process_set) -> List[torch.Tensor]:
    """Backward of a reduce-scatter, as Horovod's ``HorovodReducescatter.backward``: the gradients
    all-gathered, times the set's size for Sum (nothing for Average), times both scale factors.
    That is the set's size times the true gradient for either op; Horovod's rule, kept as is."""
    factor = pre * post * (process_set.size() if op == Sum else 1)
    gathered = synchronize(grouped_allgather_async([g.contiguous() for g in grads], process_set=process_set))
    return [g * factor if factor != 1.0 else g for g in gathered]


class _ReducescatterFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, name, op, prescale_factor, postscale_factor, process_set):  # type: ignore[override]
        ctx.args = (op, prescale_factor, postscale_factor, process_set)
        return synchronize(reducescatter_async(tensor, name, op, process_set, prescale_factor, postscale_factor))

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        return _reducescatter_backward([grad], *ctx.args)[0], None, None, None, None, None


class _GroupedReducescatterFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, name, op, prescale_factor, postscale_factor, process_set, *tensors):  # type: ignore[override]
        ctx.args = (op, prescale_factor, postscale_factor, process_set)
        return tuple(synchronize(grouped_reducescatter_async(tensors, name, op, process_set, prescale_factor,
                                                             postscale_factor)))

    @staticmethod
    def backward(ctx, *grads):  # type: ignore[override]
        return (None, None, None, None, None, *_reducescatter_backward(grads, *ctx.args))


def _check_splits_dtype(splits: Any) -> Any:
    """Horovod refuses a splits tensor that is not of an integer type (by dtype, whatever its values)."""
    if isinstance(splits, torch.Tensor):
        if splits.is_floating_point() or splits.is_complex() or splits.dtype == torch.bool:
            raise ValueError(f"alltoall splits must be an integer tensor (e.g. torch.int32), got dtype "
                             f"{splits.dtype}; convert with splits.int()")
        return splits.tolist()
    if splits is not None:
        kind = np.asarray(splits).dtype.kind
        if kind not in "iu" and len(splits):
            raise ValueError(f"alltoall splits must be integers, got {list(splits)!r}")
    return splits


def alltoall_async(tensor: torch.Tensor, splits: Any = None, name: Optional[str] = None,
        process_set: ProcessSet = global_process_set) -> FrameworkHandle:
    splits = _check_splits_dtype(splits)
    tensor = check_tensor(tensor)
    device = tensor.device if tensor.is_cuda else None
    if device is not None:  # the runtime's all-to-all moves host memory only: stage through it
        tensor = tensor.detach().cpu()

    def finish(result: Any) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        array, received = result
        out = from_numpy(array)
        return (out if device is None else out.to(device)), \
            torch.as_tensor(np.asarray(received), dtype=torch.int32)
    return FrameworkHandle(rr.alltoall_async(numpy_view(tensor), splits, name, process_set=process_set), finish)


def alltoall(tensor: torch.Tensor, splits: Any = None, name: Optional[str] = None,
        process_set: ProcessSet = global_process_set) -> Any:
    """Send ``splits[r]`` rows to rank r (equal shares if None). Returns the received tensor,
    plus the received splits when ``splits`` is given (as Horovod). Differentiable."""
    if getattr(tensor, "requires_grad", False) and torch.is_grad_enabled():
        received, received_splits = _AlltoallFunction.apply(check_tensor(tensor), splits, name, process_set)
    else:
        received, received_splits = synchronize(alltoall_async(tensor, splits, name, process_set))
    return received if splits is None else (received, received_splits)


class _AlltoallFunction(torch.autograd.Function):
    """Backward as Horovod: the gradient goes back by an all-to-all with the received splits."""

    @staticmethod
    def forward(ctx, tensor, splits, name, process_set):  # type: ignore[override]
        received, received_splits = synchronize(alltoall_async(tensor, splits, name, process_set))
        ctx.received_splits, ctx.process_set = received_splits, process_set
        ctx.mark_non_differentiable(received_splits)
        return received, received_splits

    @staticmethod
    def backward(ctx, grad, _):  # type: ignore[override]
        back, _ = synchronize(alltoall_async(grad.contiguous(), ctx.received_splits, process_set=ctx.process_set))
        return back, None, None, None


# -- join -----------------------------------------------------------------------

def join(device: int = -1) -> int:
    """This rank has no more data (Horovod's ``join``): until every rank has joined, it takes part
    in the ops the others still submit (all-reduces count it as zeros, allgathers get no rows from
    it), so a DistributedOptimizer keeps working on the ranks still training. Blocks until every
    rank has joined; returns the rank that joined last. ``device`` is accepted for Horovod: the
    stand-ins live where the other ranks' tensors live."""
    return rr.join()


# -- sparse ---------------------------------------------------------------------

def sparse_allreduce_async(tensor: torch.Tensor, name: Optional[str] = None, op: Any = Average,
                           process_set: ProcessSet = global_process_set) -> DeferredHandle:
    """Start an all-reduce of a sparse COO tensor, as Horovod does it: all-gather every rank's
    indices and values, then coalesce (duplicates summed); Average divides by size.
    ``synchronize(handle)`` (or ``handle()``) returns the reduced sparse tensor."""
    if not isinstance(tensor, torch.Tensor) or not tensor.is_sparse:
        raise TypeError("sparse_allreduce_async takes a sparse COO tensor; use allreduce_async for dense ones")
    op = resolve_op(None, op)
    if op not in (Average, Sum):
        # A RuntimeError (what Horovod programs catch from a refused op), and a ValueError as before.
        raise rr.InvalidArgumentError(f"sparse all-reduce supports op=Average or op=Sum, got {op!r}")
    # Indices are (ndim, nnz): gathered along nnz, so sent transposed and turned back after.
    indices = allgather_async(tensor._indices().t().contiguous(), None if name is None else f"{name}.indices",
                              process_set)
    values = allgather_async(tensor._values().contiguous(), None if name is None else f"{name}.values", process_set)
    shape, n = tensor.shape, process_set.size()

    def finish(all_indices: torch.Tensor, all_values: torch.Tensor) -> torch.Tensor:
        if op == Average:
            all_values = (all_values / n if all_values.is_floating_point()
                          else torch.div(all_values, n, rounding_mode="trunc"))  # toward zero, as dense ints
        return torch.sparse_coo_tensor(all_indices.t(), all_values, shape, check_invariants=False).coalesce()
    return DeferredHandle([indices, values], finish)
