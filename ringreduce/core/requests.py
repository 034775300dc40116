"""What a submitted op is, as the engine thread sees it, and what the user waits on.

* ``Signature``: what every rank must agree on for one op name (kind, dtype,
  shape, reduce op, root, scaling, memory). Interned: a step that repeats its
  ops brings the very same objects, so comparing a batch with a kept plan is
  mostly identity checks.
* ``Request``: one submitted op (one part of a handle).
* ``Handle``: the future of a submission (one op, or a group of all-reduces);
  ``Completion`` is where handles wait.
* ``AllreduceOp``: one all-reduce submitted on its own, its request and its
  handle in one object. A training step submits one per gradient; a framework
  binding may subclass it to make the op its own handle as well.
"""
from __future__ import annotations

import enum
import threading
from typing import Any, Callable, NamedTuple, Sequence

import numpy as np

from mtrain.ringreduce.core.errors import Refusal
from mtrain.ringreduce.core.ops import Kind, ReduceOp, dtype_code
from mtrain.ringreduce.transport.backend import backend_for

# Ops submitted without a name are named by a per-rank counter under this prefix
# (``SubmitQueue.auto_name``); such names never repeat, so the response cache never keeps them.
UNNAMED_PREFIX = "noname."


class RequestState(enum.Enum):
    """Where one submitted op stands in the negotiation on this rank. It changes only through
    the request's own methods: ``cache_at``, ``report`` and ``uncache``."""

    UNREPORTED = "unreported"  # neither cached nor reported to the coordinator yet
    REPORTED = "reported"      # sent to the coordinator; waiting for its verdict
    CACHED = "cached"          # known to every rank as a cache bit: goes in the bit vector


class Signature(NamedTuple):
    """What every rank must submit alike for one name; compared whole by the coordinator."""

    kind: int            # Kind
    dtype: int           # ops.dtype_code
    shape: "tuple[int, ...]"  # without the first dimension for allgather/alltoall; () when shapeless
    op: int              # ReduceOp, -1 for kinds without one
    root: int            # rank within the process set, -1 for kinds without one
    prescale: float
    postscale: float
    backend: str         # where the memory lives (Backend.name)
    parts: int = 1       # how many ops the handle groups: ranks grouping different counts mismatch


# Kinds whose signature leaves out (part of) the shape.
_FIRST_DIMENSION_FREE = frozenset((Kind.ALLGATHER, Kind.ALLTOALL))  # may differ per rank
_SHAPELESS = frozenset((Kind.BARRIER, Kind.BROADCAST_OBJECT, Kind.ALLGATHER_OBJECT))
_SIGNATURES: "dict[Signature, Signature]" = {}
_SIGNATURES_MAX = 1 << 16
_ALLREDUCE_CODE = int(Kind.ALLREDUCE)
# The signature of each host all-reduce seen so far, by (dtype, shape, op, prescale, postscale).
_HOST_ALLREDUCE: "dict[tuple, Signature]" = {}

PLACEHOLDER = np.empty(0, dtype=np.uint8)  # the array of ops that carry none (barrier, objects)
HOST = backend_for(PLACEHOLDER)  # the backend of every host array
_HOST_NAME = HOST.name


def intern(signature: Signature) -> Signature:
    """The one shared object equal to ``signature``."""
    interned = _SIGNATURES.get(signature)
    if interned is not None:
        return interned
    if len(_SIGNATURES) >= _SIGNATURES_MAX:
        _SIGNATURES.clear()
    return _SIGNATURES.setdefault(signature, signature)


def host_allreduce_signature(array: np.ndarray, op: ReduceOp, prescale: float, postscale: float) -> Signature:
    """The signature of an all-reduce of host array ``array`` (checked arguments). A caller that
    submits the same array with the same arguments every step may keep it and pass it to
    ``runtime.submit_allreduce``. TypeError for a dtype the runtime cannot reduce."""
    # Looked up by a plain tuple first: building the NamedTuple (a Python-level __new__) and
    # interning it would cost more than the rest of a per-tensor submit.
    key = (array.dtype, array.shape, int(op), prescale, postscale)
    signature = _HOST_ALLREDUCE.get(key)
    if signature is None:
        code = dtype_code(array.dtype)  # TypeError if unsupported
        if len(_HOST_ALLREDUCE) >= _SIGNATURES_MAX:
            _HOST_ALLREDUCE.clear()
        signature = _HOST_ALLREDUCE[key] = intern(
            Signature(_ALLREDUCE_CODE, code, array.shape, int(op), -1, prescale, postscale, _HOST_NAME))
    return signature


