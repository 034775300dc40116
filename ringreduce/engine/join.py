"""``hvd.join()``: a rank with no more data stands in for the others' ops until every rank joined.

While some ranks have joined, the others' all-reduces and barriers still run:
each joined rank brings a stand-in (``stand_in``) with no data of its own, zeros
for a reduction (the op's identity for Min, Max and Product). Every other
collective fails on every rank that submitted it (``problem``), with the
RuntimeError Horovod's controller gives (horovod/common/controller.cc,
``ConstructResponse``: allgather, alltoall, reducescatter and broadcast "are not
supported with Join"); the job goes on, and those ranks may join afterwards.
The last rank to join is the result of every rank's ``join()``.
"""
from __future__ import annotations

import time
from typing import Any, Callable

import numpy as np

from mtrain.ringreduce.core.errors import JoinedError
from mtrain.ringreduce.core.ops import Kind, ReduceOp, dtype_from_code
from mtrain.ringreduce.core.requests import PLACEHOLDER, Handle, Request, Signature
from mtrain.ringreduce.transport.backend import backend_for


class JoinState:
    """This rank's view of a join in progress (engine thread). The join handle itself waits in the
    submit queue (``SubmitQueue.offer_join``), where the user's thread puts it."""

    __slots__ = ("active", "seen", "last")

    def __init__(self) -> None:
        self.active = False  # this rank stands in for every op with zeros
        self.seen: "set[int]" = set()  # ranks (of the engine's communicator) known to have joined
        self.last = -1

    def note(self, joined: "list[int]") -> bool:
        """Track who has joined (seen alike by every rank); returns whether anyone new joined."""
        new = set(joined) - self.seen
        if new:
            self.last = max(new)  # ranks joining in the same cycle: the highest is "last"
        self.seen = set(joined)
        return bool(new)

    def finish(self) -> int:
        """Every rank has joined: the rank that joined last; reset."""
        last = self.last
        self.active, self.seen, self.last = False, set(), -1
        return last


def runnable(ready: "list[str]", own: "list[Request | None]", ready_meta: "dict[str, Signature]",
             cached_signature: "Callable[[str], Signature]", joined: "list[int]",
             done_cv: Any) -> "tuple[list[Request], list[tuple[Request, JoinedError]]]":
    """The ready ops (by name, in the agreed order) as this rank runs them while ``joined`` (job
    ranks) have joined: its own (``own``, None where it has none: it has joined itself), a
    stand-in where it has none; and its ops that cannot run, with the error each ends with."""
    runnable, refused = [], []
    for name, request in zip(ready, own):
        signature = request.signature if request is not None else (
            ready_meta[name] if name in ready_meta else cached_signature(name))
        why = problem(signature, joined)
        if why:
            if request is not None:
                refused.append((request, JoinedError(f"op {name!r} cannot run: {why}")))
            continue
        runnable.append(request if request is not None else stand_in(name, signature, done_cv))
    return runnable, refused


# What Horovod's controller calls each collective it refuses while a rank has joined;
# the object forms are built on them in Horovod (broadcast_object on broadcast, allgather_object
# on allgather), so they are refused alike.
_REFUSED_WHILE_JOINED = {Kind.ALLGATHER: "Allgather", Kind.ALLGATHER_OBJECT: "Allgather",
                         Kind.ALLTOALL: "Alltoall", Kind.REDUCESCATTER: "Reducescatter",
                         Kind.BROADCAST: "Broadcast", Kind.BROADCAST_OBJECT: "Broadcast"}


def problem(signature: Signature, joined: "list[int]") -> str:
    """Why the op with this signature cannot run while ``joined`` (job ranks) have joined; "" if it can."""
    what = _REFUSED_WHILE_JOINED.get(Kind(signature.kind))
    if what is None or not joined:
        return ""
    hint = ("; gradients of sparse tensors are all-gathered, so pass sparse_as_dense=True to "
            "DistributedOptimizer" if what == "Allgather" else "")
    return (f"{what} is not supported with Join at this time: rank(s) {sorted(joined)} have called join() "
            f"and have no data for it; run it before any rank joins, or after join() returns on every "
            f"rank{hint}")


def stand_in(name: str, signature: Signature, done_cv: Any) -> Request:
    """What a joined rank brings to an all-reduce or a barrier the others submitted: zeros for an
    all-reduce (the identity for Min, Max and Product). Its result is dropped."""
    kind = Kind(signature.kind)
    dtype = dtype_from_code(signature.dtype)
    op = None if signature.op < 0 else ReduceOp(signature.op)
    if kind is Kind.BARRIER:
        array = PLACEHOLDER
    else:
        array = np.full(signature.shape, identity(op, dtype), dtype=dtype)
    if signature.backend != backend_for(array).name:  # the others' arrays live on a GPU: so does this one
        import cupy
        array = cupy.asarray(array)
    request = Request(kind, name, array, Handle(1, False, done_cv), 0, backend_for(array), op=op,
                      root=signature.root, in_place=True, prescale=signature.prescale,
                      postscale=signature.postscale)
    request.signature = signature
    # Submitted, in effect, now: the timeline's NEGOTIATE span and the step meter's wait run from
    # here (a never-submitted 0 made them as long as the machine's uptime).
    request.submitted = time.monotonic()
    return request


def identity(op: "ReduceOp | None", dtype: np.dtype) -> Any:
    """The value that leaves ``op``'s result unchanged (zeros for Sum, Average and kinds with no op)."""
    if op == ReduceOp.Min:
        return np.finfo(dtype).max if dtype.kind == "f" else (True if dtype.kind == "b" else np.iinfo(dtype).max)
    if op == ReduceOp.Max:
        return np.finfo(dtype).min if dtype.kind == "f" else (False if dtype.kind == "b" else np.iinfo(dtype).min)
    if op == ReduceOp.Product:
        return 1
    return 0
