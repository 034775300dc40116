"""One op's way in: its arguments checked, in one pass, then submitted to its set's engine, or refused.

Every collective the API starts (api.py) comes here as one function per kind. Each checks its
arguments in the caller's thread (the array, the reduce op and what the dtype allows, the root,
the splits, a writable output) and builds the op's requests. An op whose arguments are refused
here raises at once on this rank; before it raises, the rank still takes the op's name(s) into
the negotiation as a refusal (``errors.Refusal``), so that the ranks that did submit the op raise
the same class instead of waiting for this one, and unnamed ops stay numbered alike on every rank.
"""
from __future__ import annotations

import pickle
from typing import Any, Callable, NamedTuple, Sequence

import numpy as np

from mtrain.ringreduce import exits
from mtrain.ringreduce.core.errors import HorovodInternalError, InvalidArgumentError, Refusal
from mtrain.ringreduce.core.ops import Adasum, Kind, ReduceOp, check_op, check_reducible, dtype_code
from mtrain.ringreduce.core.requests import (
    AllreduceOp,
    Handle,
    Signature,
    host_allreduce_signature,
    make_refusal,
    make_request,
)
from mtrain.ringreduce.engine.cycle import Engine
from mtrain.ringreduce.process_sets import ProcessSet, current, global_process_set, installed
from mtrain.ringreduce.transport.adasum import is_power_of_two
from mtrain.ringreduce.transport.backend import is_device_array


class Checked(NamedTuple):
    """An op's arguments once checked: its arrays (None: a part that carries none) and the
    fields of its requests."""

    arrays: "list[Any]"
    fields: "dict[str, Any]"


# -- the checks --------------------------------------------------------------------


def check_array(value: Any) -> np.ndarray:
    """``value`` as an array the engine takes: a NumPy array, a NumPy scalar (as a 0-d array),
    or a device array (the engine picks its backend); TypeError for anything else."""
    if isinstance(value, np.ndarray):
        return value
    if isinstance(value, np.generic):  # a NumPy scalar: treat as a 0-d array
        return np.asarray(value)
    if is_device_array(value):
        return value
    raise TypeError(f"expected a numpy.ndarray, got {type(value).__name__}; "
                    "wrap Python data with numpy.asarray() first")


def check_name(name: Any) -> None:
    """An op's name is a str, or None for an unnamed op (numbered by the engine)."""
    if name is not None and not isinstance(name, str):
        raise TypeError(f"an op's name must be a str, or None to leave it unnamed; got {type(name).__name__} "
                        f"{name!r}")


def check_writable(array: Any, what: str) -> Any:
    """``array``, which an in-place op writes its result into."""
    if type(array) is np.ndarray and not array.flags.writeable:
        raise InvalidArgumentError(f"{what} writes its result into its input, which is read-only; pass a writable "
                                   "array, or use the out-of-place form")
    return array


def listed(arrays: Any) -> list:
    """A grouped op's arrays as a list (something that is not a sequence is one array, refused by
    ``check_array``)."""
    try:
        return list(arrays)
    except TypeError:
        return [arrays]


def check_root(root_rank: int, process_set: ProcessSet = global_process_set) -> int:
    """``root_rank`` (a global rank, as in Horovod) as a rank within ``process_set``."""
    registry = current()
    state = registry.member(process_set)
    if not isinstance(root_rank, (int, np.integer)) or not 0 <= int(root_rank) < registry.size:
        raise InvalidArgumentError(f"root_rank must be an integer in [0, {registry.size}); got {root_rank!r}")
    if int(root_rank) not in state.ranks:
        raise InvalidArgumentError(f"root_rank {int(root_rank)} is not part of process set {state.id} "
                                   f"(ranks {state.ranks}); give a root from the set (a global rank)")
    return state.set_rank_of(int(root_rank))


