"""The mtrain backend's ``ProcessGroup``: torch's collectives, point-to-point and barriers on
mtrain's runtime, with gloo's semantics. How ops are named, issued and completed:
docs/ddp-backend.md."""
from __future__ import annotations

import math
import threading
from datetime import timedelta
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch
import torch.distributed as dist

import mtrain.ringreduce as rr

from ..torch.bridge import check_host_tensor, flat_host_array, inplace_host_array, real_view, to_tensor
from .errors import ArgumentError
from .monitored import meet_on_store, timeout_seconds
from .reductions import Reduction, options_op, reduction_for
from .work import Completer, TransferWork, Work, finished_work

__all__ = ["BACKEND", "SLOTS", "ProcessGroupMtrain", "monitored_barrier"]

BACKEND = "mtrain"

# Ops of one signature that may be in flight at once before a name is reused (docs/ddp-backend.md).
SLOTS = 4


def array_signature(array: np.ndarray) -> str:
    """An array's dtype and shape, as op names carry them."""
    return f"{array.dtype}{list(array.shape)}"


def split_rows(result: np.ndarray, count: int) -> List[np.ndarray]:
    """Split a gathered flat array into ``count`` equal parts (one per rank)."""
    return np.split(result.reshape(-1), count)


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
        self._completer: Optional[Completer] = None
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
        name = ".".join([self._prefix] + [str(part) for part in signature] + [str(count % SLOTS)])
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
                self._completer = Completer()
        future = torch.futures.Future()
        self._completer.add(handles, finish, future)
        return Work(future)

    def _root(self, group_rank: int, what: str) -> int:
        """A group rank (as torch passes roots) as the global rank the runtime takes."""
        if isinstance(group_rank, bool) or not isinstance(group_rank, int) or not 0 <= group_rank < self.size():
            raise ArgumentError(f"{what}: invalid root rank {group_rank!r}: this group has ranks "
                                f"0..{self.size() - 1}")
        return self._members[group_rank]

    def _reduce_arrays(self, arrays: List[np.ndarray], reduction: Reduction, name: str,
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
        return self._allreduce(list(tensors), options_op(opts), "allreduce")

    def allreduce_coalesced(self, tensors: Sequence[torch.Tensor], opts: Any = None) -> Any:
        return self._allreduce(list(tensors), options_op(opts), "allreduce_coalesced")

    def _allreduce(self, tensors: List[torch.Tensor], torch_op: Any, kind: str) -> Any:
        reduction = reduction_for(torch_op, tensors, kind)
        if not tensors:
            return finished_work([])
        pairs = [inplace_host_array(t, f"{kind} tensors[{i}]") for i, t in enumerate(tensors)]
        arrays = [array for array, _ in pairs]
        name = self._name(kind, reduction.name.lower(), *[array_signature(a) for a in arrays])
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
        reduction = reduction_for(options_op(opts), tensors, "reduce")
        root = self._root(0 if opts is None else opts.rootRank, "reduce")
        if not tensors:
            return finished_work([])
        on_root = rr.rank() == root
        # Every rank reduces a flat copy (the same shapes, so the same name, everywhere); the root lands
        # the result in its tensors.
        pairs = [inplace_host_array(t, f"reduce tensors[{i}]") for i, t in enumerate(tensors)] if on_root else []
        arrays = [flat_host_array(t, f"reduce tensors[{i}]") for i, t in enumerate(tensors)]
        name = self._name("reduce", reduction.name.lower(), f"root{root}", *[array_signature(a) for a in arrays])
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
        check_host_tensor(output, "reduce_scatter output")
        if len(parts) != self.size():
            raise ArgumentError(f"reduce_scatter: the input list has {len(parts)} tensors; it needs one per rank of "
                                f"the group ({self.size()})")
        for r, part in enumerate(parts):
            check_host_tensor(part, f"reduce_scatter input[{r}]")
            if part.dtype != output.dtype:
                raise ArgumentError(f"reduce_scatter: input[{r}] is {part.dtype}, the output {output.dtype}; they "
                                    "must match")
        if parts[self.rank()].numel() != output.numel():
            raise ArgumentError(f"reduce_scatter: input[{self.rank()}] has {parts[self.rank()].numel()} elements, "
                                f"this rank's output {output.numel()}; they must match")
        arrays = [flat_host_array(part, f"reduce_scatter input[{r}]") for r, part in enumerate(parts)]
        # Counted in array elements: a complex tensor's are (real, imaginary) pairs.
        return self._reduce_scatter(output, np.concatenate(arrays), [a.size for a in arrays], options_op(opts),
                                    "reduce_scatter")

    def reduce_scatter_single(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor,
                              opts: Any = None) -> Any:
        """``reduce_scatter_tensor``: reduce the input over ranks; rank r keeps part r in the output."""
        check_host_tensor(output_tensor, "reduce_scatter_tensor output")
        flat = flat_host_array(input_tensor, "reduce_scatter_tensor input")
        if input_tensor.numel() != self.size() * output_tensor.numel() or output_tensor.dtype != input_tensor.dtype:
            raise ArgumentError(f"reduce_scatter_tensor: the input ({input_tensor.dtype}"
                                f"{list(input_tensor.shape)}) must hold group size ({self.size()}) times the "
                                f"output ({output_tensor.dtype}{list(output_tensor.shape)})")
        return self._reduce_scatter(output_tensor, flat, [flat.size // self.size()] * self.size(),
                                    options_op(opts), "reduce_scatter_tensor")

    _reduce_scatter_base = reduce_scatter_single  # older torch's name for reduce_scatter_tensor

    def _reduce_scatter(self, output: torch.Tensor, flat: np.ndarray, counts: List[int], torch_op: Any,
                        kind: str) -> Any:
        """Reduce ``flat`` (every rank's parts, ``counts[r]`` elements for rank r) over the group; this
        rank's part of the result lands in ``output``."""
        reduction = reduction_for(torch_op, [output], kind)
        destination, land = inplace_host_array(output, f"{kind} output")
        if reduction.op is not None and len(set(counts)) == 1 and counts[0] > 0:
            # Equal parts: the runtime's reduce-scatter (row r of the stacked parts to rank r).
            rows = flat.reshape(self.size(), -1)
            name = self._name(kind, reduction.name.lower(), array_signature(rows))
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
        pairs = [inplace_host_array(t, f"broadcast tensors[{i}]") for i, t in enumerate(tensors)]
        handles, names = [], []
        for array, _ in pairs:
            names.append(self._name("broadcast", f"root{root}", array_signature(array)))
            handles.append(rr.broadcast_async_(array, root, name=names[-1], process_set=self._set))

        def finish() -> List[torch.Tensor]:
            for _, land in pairs:
                land()
            return tensors
        return self._issue(names, handles, finish) if names else finished_work(tensors)

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
                check_host_tensor(out, f"allgather output_tensors[{i}][{r}]")
                if out.numel() != tensor.numel() or out.dtype != tensor.dtype:
                    raise ArgumentError(f"allgather: output_tensors[{i}][{r}] is {out.dtype}{list(out.shape)}, "
                                        f"the input is {tensor.dtype}{list(tensor.shape)}; they must match")
        return self._gather([(t, outs) for t, outs in zip(input_tensors, outputs)],
                            [outs for outs in output_tensors])

    def _allgather_base(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, opts: Any = None) -> Any:
        """``all_gather_into_tensor``: every rank's input, in rank order, into one output tensor."""
        check_host_tensor(output_tensor, "all_gather_into_tensor output")
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
            array = flat_host_array(tensor, f"allgather input_tensors[{i}]")
            names.append(self._name("allgather", array_signature(array)))
            handles.append(rr.allgather_async(array, name=names[-1], process_set=self._set))

        def finish() -> Any:
            for handle, (tensor, outs) in zip(handles, pairs):
                for out, row in zip(outs, split_rows(rr.synchronize(handle), self.size())):
                    out.detach().copy_(to_tensor(row, tensor.dtype).view(out.shape))
            return value
        return self._issue(names, handles, finish) if names else finished_work(value)

    def alltoall(self, output_tensors: Sequence[torch.Tensor], input_tensors: Sequence[torch.Tensor],
                 opts: Any = None) -> Any:
        """``all_to_all``: input_tensors[r] goes to rank r; output_tensors[r] receives rank r's."""
        outputs, inputs = list(output_tensors), list(input_tensors)
        for what, tensors in (("input", inputs), ("output", outputs)):
            if len(tensors) != self.size():
                raise ArgumentError(f"all_to_all: the {what} tensor list has {len(tensors)} tensors; it needs one "
                                    f"per rank of the group ({self.size()})")
            for r, tensor in enumerate(tensors):
                check_host_tensor(tensor, f"all_to_all {what}[{r}]")
        dtype = inputs[0].dtype
        if any(t.dtype != dtype for t in inputs + outputs):
            raise ArgumentError("all_to_all: every input and output tensor must have the same dtype")
        flat = np.concatenate([flat_host_array(t, "all_to_all input") for t in inputs])
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
        check_host_tensor(output_tensor, "all_to_all_single output")
        check_host_tensor(input_tensor, "all_to_all_single input")
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
        flat = flat_host_array(input_tensor, "all_to_all_single input")
        destination, land = inplace_host_array(output_tensor, "all_to_all_single output")

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
        flat = flat_host_array(tensor, "gather input")
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
            flat = np.concatenate([flat_host_array(t, "scatter input") for t in inputs])
            send = [t.numel() for t in inputs]
        else:
            flat, send = flat_host_array(output, "scatter output")[:0], [0] * self.size()
        receive = [output.numel() if r == group_root else 0 for r in range(self.size())]
        destination, land = inplace_host_array(output, "scatter output")

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
            check_host_tensor(tensor, f"{kind} {role}[{r}]")
            if tensor.numel() != like.numel() or tensor.dtype != like.dtype:
                raise ArgumentError(f"{kind}: {role}[{r}] is {tensor.dtype}{list(tensor.shape)}, this rank's tensor "
                                    f"{like.dtype}{list(like.shape)}; they must match")
        return tensors

    # -- point-to-point (the runtime's send/recv; group ranks as torch passes them) ---------------
    def _one(self, tensors: Sequence[torch.Tensor], what: str) -> torch.Tensor:
        tensors = list(tensors)
        if len(tensors) != 1:
            raise ArgumentError(f"{what} takes one tensor, got {len(tensors)}")
        return check_host_tensor(tensors[0], f"{what} tensor")

    def _peer(self, group_rank: int, what: str) -> int:
        if isinstance(group_rank, bool) or not isinstance(group_rank, int) or not 0 <= group_rank < self.size():
            raise ArgumentError(f"{what}: invalid peer rank {group_rank!r}: this group has ranks 0..{self.size() - 1}")
        return self._members[group_rank]

    def send(self, tensors: Sequence[torch.Tensor], dstRank: int, tag: int = 0) -> Any:  # noqa: N803
        tensor = self._one(tensors, "send")
        array = real_view(tensor.detach().contiguous())
        transfer = rr.send_async(array, self._peer(dstRank, "send"), tag, process_set=self._set)
        return TransferWork(transfer, lambda: [tensor])

    def recv(self, tensors: Sequence[torch.Tensor], srcRank: int, tag: int = 0) -> Any:  # noqa: N803
        tensor = self._one(tensors, "recv")
        array, land = inplace_host_array(tensor, "recv tensor")
        transfer = rr.recv_async(array, self._peer(srcRank, "recv"), tag, process_set=self._set)

        def finish() -> List[torch.Tensor]:
            land()
            return [tensor]
        return TransferWork(transfer, finish)

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
        seconds = timeout_seconds(self._timeout if timeout is None else timeout, "monitored_barrier")
        if self._store is None:
            raise RuntimeError("monitored_barrier needs the group's torch store; this group was made without one")
        key = f"mtrain.monitored_barrier.{self._monitored}"
        self._monitored += 1
        meet_on_store(self._store, key, rank=self.rank(), size=self.size(), seconds=seconds,
                      wait_all_ranks=wait_all_ranks, describe=self._describe)

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