class Completion(threading.Condition):
    """Where handles wait: the engine notifies it once per batch it completes.

    ``waiting(+1)`` before a thread blocks on a handle and ``waiting(-1)`` after tell
    the engine that someone waits: it then starts its next cycle at once instead of
    holding on to let more submissions join the batch (``SubmitQueue.wait_for_cycle``)."""

    def __init__(self, waiting: "Callable[[int], None] | None" = None) -> None:
        super().__init__()
        self.waiting = waiting
        # Set by an engine that lets a thread about to block run its cycle (``Engine.assist``).
        self.assist: "Callable[[Handle], None] | None" = None


class Handle:
    """The future of one submitted op (or of a group of all-reduces).

    Deliberately light: no Event or Lock per handle (creating those costs more
    than the rest of a submit). Only the engine thread writes a handle; waiters
    sleep on the engine's one completion condition, notified once per batch.
    """

    __slots__ = ("_results", "_remaining", "_grouped", "_error", "_done_cv")

    def __init__(self, parts: int, grouped: bool, done_cv: threading.Condition) -> None:
        self._results: "list[Any]" = [None] * parts
        self._remaining = parts
        self._grouped = grouped
        self._error: "BaseException | None" = None
        self._done_cv = done_cv

    def complete(self, index: int, result: Any) -> None:
        """Part ``index`` ended with ``result`` (engine thread)."""
        self._results[index] = result
        self._remaining -= 1

    def fail(self, error: BaseException) -> None:
        """The handle ends with ``error`` (engine thread); the first error stays."""
        if self._error is None:
            self._error = error

    @property
    def parts(self) -> int:
        """How many ops the handle groups."""
        return len(self._results)

    def done(self) -> bool:
        return self._remaining == 0 or self._error is not None

    def wait(self) -> Any:
        if not (self._remaining == 0 or self._error is not None):
            self._block()
        if self._error is not None:
            raise self._error
        return self._results if self._grouped else self._results[0]

    def _block(self) -> None:
        cv = self._done_cv
        assist = getattr(cv, "assist", None)  # None: a plain Condition, or no engine help
        if assist is not None:
            assist(self)
            if self.done():
                return
        waiting = getattr(cv, "waiting", None)  # None: a plain Condition (no engine to hurry)
        if waiting is not None:
            waiting(1)
        try:
            with cv:
                while not self.done():
                    cv.wait(0.1)  # short waits keep Ctrl-C responsive
        finally:
            if waiting is not None:
                waiting(-1)


class Request:
    """One submitted op (one part of a handle), as the engine thread sees it.

    A plain class with slots rather than a dataclass: a training step creates one per
    tensor, so its construction is on the per-tensor path."""

    __slots__ = ("kind", "name", "array", "handle", "index", "backend", "op", "root", "splits", "in_place",
                 "prescale", "postscale", "obj", "submitted", "state", "signature", "bit")

    def __init__(self, kind: Kind, name: str, array: Any, handle: Handle, index: int, backend: Any,
                 op: "ReduceOp | None" = None, root: int = -1, splits: "Sequence[int] | None" = None,
                 in_place: bool = False, prescale: float = 1.0, postscale: float = 1.0,
                 obj: "bytes | None" = None) -> None:
        self.kind = kind
        self.name = name
        self.array = array
        self.handle = handle
        self.index = index
        self.backend = backend
        self.op = op
        self.root = root
        self.splits = splits
        self.in_place = in_place
        self.prescale = prescale
        self.postscale = postscale
        self.obj = obj  # a pickled object (the *_object collectives)
        self.submitted = 0.0  # set by Engine.submit
        self.state = RequestState.UNREPORTED
        self.signature = self.meta()  # validates the dtype here, in the caller's thread
        self.bit = -1  # response-cache bit while state is CACHED

    def __repr__(self) -> str:
        return f"Request({self.name!r}, {self.describe()})"

    def meta(self) -> Signature:
        """What every rank must agree on for this name (one shared object per distinct value)."""
        kind = self.kind
        array = self.array
        if kind in _FIRST_DIMENSION_FREE:
            shape: "tuple[int, ...]" = tuple(array.shape[1:])
        elif kind in _SHAPELESS:
            shape = ()
        else:
            shape = tuple(array.shape)
        op = self.op
        return intern(Signature(int(kind), dtype_code(array.dtype), shape, -1 if op is None else int(op), self.root,
                                self.prescale, self.postscale, self.backend.name, len(self.handle._results)))

    def describe(self, members: "Sequence[int] | None" = None) -> str:
        """What this rank submitted, for error messages; ``members`` maps the engine's ranks to
        the job's (a process set's root is a rank of the set inside, a job rank to the user)."""
        text = self.kind.name.lower()
        if isinstance(self.signature, Refusal):
            return f"{text} refused ({self.signature.text})"
        if self.array is not None and self.kind not in _SHAPELESS:
            text += f" {self.array.dtype}{list(self.array.shape)}"
        if self.op is not None:
            text += f" op={ReduceOp(self.op).name}"
        if self.root >= 0:
            text += f" root_rank={self.root if members is None else members[self.root]}"
        if (self.prescale, self.postscale) != (1.0, 1.0):
            text += f" prescale={self.prescale:g} postscale={self.postscale:g}"
        parts = len(self.handle._results)
        if parts > 1:
            text += f" (part {self.index + 1} of {parts})"
        return text

    @property
    def nbytes(self) -> int:
        return self.array.nbytes

    def cache_at(self, bit: int) -> None:
        """Every rank knows this op as cache ``bit``: it goes in the bit vector."""
        self.state = _CACHED
        self.bit = bit

    def report(self) -> None:
        """Sent to the coordinator: it waits for the verdict."""
        self.state = _REPORTED

    def uncache(self) -> None:
        """Its cache entry is gone (invalidated, or the cache turned off): it is reported afresh."""
        self.state = _UNREPORTED


