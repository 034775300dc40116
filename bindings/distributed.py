"""``torch.distributed`` backend "mtrain": torch collectives and DDP on mtrain's engine and ring.

    import mtrain.distributed                      # registers the backend
    torch.distributed.init_process_group("mtrain")  # or mtrain.distributed.init_process_group()
    model = torch.nn.parallel.DistributedDataParallel(model)
    dp = torch.distributed.new_group([0, 2])       # a subgroup, on the mtrain backend too

Ranks are started by ``mpirun`` / ``mtrain run``; torch's global rank and world
size must be the runtime's (``rr.rank()``, ``rr.size()``). Collectives on CPU
tensors, with gloo's semantics: all_reduce and all_reduce_coalesced, reduce
(the result on the destination; the other ranks' tensors are left as they
were), broadcast, all_gather, all_gather_into_tensor, reduce_scatter (tensor
lists, sizes may differ per rank) and reduce_scatter_tensor, all_to_all and
all_to_all_single (with or without split sizes), barrier; so also
all_gather_object and broadcast_object_list, which torch builds on them.
ReduceOp SUM, AVG, MIN, MAX, PRODUCT run on the runtime's all-reduce; BAND, BOR
and BXOR (integer and bool tensors) gather every rank's tensor and fold it with
NumPy (correct, not fast). PREMUL_SUM is refused (gloo has none either).
``async_op=True`` returns a Work whose future DDP's comm hooks chain on.
gather and scatter are all-to-alls in which one rank receives (sends) alone.
Point-to-point: send, recv, isend, irecv and batch_isend_irecv (so torch's
pipelining) on the runtime's transfers (``mtrain.ringreduce.p2p``), matched in
order per (source, destination, tag) within the group; their Work waits on the
transfer itself. A recv whose tensor does not fit what was sent (dtype or
number of elements) raises a MismatchError saying what was sent.

Subgroups: ``new_group(ranks)`` with backend mtrain makes a *private process
set* of the runtime (``rr.private_process_set``): torch calls our creator on
the member ranks only, in the same order on each, and the members alone make
the set's communicators and its own engine. A group of every rank runs on the
global set. torch hands collectives group ranks (``opts.rootRank``); the
runtime takes global ranks (Horovod's convention), so the group translates.
``destroy_process_group(group)`` on the members releases the set.

``monitored_barrier``: torch's ``dist.monitored_barrier`` refuses every backend
but gloo before it reaches the group (a ValueError in distributed_c10d.py), so
call ``mtrain.distributed.monitored_barrier(group, timeout, wait_all_ranks)``:
the same semantics on an mtrain group (rank 0 of the group raises a
RuntimeError naming the rank that did not arrive within the timeout, or all of
them with ``wait_all_ranks``; the others raise too, and nothing waits past the
timeout), and torch's own function for any other group. It meets on the
group's torch store (the rendezvous store torch gives each group), not on the
engine: a runtime op cannot be taken back once its timeout has passed, and the
engine does not say which ranks are missing.

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
rank. The group also registers itself for the ``cpu`` device type: DDP's
parameter check looks the backend up by device and fails with "No backend type
associated with device type cpu" otherwise.

Names: the runtime matches ops across ranks by name and caches names it has
seen (the response cache, a fixed number of bits). torch issues a group's
collectives in the same order on every rank, so an op's name is built from its
signature (kind, dtype, shape, op, root) and how many ops of that signature the
group has issued, modulo ``_SLOTS``: identical on every rank, and repeating
from one training step to the next, so DDP's bucket all-reduces hit the cache.
(Shapes that may differ between ranks, as an all_to_all's, stay out of the
name.) Before a name is reused, its previous op is waited for (it was issued by
every rank already, so the wait ends).
"""
from __future__ import annotations

import atexit
import math
import os
import queue
import socket
import sys
import threading
import time
from datetime import timedelta
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Sequence, Tuple

import numpy as np
import torch
import torch.distributed as dist

import mtrain.ringreduce as rr

from .torch.bridge import real_view, to_tensor

__all__ = ["BACKEND", "ArgumentError", "ProcessGroupMtrain", "init_process_group", "monitored_barrier", "register"]

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

# Folded from every rank's tensor (gathered): the runtime's all-reduce has no bitwise ops.
_BITWISE_OPS = {
    dist.ReduceOp.BAND: np.bitwise_and,
    dist.ReduceOp.BOR: np.bitwise_or,
    dist.ReduceOp.BXOR: np.bitwise_xor,
}


class ArgumentError(ValueError, RuntimeError):
    """A collective's arguments were refused: a ValueError, and a RuntimeError as gloo raises
    (its checks are ``TORCH_CHECK``s), so code written for either keeps catching it."""


class _Reduction(NamedTuple):
    """A torch ReduceOp as this backend runs it: on the runtime's all-reduce (``op``), or gathered
    and folded with a NumPy ufunc (``fold``)."""

    name: str
    op: Optional[rr.ReduceOp]
    fold: Optional[np.ufunc]


