"""PyTorch adapter: ``import mtrain.torch as hvd`` in place of ``import horovod.torch as hvd``.

CPU tensors cross to the runtime as NumPy views of their own memory (no copy);
in-place ops write the result straight back into the tensor. CUDA tensors cross
as CuPy views through DLPack (no copy). The runtime queues its device work on
the legacy default stream (``mtrain.ringreduce.cuda``): a CUDA tensor is handed over
after the legacy stream has been made to wait for torch's current stream, and a
result is handed back after torch's current stream has been made to wait for
the legacy stream, so torch side streams are ordered too.
"""
from __future__ import annotations

import contextlib
import warnings
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple, Union

import numpy as np
import torch

import mtrain.ringreduce as rr
from mtrain.ringreduce import cuda as _cuda
from mtrain.ringreduce.requests import AllreduceOp
from mtrain.ringreduce.runtime import submit_allreduce
from mtrain.ringreduce import (  # noqa: F401  (re-exported: the Horovod API)
    Adasum, Average, HorovodInternalError, Max, Min, MismatchError, NotInitializedError, ProcessSet, Product,
    ReduceOp, Sum, add_process_set, allgather_object, barrier, broadcast_object, cross_rank, cross_size,
    global_process_set, init, is_homogeneous, is_initialized, local_rank, local_size, mpi_threads_supported,
    rank, remove_process_set, shutdown, size, start_timeline, stop_timeline,
)

from .build_info import (  # noqa: F401  (re-exported: Horovod's build queries)
    ccl_built, cuda_built, ddl_built, gloo_built, gloo_enabled, mpi_built, mpi_enabled, nccl_built, rocm_built)
from . import compression as _compression
from .gradient_op import check_gradient_op, resolve_op
from .handles import DeferredHandle, Handle, HandleBase, poll, synchronize  # noqa: F401

__all__ = [
    "Adasum", "Average", "Compression", "DistributedOptimizer", "HorovodInternalError", "Max", "Min",
    "MismatchError", "NotInitializedError", "ProcessSet", "Product", "ReduceOp", "Sum", "add_process_set",
    "global_process_set", "join", "remove_process_set",
    "allgather", "allgather_async", "allgather_object", "allreduce", "allreduce_", "allreduce_async",
    "allreduce_async_", "alltoall", "alltoall_async", "barrier", "broadcast", "broadcast_", "broadcast_async",
    "broadcast_async_", "broadcast_object", "broadcast_optimizer_state", "broadcast_parameters",
    "ccl_built", "cross_rank", "cross_size", "cuda_built", "ddl_built", "gloo_built", "gloo_enabled",
    "grouped_allgather", "grouped_allgather_async", "grouped_allreduce", "grouped_allreduce_",
    "grouped_allreduce_async", "grouped_allreduce_async_", "grouped_reducescatter",
    "grouped_reducescatter_async", "init", "is_homogeneous", "is_initialized", "local_rank", "local_size",
    "mpi_built", "mpi_enabled", "mpi_threads_supported", "nccl_built", "poll", "rank", "reducescatter",
    "reducescatter_async", "rocm_built", "shutdown", "size", "sparse_allreduce_async", "start_timeline",
    "SyncBatchNorm",
    "stop_timeline", "synchronize",
]


def __dir__() -> List[str]:
    """The Horovod API only: no private helpers or imported modules (``dir(hvd)``), but the
    ``hvd.elastic`` namespace, as Horovod's subpackage."""
    return sorted(__all__ + [name for name in ("elastic",) if name in globals()])


class Compression:
    """Gradient compression choices: ``Compression.none`` or ``Compression.fp16``."""
    none = _compression.NoneCompressor
    fp16 = _compression.fp16_compressor(
        cast=lambda t, dtype: t.to(dtype), is_floating=lambda t: t.is_floating_point(),
        dtype_of=lambda t: t.dtype, float16=torch.float16)


def _follow_runtime_device(device_id: int) -> None:
    """init() picked this rank's GPU for CuPy: make it torch's current device too."""
    if torch.cuda.is_available():
        torch.cuda.set_device(device_id)


_cuda.on_device_bound(_follow_runtime_device)


# -- tensors <-> NumPy ---------------------------------------------------------

def _bfloat16() -> Any:
    try:
        import ml_dtypes
    except ImportError:
        raise TypeError("bfloat16 tensors need the ml_dtypes package: pip install ml_dtypes") from None
    return ml_dtypes.bfloat16


def _check_tensor(tensor: Any, what: str = "tensor") -> torch.Tensor:
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"expected a torch.Tensor as {what}, got {type(tensor).__name__}")
    if tensor.is_cpu:  # the common case first, and without building a torch.device
        pass
    elif not tensor.is_cuda:
        raise NotImplementedError(f"{what} is on {tensor.device}: mtrain supports CPU and CUDA tensors")
    elif not cuda_built():
        raise NotImplementedError(f"{what} is a CUDA tensor: mtrain's GPU path needs CuPy; "
                                  "pip install 'mtrain[cuda12]' (or [cuda13] for CUDA 13)")
    if tensor.is_sparse:
        raise NotImplementedError(f"{what} is sparse: only dense tensors are supported; call .to_dense() first")
    return tensor


