"""``torch.distributed`` backend "mtrain": torch collectives and DDP on mtrain's engine and ring.

    import mtrain.distributed                      # registers the backend
    torch.distributed.init_process_group("mtrain")  # or mtrain.distributed.init_process_group()
    model = torch.nn.parallel.DistributedDataParallel(model)

Ranks are started by ``mpirun`` / ``mtrain run``; the group's rank and size
must be the runtime's (``rr.rank()``, ``rr.size()``). Collectives on CPU
tensors: allreduce (SUM, AVG, MIN, MAX, PRODUCT), allreduce_coalesced,
broadcast, allgather, all_gather_into_tensor, barrier; ``async_op=True``
returns a Work whose future DDP's comm hooks chain on.

How it is built (pure Python, no C++): torch lets a ``ProcessGroup`` subclass
be written in Python; its collectives are called with the tensors and an
options object and return a ``Work``. Each collective here hands NumPy views of
the tensors to the runtime's async API and returns a Work made from a
``torch.futures.Future``. The runtime's handles have no completion callback,
so one daemon thread per group (``_Completer``) waits on them in submission
order and completes the futures; DDP's chained callbacks (the division by world
size) then run on that thread. One thread per group, not per process: ranks
issue one group's ops in the same order, but not two groups' ops, and a Work of
one group must not wait behind an op of another that needs a later call of this
rank. A Work's ``wait()`` raises its collective's error. The group also registers
itself for the ``cpu`` device type: DDP's parameter check looks the backend
up by device and fails with "No backend type associated with device type
cpu" otherwise.

Names: the runtime matches ops across ranks by name and caches names it has
seen (the response cache, a fixed number of bits). torch issues a group's
collectives in the same order on every rank, so an op's name is built from its
signature (kind, dtype, shape, op, root) and how many ops of that signature the
group has issued, modulo ``_SLOTS``: identical on every rank, and repeating
from one training step to the next, so DDP's bucket all-reduces hit the cache.
Before a name is reused, its previous op is waited for (it was issued by every
rank already, so the wait ends).
"""
from __future__ import annotations

import atexit
import os
import queue
import socket
import sys
import threading
from datetime import timedelta
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch
import torch.distributed as dist

import mtrain.ringreduce as rr

from .torch.bridge import real_view, to_tensor

__all__ = ["BACKEND", "ProcessGroupMtrain", "init_process_group", "register"]

BACKEND = "mtrain"

# Ops of one signature that may be in flight at once before a name is reused (see module docstring).
_SLOTS = 4

_REDUCE_OPS = {
    dist.ReduceOp.SUM: rr.Sum,
    dist.ReduceOp.AVG: rr.Average,
    dist.ReduceOp.MIN: rr.Min,
    dist.ReduceOp.MAX: rr.Max,
    dist.ReduceOp.PRODUCT: rr.Product,
}


def _reduce_op(torch_op: Any) -> rr.ReduceOp:
    for key, op in _REDUCE_OPS.items():
        if torch_op == key:
            return op
    supported = ", ".join(f"ReduceOp.{k.name}" for k in _REDUCE_OPS)
    raise ValueError(f"the mtrain backend does not support {torch_op!r}; use one of {supported} "
                     "(or a gloo process group for bitwise and pre-multiplied sums)")


# -- tensors <-> NumPy (through the bridge mtrain.torch crosses too) ----------------

def _check_tensor(tensor: Any, what: str) -> torch.Tensor:
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{what}: expected a torch.Tensor, got {type(tensor).__name__}")
    if tensor.device.type != "cpu":
        raise NotImplementedError(f"{what} is on {tensor.device}: the mtrain torch.distributed backend "
                                  "takes CPU tensors; move it with .cpu(), or use nccl/gloo for this group")
    if tensor.layout != torch.strided:
        raise NotImplementedError(f"{what} has layout {tensor.layout}: only dense tensors are supported; "
                                  "call .to_dense() first")
    return tensor


def _inplace_array(tensor: torch.Tensor, what: str) -> Tuple[np.ndarray, Callable[[], None]]:
    """An array the runtime may write, and how to land it back in ``tensor`` afterwards."""
    tensor = _check_tensor(tensor, what).detach()
    if tensor.is_contiguous():
        return real_view(tensor), lambda: None
    temp = tensor.contiguous()

    def land() -> None:
        tensor.copy_(temp)
    return real_view(temp), land