def check_splits(splits: "Sequence[int] | None", first: int,
                 process_set: ProcessSet = global_process_set) -> "list[int]":
    """Rows to send to each rank of the set: ``splits``, or equal shares when None."""
    size_ = current().member(process_set).size
    if splits is None:
        if first % size_:
            raise ValueError(f"alltoall without splits needs the first dimension ({first}) to be "
                             f"divisible by the number of ranks ({size_}); pass splits=")
        return [first // size_] * size_
    send = np.asarray(splits).reshape(-1)
    if (send.size != size_ or send.dtype.kind not in "iu" or np.any(send < 0)
            or int(send.sum()) != first):
        raise ValueError(f"alltoall splits must be {size_} non-negative integers summing to "
                         f"the first dimension ({first}); got {send.tolist()}")
    return [int(n) for n in send]


def check_adasum(array: Any, process_set: ProcessSet) -> None:
    """Horovod's rules for running Adasum (horovod/torch/mpi_ops.py ``_allreduce_async``, the same
    in horovod/tensorflow/__init__.py): the global set only; host arrays on a power-of-two number
    of ranks; device arrays (summed within each host, then Adasum across hosts) on a power-of-two
    number of hosts that each run the same number of ranks. NotImplementedError, as Horovod's."""
    registry = current()
    if process_set.process_set_id != 0:
        raise NotImplementedError("Adasum does not support non-global process sets yet. Run it on the "
                                  "global process set, or use op=Average on this one")
    if is_device_array(array):
        if not registry.homogeneous:
            raise NotImplementedError("Running GPU Adasum on heterogeneous cluster is not supported yet. Run the "
                                      "same number of ranks on every host, or use op=Average")
        hosts = registry.size // registry.local_size
        if not is_power_of_two(hosts):
            raise NotImplementedError(f"Running GPU Adasum with non-power of 2 nodes is not supported yet. This "
                                      f"job has {hosts} hosts: use 1, 2, 4, 8, ... hosts, or op=Average")
    elif not is_power_of_two(registry.size):
        raise NotImplementedError(f"Running Adasum with non-power of 2 ranks is not supported yet. This job has "
                                  f"{registry.size} ranks: run 1, 2, 4, 8, ... ranks, or use op=Average")


def check_scattering_op(op: Any) -> ReduceOp:
    """A reduce-scatter's op: every elementwise one (Horovod's takes Average and Sum only), never
    Adasum, which reduces whole tensors."""
    checked = check_op(op)
    if checked is Adasum:
        raise InvalidArgumentError("reducescatter does not support op Adasum (as Horovod's: 'Reducescatter "
                                   "currently only supports AVERAGE and SUM.'); use op=Sum or op=Average")
    return checked


def _reduction(op: Any, prescale_factor: float, postscale_factor: float) -> "dict[str, Any]":
    return dict(op=op, prescale=float(prescale_factor), postscale=float(postscale_factor))


# -- the submit core -----------------------------------------------------------------


def _refuse(engine: Engine, kind: Kind, names: "list[str]", error: Exception) -> None:
    """Submit a refusal under each of ``names`` (see the module's docstring)."""
    refusal = Refusal.of(error)
    handle = Handle(len(names), len(names) > 1, engine.done_cv)  # nobody waits on it
    try:
        engine.submit([make_refusal(kind, name, handle, index, refusal) for index, name in enumerate(names)])
    except (InvalidArgumentError, HorovodInternalError):
        pass  # shut down, or the name is in flight here already: the caller's own error is what it sees


def _submit(kind: Kind, name: "str | None", process_set: ProcessSet, checked: "Callable[[], Checked]",
            parts: int = 1, grouped: bool = False) -> Handle:
    """Submit one op of ``parts`` arrays under one handle. ``checked`` runs the op's argument checks. If it
    raises, this rank still takes the op's name(s) into the negotiation, as a refusal, then raises."""
    engine = current().member(process_set).engine  # outside the set: there is nothing to take part in
    check_name(name)
    exits.forget_status()  # still submitting: any SystemExit noted before was caught, not an exit
    handle = Handle(parts, grouped, engine.done_cv)
    base = name or engine.auto_name()
    names = [f"{base}.{i}" for i in range(parts)] if grouped else [base]
    try:
        arrays, fields = checked()
        requests = [make_request(kind, array, n, handle, i, **fields)
                    for i, (array, n) in enumerate(zip(arrays, names))]
    except Exception as error:
        _refuse(engine, kind, names, error)
        raise
    engine.submit(requests)
    return handle


# -- one function per kind -----------------------------------------------------------


def submit_allreduce(array: Any, op: Any, name: "str | None", prescale_factor: float, postscale_factor: float,
                     in_place: bool, process_set: ProcessSet = global_process_set,
                     op_class: "type[AllreduceOp] | None" = None,
                     signature: "Signature | None" = None) -> AllreduceOp:
    """Submit an all-reduce of one array and return its op (a Handle): the per-tensor entry
    point the framework bindings build on (``allreduce_async``/``allreduce_async_`` take it too).

    ``op_class``: a subclass of ``AllreduceOp`` to create, so that a binding's handle is the
    runtime's op itself; ``signature``: the op's ``signature`` from an earlier submit of the
    same host array with the same (checked) arguments, so the checks need not run again.
    Arguments refused here are refused as by every other op."""
    registry = installed()
    if registry is not None and process_set is global_process_set and process_set.process_set_id == 0:
        engine = registry.engine  # the global set's engine: what member() returns for it
    else:
        engine = current().member(process_set).engine
    if name is not None and type(name) is not str:
        check_name(name)
    exits.forget_status()  # still submitting: any SystemExit noted before was caught, not an exit
    if signature is None:
        # The same checks as the general path's, in the same order, each skipped where the
        # common case (a ReduceOp member, a host array, not bool) makes it a no-op.
        try:
            if type(op) is not ReduceOp:  # a ReduceOp member passes as is (check_op's result)
                op = check_op(op)
            if type(array) is not np.ndarray:
                array = check_array(array)
            if array.dtype.kind == "b" or op is Adasum:  # only these restrict the dtype
                check_reducible(array.dtype, op)
            if op is Adasum:
                check_adasum(array, process_set)
            prescale_factor, postscale_factor = float(prescale_factor), float(postscale_factor)
            if type(array) is np.ndarray:  # the signature checks the dtype (TypeError)
                if in_place and not array.flags.writeable:
                    check_writable(array, "allreduce_")  # raises
                signature = host_allreduce_signature(array, op, prescale_factor, postscale_factor)
            else:
                dtype_code(array.dtype)
        except Exception as error:
            _refuse(engine, Kind.ALLREDUCE, [name or engine.auto_name()], error)
            raise
    return engine.submit_allreduce(array, name, op, in_place, prescale_factor, postscale_factor, op_class,
                                   signature)


def submit_grouped_allreduce(arrays: Any, op: ReduceOp, name: "str | None", prescale_factor: float,
                             postscale_factor: float, in_place: bool,
                             process_set: ProcessSet = global_process_set) -> Handle:
    """Several all-reduces under one handle (one tensor alone takes ``submit_allreduce``)."""
    items = listed(arrays)

    def checked() -> Checked:
        checked_op = check_op(op)
        group = [check_array(a) for a in items]
        for array in group:
            check_reducible(array.dtype, checked_op)
            if in_place:
                check_writable(array, "grouped_allreduce_")
        if checked_op is Adasum and group:
            check_adasum(group[0], process_set)
        return Checked(group, dict(_reduction(checked_op, prescale_factor, postscale_factor), in_place=in_place))
    return _submit(Kind.ALLREDUCE, name, process_set, checked, len(items), True)


def submit_allgather(array: Any, name: "str | None", process_set: ProcessSet) -> Handle:
    return _submit(Kind.ALLGATHER, name, process_set, lambda: Checked([check_array(array)], {}))


def submit_grouped_allgather(arrays: Any, name: "str | None", process_set: ProcessSet) -> Handle:
    items = listed(arrays)
    return _submit(Kind.ALLGATHER, name, process_set, lambda: Checked([check_array(a) for a in items], {}),
                   len(items), True)


def submit_broadcast(array: Any, root_rank: int, name: "str | None", process_set: ProcessSet,
                     in_place: bool) -> Handle:
    if not in_place:
        return _submit(Kind.BROADCAST, name, process_set,
                       lambda: Checked([check_array(array)], dict(root=check_root(root_rank, process_set))))
    return _submit(Kind.BROADCAST, name, process_set,
                   lambda: Checked([check_writable(check_array(array), "broadcast_")],
                                   dict(root=check_root(root_rank, process_set), in_place=True)))


def submit_reducescatter(array: Any, op: Any, name: "str | None", prescale_factor: float, postscale_factor: float,
                         process_set: ProcessSet) -> Handle:
    def checked() -> Checked:
        checked_array = check_array(array)
        checked_op = check_scattering_op(op)
        check_reducible(checked_array.dtype, checked_op)
        if checked_array.ndim == 0:
            raise InvalidArgumentError("reducescatter needs an array with at least one dimension to split; "
                                       "got a scalar (0-d): reshape it to (1,) or use allreduce")
        return Checked([checked_array], _reduction(checked_op, prescale_factor, postscale_factor))
    return _submit(Kind.REDUCESCATTER, name, process_set, checked)


def submit_grouped_reducescatter(arrays: Any, op: Any, name: "str | None", prescale_factor: float,
                                 postscale_factor: float, process_set: ProcessSet) -> Handle:
    items = listed(arrays)

    def checked() -> Checked:
        checked_op = check_scattering_op(op)
        group = [check_array(a) for a in items]
        for index, array in enumerate(group):
            check_reducible(array.dtype, checked_op)
            if array.ndim == 0:
                raise InvalidArgumentError(f"reducescatter needs arrays with at least one dimension to split; "
                                           f"arrays[{index}] is a scalar (0-d): reshape it to (1,)")
        return Checked(group, _reduction(checked_op, prescale_factor, postscale_factor))
    return _submit(Kind.REDUCESCATTER, name, process_set, checked, len(items), True)


def submit_alltoall(array: Any, splits: "Sequence[int] | None", name: "str | None",
                    process_set: ProcessSet) -> Handle:
    def checked() -> Checked:
        checked_array = check_array(array)
        if checked_array.ndim == 0:
            raise InvalidArgumentError("alltoall needs an array with at least one dimension to split")
        return Checked([checked_array], dict(splits=check_splits(splits, checked_array.shape[0], process_set)))
    return _submit(Kind.ALLTOALL, name, process_set, checked)


def submit_barrier(process_set: ProcessSet) -> Handle:
    return _submit(Kind.BARRIER, None, process_set, lambda: Checked([None], {}))


def submit_broadcast_object(obj: Any, root_rank: int, name: "str | None", process_set: ProcessSet) -> Handle:
    """The root's object, pickled here in the caller's thread (the engine moves bytes only). A root
    that cannot pickle its object refuses the op: the others raise its class."""
    def checked() -> Checked:
        root = check_root(root_rank, process_set)
        payload = pickle.dumps(obj) if root == current().member(process_set).rank else None
        return Checked([None], dict(root=root, obj=payload))
    return _submit(Kind.BROADCAST_OBJECT, name, process_set, checked)


def submit_allgather_object(obj: Any, name: "str | None", process_set: ProcessSet) -> Handle:
    return _submit(Kind.ALLGATHER_OBJECT, name, process_set, lambda: Checked([None], dict(obj=pickle.dumps(obj))))