def _check_tensors(tensors: Sequence[Any]) -> List[torch.Tensor]:
    """``_check_tensor`` on each of ``tensors`` (naming ``tensors[i]`` only when one fails)."""
    tensors = list(tensors)
    for i, tensor in enumerate(tensors):
        if not (isinstance(tensor, torch.Tensor) and tensor.is_cpu and not tensor.is_sparse):
            _check_tensor(tensor, f"tensors[{i}]")
    return tensors


def _wait_for(waiter: Any, producer: Any) -> None:
    """Later work on stream ``waiter`` runs after the work queued on ``producer`` so far."""
    if waiter != producer:
        waiter.wait_stream(producer)


def _numpy_view(tensor: torch.Tensor) -> np.ndarray:
    """The tensor's own memory as a NumPy array (tensor must be contiguous for writes to land)."""
    if tensor.requires_grad:
        # Only then: detach() is a dispatched torch op that also releases the GIL, which on
        # the per-tensor path hands the GIL to the engine thread and back every time.
        tensor = tensor.detach()
    if tensor.is_cuda:  # a CuPy view of the same device memory, no copy
        if tensor.dtype == torch.bfloat16:
            raise TypeError("bfloat16 CUDA tensors are not supported (CuPy has no bfloat16); "
                            "cast to float16 or float32 first")
        import cupy
        device = tensor.device
        legacy = torch.cuda.default_stream(device)  # the stream the runtime's device work goes on
        _wait_for(legacy, torch.cuda.current_stream(device))
        tensor.record_stream(legacy)  # the caching allocator must not reuse it before that work is done
        with torch.cuda.device(device):  # __dlpack__ refuses a tensor off the current device
            # stream=-1: ordered above. CuPy's own hand-shake would pass its current stream,
            # which is the per-thread default stream (refused by torch) under
            # CUPY_CUDA_PER_THREAD_DEFAULT_STREAM=1.
            capsule = tensor.__dlpack__(stream=-1)
        return cupy.from_dlpack(capsule)
    if tensor.dtype is torch.bfloat16:
        return tensor.view(torch.int16).numpy().view(_bfloat16())
    return tensor.numpy()


def _after_device_work(tensor: torch.Tensor) -> torch.Tensor:
    """Order torch's current stream after the runtime's device work (in-place results)."""
    if tensor.is_cuda:
        _wait_for(torch.cuda.current_stream(tensor.device), torch.cuda.default_stream(tensor.device))
    return tensor


def _from_numpy(array: np.ndarray) -> torch.Tensor:
    if type(array).__module__.startswith("cupy"):  # device result: back as a CUDA tensor, no copy
        device = torch.device("cuda", array.device.id)
        _wait_for(torch.cuda.current_stream(device), torch.cuda.default_stream(device))
        return torch.from_dlpack(array.__dlpack__(stream=-1))  # stream=-1: ordered just above
    if array.dtype.name == "bfloat16":
        return torch.from_numpy(np.ascontiguousarray(array).view(np.int16)).view(torch.bfloat16)
    if not array.flags.writeable:
        array = array.copy()
    return torch.from_numpy(array)


class _InPlaceHandle(Handle):
    """An in-place op on a tensor (or a list of them) the runtime writes directly (contiguous,
    on the CPU): the result is the tensor (or the list) itself. No finishing function per op,
    and nothing to remember after the wait (the runtime handle keeps its result and its error),
    so it sets two fields: one is created per gradient."""

    __slots__ = ("_tensor",)
    _finish = None  # never written: shadows the base slot, so it costs nothing per handle

    def __init__(self, inner: Any, tensor: "torch.Tensor | List[torch.Tensor]") -> None:
        self._inner = inner
        self._tensor = tensor

    def poll(self) -> bool:
        return self._inner.done()

    def wait(self) -> Any:
        self._inner.wait()  # raises the op's error (every time it is asked, as before)
        return self._tensor


class _TensorAllreduce(HandleBase, AllreduceOp):
    """An in-place all-reduce of one contiguous CPU tensor: the runtime's op and the binding's
    handle in one object (one per gradient of every step). ``wait()`` returns the tensor."""

    __slots__ = ("_tensor",)

    poll = AllreduceOp.done

    def wait(self) -> Any:
        # ``Handle.wait`` inline (one frame less per gradient), returning the tensor.
        if self._remaining and self._error is None:
            self._block()
        if self._error is not None:
            raise self._error  # the op's error (every time it is asked)
        return self._tensor