def _input_array(tensor: torch.Tensor, what: str) -> np.ndarray:
    """A read-only use of ``tensor``: its values as one flat array."""
    return real_view(_check_tensor(tensor, what).detach().contiguous()).reshape(-1)


def _rows(result: np.ndarray, count: int) -> List[np.ndarray]:
    """Split a gathered flat array into ``count`` equal parts (one per rank)."""
    return np.split(result.reshape(-1), count)


# -- completing torch futures ----------------------------------------------------

class _Completer:
    """A daemon thread that waits on one group's runtime handles and completes the torch futures."""

    def __init__(self) -> None:
        self._queue: "queue.SimpleQueue[Tuple[List[Any], Callable[[], Any], torch.futures.Future]]" = \
            queue.SimpleQueue()
        self._closing = False
        self._thread = threading.Thread(target=self._run, name="mtrain-distributed-completer", daemon=True)
        self._thread.start()
        # A daemon thread still inside torch (completing a future) when the interpreter
        # finalizes is unwound through C++ frames that cannot be unwound: std::terminate,
        # SIGABRT. At exit it stops touching torch, and finishes what it is doing first.
        atexit.register(self._close)

    def _close(self) -> None:
        self._closing = True
        self._queue.put(None)
        self._thread.join(timeout=2.0)

    def finish_and_stop(self) -> None:
        """End the thread once the ops queued so far are completed (their Works still complete)."""
        self._queue.put(None)

    def add(self, handles: List[Any], finish: Callable[[], Any], future: torch.futures.Future) -> None:
        self._queue.put((handles, finish, future))

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None or self._closing:
                return  # (a None after the last item: finish_and_stop)
            handles, finish, future = item
            try:
                for handle in handles:
                    rr.synchronize(handle)
                value = finish()
            except Exception as error:  # the op's own error goes to whoever waits on its Work
                if self._closing:
                    return
                future.set_exception(error)
            else:
                if self._closing:
                    return
                future.set_result(value)


class _Work(dist.Work):
    """A collective's Work: its future, which the group's completer completes. ``wait()`` raises the
    op's error. (torch's ``_create_work_from_future`` makes a Work whose ``wait()`` returns True on a
    failed future: the error would be lost.) torch's Python ProcessGroup trampoline forwards
    ``wait``/``get_future`` to these methods when C++ (DDP's reducer) holds the Work."""

    def __init__(self, future: torch.futures.Future) -> None:
        super().__init__()
        self._future = future

    def wait(self, timeout: Any = None) -> bool:
        self._future.wait()  # raises the op's error
        return True

    def get_future(self) -> torch.futures.Future:
        return self._future

    def is_completed(self) -> bool:
        return self._future.done()

    def result(self) -> Any:
        return self._future.wait()


def _finished_work(value: Any) -> Any:
    future = torch.futures.Future()
    future.set_result(value)
    return _Work(future)


# -- the process group -------------------------------------------------------------