def _reduction(torch_op: Any, tensors: Sequence[torch.Tensor], what: str) -> _Reduction:
    """``torch_op`` checked against the tensors it reduces; a one-line error says what to use instead."""
    reduction = None
    for key, op in _REDUCE_OPS.items():
        if torch_op == key:
            reduction = _Reduction(key.name, op, None)
    for key, fold in _BITWISE_OPS.items():
        if torch_op == key:
            reduction = _Reduction(key.name, None, fold)
    if reduction is None:
        if torch_op == dist.ReduceOp.PREMUL_SUM:
            raise ArgumentError(f"{what}: ReduceOp.PREMUL_SUM is not supported by the mtrain backend (nor by "
                                "gloo): multiply the tensor by the factor, then reduce with ReduceOp.SUM")
        supported = ", ".join(f"ReduceOp.{k.name}" for k in list(_REDUCE_OPS) + list(_BITWISE_OPS))
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


def _timeout_seconds(timeout: Any, what: str) -> float:
    if isinstance(timeout, timedelta):
        seconds = timeout.total_seconds()
    elif isinstance(timeout, (int, float)) and not isinstance(timeout, bool):
        seconds = float(timeout)  # torch takes seconds as a float here too (with a warning)
    else:
        raise ArgumentError(f"{what}: timeout must be a datetime.timedelta, got {timeout!r}")
    if not seconds > 0:
        raise ArgumentError(f"{what}: timeout must be positive, got {timeout!r}")
    return seconds


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


class _TransferWork(dist.Work):
    """A send's or recv's Work: waits on the runtime's transfer itself (point-to-point ops of
    several groups and directions complete in any order, so they take no completer thread; a
    recv waited for first must not hold up a send issued before it). The future, if asked for,
    is completed by whichever thread finishes the transfer."""

    def __init__(self, transfer: Any, finish: Callable[[], Any]) -> None:
        super().__init__()
        self._transfer, self._finish = transfer, finish
        self._lock = threading.Lock()
        self._landed = False
        self._value: Any = None

    def _land(self) -> Any:
        with self._lock:
            if not self._landed:
                self._value, self._landed = self._finish(), True
            return self._value

    def wait(self, timeout: Any = None) -> bool:
        rr.synchronize(self._transfer)  # raises the transfer's error
        self._land()
        return True

    def is_completed(self) -> bool:
        return rr.poll(self._transfer)

    def is_success(self) -> bool:
        return self.is_completed() and self._transfer.error() is None

    def exception(self) -> Any:
        return self._transfer.error()

    def result(self) -> Any:
        self.wait()
        return self._value

    def get_future(self) -> torch.futures.Future:
        future = torch.futures.Future()

        def complete(transfer: Any) -> None:
            if transfer.error() is not None:
                future.set_exception(transfer.error())
            else:
                future.set_result(self._land())
        self._transfer.add_done_callback(complete)
        return future


def _options_op(opts: Any) -> Any:
    return dist.ReduceOp.SUM if opts is None else opts.reduceOp


def _signature(array: np.ndarray) -> str:
    return f"{array.dtype}{list(array.shape)}"


# -- the process group -------------------------------------------------------------