# An Enum member read through its class costs a lookup each time.
_UNREPORTED, _REPORTED, _CACHED = RequestState.UNREPORTED, RequestState.REPORTED, RequestState.CACHED


class AllreduceOp(Handle):
    """One all-reduce submitted on its own: its handle and its request in one object.

    The engine sees it as a Request (``handle`` is the op itself, ``index`` 0); the user as a
    Handle. Fields that are the same for every such op are class attributes. A framework
    binding may subclass it (adding its own slots) so that the op is also its handle; the
    runtime creates it (``runtime.submit_allreduce``), with arguments already checked."""

    __slots__ = ("name", "array", "backend", "op", "in_place", "prescale", "postscale", "submitted", "state",
                 "signature", "bit")

    kind = Kind.ALLREDUCE
    index = 0
    root = -1
    splits = None
    obj = None
    _grouped = False

    def __init__(self, done_cv: threading.Condition, name: str, array: Any, op: ReduceOp, in_place: bool,
                 prescale: float, postscale: float, signature: "Signature | None" = None) -> None:
        self._results = [None]
        self._remaining = 1
        self._error = None
        self._done_cv = done_cv
        self.name = name
        self.array = array
        self.op = op
        self.in_place = in_place
        self.prescale = prescale
        self.postscale = postscale
        self.submitted = 0.0
        self.state = _UNREPORTED
        self.bit = -1
        if signature is not None:  # kept by the caller from an earlier submit of this host array
            self.backend = HOST
            self.signature = signature
        elif type(array) is np.ndarray:
            self.backend = HOST
            self.signature = host_allreduce_signature(array, op, prescale, postscale)
        else:
            self.backend = backend_for(array)
            self.signature = self.meta()

    @property
    def handle(self) -> "AllreduceOp":
        return self  # a property, not a slot: a slot would make each op a reference cycle

    __repr__ = Request.__repr__
    meta = Request.meta
    describe = Request.describe
    nbytes = Request.nbytes
    cache_at = Request.cache_at
    report = Request.report
    uncache = Request.uncache


def make_request(kind: Kind, array: "Any | None", name: str, handle: Handle, index: int = 0,
                 **fields: Any) -> Request:
    """A request for ``array`` (None: an op that carries no array) in its own memory's backend."""
    if array is None:
        array = PLACEHOLDER
    backend = HOST if type(array) is np.ndarray else backend_for(array)
    return Request(kind, name, array, handle, index, backend, **fields)


def make_refusal(kind: Kind, name: str, handle: Handle, index: int, refusal: Refusal) -> Request:
    """What this rank negotiates under ``name`` for an op whose arguments it refused (``errors.Refusal``):
    carries no data, and its signature is the refusal, so the op never runs on any rank."""
    request = Request(kind, name, PLACEHOLDER, handle, index, HOST)
    request.signature = refusal  # type: ignore[assignment]
    return request
