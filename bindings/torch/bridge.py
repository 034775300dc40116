"""The one torch ⇄ NumPy bridge: how a tensor's memory is handed to the runtime and a result
handed back. ``mtrain.torch`` (the Horovod API) and ``mtrain.distributed`` (the DDP backend)
both cross through here.

CPU tensors cross as NumPy views of their own memory (no copy), so an in-place op writes
the result straight back into the tensor. bfloat16 crosses as ``ml_dtypes.bfloat16`` on the
same bytes. CUDA tensors cross as CuPy views through DLPack (no copy). The runtime queues
its device work on the legacy default stream (``mtrain.ringreduce.transport.cuda``): a CUDA tensor is
handed over after the legacy stream has been made to wait for torch's current stream, and a
result is handed back after torch's current stream has been made to wait for the legacy
stream, so torch side streams are ordered too.

What each side takes is checked here too: ``check_tensor`` (dense CPU or CUDA tensors, the
Horovod API) and ``check_host_tensor`` (dense CPU tensors, the DDP backend, with the
remedies a torch.distributed user needs).
"""
from __future__ import annotations

from typing import Any, Callable, List, Optional, Sequence, Tuple

import numpy as np
import torch

from ..build_info import cuda_built

__all__ = ["after_device_work", "bfloat16", "check_host_tensor", "check_tensor", "check_tensors", "flat_host_array",
           "from_numpy", "host_array", "inplace_host_array", "numpy_view", "real_view", "to_tensor"]


# -- what the runtime takes ------------------------------------------------------

def check_tensor(tensor: Any, what: str = "tensor") -> torch.Tensor:
    """``tensor`` if the Horovod API's collectives take it (a dense CPU or CUDA torch.Tensor); an
    error naming ``what`` and the remedy otherwise."""
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


def check_tensors(tensors: Sequence[Any]) -> List[torch.Tensor]:
    """``check_tensor`` on each of ``tensors`` (naming ``tensors[i]`` only when one fails)."""
    tensors = list(tensors)
    for i, tensor in enumerate(tensors):
        if not (isinstance(tensor, torch.Tensor) and tensor.is_cpu and not tensor.is_sparse):
            check_tensor(tensor, f"tensors[{i}]")
    return tensors


def check_host_tensor(tensor: Any, what: str) -> torch.Tensor:
    """``tensor`` if the DDP backend's collectives take it (a dense CPU torch.Tensor); an error
    naming ``what`` and the remedy otherwise (another device: another backend for the group)."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{what}: expected a torch.Tensor, got {type(tensor).__name__}")
    if tensor.device.type != "cpu":
        raise NotImplementedError(f"{what} is on {tensor.device}: the mtrain torch.distributed backend "
                                  "takes CPU tensors; move it with .cpu(), or use nccl/gloo for this group")
    if tensor.layout != torch.strided:
        raise NotImplementedError(f"{what} has layout {tensor.layout}: only dense tensors are supported; "
                                  "call .to_dense() first")
    return tensor


def inplace_host_array(tensor: torch.Tensor, what: str) -> Tuple[np.ndarray, Callable[[], None]]:
    """A checked CPU tensor as an array the runtime may write (``real_view``), and how to land it
    back in ``tensor`` afterwards (nothing to do for a contiguous tensor: the array is its memory)."""
    tensor = check_host_tensor(tensor, what).detach()
    if tensor.is_contiguous():
        return real_view(tensor), lambda: None
    temp = tensor.contiguous()

    def land() -> None:
        tensor.copy_(temp)
    return real_view(temp), land


def flat_host_array(tensor: torch.Tensor, what: str) -> np.ndarray:
    """A read-only use of a checked CPU tensor: its values as one flat array (``real_view``)."""
    return real_view(check_host_tensor(tensor, what).detach().contiguous()).reshape(-1)


# -- tensors <-> arrays --------------------------------------------------------------


def bfloat16() -> Any:
    """NumPy's bfloat16 dtype (from ``ml_dtypes``); a TypeError that says how to install it."""
    try:
        import ml_dtypes
    except ImportError:
        raise TypeError("bfloat16 tensors need the ml_dtypes package: pip install ml_dtypes") from None
    return ml_dtypes.bfloat16


def host_array(tensor: torch.Tensor) -> np.ndarray:
    """A CPU tensor's own memory as a NumPy array (bfloat16 as ``ml_dtypes.bfloat16``)."""
    if tensor.dtype is torch.bfloat16:
        return tensor.view(torch.int16).numpy().view(bfloat16())
    try:
        return tensor.numpy()
    except TypeError as error:  # a dtype NumPy has no twin for (e.g. the float8 types)
        raise TypeError(f"mtrain cannot reduce {tensor.dtype} tensors: {error}") from None


def real_view(tensor: torch.Tensor) -> np.ndarray:
    """``host_array``, with a complex tensor as trailing (real, imaginary) pairs: what a sum or
    an average of complex numbers is on the runtime's real dtypes."""
    if tensor.is_complex():
        return torch.view_as_real(tensor).numpy()
    return host_array(tensor)


def _wait_for(waiter: Any, producer: Any) -> None:
    """Later work on stream ``waiter`` runs after the work queued on ``producer`` so far."""
    if waiter != producer:
        waiter.wait_stream(producer)


def numpy_view(tensor: torch.Tensor) -> Any:
    """The tensor's own memory for the runtime: a NumPy array for a CPU tensor, a CuPy array for
    a CUDA one (the tensor must be contiguous for writes to land)."""
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
    return host_array(tensor)


def after_device_work(tensor: torch.Tensor) -> torch.Tensor:
    """Order torch's current stream after the runtime's device work (in-place results)."""
    if tensor.is_cuda:
        _wait_for(torch.cuda.current_stream(tensor.device), torch.cuda.default_stream(tensor.device))
    return tensor


def to_tensor(array: np.ndarray, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """A host result as a CPU tensor, on the array's memory where NumPy allows (a read-only
    array is copied). ``dtype``: the tensor's that went in, where ``real_view`` may have turned
    it into (real, imaginary) pairs."""
    if array.dtype.name == "bfloat16":
        return torch.from_numpy(np.ascontiguousarray(array).view(np.int16)).view(torch.bfloat16)
    if not array.flags.writeable:
        array = array.copy()
    if dtype is not None and dtype.is_complex:
        return torch.view_as_complex(torch.from_numpy(np.ascontiguousarray(array)).view(-1, 2))
    return torch.from_numpy(array)


def from_numpy(array: Any) -> torch.Tensor:
    """A runtime result as a tensor: a CUDA tensor for a CuPy array (no copy), else ``to_tensor``."""
    if type(array).__module__.startswith("cupy"):
        device = torch.device("cuda", array.device.id)
        _wait_for(torch.cuda.current_stream(device), torch.cuda.default_stream(device))
        return torch.from_dlpack(array.__dlpack__(stream=-1))  # stream=-1: ordered just above
    return to_tensor(array)