class _ViewCache:
    """NumPy views of small CPU tensors, kept from one step to the next under a key (a
    parameter, or an op's name): a training step that all-reduces the same tensors again
    converts none of them. An entry is used only for the very tensor it was made from, with
    the same memory and shape, so one that was resized or given new storage
    (``tensor.data = ...``, ``set_``) is converted afresh.

    Only small tensors: an entry keeps its tensor's memory alive until it is replaced, and
    for a large tensor the conversion is noise next to its reduction anyway."""

    MAX_BYTES = 16 << 10
    MAX_ENTRIES = 4096

    def __init__(self) -> None:
        self._entries: "dict[Any, tuple[torch.Tensor, int, Any, np.ndarray]]" = {}

    def keep(self, key: Any, tensor: torch.Tensor) -> np.ndarray:
        """``_numpy_view(tensor)`` of a checked, contiguous CPU tensor, kept under ``key`` for
        ``submit`` (called once ``submit`` found no view of it there)."""
        array = _numpy_view(tensor)
        if array.nbytes <= self.MAX_BYTES:
            if len(self._entries) >= self.MAX_ENTRIES:
                self._entries.clear()
            # [tensor, its data_ptr, its shape, the view, the last submit's arguments (see submit)]
            self._entries[key] = [tensor, tensor.data_ptr(), tensor.shape, array, None]
        else:
            self._entries.pop(key, None)
        return array

    def submit(self, key: Any, tensor: Any, op: Any, name: Optional[str], prescale_factor: float,
               postscale_factor: float, process_set: ProcessSet) -> "_TensorAllreduce | None":
        """The in-place all-reduce of ``tensor`` from its view kept under ``key``, or None (and
        nothing submitted) if there is none. The per-gradient path of a training step: with the
        same arguments as last time, the runtime's checked op, factors and signature are reused."""
        entry = self._entries.get(key)
        # Only checked tensors (CPU, dense, contiguous) are kept, so the very tensor with the
        # same memory and shape needs no further check but contiguity (``as_strided_`` may
        # change strides in place, keeping memory and shape).
        if entry is None or not (entry[0] is tensor and entry[1] == tensor.data_ptr()
                                 and entry[2] == tensor.shape and tensor.is_contiguous()):
            return None
        last = entry[4]
        if last is not None and last[0] is op and last[1] == prescale_factor and last[2] == postscale_factor:
            handle = submit_allreduce(entry[3], last[3], name, last[4], last[5], True, process_set,
                                           _TensorAllreduce, last[6])
        else:
            handle = submit_allreduce(entry[3], op, name, prescale_factor, postscale_factor, True,
                                           process_set, _TensorAllreduce)
            entry[4] = (op, prescale_factor, postscale_factor, handle.op, handle.prescale, handle.postscale,
                        handle.signature)
        handle._tensor = tensor  # only this thread reads it, after the submit
        return handle

    def clear(self) -> None:
        self._entries.clear()


_named_views = _ViewCache()  # for ops the caller names: names recur every step


def _allreduce_in_place(tensor: torch.Tensor, name: Optional[str], op: Any, prescale_factor: float,
                        postscale_factor: float, process_set: ProcessSet,
                        views: "_ViewCache | None" = None, key: Any = None) -> Handle:
    """Start an in-place all-reduce of a checked tensor whose view is not kept (yet): a tensor's
    first step. ``views`` and ``key``: where its NumPy view is kept for ``_ViewCache.submit``
    to take the next steps."""
    if tensor.is_cpu and tensor.is_contiguous():
        if key is not None:
            array = views.keep(key, tensor)  # type: ignore[union-attr]
        elif name is not None:
            array = _named_views.keep(name, tensor)
        else:
            array = _numpy_view(tensor)
        # The runtime's allreduce_async_ for one array, called directly.
        handle = submit_allreduce(array, op, name, prescale_factor, postscale_factor, True, process_set,
                                       _TensorAllreduce)
        handle._tensor = tensor  # only this thread reads it, after the submit
        return handle
    buffer, land = _inplace_buffer(tensor)
    inner = rr.allreduce_async_(buffer, op, name, prescale_factor, postscale_factor, process_set=process_set)
    return Handle(inner, land)


def _inplace_buffer(tensor: torch.Tensor) -> Tuple[np.ndarray, Any]:
    """A NumPy buffer the runtime may write, and how to land it back into ``tensor``."""
    if tensor.is_contiguous():
        return _numpy_view(tensor), lambda _: _after_device_work(tensor)
    temp = tensor.detach().contiguous()

    def copy_back(_: Any) -> torch.Tensor:
        _after_device_work(temp)
        with torch.no_grad():
            tensor.copy_(temp)
        return tensor
    return _numpy_view(temp), copy_back


# -- all-reduce --------------------------------------------------------------

def allreduce_async(tensor: torch.Tensor, average: Optional[bool] = None, name: Optional[str] = None,
                    op: Any = None, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
        process_set: ProcessSet = global_process_set) -> Handle:
    """Start an all-reduce of ``tensor`` into a new tensor; ``synchronize`` returns it."""
    array = _numpy_view(_check_tensor(tensor))
    inner = rr.allreduce_async(array, resolve_op(average, op), name, prescale_factor, postscale_factor,
                               process_set=process_set)
    return Handle(inner, lambda result: _from_numpy(result).reshape(tensor.shape))


def allreduce_async_(tensor: torch.Tensor, average: Optional[bool] = None, name: Optional[str] = None,
                     op: Any = None, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
        process_set: ProcessSet = global_process_set) -> Handle:
    """Start an in-place all-reduce of ``tensor``; ``synchronize`` returns ``tensor``."""
    op = Average if op is None and average is None else resolve_op(average, op)
    if name is not None:
        # The per-gradient path of a training loop: a tensor all-reduced under this name
        # before, its view kept (and so checked) then.
        handle = _named_views.submit(name, tensor, op, name, prescale_factor, postscale_factor, process_set)
        if handle is not None:
            return handle
    return _allreduce_in_place(_check_tensor(tensor), name, op, prescale_factor, postscale_factor, process_set)