class ProcessGroupMtrain(dist.ProcessGroup):
    """A torch ``ProcessGroup`` whose collectives run on mtrain's runtime (all ranks of the job)."""

    def __init__(self, rank: int, size: int, group_name: str = "") -> None:
        super().__init__(rank, size)
        self._prefix = f"torch.distributed[{group_name}]"
        self._issued: Dict[tuple, int] = {}
        self._last: Dict[str, List[Any]] = {}  # name -> handles of the op that last used it
        self._completer: Optional[_Completer] = None
        self._completer_lock = threading.Lock()
        # DDP (and other device-dispatched calls) look the backend up by device type.
        self._register_backend(torch.device("cpu"), dist.ProcessGroup.BackendType.CUSTOM, None)

    def getBackendName(self) -> str:  # noqa: N802  (torch's method name)
        return BACKEND

    def __repr__(self) -> str:
        return f"ProcessGroupMtrain(rank={self.rank()}, size={self.size()})"

    # -- issuing -------------------------------------------------------------
    def _name(self, *signature: Any) -> str:
        count = self._issued.get(signature, 0)
        self._issued[signature] = count + 1
        name = ".".join([self._prefix] + [str(part) for part in signature] + [str(count % _SLOTS)])
        for handle in self._last.pop(name, ()):  # its previous op must be out of the runtime
            if not rr.poll(handle):
                try:
                    rr.synchronize(handle)
                except Exception:  # noqa: BLE001  (reported through that op's own Work)
                    pass
        return name

    def shutdown(self) -> None:
        """Called by ``destroy_process_group``: the group's completer ends after the ops queued so far."""
        with self._completer_lock:
            if self._completer is not None:
                self._completer.finish_and_stop()
                self._completer = None

    def _issue(self, name: str, handles: List[Any], finish: Callable[[], Any]) -> Any:
        self._last[name] = handles
        with self._completer_lock:
            if self._completer is None:
                self._completer = _Completer()
        future = torch.futures.Future()
        self._completer.add(handles, finish, future)
        return _Work(future)

    # -- collectives -----------------------------------------------------------
    def allreduce(self, tensors: Sequence[torch.Tensor], opts: Any = None) -> Any:
        op = _reduce_op(dist.ReduceOp.SUM if opts is None else opts.reduceOp)
        return self._allreduce(list(tensors), op, "allreduce")

    def allreduce_coalesced(self, tensors: Sequence[torch.Tensor], opts: Any = None) -> Any:
        op = _reduce_op(dist.ReduceOp.SUM if opts is None else opts.reduceOp)
        return self._allreduce(list(tensors), op, "allreduce_coalesced")

    def _allreduce(self, tensors: List[torch.Tensor], op: rr.ReduceOp, kind: str) -> Any:
        if not tensors:
            return _finished_work([])
        pairs = [_inplace_array(t, f"{kind} tensors[{i}]") for i, t in enumerate(tensors)]
        for i, t in enumerate(tensors):
            if t.is_complex() and op not in (rr.Sum, rr.Average):
                raise ValueError(f"{kind} tensors[{i}] is complex: only ReduceOp.SUM and ReduceOp.AVG "
                                 "are defined for complex tensors")
        arrays = [array for array, _ in pairs]
        name = self._name(kind, op.name.lower(), *[f"{a.dtype}{list(a.shape)}" for a in arrays])
        if len(arrays) == 1:
            handle = rr.allreduce_async_(arrays[0], op=op, name=name)
        else:
            handle = rr.grouped_allreduce_async_(arrays, op=op, name=name)

        def finish() -> List[torch.Tensor]:
            for _, land in pairs:
                land()
            return tensors
        return self._issue(name, [handle], finish)

    def broadcast(self, tensors: Sequence[torch.Tensor], opts: Any = None) -> Any:
        tensors = list(tensors)
        root = 0 if opts is None else opts.rootRank
        if not 0 <= root < self.size():
            raise ValueError(f"broadcast root rank {root} is not a rank of this group (size {self.size()})")
        pairs = [_inplace_array(t, f"broadcast tensors[{i}]") for i, t in enumerate(tensors)]
        handles, names = [], []
        for array, _ in pairs:
            names.append(self._name("broadcast", f"root{root}", f"{array.dtype}{list(array.shape)}"))
            handles.append(rr.broadcast_async_(array, root, name=names[-1]))

        def finish() -> List[torch.Tensor]:
            for _, land in pairs:
                land()
            return tensors
        for name in names[:-1]:
            self._last[name] = handles
        return self._issue(names[-1], handles, finish) if names else _finished_work(tensors)

    def allgather(self, output_tensors: Sequence[Sequence[torch.Tensor]],
                  input_tensors: Sequence[torch.Tensor], opts: Any = None) -> Any:
        if len(output_tensors) != len(input_tensors):
            raise ValueError(f"allgather: {len(output_tensors)} output lists for {len(input_tensors)} inputs; "
                             "pass one list of world-size tensors per input tensor")
        outputs = [list(outs) for outs in output_tensors]
        for i, (outs, tensor) in enumerate(zip(outputs, input_tensors)):
            if len(outs) != self.size():
                raise ValueError(f"allgather: output list {i} has {len(outs)} tensors; it needs one per rank "
                                 f"({self.size()})")
            for r, out in enumerate(outs):
                _check_tensor(out, f"allgather output_tensors[{i}][{r}]")
                if out.numel() != tensor.numel() or out.dtype != tensor.dtype:
                    raise ValueError(f"allgather: output_tensors[{i}][{r}] is {out.dtype}{list(out.shape)}, "
                                     f"the input is {tensor.dtype}{list(tensor.shape)}; they must match")
        return self._gather([(t, outs) for t, outs in zip(input_tensors, outputs)],
                            [outs for outs in output_tensors])

    def _allgather_base(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, opts: Any = None) -> Any:
        """``all_gather_into_tensor``: every rank's input, in rank order, into one output tensor."""
        _check_tensor(output_tensor, "all_gather_into_tensor output")
        if not output_tensor.is_contiguous():
            raise ValueError("all_gather_into_tensor: the output tensor must be contiguous")
        if output_tensor.numel() != self.size() * input_tensor.numel() or output_tensor.dtype != input_tensor.dtype:
            raise ValueError(f"all_gather_into_tensor: the output ({output_tensor.dtype}"
                             f"{list(output_tensor.shape)}) must hold world size ({self.size()}) times the "
                             f"input ({input_tensor.dtype}{list(input_tensor.shape)})")
        parts = list(torch.tensor_split(output_tensor.view(-1), self.size()))
        return self._gather([(input_tensor, parts)], [output_tensor])

    all_gather_single = _allgather_base  # torch 2.13's name for all_gather_into_tensor

    def reduce_scatter_single(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor,
                              opts: Any = None) -> Any:
        """``reduce_scatter_tensor``: reduce the input over ranks; rank r keeps part r in the output."""
        op = _reduce_op(dist.ReduceOp.SUM if opts is None else opts.reduceOp)
        if input_tensor.numel() != self.size() * output_tensor.numel() or output_tensor.dtype != input_tensor.dtype:
            raise ValueError(f"reduce_scatter_tensor: the input ({input_tensor.dtype}{list(input_tensor.shape)}) "
                             f"must hold world size ({self.size()}) times the output "
                             f"({output_tensor.dtype}{list(output_tensor.shape)})")
        if input_tensor.is_complex() and op not in (rr.Sum, rr.Average):
            raise ValueError("reduce_scatter_tensor: only ReduceOp.SUM and ReduceOp.AVG are defined for "
                             "complex tensors")
        array = _input_array(input_tensor, "reduce_scatter_tensor input").reshape(self.size(), -1)
        destination, land = _inplace_array(output_tensor, "reduce_scatter_tensor output")
        name = self._name("reduce_scatter", op.name.lower(), f"{array.dtype}{list(array.shape)}")
        handle = rr.reducescatter_async(array, op=op, name=name)

        def finish() -> List[torch.Tensor]:
            destination.reshape(-1)[...] = rr.synchronize(handle).reshape(-1)
            land()
            return [output_tensor]
        return self._issue(name, [handle], finish)

    _reduce_scatter_base = reduce_scatter_single  # older torch's name for reduce_scatter_tensor

    def _unsupported(self, what: str) -> Any:
        raise NotImplementedError(
            f"the mtrain torch.distributed backend does not implement {what}; it has all_reduce, "
            "broadcast, all_gather, all_gather_into_tensor, reduce_scatter_tensor and barrier. Run other "
            "collectives on a gloo group: torch.distributed.new_group(backend='gloo')")

    def allgather_coalesced(self, *args: Any) -> Any:
        return self._unsupported("all_gather_coalesced")

    def all_gather_single_coalesced(self, *args: Any) -> Any:
        return self._unsupported("all_gather_into_tensor_coalesced")

    def all_to_all_single(self, *args: Any) -> Any:
        return self._unsupported("all_to_all_single")

    def alltoall(self, *args: Any) -> Any:
        return self._unsupported("all_to_all")

    def gather(self, *args: Any) -> Any:
        return self._unsupported("gather")

    def scatter(self, *args: Any) -> Any:
        return self._unsupported("scatter")

    def reduce(self, *args: Any) -> Any:
        return self._unsupported("reduce (use all_reduce)")

    def reduce_scatter(self, *args: Any) -> Any:
        return self._unsupported("reduce_scatter on tensor lists (use reduce_scatter_tensor)")

    def reduce_scatter_single_coalesced(self, *args: Any) -> Any:
        return self._unsupported("reduce_scatter_tensor_coalesced")

    def send(self, *args: Any) -> Any:
        return self._unsupported("send (point-to-point)")

    def recv(self, *args: Any) -> Any:
        return self._unsupported("recv (point-to-point)")

    def recv_anysource(self, *args: Any) -> Any:
        return self._unsupported("recv (point-to-point)")

    def _gather(self, pairs: List[Tuple[torch.Tensor, List[torch.Tensor]]], value: Any) -> Any:
        handles, names = [], []
        for i, (tensor, _) in enumerate(pairs):
            array = _input_array(tensor, f"allgather input_tensors[{i}]")
            names.append(self._name("allgather", f"{array.dtype}{list(array.shape)}"))
            handles.append(rr.allgather_async(array, name=names[-1]))

        def finish() -> Any:
            for handle, (tensor, outs) in zip(handles, pairs):
                for out, row in zip(outs, _rows(rr.synchronize(handle), self.size())):
                    out.detach().copy_(to_tensor(row, tensor.dtype).view(out.shape))
            return value
        if not names:
            return _finished_work(value)
        for name in names[:-1]:
            self._last[name] = handles
        return self._issue(names[-1], handles, finish)

    def barrier(self, opts: Any = None) -> Any:
        # The runtime's barrier() blocks; a one-byte all-reduce is a barrier that can be awaited later.
        name = self._name("barrier")
        handle = rr.allreduce_async_(np.zeros(1, dtype=np.uint8), op=rr.Sum, name=name)
        return self._issue(name, [handle], lambda: [])