class ProcessGroupMtrain(dist.ProcessGroup):
    """A torch ``ProcessGroup`` whose collectives run on mtrain's runtime: on the global process set
    for a group of every rank, on a private set (``rr.private_process_set``) for a subgroup."""

    def __init__(self, rank: int, size: int, group_name: str = "",
                 process_set: rr.ProcessSet = rr.global_process_set, members: Optional[Sequence[int]] = None,
                 store: Any = None, timeout: Optional[timedelta] = None) -> None:
        super().__init__(rank, size)
        self._prefix = f"torch.distributed[{group_name}]"
        self._group_name = group_name
        self._set = process_set
        self._members = list(members) if members else list(range(size))  # the global rank of each group rank
        self._store = store  # torch's store for this group: monitored_barrier meets there
        self._timeout = timeout
        self._monitored = 0  # monitored barriers so far (the same count on every member)
        self._issued: Dict[tuple, int] = {}
        self._last: Dict[str, List[Any]] = {}  # name -> handles of the op that last used it
        self._completer: Optional[_Completer] = None
        self._completer_lock = threading.Lock()
        # DDP (and other device-dispatched calls) look the backend up by device type.
        self._register_backend(torch.device("cpu"), dist.ProcessGroup.BackendType.CUSTOM, None)

    def getBackendName(self) -> str:  # noqa: N802  (torch's method name)
        return BACKEND

    # torch keeps a group's name on its C++ backend objects, and this group has none (it is its own
    # backend): ``pg.group_name`` would raise "ProcessGroup name not set", and with it
    # ``destroy_process_group(group)``. The name is kept here.
    def _set_group_name(self, name: str) -> None:
        self._group_name = name

    @property
    def group_name(self) -> str:
        return self._group_name

    def __repr__(self) -> str:
        ranks = "" if self._set is rr.global_process_set else f", ranks={self._members}"
        return f"ProcessGroupMtrain(rank={self.rank()}, size={self.size()}{ranks})"

    def shutdown(self) -> None:
        """Called by ``destroy_process_group``: a subgroup's private set is released (its engine stops)."""
        if self._set is not rr.global_process_set and self._set.process_set_id is not None and rr.is_initialized():
            try:
                rr.remove_process_set(self._set)  # ops still in flight fail, on every member
            except rr.InvalidArgumentError:
                pass  # gone already: the runtime was shut down and started again
        with self._completer_lock:
            if self._completer is not None:
                self._completer.finish_and_stop()
                self._completer = None

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

    def _issue(self, names: List[str], handles: List[Any], finish: Callable[[], Any]) -> Any:
        for name in names:
            self._last[name] = handles
        with self._completer_lock:
            if self._completer is None:
                self._completer = _Completer()
        future = torch.futures.Future()
        self._completer.add(handles, finish, future)
        return _Work(future)

    def _root(self, group_rank: int, what: str) -> int:
        """A group rank (as torch passes roots) as the global rank the runtime takes."""
        if isinstance(group_rank, bool) or not isinstance(group_rank, int) or not 0 <= group_rank < self.size():
            raise ArgumentError(f"{what}: invalid root rank {group_rank!r}: this group has ranks "
                                f"0..{self.size() - 1}")
        return self._members[group_rank]

    def _reduce_arrays(self, arrays: List[np.ndarray], reduction: _Reduction, name: str,
                       in_place: bool) -> Tuple[Any, Callable[[], List[np.ndarray]]]:
        """Submit the reduction of ``arrays`` over the group; returns the handle and how to get the
        reduced arrays once it is done (``arrays`` themselves when reduced in place on the runtime)."""
        if reduction.fold is not None:  # every rank's values, one row per rank, folded here
            fold = reduction.fold
            handle = rr.grouped_allgather_async([a.reshape(1, -1) for a in arrays], name=name,
                                                process_set=self._set)
            return handle, lambda: [fold.reduce(rows, axis=0).reshape(a.shape)
                                    for rows, a in zip(rr.synchronize(handle), arrays)]
        if len(arrays) == 1:
            start = rr.allreduce_async_ if in_place else rr.allreduce_async
            handle = start(arrays[0], op=reduction.op, name=name, process_set=self._set)
            return handle, lambda: [rr.synchronize(handle)]
        start = rr.grouped_allreduce_async_ if in_place else rr.grouped_allreduce_async
        handle = start(arrays, op=reduction.op, name=name, process_set=self._set)
        return handle, lambda: list(rr.synchronize(handle))

    # -- reductions ------------------------------------------------------------
    def allreduce(self, tensors: Sequence[torch.Tensor], opts: Any = None) -> Any:
        return self._allreduce(list(tensors), _options_op(opts), "allreduce")

    def allreduce_coalesced(self, tensors: Sequence[torch.Tensor], opts: Any = None) -> Any:
        return self._allreduce(list(tensors), _options_op(opts), "allreduce_coalesced")

    def _allreduce(self, tensors: List[torch.Tensor], torch_op: Any, kind: str) -> Any:
        reduction = _reduction(torch_op, tensors, kind)
        if not tensors:
            return _finished_work([])
        pairs = [_inplace_array(t, f"{kind} tensors[{i}]") for i, t in enumerate(tensors)]
        arrays = [array for array, _ in pairs]
        name = self._name(kind, reduction.name.lower(), *[_signature(a) for a in arrays])
        handle, results = self._reduce_arrays(arrays, reduction, name, in_place=True)

        def finish() -> List[torch.Tensor]:
            for (array, land), result in zip(pairs, results()):
                if result is not array:
                    array[...] = result
                land()
            return tensors
        return self._issue([name], [handle], finish)

    def reduce(self, tensors: Sequence[torch.Tensor], opts: Any = None) -> Any:
        """The reduction lands on the root only; the other ranks' tensors are left as they were
        (gloo leaves partial sums in them; torch documents nothing there)."""
        tensors = list(tensors)
        reduction = _reduction(_options_op(opts), tensors, "reduce")
        root = self._root(0 if opts is None else opts.rootRank, "reduce")
        if not tensors:
            return _finished_work([])
        on_root = rr.rank() == root
        # Every rank reduces a flat copy (the same shapes, so the same name, everywhere); the root lands
        # the result in its tensors.
        pairs = [_inplace_array(t, f"reduce tensors[{i}]") for i, t in enumerate(tensors)] if on_root else []
        arrays = [_input_array(t, f"reduce tensors[{i}]") for i, t in enumerate(tensors)]
        name = self._name("reduce", reduction.name.lower(), f"root{root}", *[_signature(a) for a in arrays])
        handle, results = self._reduce_arrays(arrays, reduction, name, in_place=False)

        def finish() -> List[torch.Tensor]:
            reduced = results()
            for (destination, land), result in zip(pairs, reduced):
                destination.reshape(-1)[...] = result.reshape(-1)
                land()
            return tensors
        return self._issue([name], [handle], finish)

    def reduce_scatter(self, output_tensors: Sequence[torch.Tensor],
                       input_tensors: Sequence[Sequence[torch.Tensor]], opts: Any = None) -> Any:
        """``reduce_scatter``: rank r gets the reduction of every rank's ``input_list[r]`` (sizes may
        differ from rank to rank, as on gloo)."""
        outputs, inputs = list(output_tensors), [list(parts) for parts in input_tensors]
        if len(outputs) != 1 or len(inputs) != 1:
            raise ArgumentError(f"reduce_scatter takes one output tensor and one input list, got {len(outputs)} and "
                                f"{len(inputs)}")
        (output,), (parts,) = outputs, inputs
        _check_tensor(output, "reduce_scatter output")
        if len(parts) != self.size():
            raise ArgumentError(f"reduce_scatter: the input list has {len(parts)} tensors; it needs one per rank of "
                                f"the group ({self.size()})")
        for r, part in enumerate(parts):
            _check_tensor(part, f"reduce_scatter input[{r}]")
            if part.dtype != output.dtype:
                raise ArgumentError(f"reduce_scatter: input[{r}] is {part.dtype}, the output {output.dtype}; they "
                                    "must match")
        if parts[self.rank()].numel() != output.numel():
            raise ArgumentError(f"reduce_scatter: input[{self.rank()}] has {parts[self.rank()].numel()} elements, "
                                f"this rank's output {output.numel()}; they must match")
        arrays = [_input_array(part, f"reduce_scatter input[{r}]") for r, part in enumerate(parts)]
        # Counted in array elements: a complex tensor's are (real, imaginary) pairs.
        return self._reduce_scatter(output, np.concatenate(arrays), [a.size for a in arrays], _options_op(opts),
                                    "reduce_scatter")

    def reduce_scatter_single(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor,
                              opts: Any = None) -> Any:
        """``reduce_scatter_tensor``: reduce the input over ranks; rank r keeps part r in the output."""
        _check_tensor(output_tensor, "reduce_scatter_tensor output")
        flat = _input_array(input_tensor, "reduce_scatter_tensor input")
        if input_tensor.numel() != self.size() * output_tensor.numel() or output_tensor.dtype != input_tensor.dtype:
            raise ArgumentError(f"reduce_scatter_tensor: the input ({input_tensor.dtype}"
                                f"{list(input_tensor.shape)}) must hold group size ({self.size()}) times the "
                                f"output ({output_tensor.dtype}{list(output_tensor.shape)})")
        return self._reduce_scatter(output_tensor, flat, [flat.size // self.size()] * self.size(),
                                    _options_op(opts), "reduce_scatter_tensor")

    _reduce_scatter_base = reduce_scatter_single  # older torch's name for reduce_scatter_tensor

    def _reduce_scatter(self, output: torch.Tensor, flat: np.ndarray, counts: List[int], torch_op: Any,
                        kind: str) -> Any:
        """Reduce ``flat`` (every rank's parts, ``counts[r]`` elements for rank r) over the group; this
        rank's part of the result lands in ``output``."""
        reduction = _reduction(torch_op, [output], kind)
        destination, land = _inplace_array(output, f"{kind} output")
        if reduction.op is not None and len(set(counts)) == 1 and counts[0] > 0:
            # Equal parts: the runtime's reduce-scatter (row r of the stacked parts to rank r).
            rows = flat.reshape(self.size(), -1)
            name = self._name(kind, reduction.name.lower(), _signature(rows))
            handle = rr.reducescatter_async(rows, op=reduction.op, name=name, process_set=self._set)

            def mine() -> np.ndarray:
                return rr.synchronize(handle)
        else:  # unequal parts, or a bitwise op: reduce it all, keep this rank's part
            name = self._name(kind, reduction.name.lower(), str(flat.dtype), *counts)
            handle, results = self._reduce_arrays([flat], reduction, name, in_place=False)
            start = sum(counts[:self.rank()])

            def mine() -> np.ndarray:
                return results()[0][start:start + counts[self.rank()]]

        def finish() -> List[torch.Tensor]:
            destination.reshape(-1)[...] = mine().reshape(-1)
            land()
            return [output]
        return self._issue([name], [handle], finish)

    # -- data movement ---------------------------------------------------------
    def broadcast(self, tensors: Sequence[torch.Tensor], opts: Any = None) -> Any:
        tensors = list(tensors)
        root = self._root(0 if opts is None else opts.rootRank, "broadcast")
        pairs = [_inplace_array(t, f"broadcast tensors[{i}]") for i, t in enumerate(tensors)]
        handles, names = [], []
        for array, _ in pairs:
            names.append(self._name("broadcast", f"root{root}", _signature(array)))
            handles.append(rr.broadcast_async_(array, root, name=names[-1], process_set=self._set))

        def finish() -> List[torch.Tensor]:
            for _, land in pairs:
                land()
            return tensors
        return self._issue(names, handles, finish) if names else _finished_work(tensors)

    def allgather(self, output_tensors: Sequence[Sequence[torch.Tensor]],
                  input_tensors: Sequence[torch.Tensor], opts: Any = None) -> Any:
        if len(output_tensors) != len(input_tensors):
            raise ArgumentError(f"allgather: {len(output_tensors)} output lists for {len(input_tensors)} inputs; "
                                "pass one list of group-size tensors per input tensor")
        outputs = [list(outs) for outs in output_tensors]
        for i, (outs, tensor) in enumerate(zip(outputs, input_tensors)):
            if len(outs) != self.size():
                raise ArgumentError(f"allgather: output list {i} has {len(outs)} tensors; it needs one per rank "
                                    f"of the group ({self.size()})")
            for r, out in enumerate(outs):
                _check_tensor(out, f"allgather output_tensors[{i}][{r}]")
                if out.numel() != tensor.numel() or out.dtype != tensor.dtype:
                    raise ArgumentError(f"allgather: output_tensors[{i}][{r}] is {out.dtype}{list(out.shape)}, "
                                        f"the input is {tensor.dtype}{list(tensor.shape)}; they must match")
        return self._gather([(t, outs) for t, outs in zip(input_tensors, outputs)],
                            [outs for outs in output_tensors])

    def _allgather_base(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, opts: Any = None) -> Any:
        """``all_gather_into_tensor``: every rank's input, in rank order, into one output tensor."""
        _check_tensor(output_tensor, "all_gather_into_tensor output")
        if not output_tensor.is_contiguous():
            raise ArgumentError("all_gather_into_tensor: the output tensor must be contiguous")
        if output_tensor.numel() != self.size() * input_tensor.numel() or output_tensor.dtype != input_tensor.dtype:
            raise ArgumentError(f"all_gather_into_tensor: the output ({output_tensor.dtype}"
                                f"{list(output_tensor.shape)}) must hold group size ({self.size()}) times the "
                                f"input ({input_tensor.dtype}{list(input_tensor.shape)})")
        parts = list(torch.tensor_split(output_tensor.view(-1), self.size()))
        return self._gather([(input_tensor, parts)], [output_tensor])

    all_gather_single = _allgather_base  # torch 2.13's name for all_gather_into_tensor

    def _gather(self, pairs: List[Tuple[torch.Tensor, List[torch.Tensor]]], value: Any) -> Any:
        handles, names = [], []
        for i, (tensor, _) in enumerate(pairs):
            array = _input_array(tensor, f"allgather input_tensors[{i}]")
            names.append(self._name("allgather", _signature(array)))
            handles.append(rr.allgather_async(array, name=names[-1], process_set=self._set))

        def finish() -> Any:
            for handle, (tensor, outs) in zip(handles, pairs):
                for out, row in zip(outs, _rows(rr.synchronize(handle), self.size())):
                    out.detach().copy_(to_tensor(row, tensor.dtype).view(out.shape))
            return value
        return self._issue(names, handles, finish) if names else _finished_work(value)

    def alltoall(self, output_tensors: Sequence[torch.Tensor], input_tensors: Sequence[torch.Tensor],
                 opts: Any = None) -> Any:
        """``all_to_all``: input_tensors[r] goes to rank r; output_tensors[r] receives rank r's."""
        outputs, inputs = list(output_tensors), list(input_tensors)
        for what, tensors in (("input", inputs), ("output", outputs)):
            if len(tensors) != self.size():
                raise ArgumentError(f"all_to_all: the {what} tensor list has {len(tensors)} tensors; it needs one "
                                    f"per rank of the group ({self.size()})")
            for r, tensor in enumerate(tensors):
                _check_tensor(tensor, f"all_to_all {what}[{r}]")
        dtype = inputs[0].dtype
        if any(t.dtype != dtype for t in inputs + outputs):
            raise ArgumentError("all_to_all: every input and output tensor must have the same dtype")
        flat = np.concatenate([_input_array(t, "all_to_all input") for t in inputs])
        receive = [o.numel() for o in outputs]

        def place(received: np.ndarray) -> None:
            for out, part in zip(outputs, np.split(received, np.cumsum(receive)[:-1])):
                out.detach().copy_(to_tensor(part, out.dtype).view(out.shape))
        return self._alltoall(flat, [t.numel() for t in inputs], receive, place, outputs, "all_to_all")

    def all_to_all_single(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor,
                          output_split_sizes: Sequence[int], input_split_sizes: Sequence[int],
                          opts: Any = None) -> Any:
        """``all_to_all_single``: dim 0 of the input is split among the ranks (equally, or by
        ``input_split_sizes``); rank r's part lands in the output's part r (``output_split_sizes``)."""
        _check_tensor(output_tensor, "all_to_all_single output")
        _check_tensor(input_tensor, "all_to_all_single input")
        if input_tensor.dim() == 0 or output_tensor.dim() == 0:
            raise ArgumentError("all_to_all_single: the tensors need at least one dimension to split")
        if output_tensor.dtype != input_tensor.dtype:
            raise ArgumentError(f"all_to_all_single: the output is {output_tensor.dtype}, the input "
                                f"{input_tensor.dtype}; they must match")
        row = math.prod(input_tensor.shape[1:])
        if math.prod(output_tensor.shape[1:]) != row:
            raise ArgumentError(f"all_to_all_single: a row of the output ({list(output_tensor.shape[1:])}) and of "
                                f"the input ({list(input_tensor.shape[1:])}) must hold as many elements")
        send = self._splits(input_split_sizes, input_tensor.shape[0], "input")
        receive = self._splits(output_split_sizes, output_tensor.shape[0], "output")
        flat = _input_array(input_tensor, "all_to_all_single input")
        destination, land = _inplace_array(output_tensor, "all_to_all_single output")

        def place(received: np.ndarray) -> None:
            destination.reshape(-1)[...] = received
            land()
        return self._alltoall(flat, [n * row for n in send], [n * row for n in receive], place, [output_tensor],
                              "all_to_all_single", *input_tensor.shape[1:])

    alltoall_base = all_to_all_single  # older torch's name

    def _splits(self, sizes: Sequence[int], first: int, what: str) -> List[int]:
        """Rows to send to (or receive from) each rank: ``sizes``, or equal shares when empty."""
        sizes = list(sizes or [])
        if not sizes:
            if first % self.size():
                raise ArgumentError(f"all_to_all_single: the {what}'s dim 0 ({first}) does not divide equally "
                                    f"across the group size ({self.size()}); pass {what}_split_sizes")
            return [first // self.size()] * self.size()
        if len(sizes) != self.size():
            raise ArgumentError(f"all_to_all_single: {len(sizes)} {what} split sizes; the number of splits must "
                                f"equal the group size ({self.size()})")
        if any(isinstance(n, bool) or not isinstance(n, int) or n < 0 for n in sizes) or sum(sizes) != first:
            raise ArgumentError(f"all_to_all_single: {what} split sizes {sizes} must be non-negative integers "
                                f"summing to the {what}'s dim 0 ({first})")
        return sizes

    def _alltoall(self, flat: np.ndarray, send: List[int], receive: List[int],
                  place: Callable[[np.ndarray], None], value: Any, kind: str, *shared: Any) -> Any:
        """Send ``send[r]`` elements of ``flat`` to group rank r; what arrives (``receive[r]`` elements
        from rank r, checked) goes to ``place`` as one flat array. ``shared``: what the ranks' calls have
        in common besides the dtype (sizes may differ from rank to rank, so they stay out of the name)."""
        name = self._name(kind, str(flat.dtype), *shared)
        handle = rr.alltoall_async(flat, splits=send, name=name, process_set=self._set)

        def finish() -> Any:
            received, received_splits = rr.synchronize(handle)
            got = [int(n) for n in np.asarray(received_splits).reshape(-1)]
            if got != receive:
                raise ArgumentError(f"{kind}: rank {self.rank()} of the group expected {receive} elements from the "
                                    f"ranks of the group, but they sent {got}: the split sizes of the ranks "
                                    "must agree")
            place(received.reshape(-1))
            return value
        return self._issue([name], [handle], finish)

    # -- gather and scatter (all-to-alls with one root) --------------------------------
    def gather(self, output_tensors: Sequence[Sequence[torch.Tensor]], input_tensors: Sequence[torch.Tensor],
               opts: Any = None) -> Any:
        """``gather``: every rank's tensor, in rank order, into the root's list. An all-to-all in
        which each rank sends to the root alone."""
        root = self._root(0 if opts is None else opts.rootRank, "gather")
        group_root = self._members.index(root)
        tensor = self._one(input_tensors, "gather")
        outputs = self._root_list(output_tensors, tensor, group_root, "gather", "output")
        flat = _input_array(tensor, "gather input")
        send = [flat.size if r == group_root else 0 for r in range(self.size())]
        receive = [o.numel() for o in outputs] if self.rank() == group_root else [0] * self.size()

        def place(received: np.ndarray) -> None:
            for out, part in zip(outputs, np.split(received, np.cumsum(receive)[:-1])):
                out.detach().copy_(to_tensor(part, out.dtype).view(out.shape))
        return self._alltoall(flat, send, receive, place, [outputs], "gather", f"root{root}")

    def scatter(self, output_tensors: Sequence[torch.Tensor], input_tensors: Sequence[Sequence[torch.Tensor]],
                opts: Any = None) -> Any:
        """``scatter``: the root's i-th tensor to group rank i. An all-to-all in which the root alone
        sends."""
        root = self._root(0 if opts is None else opts.rootRank, "scatter")
        group_root = self._members.index(root)
        output = self._one(output_tensors, "scatter")
        inputs = self._root_list(input_tensors, output, group_root, "scatter", "input")
        if self.rank() == group_root:
            flat = np.concatenate([_input_array(t, "scatter input") for t in inputs])
            send = [t.numel() for t in inputs]
        else:
            flat, send = _input_array(output, "scatter output")[:0], [0] * self.size()
        receive = [output.numel() if r == group_root else 0 for r in range(self.size())]
        destination, land = _inplace_array(output, "scatter output")

        def place(received: np.ndarray) -> None:
            destination.reshape(-1)[...] = received
            land()
        return self._alltoall(flat, send, receive, place, [output], "scatter", f"root{root}")

    def _root_list(self, lists: Sequence[Sequence[torch.Tensor]], like: torch.Tensor, group_root: int, kind: str,
                   role: str) -> List[torch.Tensor]:
        """The root's one list of a tensor per group rank, each with ``like``'s dtype and number of
        elements (an empty list elsewhere, where torch passes none)."""
        tensors = list(lists[0]) if lists else []
        if self.rank() != group_root:
            if tensors:
                raise ArgumentError(f"{kind}: only the root passes {role} tensors")
            return tensors
        if len(lists) != 1 or len(tensors) != self.size():
            raise ArgumentError(f"{kind}: the root needs one list of {self.size()} {role} tensors (one per rank of "
                                "the group)")
        for r, tensor in enumerate(tensors):
            _check_tensor(tensor, f"{kind} {role}[{r}]")
            if tensor.numel() != like.numel() or tensor.dtype != like.dtype:
                raise ArgumentError(f"{kind}: {role}[{r}] is {tensor.dtype}{list(tensor.shape)}, this rank's tensor "
                                    f"{like.dtype}{list(like.shape)}; they must match")
        return tensors

    # -- point-to-point (the runtime's send/recv; group ranks as torch passes them) ---------------
    def _one(self, tensors: Sequence[torch.Tensor], what: str) -> torch.Tensor:
        tensors = list(tensors)
        if len(tensors) != 1:
            raise ArgumentError(f"{what} takes one tensor, got {len(tensors)}")
        return _check_tensor(tensors[0], f"{what} tensor")

    def _peer(self, group_rank: int, what: str) -> int:
        if isinstance(group_rank, bool) or not isinstance(group_rank, int) or not 0 <= group_rank < self.size():
            raise ArgumentError(f"{what}: invalid peer rank {group_rank!r}: this group has ranks 0..{self.size() - 1}")
        return self._members[group_rank]

    def send(self, tensors: Sequence[torch.Tensor], dstRank: int, tag: int = 0) -> Any:  # noqa: N803
        tensor = self._one(tensors, "send")
        array = real_view(tensor.detach().contiguous())
        transfer = rr.send_async(array, self._peer(dstRank, "send"), tag, process_set=self._set)
        return _TransferWork(transfer, lambda: [tensor])

    def recv(self, tensors: Sequence[torch.Tensor], srcRank: int, tag: int = 0) -> Any:  # noqa: N803
        tensor = self._one(tensors, "recv")
        array, land = _inplace_array(tensor, "recv tensor")
        transfer = rr.recv_async(array, self._peer(srcRank, "recv"), tag, process_set=self._set)

        def finish() -> List[torch.Tensor]:
            land()
            return [tensor]
        return _TransferWork(transfer, finish)

    # -- synchronization ---------------------------------------------------------
    def barrier(self, opts: Any = None) -> Any:
        # The runtime's barrier() blocks; a one-byte all-reduce is a barrier that can be awaited later.
        name = self._name("barrier")
        handle = rr.allreduce_async_(np.zeros(1, dtype=np.uint8), op=rr.Sum, name=name, process_set=self._set)
        return self._issue([name], [handle], lambda: [])

    def monitored_barrier(self, timeout: Any = None, wait_all_ranks: bool = False) -> None:
        """gloo's monitored barrier, on the group's torch store: every rank announces its arrival; rank 0
        waits for the others until ``timeout`` (default: the group's), then releases them, or raises
        naming the first missing rank (every missing rank with ``wait_all_ranks``) and tells the others
        so. Every rank raises RuntimeError by its own deadline; nothing waits longer."""
        seconds = _timeout_seconds(self._timeout if timeout is None else timeout, "monitored_barrier")
        if self._store is None:
            raise RuntimeError("monitored_barrier needs the group's torch store; this group was made without one")
        deadline = time.monotonic() + seconds
        key = f"mtrain.monitored_barrier.{self._monitored}"
        self._monitored += 1
        me, size, store = self.rank(), self.size(), self._store
        store.set(f"{key}.arrived.{me}", b"1")
        if me == 0:
            waiting = list(range(1, size))
            while True:
                waiting = [r for r in waiting if not store.check([f"{key}.arrived.{r}"])]
                left = deadline - time.monotonic()
                if not waiting or left <= 0:
                    break
                time.sleep(min(0.005, left))
            if waiting:
                missing = waiting if wait_all_ranks else waiting[:1]
                names = ", ".join(self._describe(r) for r in missing)
                text = f"rank{'s' if len(missing) > 1 else ''} {names} of the group did not arrive within {seconds:g} s"
                store.set(f"{key}.released", ("failed: " + text).encode())
                raise RuntimeError(f"monitored_barrier: {text}")
            store.set(f"{key}.released", b"ok")
            return
        while not store.check([f"{key}.released"]):
            left = deadline - time.monotonic()
            if left <= 0:
                raise RuntimeError(f"monitored_barrier: rank {self._describe(me)} arrived, but group rank 0 "
                                   f"({self._describe(0)}) did not release it within {seconds:g} s: rank 0 did not "
                                   "arrive, or failed; check its log")
            time.sleep(min(0.005, left))
        released = bytes(store.get(f"{key}.released")).decode()
        if released != "ok":
            raise RuntimeError(f"monitored_barrier: rank {self._describe(me)} arrived, but group rank 0 reports: "
                               f"{released.removeprefix('failed: ')}")

    def _describe(self, group_rank: int) -> str:
        global_rank = self._members[group_rank]
        return str(group_rank) if global_rank == group_rank else f"{group_rank} (global rank {global_rank})"

    # -- not here ------------------------------------------------------------------
    def _unsupported(self, what: str) -> Any:
        raise NotImplementedError(
            f"the mtrain torch.distributed backend does not implement {what}; it has all_reduce, reduce, "
            "broadcast, all_gather, all_gather_into_tensor, gather, scatter, reduce_scatter, "
            "reduce_scatter_tensor, all_to_all, all_to_all_single, send, recv, barrier and "
            "mtrain.distributed.monitored_barrier. Run other collectives on a gloo group: "
            "torch.distributed.new_group(backend='gloo')")

    def allgather_coalesced(self, *args: Any) -> Any:
        return self._unsupported("all_gather_coalesced")

    def all_gather_single_coalesced(self, *args: Any) -> Any:
        return self._unsupported("all_gather_into_tensor_coalesced")

    def reduce_scatter_single_coalesced(self, *args: Any) -> Any:
        return self._unsupported("reduce_scatter_tensor_coalesced")

    def recv_anysource(self, *args: Any) -> Any:
        return self._unsupported("recv from any source (name the source rank)")


def monitored_barrier(group: Any = None, timeout: Any = None, wait_all_ranks: bool = False) -> None:
    """``torch.distributed.monitored_barrier`` for mtrain groups (torch's own refuses every backend but
    gloo): a barrier that raises RuntimeError naming the rank(s) that did not arrive within ``timeout``
    (a ``timedelta``; default the group's). Any other group goes to torch's function."""
    if group is None:
        group = dist.group.WORLD
    if group is dist.GroupMember.NON_GROUP_MEMBER:
        return None  # as torch: a rank outside the group does nothing
    if isinstance(group, ProcessGroupMtrain):
        return group.monitored_barrier(timeout, wait_all_ranks=wait_all_ranks)
    return dist.monitored_barrier(group, timeout=timeout, wait_all_ranks=wait_all_ranks)


# -- creating groups ----------------------------------------------------------------

def _create(options: Any, backend_options: Any = None) -> ProcessGroupMtrain:
    """The creator torch calls for ``init_process_group("mtrain")`` and ``new_group(backend="mtrain")``,
    on the group's members only (torch returns NON_GROUP_MEMBER on the others before it gets here)."""
    rank, size = options.group_rank, options.group_size
    members = [int(r) for r in (options.global_ranks_in_group or [])]
    if not rr.is_initialized():
        if members and len(members) < dist.get_world_size():
            # init() takes every rank of the job, and torch calls us on the members only.
            raise RuntimeError(f"an mtrain subgroup (ranks {members}) needs mtrain's runtime started on every "
                               "rank first: call mtrain.ringreduce.init() (or hvd.init()) on every rank before "
                               "new_group(backend='mtrain'), or make the default group mtrain")
        rr.init()
    process_set = rr.global_process_set
    if not members:  # the default group
        if (rank, size) != (rr.rank(), rr.size()):
            raise RuntimeError(f"torch.distributed says rank {rank} of {size}, but this process is mtrain rank "
                               f"{rr.rank()} of {rr.size()}: set RANK and WORLD_SIZE to the MPI rank and size "
                               "(or call mtrain.distributed.init_process_group(), which does)")
    else:
        if len(set(members)) != len(members) or any(not 0 <= r < rr.size() for r in members):
            raise RuntimeError(f"group {options.group_id!r} has ranks {members}; the mtrain job has distinct ranks "
                               f"0..{rr.size() - 1}")
        if len(members) != size or not 0 <= rank < size or members[rank] != rr.rank():
            raise RuntimeError(f"torch.distributed says this process is rank {rank} of group {options.group_id!r} "
                               f"(global ranks {members}), but it is mtrain rank {rr.rank()}: torch's global ranks "
                               "must be the MPI ranks (set RANK to the MPI rank)")
        if members != sorted(members):
            raise RuntimeError(f"group {options.group_id!r} lists its ranks out of order ({members}); the mtrain "
                               "backend orders a group's ranks as their global ranks (as new_group does)")
        if len(members) < rr.size():
            process_set = rr.private_process_set(members)
    return ProcessGroupMtrain(rank, size, str(options.group_id), process_set, members, options.store,
                              options.timeout)


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