def allreduce(tensor: torch.Tensor, average: Optional[bool] = None, name: Optional[str] = None,
              compression: type = Compression.none, op: Any = None,
              prescale_factor: float = 1.0, postscale_factor: float = 1.0,
        process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """A new tensor: ``tensor`` reduced over all ranks (default Average). Differentiable."""
    op = resolve_op(average, op)
    compressed, ctx = compression.compress(_check_tensor(tensor))
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
        process_set: ProcessSet = global_process_set) -> Handle:
    """Start all-reduces of several tensors as one unit; ``synchronize`` returns new tensors."""
    arrays = [_numpy_view(t) for t in _check_tensors(tensors)]
    inner = rr.grouped_allreduce_async(arrays, resolve_op(average, op), name, prescale_factor, postscale_factor,
                                       process_set=process_set)
    return Handle(inner, lambda results: [_from_numpy(r).reshape(t.shape) for r, t in zip(results, tensors)])


def grouped_allreduce_async_(tensors: Sequence[torch.Tensor], average: Optional[bool] = None,
                             name: Optional[str] = None, op: Any = None, prescale_factor: float = 1.0,
                             postscale_factor: float = 1.0,
        process_set: ProcessSet = global_process_set) -> Handle:
    """In-place grouped all-reduce; ``synchronize`` returns the same tensors."""
    tensors = _check_tensors(tensors)
    if all(t.is_cpu and t.is_contiguous() for t in tensors):  # written in place: nothing to land
        inner = rr.grouped_allreduce_async_([_numpy_view(t) for t in tensors], resolve_op(average, op), name,
                                            prescale_factor, postscale_factor, process_set=process_set)
        return _InPlaceHandle(inner, tensors)
    pairs = [_inplace_buffer(t) for t in tensors]
    inner = rr.grouped_allreduce_async_([b for b, _ in pairs], resolve_op(average, op), name,
                                        prescale_factor, postscale_factor, process_set=process_set)
    return Handle(inner, lambda results: [land(r) for (_, land), r in zip(pairs, results)])


def grouped_allreduce(tensors: Sequence[torch.Tensor], average: Optional[bool] = None,
                      name: Optional[str] = None, compression: type = Compression.none, op: Any = None,
                      prescale_factor: float = 1.0, postscale_factor: float = 1.0,
        process_set: ProcessSet = global_process_set) -> List[torch.Tensor]:
    """New tensors: each of ``tensors`` reduced over all ranks, as one fused unit."""
    compressed = [compression.compress(_check_tensor(t, f"tensors[{i}]")) for i, t in enumerate(tensors)]
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
# Each public op runs an autograd Function only when its input needs a gradient; a
# tensor without requires_grad takes the plain path (no per-op autograd work).

def _wants_grad(tensors: Sequence[torch.Tensor]) -> bool:
    return torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad for t in tensors)


def allgather_async(tensor: torch.Tensor, name: Optional[str] = None,
        process_set: ProcessSet = global_process_set) -> Handle:
    return Handle(rr.allgather_async(_numpy_view(_check_tensor(tensor)), name, process_set=process_set), _from_numpy)


def allgather(tensor: torch.Tensor, name: Optional[str] = None,
        process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """Every rank's tensor concatenated along dimension 0 (first dimensions may differ). Differentiable."""
    if getattr(tensor, "requires_grad", False) and torch.is_grad_enabled():
        return _AllgatherFunction.apply(_check_tensor(tensor), name, process_set)
    return synchronize(allgather_async(tensor, name, process_set))


def grouped_allgather_async(tensors: Sequence[torch.Tensor], name: Optional[str] = None,
        process_set: ProcessSet = global_process_set) -> Handle:
    """Start all-gathers of several tensors as one unit; ``synchronize`` returns a list."""
    arrays = [_numpy_view(_check_tensor(t, f"tensors[{i}]")) for i, t in enumerate(tensors)]
    return Handle(rr.grouped_allgather_async(arrays, name, process_set=process_set), lambda results: [_from_numpy(r) for r in results])


def grouped_allgather(tensors: Sequence[torch.Tensor], name: Optional[str] = None,
        process_set: ProcessSet = global_process_set) -> List[torch.Tensor]:
    """``allgather`` of each tensor, as one unit. Differentiable."""
    tensors = list(tensors)
    if _wants_grad(tensors):
        return list(_GroupedAllgatherFunction.apply(name, process_set, *tensors))
    return synchronize(grouped_allgather_async(tensors, name, process_set))


def _slice_of_summed_gradient(grad: torch.Tensor, rows: int, shape: torch.Size,
                              process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """Backward of an all-gather: this rank's rows of the gradient summed over ranks (as Horovod)."""
    return _gathered_slices([grad], [rows], [shape], process_set)[0]


def _gathered_slices(grads: Sequence[torch.Tensor], rows: Sequence[int],
                     shapes: Sequence[torch.Size], process_set: ProcessSet = global_process_set) -> List[torch.Tensor]:
    summed = synchronize(grouped_allreduce_async([g.contiguous() for g in grads], op=Sum, process_set=process_set))
    every_rows = synchronize(allgather_async(torch.tensor([list(rows)], dtype=torch.int64),
                                             process_set=process_set))  # set size x k
    offsets = every_rows[:process_set.rank()].sum(dim=0).tolist()
    return [s.narrow(0, int(o), r).reshape(shape) for s, o, r, shape in zip(summed, offsets, rows, shapes)]


class _AllgatherFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, name, process_set):  # type: ignore[override]
        ctx.rows, ctx.shape = (tensor.shape[0] if tensor.dim() else 1), tensor.shape
        ctx.process_set = process_set
        return synchronize(allgather_async(tensor, name, process_set))

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        return _slice_of_summed_gradient(grad, ctx.rows, ctx.shape, ctx.process_set), None, None


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
        process_set: ProcessSet = global_process_set) -> Handle:
    return Handle(rr.broadcast_async(_numpy_view(_check_tensor(tensor)), root_rank, name, process_set=process_set),
                  lambda result: _from_numpy(result).reshape(tensor.shape))