# -- creating groups ----------------------------------------------------------------

def _create(options: Any, backend_options: Any = None) -> ProcessGroupMtrain:
    """The creator torch calls for ``init_process_group("mtrain")`` and ``new_group(backend="mtrain")``."""
    if not rr.is_initialized():
        rr.init()
    rank, size = options.group_rank, options.group_size
    members = list(options.global_ranks_in_group or [])
    if members and members != list(range(rr.size())):
        raise RuntimeError(f"the mtrain backend runs collectives over every rank of the mtrain job; "
                           f"group {options.group_id!r} has ranks {members} of {rr.size()}. Create subgroups "
                           "with backend='gloo'")
    if (rank, size) != (rr.rank(), rr.size()):
        raise RuntimeError(f"torch.distributed says rank {rank} of {size}, but this process is mtrain rank "
                           f"{rr.rank()} of {rr.size()}: set RANK and WORLD_SIZE to the MPI rank and size "
                           "(or call mtrain.distributed.init_process_group(), which does)")
    return ProcessGroupMtrain(rank, size, str(options.group_id))


def register() -> None:
    """Register the "mtrain" backend with torch.distributed (done on ``import mtrain.distributed``)."""
    if BACKEND.upper() not in dist.Backend._plugins:
        dist.Backend.register_backend(BACKEND, _create, extended_api=True, devices=["cpu"])


