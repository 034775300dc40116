"""The per-tensor in-place all-reduce: the path every gradient of every step takes.

A contiguous CPU tensor is reduced through its NumPy view, and the runtime's op is also the
binding's handle (``TensorAllreduce``: one object per gradient). The view, and what the
runtime made of the op's arguments, are kept from one step to the next (``ViewCache``), so a
training step that all-reduces the same tensors again converts and checks none of them.
"""
from __future__ import annotations

from typing import Any, List, NamedTuple, Optional, Tuple

import numpy as np
import torch

import mtrain.ringreduce as rr
from mtrain.ringreduce import AllreduceOp, ProcessSet, ReduceOp, Signature, submit_allreduce

from ..handles import FrameworkHandle, FrameworkHandleBase
from .bridge import after_device_work, numpy_view

__all__ = ["InPlaceHandle", "TensorAllreduce", "ViewCache", "allreduce_in_place", "inplace_buffer",
           "named_views"]


class InPlaceHandle(FrameworkHandle):
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


class TensorAllreduce(FrameworkHandleBase, AllreduceOp):
    """An in-place all-reduce of one contiguous CPU tensor: the runtime's op and the binding's
    handle in one object (one per gradient of every step). ``wait()`` returns the tensor."""

    __slots__ = ("_tensor",)

    poll = AllreduceOp.done

    def wait(self) -> Any:
        AllreduceOp.wait(self)  # raises the op's error (every time it is asked)
        return self._tensor


class _Submitted(NamedTuple):
    """A view's last submit: the arguments as the caller passed them, and as the runtime
    checked them (reused, with the signature, while the caller's stay the same)."""

    op: Any
    prescale_factor: float
    postscale_factor: float
    checked_op: ReduceOp
    prescale: float
    postscale: float
    signature: Signature


class _View:
    """A kept view: the tensor, what identifies its memory (data pointer and shape), the NumPy
    view of it, and its last submit (None before the first)."""

    __slots__ = ("tensor", "data_ptr", "shape", "array", "last")

    def __init__(self, tensor: torch.Tensor, array: np.ndarray) -> None:
        self.tensor = tensor
        self.data_ptr = tensor.data_ptr()
        self.shape = tensor.shape
        self.array = array
        self.last: "_Submitted | None" = None


class ViewCache:
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
        self._entries: "dict[Any, _View]" = {}

    def keep(self, key: Any, tensor: torch.Tensor) -> np.ndarray:
        """``numpy_view(tensor)`` of a checked, contiguous CPU tensor, kept under ``key`` for
        ``submit`` (called once ``submit`` found no view of it there)."""
        array = numpy_view(tensor)
        if array.nbytes <= self.MAX_BYTES:
            if len(self._entries) >= self.MAX_ENTRIES:
                self._entries.clear()
            self._entries[key] = _View(tensor, array)
        else:
            self._entries.pop(key, None)
        return array

    def submit(self, key: Any, tensor: Any, op: Any, name: Optional[str], prescale_factor: float,
               postscale_factor: float, process_set: ProcessSet) -> "TensorAllreduce | None":
        """The in-place all-reduce of ``tensor`` from its view kept under ``key``, or None (and
        nothing submitted) if there is none. The per-gradient path of a training step: with the
        same arguments as last time, the runtime's checked op, factors and signature are reused."""
        view = self._entries.get(key)
        # Only checked tensors (CPU, dense, contiguous) are kept, so the very tensor with the
        # same memory and shape needs no further check but contiguity (``as_strided_`` may
        # change strides in place, keeping memory and shape).
        if view is None or not (view.tensor is tensor and view.data_ptr == tensor.data_ptr()
                                and view.shape == tensor.shape and tensor.is_contiguous()):
            return None
        last = view.last
        if (last is not None and last.op is op and last.prescale_factor == prescale_factor
                and last.postscale_factor == postscale_factor):
            handle = submit_allreduce(view.array, last.checked_op, name, last.prescale, last.postscale, True,
                                      process_set, TensorAllreduce, last.signature)
        else:
            handle = submit_allreduce(view.array, op, name, prescale_factor, postscale_factor, True,
                                      process_set, TensorAllreduce)
            view.last = _Submitted(op, prescale_factor, postscale_factor, handle.op, handle.prescale,
                                   handle.postscale, handle.signature)
        handle._tensor = tensor  # only this thread reads it, after the submit
        return handle

    def clear(self) -> None:
        self._entries.clear()


named_views = ViewCache()  # for ops the caller names: names recur every step


def allreduce_in_place(tensor: torch.Tensor, name: Optional[str], op: Any, prescale_factor: float,
                       postscale_factor: float, process_set: ProcessSet,
                       views: "ViewCache | None" = None, key: Any = None) -> FrameworkHandle:
    """Start an in-place all-reduce of a checked tensor whose view is not kept (yet): a tensor's
    first step. ``views`` and ``key``: where its NumPy view is kept for ``ViewCache.submit``
    to take the next steps."""
    if tensor.is_cpu and tensor.is_contiguous():
        if key is not None:
            array = views.keep(key, tensor)  # type: ignore[union-attr]
        elif name is not None:
            array = named_views.keep(name, tensor)
        else:
            array = numpy_view(tensor)
        handle = submit_allreduce(array, op, name, prescale_factor, postscale_factor, True, process_set,
                                  TensorAllreduce)
        handle._tensor = tensor  # only this thread reads it, after the submit
        return handle
    buffer, land = inplace_buffer(tensor)
    inner = rr.allreduce_async_(buffer, op, name, prescale_factor, postscale_factor, process_set=process_set)
    return FrameworkHandle(inner, land)


def inplace_buffer(tensor: torch.Tensor) -> Tuple[Any, Any]:
    """A buffer the runtime may write (NumPy, or CuPy for a CUDA tensor), and how to land it
    back into ``tensor``."""
    if tensor.is_contiguous():
        return numpy_view(tensor), lambda _: after_device_work(tensor)
    temp = tensor.detach().contiguous()

    def copy_back(_: Any) -> torch.Tensor:
        after_device_work(temp)
        with torch.no_grad():
            tensor.copy_(temp)
        return tensor
    return numpy_view(temp), copy_back