def broadcast_async_(tensor: torch.Tensor, root_rank: int, name: Optional[str] = None,
        process_set: ProcessSet = global_process_set) -> Handle:
    buffer, land = _inplace_buffer(_check_tensor(tensor))
    return Handle(rr.broadcast_async_(buffer, root_rank, name, process_set=process_set), land)


def broadcast(tensor: torch.Tensor, root_rank: int, name: Optional[str] = None,
        process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """A new tensor holding ``root_rank``'s values. Differentiable."""
    if getattr(tensor, "requires_grad", False) and torch.is_grad_enabled():
        return _BroadcastFunction.apply(_check_tensor(tensor), root_rank, name, process_set)
    return synchronize(broadcast_async(tensor, root_rank, name, process_set))


class _BroadcastFunction(torch.autograd.Function):
    """Backward as Horovod: the gradient summed over ranks lands on the root; other ranks get zeros."""

    @staticmethod
    def forward(ctx, tensor, root_rank, name, process_set):  # type: ignore[override]
        ctx.root_rank, ctx.process_set = root_rank, process_set
        return synchronize(broadcast_async(tensor, root_rank, name, process_set))

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        summed = synchronize(allreduce_async(grad.contiguous(), op=Sum, process_set=ctx.process_set))
        if rank() != ctx.root_rank:
            summed = torch.zeros_like(summed)
        return summed, None, None, None


def broadcast_(tensor: torch.Tensor, root_rank: int, name: Optional[str] = None,
        process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """In place: ``tensor`` takes ``root_rank``'s values and is returned."""
    return synchronize(broadcast_async_(tensor, root_rank, name, process_set))


def reducescatter_async(tensor: torch.Tensor, name: Optional[str] = None, op: Any = Average,
                        prescale_factor: float = 1.0, postscale_factor: float = 1.0,
        process_set: ProcessSet = global_process_set) -> Handle:
    array = _numpy_view(_check_tensor(tensor))
    return Handle(rr.reducescatter_async(array, op, name, prescale_factor, postscale_factor,
                                                   process_set=process_set), _from_numpy)


def reducescatter(tensor: torch.Tensor, name: Optional[str] = None, compression: type = Compression.none,
                  op: Any = Average, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
        process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """Reduce over ranks, keep this rank's rows (the first ``rows % size`` ranks get one extra).
    Differentiable."""
    compressed, ctx = compression.compress(_check_tensor(tensor))
    if tensor.requires_grad and torch.is_grad_enabled():
        reduced = _ReducescatterFunction.apply(compressed, name, op, prescale_factor, postscale_factor, process_set)
    else:
        reduced = synchronize(reducescatter_async(compressed, name, op, prescale_factor, postscale_factor,
                                                   process_set))
    return compression.decompress(reduced, ctx)


def grouped_reducescatter_async(tensors: Sequence[torch.Tensor], name: Optional[str] = None, op: Any = Average,
                                prescale_factor: float = 1.0, postscale_factor: float = 1.0,
        process_set: ProcessSet = global_process_set) -> Handle:
    """Start reduce-scatters of several tensors as one unit; ``synchronize`` returns a list."""
    arrays = [_numpy_view(_check_tensor(t, f"tensors[{i}]")) for i, t in enumerate(tensors)]
    inner = rr.grouped_reducescatter_async(arrays, op, name, prescale_factor, postscale_factor,
                                             process_set=process_set)
    return Handle(inner, lambda results: [_from_numpy(r) for r in results])


def grouped_reducescatter(tensors: Sequence[torch.Tensor], name: Optional[str] = None,
                          compression: type = Compression.none, op: Any = Average,
                          prescale_factor: float = 1.0, postscale_factor: float = 1.0,
        process_set: ProcessSet = global_process_set) -> List[torch.Tensor]:
    """``reducescatter`` of each tensor, as one unit. Differentiable."""
    compressed = [compression.compress(_check_tensor(t, f"tensors[{i}]")) for i, t in enumerate(tensors)]
    inputs = [t for t, _ in compressed]
    if _wants_grad(inputs):
        reduced = list(_GroupedReducescatterFunction.apply(name, op, prescale_factor, postscale_factor, process_set,
                                                           *inputs))
    else:
        reduced = synchronize(grouped_reducescatter_async(inputs, name, op, prescale_factor, postscale_factor,
                                                           process_set))
    return [compression.decompress(r, ctx) for r, (_, ctx) in zip(reduced, compressed)]


def _reducescatter_backward(grads: Sequence[torch.Tensor], op: Any, pre: float, post: float,
                            process_set: ProcessSet = global_process_set) -> List[torch.Tensor]:
    """All-gather of the gradients (as Horovod), divided by size for Average, times the scaling."""
    gathered = synchronize(grouped_allgather_async([g.contiguous() for g in grads], process_set=process_set))
    factor = pre * post / (process_set.size() if op == Average else 1)
    return [g * factor if factor != 1.0 else g for g in gathered]


class _ReducescatterFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, name, op, prescale_factor, postscale_factor, process_set):  # type: ignore[override]
        ctx.args = (op, prescale_factor, postscale_factor, process_set)
        return synchronize(reducescatter_async(tensor, name, op, prescale_factor, postscale_factor, process_set))

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        return _reducescatter_backward([grad], *ctx.args)[0], None, None, None, None, None


class _GroupedReducescatterFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, name, op, prescale_factor, postscale_factor, process_set, *tensors):  # type: ignore[override]
        ctx.args = (op, prescale_factor, postscale_factor, process_set)
        return tuple(synchronize(grouped_reducescatter_async(tensors, name, op, prescale_factor,
                                                             postscale_factor, process_set)))

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
        process_set: ProcessSet = global_process_set) -> Handle:
    splits = _check_splits_dtype(splits)
    tensor = _check_tensor(tensor)
    device = tensor.device if tensor.is_cuda else None
    if device is not None:  # the runtime's all-to-all moves host memory only: stage through it
        tensor = tensor.detach().cpu()

    def finish(result: Any) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        array, received = result
        out = _from_numpy(array)
        return (out if device is None else out.to(device)), \
            torch.as_tensor(np.asarray(received), dtype=torch.int32)
    return Handle(rr.alltoall_async(_numpy_view(tensor), splits, name, process_set=process_set), finish)