def init_process_group(timeout: Optional[timedelta] = None, **kwargs: Any) -> None:
    """``torch.distributed.init_process_group("mtrain")`` for ranks started by mpirun / mtrain run.

    Rank and world size come from the runtime. The rendezvous address is
    ``MASTER_ADDR``/``MASTER_PORT`` when both are set; otherwise rank 0 picks a
    free port and sends its address to every rank.
    """
    if not rr.is_initialized():
        rr.init()
    if "init_method" not in kwargs and "store" not in kwargs:
        if not ("MASTER_ADDR" in os.environ and "MASTER_PORT" in os.environ):
            address = None
            if rr.rank() == 0:
                host = "127.0.0.1" if rr.cross_size() == 1 else socket.gethostname()
                with socket.socket() as s:
                    s.bind(("", 0))
                    address = f"tcp://{host}:{s.getsockname()[1]}"
            kwargs["init_method"] = rr.broadcast_object(address, 0, name="mtrain.distributed.rendezvous")
    if timeout is not None:
        kwargs["timeout"] = timeout
    hook = sys.excepthook
    dist.init_process_group(BACKEND, rank=rr.rank(), world_size=rr.size(), **kwargs)
    # torch wraps the excepthook and points sys.stderr at a buffer while the previous hook runs;
    # mtrain's hook aborts the job from inside, so the traceback would never be printed.
    sys.excepthook = hook


register()