def alltoall(tensor: torch.Tensor, splits: Any = None, name: Optional[str] = None,
        process_set: ProcessSet = global_process_set) -> Any:
    """Send ``splits[r]`` rows to rank r (equal shares if None). Returns the received tensor,
    plus the received splits when ``splits`` is given (as Horovod). Differentiable."""
    if getattr(tensor, "requires_grad", False) and torch.is_grad_enabled():
        received, received_splits = _AlltoallFunction.apply(_check_tensor(tensor), splits, name, process_set)
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
        raise ValueError(f"sparse all-reduce supports op=Average or op=Sum, got {op!r}")
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


# -- model and optimizer state -----------------------------------------------

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
        tensors.append(_check_tensor(value, "optimizer state"))
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
    """
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"expected a torch.optim.Optimizer, got {type(optimizer).__name__}")
    state = optimizer.state_dict()
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


# -- DistributedOptimizer ------------------------------------------------------

class _DistributedOptimizer:
    """Mixed in before the wrapped optimizer's own class (see ``DistributedOptimizer``)."""

    def _mtrain_setup(self, named_parameters: Any, compression: type, backward_passes_per_step: int,
                      op: Any, gradient_predivide_factor: float, sparse_as_dense: bool = False,
                      process_set: ProcessSet = global_process_set) -> None:
        self.process_set = process_set
        self._compression = compression
        self.backward_passes_per_step = backward_passes_per_step
        self.op = op
        self.gradient_predivide_factor = gradient_predivide_factor
        self.sparse_as_dense = bool(sparse_as_dense)
        params = [p for group in self.param_groups for p in group["params"]]
        self._parameter_names = _parameter_names(named_parameters, params)
        # Formatted once here, not once per gradient per step.
        self._gradient_names = {p: f"DistributedOptimizer.{name}" for p, name in self._parameter_names.items()}
        self._gradient_views = _ViewCache()  # each parameter's gradient as NumPy, while it stays the same
        self._requires_update = [p for p in dict.fromkeys(params) if p.requires_grad]
        self._allreduce_delay = {p: backward_passes_per_step for p in self._requires_update}
        self._handles: Dict[torch.Tensor, Any] = {}
        self._synchronized = False
        self._should_synchronize = True
        self._hook_handles = []
        for p in self._requires_update:
            self._hook_handles.append(p.register_hook(self._make_check_hook(p)))
            self._hook_handles.append(p.register_post_accumulate_grad_hook(self._make_hook(p)))

    def _make_check_hook(self, p: torch.Tensor) -> Any:
        # Runs before the gradient is accumulated: an all-reduce may be writing p.grad.
        def check(grad: torch.Tensor) -> None:
            if self._allreduce_delay[p] <= 0:
                raise RuntimeError(
                    f"gradient of {self._parameter_names[p]!r} computed more than backward_passes_per_step="
                    f"{self.backward_passes_per_step} times before optimizer.step(); call step() (or "
                    "synchronize()) after each group of backward passes, or raise backward_passes_per_step")
        return check

    def _make_hook(self, p: torch.Tensor) -> Any:
        def hook(_: torch.Tensor) -> None:
            self._synchronized = False
            self._allreduce_delay[p] -= 1
            if self._allreduce_delay[p] == 0:
                self._handles[p] = self._allreduce_grad_async(p)
            else:
                self._handles.setdefault(p, None)
        return hook

    def _allreduce_grad_async(self, p: torch.Tensor) -> Tuple[Handle, Any]:
        grad = p.grad
        if grad is None:  # no gradient on this rank this step: take part with zeros
            grad = p.grad = torch.zeros_like(p)
        name = self._gradient_names[p]
        if grad.is_sparse:  # e.g. nn.Embedding(sparse=True)
            if not self.sparse_as_dense:  # as Horovod: gather indices and values, no compression
                return sparse_allreduce_async(grad, name=name, op=self.op, process_set=self.process_set), None
            grad = p.grad = grad.to_dense()
        compressed, ctx = self._compression.compress(grad)
        pre, post = 1.0, 1.0
        if self.op == Average:  # the runtime divides by size after the postscale
            pre, post = 1.0 / self.gradient_predivide_factor, self.gradient_predivide_factor
        handle = self._gradient_views.submit(p, compressed, self.op, name, pre, post, self.process_set)
        if handle is not None:  # this gradient's view from the last step
            return handle, ctx
        handle = _allreduce_in_place(_check_tensor(compressed), name, self.op, pre, post, self.process_set,
                                     self._gradient_views, p)
        return handle, ctx

    def synchronize(self) -> None:
        """Finish every gradient's all-reduce now (starting those not yet started)."""
        try:
            for p in self._requires_update:
                if self._handles.get(p) is None:
                    self._handles[p] = self._allreduce_grad_async(p)
            for p, (handle, ctx) in self._handles.items():
                reduced = self._compression.decompress(handle.wait(), ctx)
                if reduced.is_sparse:
                    p.grad = reduced
                elif reduced is not p.grad:
                    with torch.no_grad():
                        p.grad.copy_(reduced)
        finally:
            self._handles.clear()
            for p in self._allreduce_delay:
                self._allreduce_delay[p] = self.backward_passes_per_step
        self._synchronized = True

    @contextlib.contextmanager
    def skip_synchronize(self) -> Any:
        """Within this context ``step()`` does not synchronize (call ``synchronize()`` yourself)."""
        self._should_synchronize = False
        try:
            yield
        finally:
            self._should_synchronize = True

    def step(self, closure: Any = None) -> Any:
        loss = None
        if closure is not None:  # backward inside the closure must finish before we average
            with torch.enable_grad():
                loss = closure()
        # After an explicit synchronize() the gradients are already averaged: no second round
        # (Horovod would reduce them again); warn as Horovod does, with the remedy.
        if self._should_synchronize:
            if self._synchronized:
                warnings.warn("optimizer.step() was called after optimizer.synchronize() outside an "
                              "optimizer.skip_synchronize() context; this can slow training down. When you "
                              "call optimizer.synchronize() yourself, call step() inside "
                              "`with optimizer.skip_synchronize():`", UserWarning, stacklevel=2)
            else:
                self.synchronize()
        self._synchronized = False
        super().step()  # type: ignore[misc]
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        if self._handles:
            raise RuntimeError("optimizer.zero_grad() was called after loss.backward() but before "
                               "optimizer.step() or optimizer.synchronize(): the gradients are still "
                               "being averaged; call step() (or synchronize()) first")
        super().zero_grad(set_to_none)  # type: ignore[misc]
        if set_to_none:  # the gradients are gone: so are their views (which would keep them alive)
            self._gradient_views.clear()

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        self._handles.clear()
        self._synchronized = False
        for p in self._allreduce_delay:
            self._allreduce_delay[p] = self.backward_passes_per_step
        super().load_state_dict(state_dict)  # type: ignore[misc]

    def set_backward_passes_per_step(self, passes: int) -> None:
        self.backward_passes_per_step = _check_passes(passes)
        for p in self._allreduce_delay:
            self._allreduce_delay[p] = passes


def _check_passes(passes: Any) -> int:
    if not isinstance(passes, int) or isinstance(passes, bool) or passes < 1:
        raise ValueError(f"backward_passes_per_step must be a positive integer, got {passes!r}")
    return passes


def _parameter_names(named_parameters: Any, params: List[torch.Tensor]) -> Dict[torch.Tensor, str]:
    """Each optimized parameter's name; errors name duplicates and unnamed parameters."""
    if named_parameters is None:
        return {p: f"noname.{i}" for i, p in enumerate(params)}
    named = list(named_parameters)
    if any(not (isinstance(item, tuple) and len(item) == 2) for item in named):
        raise ValueError("named_parameters should be a sequence of (name, parameter) tuples, "
                         "usually model.named_parameters()")
    seen, duplicates = set(), []
    for name, _ in named:
        if name in seen and name not in duplicates:
            duplicates.append(name)
        seen.add(name)
    if duplicates:
        raise ValueError(f"parameter names in named_parameters must be unique; duplicates: "
                         f"{', '.join(map(str, duplicates))}")
    names = {p: name for name, p in named}
    unnamed = [i for i, p in enumerate(params) if p not in names]
    if unnamed:
        shapes = ", ".join(f"#{i} {tuple(params[i].shape)}" for i in unnamed)
        raise ValueError(f"named_parameters misses {len(unnamed)} of the optimizer's parameters "
                         f"(index in param_groups and shape: {shapes}); pass the named_parameters() "
                         "of the model the optimizer was built from")
    return names


_CLASSES: Dict[type, type] = {}


def DistributedOptimizer(optimizer: torch.optim.Optimizer, named_parameters: Any = None,
                         compression: type = Compression.none, backward_passes_per_step: int = 1,
                         op: Any = Average, gradient_predivide_factor: float = 1.0,
                         num_groups: int = 0, groups: Any = None,
                         sparse_as_dense: bool = False,
                         process_set: ProcessSet = global_process_set) -> torch.optim.Optimizer:
    """Wrap ``optimizer`` so that ``step()`` applies gradients averaged over all ranks.

    Each gradient's all-reduce starts as soon as backward has produced it.
    The result is an instance of the optimizer's own class (``isinstance`` holds)
    sharing its hyperparameters and state. ``num_groups``/``groups`` are
    accepted for Horovod compatibility; the runtime fuses small gradients itself.
    Sparse gradients (``nn.Embedding(sparse=True)``) are reduced as Horovod does:
    by ``sparse_allreduce_async`` (all-gather of indices and values), or densified
    first and all-reduced when ``sparse_as_dense=True``.
    """
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"DistributedOptimizer wraps a torch.optim.Optimizer, got {type(optimizer).__name__}")
    if isinstance(optimizer, _DistributedOptimizer):
        raise ValueError("this optimizer is already a DistributedOptimizer; wrap the plain optimizer once")
    op = check_gradient_op(op, gradient_predivide_factor)
    _check_passes(backward_passes_per_step)
    base = type(optimizer)
    cls = _CLASSES.get(base)
    if cls is None:
        cls = type(base.__name__, (_DistributedOptimizer, base), {"__module__": base.__module__})
        _CLASSES[base] = cls
    wrapped = cls.__new__(cls)
    wrapped.__dict__.update(optimizer.__dict__)
    # An LR scheduler built on the original patches an instance-level ``step`` that would
    # bypass the averaging; schedulers must be built on the wrapped optimizer (as with Horovod).
    wrapped.__dict__.pop("step", None)
    if not isinstance(process_set, ProcessSet):
        raise TypeError(f"process_set must be an mtrain ProcessSet, got {type(process_set).__name__}")
    wrapped._mtrain_setup(named_parameters, compression, backward_passes_per_step, op,
                          gradient_predivide_factor, sparse_as_dense, process_set)
    return wrapped


# -- SyncBatchNorm ---------------------------------------------------------------

class SyncBatchNorm(torch.nn.modules.batchnorm._BatchNorm):
    """Batch normalization over the batch of every rank together (drop-in for
    ``torch.nn.SyncBatchNorm`` / Horovod's ``hvd.SyncBatchNorm``).

    In training each rank's per-channel sum, sum of squares and count are summed
    over ranks by one all-reduce; the gradient flows back through that (differentiable)
    all-reduce, so every rank's input gradient is that of the whole batch. In eval
    mode (with running statistics) it is a plain local batch norm.
    """

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"expected at least 2D input (batch, channels, ...), got {input.dim()}D input")

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        self._check_input_dim(input)
        momentum = 0.0 if self.momentum is None else self.momentum
        if self.training and self.track_running_stats and self.num_batches_tracked is not None:
            self.num_batches_tracked.add_(1)
            momentum = 1.0 / float(self.num_batches_tracked) if self.momentum is None else self.momentum
        use_batch_stats = self.training or not self.track_running_stats
        if not use_batch_stats:
            return torch.nn.functional.batch_norm(input, self.running_mean, self.running_var, self.weight,
                                                  self.bias, False, 0.0, self.eps)
        channels = input.shape[1]
        work = input.float() if input.dtype in (torch.float16, torch.bfloat16) else input
        dims = [d for d in range(work.dim()) if d != 1]
        # The statistics in float64: E[x²] - E[x]² in float32 loses the variance of data whose
        # mean is large next to its spread (torch's own kernels use Welford's method instead).
        wide = work.double()
        local_count = torch.full((1,), work.numel() // channels, dtype=torch.float64, device=work.device)
        stats = torch.cat([wide.sum(dims), (wide * wide).sum(dims), local_count])
        total = allreduce(stats, op=Sum, name=None)
        count = total[-1]
        mean64 = total[:channels] / count
        var64 = (total[channels:2 * channels] / count - mean64 * mean64).clamp_min(0)  # rounding can go below 0
        mean, var = mean64.to(work.dtype), var64.to(work.dtype)
        if self.training and self.track_running_stats:
            with torch.no_grad():
                unbiased = var * (count / (count - 1)) if float(count) > 1 else var
                self.running_mean.mul_(1 - momentum).add_(mean.detach().to(self.running_mean.dtype) * momentum)
                self.running_var.mul_(1 - momentum).add_(unbiased.detach().to(self.running_var.dtype) * momentum)
        shape = [1, channels] + [1] * (work.dim() - 2)
        out = (work - mean.reshape(shape)) * torch.rsqrt(var.reshape(shape) + self.eps)
        if self.affine:
            out = out * self.weight.reshape(shape) + self.bias.reshape(shape)
        return out.to(input.dtype)


from mtrain.elastic import torch as elastic  # noqa: E402  (hvd.elastic)
