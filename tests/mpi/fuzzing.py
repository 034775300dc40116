"""A randomized fuzzer of ``mtrain.ringreduce``'s public API: errors on every rank or none, never a hang.

Each case gives every rank a submission: one collective (any of the public ones, synchronous
or ``*_async`` + ``synchronize``) with a dtype, shapes (zero-size ones included), a memory
layout (contiguous, strided, Fortran-ordered, read-only), a reduce op with scaling factors, a
root, alltoall splits, a name and a process set. A case is one of

* ``same``: every rank submits alike (the free per-rank parts aside: data, first dimensions
  of gathers, alltoall splits, layout, sync or async);
* ``deviate``: one rank changes one field that every rank must agree on (dtype, shape, op,
  root, scaling, the collective itself, the number of grouped tensors, the name);
* ``bad_all`` / ``bad_one``: every rank, or one rank, passes a value a user can get wrong
  (an unsupported dtype, a list instead of an array, a bad op, a bool array with an
  arithmetic op, a bad scaling factor, negative, float, short or long splits, a root outside
  the job or the set, an in-place op on a read-only array, a 0-d array to split, an object
  that cannot be pickled, a name that is not a string, a set that is not registered).

Sometimes a rank outside the case's process set calls the op too: it must fail alone.

Every rank generates every rank's submission and input data from ``(seed, case number)``, so
each checks its own result against a reference computed from every rank's input. The outcome
on each rank (a digest of the result, or the class of the error) goes to the others over a
communicator of the fuzzer's own (plain mpi4py, not the runtime), and the case passes when

* every submission is valid and agrees: every rank succeeds, with the reference result
  (bitwise the same on every rank where the result is replicated), an out-of-place op leaves
  its input alone, and an in-place op returns the very array it was given;
* otherwise every rank of the set raises, all the same error class, within the stall limit.
  One exception, by design: when two ranks are refused at submission for *different*
  reasons, each raises its own error at the call (before any other rank is heard from),
  so there the classes may differ (docs/failure-semantics.md).

A watchdog ends the job when a case outlives the stall limit by ``HANG_MARGIN_S``, printing
the seed, the case and every rank's submission, so a hang is found, not waited out.

Not generated, because no runtime could give the same error on every rank there: ranks that
pass different process sets for one op (the ops go to different engines, which never meet),
and ranks of which some name an op and others leave it unnamed (an unnamed op takes the next
number of a per-rank counter, so the counters part for good).

Standard library, NumPy, mpi4py and the installed ``mtrain`` only: ``benchmarks/fuzz.py``
loads this file by path for its long run.
"""
from __future__ import annotations

import collections
import dataclasses
import hashlib
import os
import pickle
import sys
import threading
import time
from typing import Any, Callable

import numpy as np
from mpi4py import MPI

import mtrain.ringreduce as rr

DEFAULT_SEED = 22003
SEED_VARIABLE = "MTRAIN_FUZZ_SEED"      # replay: the seed a failure printed
FIRST_VARIABLE = "MTRAIN_FUZZ_FIRST"    # replay: start at this case number
CASES_VARIABLE = "MTRAIN_FUZZ_CASES"    # how many cases to run
HANG_MARGIN_S = 30.0  # a case that outlives the stall limit by this much is a hang

KINDS = ("allreduce", "allreduce_", "grouped_allreduce", "grouped_allreduce_", "allgather", "grouped_allgather",
         "broadcast", "broadcast_", "reducescatter", "grouped_reducescatter", "alltoall", "barrier",
         "broadcast_object", "allgather_object")
# What the runtime matches across ranks: the collective (in place or not is one collective)
# and whether it is a group.
FAMILY = {"allreduce": "allreduce", "allreduce_": "allreduce", "grouped_allreduce": "allreduce",
          "grouped_allreduce_": "allreduce", "allgather": "allgather", "grouped_allgather": "allgather",
          "broadcast": "broadcast", "broadcast_": "broadcast", "reducescatter": "reducescatter",
          "grouped_reducescatter": "reducescatter", "alltoall": "alltoall", "barrier": "barrier",
          "broadcast_object": "broadcast_object", "allgather_object": "allgather_object"}
REDUCING = {"allreduce", "allreduce_", "grouped_allreduce", "grouped_allreduce_", "reducescatter",
            "grouped_reducescatter"}
IN_PLACE = {"allreduce_", "grouped_allreduce_", "broadcast_"}
ROOTED = {"broadcast", "broadcast_", "broadcast_object"}
OBJECTS = {"broadcast_object", "allgather_object"}
ARRAYLESS = OBJECTS | {"barrier"}
SPLIT_ROWS = {"reducescatter", "grouped_reducescatter", "alltoall"}  # need at least one dimension
FIRST_FREE = {"allgather", "grouped_allgather", "alltoall"}  # the first dimension may differ per rank
REPLICATED = {"allreduce", "allreduce_", "grouped_allreduce", "grouped_allreduce_", "allgather",
              "grouped_allgather", "broadcast", "broadcast_", "barrier", "broadcast_object", "allgather_object"}

# The documented dtypes (docs/runtime.md); bfloat16 where ml_dtypes is installed.
DTYPES = ["float16", "float32", "float64", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32",
          "uint64", "bool"]
try:
    import ml_dtypes  # noqa: F401
    DTYPES.append("bfloat16")
except ImportError:  # pragma: no cover - ml_dtypes is a dev dependency
    pass
BAD_DTYPES = ["complex64", "complex128", "longdouble", "object", "<U2", "datetime64[s]"]
OPS = [rr.Sum, rr.Average, rr.Min, rr.Max, rr.Product]
BAD_OPS = [6, 42, "Sum"]
SCALES = [1.0, 1.0, 1.0, 0.5, 2.0, 0.25, -1.0]
NAMES = ["w", "w.grad", "bias", "layer.0"]  # reused across cases: the response cache sees them change


@dataclasses.dataclass(frozen=True)
class Part:
    """One tensor of a submission."""

    dtype: str
    shape: "tuple[int, ...]"
    layout: str  # c, strided, fortran, readonly


@dataclasses.dataclass(frozen=True)
class Submission:
    """What one rank passes for one case."""

    kind: str
    asynchronous: bool = False
    parts: "tuple[Part, ...]" = ()
    op: Any = None
    root: Any = None
    splits: Any = None
    name: Any = None
    process_set: Any = 0  # index of a registered set (0: the global set), or "unregistered", "list"
    prescale: Any = 1.0
    postscale: Any = 1.0
    obj: Any = None  # an int (the object is built from it) or "lock" / "lambda" (unpicklable)
    as_list: bool = False  # pass a Python list instead of an array

    def __str__(self) -> str:
        fields = [self.kind + (" async" if self.asynchronous else "")]
        for field in dataclasses.fields(self)[2:]:
            value = getattr(self, field.name)
            if isinstance(value, np.ndarray):  # splits given as an array
                fields.append(f"{field.name}=np.array({value.tolist()}, {value.dtype})")
            elif value != field.default:
                fields.append(f"{field.name}={value!r}")
        return "Submission(" + ", ".join(fields) + ")"


@dataclasses.dataclass
class Case:
    number: int
    mode: str
    set_index: int
    members: "list[int]"
    submissions: "dict[int, Submission]"  # global rank -> what it submits; ranks not in it sit out
    stray: "int | None" = None  # a rank outside the set that calls the op as well
    field: str = ""  # what deviates, or the bad value's kind

    def describe(self, seed: int) -> str:
        lines = [f"seed={seed} case={self.number} mode={self.mode} {self.field} process set {self.set_index} "
                 f"(ranks {self.members})" + (f", rank {self.stray} outside it calls too" if self.stray is not None
                                               else "")]
        for rank, submission in sorted(self.submissions.items()):
            lines.append(f"  rank {rank}: {submission}")
        return "\n".join(lines)


# -- generation ---------------------------------------------------------------------------

def set_lists(size: int) -> "list[list[int]]":
    """The process sets the fuzzer registers, after the global set (index 0)."""
    return {1: [], 2: [[1]], 3: [[0, 2], [1, 2]]}.get(size, [[0, size - 1], list(range(1, size))])


class _Generator:
    def __init__(self, rng: np.random.Generator, size: int) -> None:
        self.rng = rng
        self.size = size

    def pick(self, options: "list[Any] | tuple[Any, ...]") -> Any:
        return options[int(self.rng.integers(len(options)))]

    def chance(self, p: float) -> bool:
        return bool(self.rng.random() < p)

    def shape(self, min_ndim: int = 0) -> "tuple[int, ...]":
        ndim = int(self.rng.integers(min_ndim, 4))
        if self.chance(0.06):  # big enough for the ring and shared memory
            return (int(self.rng.integers(3000, 40000)),) + (1,) * max(ndim - 1, 0) if ndim else (5000,)
        return tuple(int(self.rng.choice([0, 1, 2, 3, 4, 5], p=[0.1, 0.2, 0.2, 0.2, 0.15, 0.15]))
                     for _ in range(ndim))

    def dtype(self, op: Any = None) -> str:
        if op is not None and op not in (rr.Min, rr.Max):
            return self.pick([d for d in DTYPES if d != "bool"])
        return self.pick(DTYPES)

    def layout(self, kind: str) -> str:
        choices = ["c", "c", "c", "strided", "fortran"]
        if kind not in IN_PLACE:
            choices.append("readonly")  # a read-only input to an out-of-place op is fine
        return self.pick(choices)

    def splits(self, rows: int, m: int) -> "tuple[int, ...]":
        cuts = sorted(int(c) for c in self.rng.integers(0, rows + 1, size=m - 1))
        bounds = [0] + cuts + [rows]
        return tuple(bounds[i + 1] - bounds[i] for i in range(m))

    def base(self, kind: str, members: "list[int]", name: Any) -> Submission:
        """A valid submission of ``kind`` (before the per-rank free parts)."""
        m = len(members)
        op = self.pick(OPS) if kind in REDUCING else None
        if op is not None and self.chance(0.15):
            op = int(op)  # Horovod takes the int too
        parts: "tuple[Part, ...]" = ()
        if kind not in ARRAYLESS:
            count = int(self.rng.integers(1, 4)) if kind.startswith("grouped") else 1
            dtype = self.dtype(op)
            parts = tuple(Part(dtype if self.chance(0.7) else self.dtype(op),
                               self.shape(1 if kind in SPLIT_ROWS else 0), "c") for _ in range(count))
            if kind == "alltoall":
                first = int(self.rng.integers(0, 4)) * m
                parts = (dataclasses.replace(parts[0], shape=(first,) + parts[0].shape[1:]),)
        scaled = kind in REDUCING and self.chance(0.3)
        # A negative factor would take an unsigned sum below zero: its cast back is undefined.
        scales = [s for s in SCALES if s > 0 or all(p.dtype[0] in "if" for p in parts)]
        return Submission(
            kind, parts=parts, op=op, name=name,
            root=self.pick(members) if kind in ROOTED else None,
            prescale=self.pick(scales) if scaled else 1.0, postscale=self.pick(scales) if scaled else 1.0,
            obj=0 if kind in OBJECTS else None)

    def free(self, submission: Submission, m: int) -> Submission:
        """The parts every rank chooses for itself: layout, sync or async, first dimensions of
        gathers, alltoall splits, objects."""
        kind = submission.kind
        parts = []
        for part in submission.parts:
            shape = part.shape
            if kind in FIRST_FREE and shape and self.chance(0.5):
                shape = (int(self.rng.integers(0, 5)),) + shape[1:]
            elif kind in FIRST_FREE and not shape and self.chance(0.2):
                shape = (int(self.rng.integers(0, 3)),)  # a 0-d array gathers as one row; so may a 1-d
            parts.append(Part(part.dtype, shape, self.layout(kind)))
        splits = submission.splits
        if kind == "alltoall":
            rows = parts[0].shape[0] if parts[0].shape else 0
            if rows % m or self.chance(0.6):
                splits = self.splits(rows, m)
            if splits is not None and self.chance(0.2):
                splits = np.asarray(splits, dtype=self.pick([np.int32, np.int64, np.uint16]))
        return dataclasses.replace(
            submission, parts=tuple(parts), splits=splits,
            asynchronous=kind not in ARRAYLESS and self.chance(0.4),
            obj=int(self.rng.integers(1, 1000)) if kind in OBJECTS else None)

    # -- one rank differs, with a valid value ---------------------------------------------
    def deviate(self, submission: Submission, members: "list[int]") -> "tuple[Submission, str]":
        kind = submission.kind
        fields = ["kind"]
        if submission.parts:
            fields += ["dtype", "shape"]
        if kind in REDUCING:
            fields += ["op", "scale"]
        if kind in ROOTED and len(members) > 1:
            fields.append("root")
        if kind.startswith("grouped"):
            fields.append("count")
        if isinstance(submission.name, str):
            fields.append("name")
        field = self.pick(fields)
        if field == "kind":
            # barrier takes no name: a named op against it would be a named op against an unnamed one.
            # A group against a single op meets under no common name: a stall, which takes the
            # stall limit, so mostly another collective of the same shape (a mismatch, at once).
            grouped = kind.startswith("grouped")
            same_shape = self.chance(0.75)
            other = self.pick([k for k in KINDS if (FAMILY[k], k.startswith("grouped")) != (FAMILY[kind], grouped)
                               and (k != "barrier" or submission.name is None)
                               and (not same_shape or k.startswith("grouped") == grouped)])
            return self.free(self.base(other, members, submission.name), len(members)), field
        parts = list(submission.parts)
        if field == "dtype":
            i = int(self.rng.integers(len(parts)))
            op = submission.op
            dtype = self.pick([d for d in DTYPES if d != parts[i].dtype and (d != "bool" or op is None
                                                                           or op in (rr.Min, rr.Max))])
            parts[i] = dataclasses.replace(parts[i], dtype=dtype)
        elif field == "shape":
            i = int(self.rng.integers(len(parts)))
            shape = parts[i].shape
            if kind in FIRST_FREE:  # only the trailing dimensions must agree
                trailing = shape[1:]
                if trailing and self.chance(0.5):
                    trailing = (trailing[0] + 1,) + trailing[1:]
                else:
                    trailing = trailing + (2,)
                shape = (shape[0] if shape else 1,) + trailing
            else:
                while True:
                    new = self.shape(1 if kind in SPLIT_ROWS else 0)
                    if new != shape:
                        break
                shape = new
            if kind == "alltoall":
                submission = dataclasses.replace(submission, splits=self.splits(shape[0], len(members)))
            parts[i] = dataclasses.replace(parts[i], shape=shape)
        elif field == "op":
            allowed = [o for o in OPS if int(o) != int(submission.op)
                       and (all(p.dtype != "bool" for p in parts) or o in (rr.Min, rr.Max))]
            return dataclasses.replace(submission, op=self.pick(allowed)), field
        elif field == "scale":
            which = self.pick(["prescale", "postscale"])
            value = self.pick([s for s in (0.5, 2.0, 3.0, 1.0) if s != getattr(submission, which)])
            return dataclasses.replace(submission, **{which: value}), field
        elif field == "root":
            return dataclasses.replace(submission, root=self.pick([r for r in members if r != submission.root])), field
        elif field == "count":
            count = self.pick([c for c in (1, 2, 3, 4) if c != len(parts)])
            parts = (parts * 4)[:count]
        elif field == "name":
            return dataclasses.replace(submission, name=submission.name + ".other"), field
        return dataclasses.replace(submission, parts=tuple(parts)), field

    # -- values a user can get wrong ------------------------------------------------------
    def bad_kinds(self, submission: Submission, everywhere: bool, is_root: bool) -> "list[str]":
        kind = submission.kind
        options: "list[str]" = []
        if kind not in ARRAYLESS:
            options += ["dtype", "not_array"]
        if kind in REDUCING:
            options += ["op", "bool_op", "scale"]
        if kind in IN_PLACE:
            options += ["readonly"] * 2
        if kind in SPLIT_ROWS:
            options.append("scalar")
        if kind == "alltoall":
            options += ["splits"] * 3 + ["indivisible"]
        if kind in ROOTED:
            options += ["root"] * 2
        if kind == "allgather_object" or (kind == "broadcast_object" and is_root):
            options += ["pickle"] * 2
        if everywhere:
            options += ["process_set"] + (["name"] if kind != "barrier" else [])
        return options

    def bad(self, submission: Submission, label: str, members: "list[int]") -> Submission:
        parts = list(submission.parts)
        m = len(members)
        if label == "dtype":
            i = int(self.rng.integers(len(parts)))
            parts[i] = dataclasses.replace(parts[i], dtype=self.pick(BAD_DTYPES))
        elif label == "not_array":
            return dataclasses.replace(submission, as_list=True)
        elif label == "op":
            return dataclasses.replace(submission, op=self.pick(BAD_OPS))
        elif label == "bool_op":
            parts = [dataclasses.replace(p, dtype="bool") for p in parts]
            return dataclasses.replace(submission, parts=tuple(parts),
                                       op=self.pick([rr.Sum, rr.Average, rr.Product]))
        elif label == "scale":
            return dataclasses.replace(submission, **{self.pick(["prescale", "postscale"]): self.pick(["x", None])})
        elif label == "readonly":
            i = int(self.rng.integers(len(parts)))
            parts[i] = dataclasses.replace(parts[i], layout="readonly")
        elif label == "scalar":
            i = int(self.rng.integers(len(parts)))
            parts[i] = dataclasses.replace(parts[i], shape=())
        elif label == "indivisible":
            shape = parts[0].shape
            parts[0] = dataclasses.replace(parts[0], shape=(m * int(self.rng.integers(0, 3)) + 1,) + shape[1:])
            return dataclasses.replace(submission, parts=tuple(parts), splits=None) if m > 1 else \
                dataclasses.replace(submission, splits=(-1,))
        elif label == "splits":
            rows = parts[0].shape[0]
            good = list(self.splits(rows, m))
            how = self.pick(["negative", "float", "short", "long", "sum"])
            if how == "negative":
                good[0] -= rows + 1
                good[-1] += rows + 1
                bad: Any = tuple(good)
            elif how == "float":
                bad = tuple(float(s) for s in good)
            elif how == "short":
                bad = tuple(good[:-1])
            elif how == "long":
                bad = tuple(good) + (0,)
            else:
                good[0] += 1
                bad = tuple(good)
            return dataclasses.replace(submission, splits=bad)
        elif label == "root":
            outside = [r for r in range(self.size) if r not in members]
            return dataclasses.replace(submission, root=self.pick([self.size, -1, 1.5] + outside * 3))
        elif label == "pickle":
            return dataclasses.replace(submission, obj=self.pick(["lock", "lambda"]))
        elif label == "name":
            return dataclasses.replace(submission, name=self.pick([7, b"w", 2.5]))
        elif label == "process_set":
            return dataclasses.replace(submission, process_set=self.pick(["unregistered", "list"]))
        return dataclasses.replace(submission, parts=tuple(parts))


def generate(seed: int, number: int, size: int, sets: "list[list[int]]") -> Case:
    """Case ``number`` of ``seed`` for a job of ``size`` ranks with the extra process sets ``sets``:
    the same on every rank."""
    gen = _Generator(np.random.default_rng([seed, number]), size)
    set_index = 0 if not sets or gen.chance(0.75) else int(gen.rng.integers(1, len(sets) + 1))
    members = list(range(size)) if set_index == 0 else sets[set_index - 1]
    kind = gen.pick(KINDS)
    name = None if gen.chance(0.35) else gen.pick(NAMES + [f"case.{number}"] * 2)
    if kind == "barrier":
        name = None  # barrier() takes no name
    base = gen.base(kind, members, name)
    mode = str(gen.rng.choice(["same", "deviate", "bad_all", "bad_one"], p=[0.35, 0.3, 0.12, 0.23]))
    if len(members) == 1 and mode == "deviate":
        mode = "same"
    submissions = {r: gen.free(base, len(members)) for r in members}
    field = ""
    if mode == "deviate":
        odd = gen.pick(members)
        submissions[odd], field = gen.deviate(submissions[odd], members)
    elif mode in ("bad_all", "bad_one"):
        odd = gen.pick(members)
        if kind == "broadcast_object" and mode == "bad_one" and gen.chance(0.7):
            odd = base.root  # the root's object is the one that is pickled
        options = gen.bad_kinds(base, mode == "bad_all", odd == base.root)
        if not options:
            mode = "same"
        else:
            field = gen.pick(options)
            submissions[odd] = gen.bad(submissions[odd], field, members)
            if mode == "bad_all":  # one mistake, made by every rank
                for rank in members:
                    if rank != odd:
                        submissions[rank] = _same_bad(gen.bad(submissions[rank], field, members),
                                                      submissions[odd], field)
    stray = None
    outside = [r for r in range(size) if r not in members]
    if outside and gen.chance(0.1):
        stray = gen.pick(outside)
        submissions[stray] = gen.free(base, len(members))
    return Case(number, mode, set_index, members, submissions, stray, field)


def _same_bad(submission: Submission, first: Submission, label: str) -> Submission:
    """``submission`` with the bad value of ``first`` (bad_all: one mistake, made by every rank)."""
    if label in ("name", "process_set", "root", "op", "scale"):
        return dataclasses.replace(submission, name=first.name, process_set=first.process_set, root=first.root,
                                   op=first.op, prescale=first.prescale, postscale=first.postscale)
    if label == "pickle":
        return dataclasses.replace(submission, obj=first.obj)
    if label in ("dtype", "bool_op"):
        parts = tuple(dataclasses.replace(p, dtype=q.dtype) for p, q in zip(submission.parts, first.parts))
        return dataclasses.replace(submission, parts=parts, op=first.op)
    return submission


# -- the model: what the runtime must refuse at submission, and what ranks must agree on --------

def problems(submission: Submission, members: "list[int]") -> "frozenset[str]":
    """The submit-time problems of ``submission`` (empty: valid on its own)."""
    found = set()
    kind = submission.kind
    if submission.process_set in ("unregistered", "list"):
        found.add("process_set")
    if submission.name is not None and not isinstance(submission.name, str):
        found.add("name")
    if submission.as_list:
        found.add("not_array")
    if any(p.dtype in BAD_DTYPES for p in submission.parts):
        found.add("dtype")
    if kind in REDUCING:
        op = submission.op
        if isinstance(op, str) or op not in [int(o) for o in OPS]:
            found.add("op")
        elif any(p.dtype == "bool" for p in submission.parts) and int(op) not in (int(rr.Min), int(rr.Max)):
            found.add("bool_op")
        if not all(isinstance(s, float) for s in (submission.prescale, submission.postscale)):
            found.add("scale")
    if kind in IN_PLACE and any(p.layout == "readonly" for p in submission.parts):
        found.add("readonly")
    if kind in SPLIT_ROWS and any(p.shape == () for p in submission.parts):
        found.add("scalar")
    if kind == "alltoall" and submission.parts and submission.parts[0].shape:
        rows, m = submission.parts[0].shape[0], len(members)
        splits = submission.splits
        if splits is None:
            if rows % m:
                found.add("indivisible")
        else:
            values = np.asarray(splits)
            if (values.size != m or values.dtype.kind not in "iu" or (values < 0).any()
                    or int(values.sum()) != rows):
                found.add("splits")
    if kind in ROOTED:
        root = submission.root
        if isinstance(root, bool) or not isinstance(root, (int, np.integer)) or root not in members:
            found.add("root")
    if kind in OBJECTS and submission.obj in ("lock", "lambda"):
        found.add("pickle")
    return frozenset(found)


def signature(submission: Submission) -> tuple:
    """What every rank of the set must submit alike for the op to run."""
    kind = submission.kind
    parts = tuple((p.dtype, p.shape[1:] if kind in FIRST_FREE else p.shape) for p in submission.parts)
    op = None if submission.op is None else int(submission.op)
    scaling = (float(submission.prescale), float(submission.postscale)) if kind in REDUCING else None
    return (FAMILY[kind], kind.startswith("grouped"), len(parts), parts, op, submission.root, scaling,
            submission.name)


@dataclasses.dataclass(frozen=True)
class Expectation:
    succeed: bool
    same_class: bool  # when failing: one error class on every rank of the set
    why: str


def expect(case: Case) -> Expectation:
    members = case.members
    found = {r: problems(case.submissions[r], members) for r in members}
    # broadcast_object pickles the root's object only: another rank's unpicklable object is never touched.
    for r in members:
        submission = case.submissions[r]
        if submission.kind == "broadcast_object" and "pickle" in found[r] and submission.root != r:
            found[r] = found[r] - {"pickle"}
    refused = {r: p for r, p in found.items() if p}
    if refused:
        kinds = set(refused.values())
        return Expectation(False, len(kinds) == 1,
                           "refused at submission: " + "; ".join(f"rank {r}: {sorted(p)}" for r, p in refused.items()))
    signatures = {signature(case.submissions[r]) for r in members}
    if len(signatures) > 1:
        return Expectation(False, True, f"ranks disagree ({case.field})")
    return Expectation(True, True, "valid and alike")


# -- data and references ----------------------------------------------------------------------

def _np_dtype(name: str) -> np.dtype:
    if name == "bfloat16":
        import ml_dtypes
        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)


def values(seed: int, number: int, rank: int, index: int, part: Part, op: Any = None) -> np.ndarray:
    """Rank ``rank``'s data for part ``index`` of case ``number``: distinct per rank and element."""
    rng = np.random.default_rng([seed, number, rank, index, 7])
    dtype = _np_dtype(part.dtype) if part.dtype not in BAD_DTYPES else None
    shape = part.shape
    if dtype is None:
        if part.dtype == "object":
            return np.full(shape, 1, dtype=object)
        if part.dtype == "<U2":
            return np.full(shape, "ab")
        return np.zeros(shape, dtype=np.dtype(part.dtype))
    product = op is not None and not isinstance(op, str) and op == int(rr.Product)
    if dtype.kind == "b":
        return np.asarray(rng.random(shape) < 0.5)
    if dtype.kind in "iu":
        low, high = ((0, 3) if dtype.kind == "u" else (-2, 3)) if product else \
            ((0, 41) if dtype.kind == "u" else (-20, 21))
        return np.asarray(rng.integers(low, high, size=shape)).astype(dtype)
    if product:
        return np.asarray(1.0 + rng.integers(-4, 5, size=shape) / 16.0).astype(dtype)
    return np.asarray(rng.integers(-32, 33, size=shape) * 0.25).astype(dtype)


def _arrange(data: np.ndarray, layout: str) -> np.ndarray:
    """``data`` in the memory layout asked for (the same values)."""
    if layout == "strided" and data.ndim:
        big = np.zeros(data.shape[:-1] + (2 * data.shape[-1] + 1,), dtype=data.dtype)
        view = big[..., 1::2]
        view[...] = data
        return view
    if layout == "fortran":
        return np.asarray(data, order="F")  # (np.asfortranarray would make a 0-d array 1-d)
    if layout == "readonly":
        data = data.copy()
        data.flags.writeable = False
    return data


def _scale(data: np.ndarray, factor: float) -> np.ndarray:
    """Horovod's scaling: floats in their dtype, integers in float64 truncated toward zero."""
    if factor == 1.0 or data.size == 0:
        return data
    if data.dtype.kind in "iu":
        return np.trunc(data * np.float64(factor)).astype(data.dtype)
    return data * data.dtype.type(factor)


def reduction(inputs: "list[np.ndarray]", op: int, prescale: float, postscale: float) -> np.ndarray:
    """The reference reduction: integers exactly (wrapping in their dtype), floats in float64."""
    dtype = inputs[0].dtype
    scaled = [_scale(a, prescale) for a in inputs]
    m = len(inputs)
    if dtype.kind in "biu":
        fn = {int(rr.Sum): np.add, int(rr.Average): np.add, int(rr.Product): np.multiply,
              int(rr.Min): np.logical_and if dtype.kind == "b" else np.minimum,
              int(rr.Max): np.logical_or if dtype.kind == "b" else np.maximum}[op]
        out = scaled[0].copy()
        for a in scaled[1:]:
            out = fn(out, a).astype(dtype)
        if op == int(rr.Average):
            return _scale(out, postscale / m)
        return _scale(out, postscale)
    wide = np.stack([a.astype(np.float64) for a in scaled])
    out = {int(rr.Sum): wide.sum(0), int(rr.Average): wide.sum(0) / m, int(rr.Product): wide.prod(0),
           int(rr.Min): wide.min(0), int(rr.Max): wide.max(0)}[op]
    return out * postscale


_TOLERANCE = {"float16": 4e-3, "bfloat16": 3e-2, "float32": 1e-5, "float64": 1e-12}


def _close(got: np.ndarray, want: np.ndarray, what: str) -> "str | None":
    if got.shape != want.shape:
        return f"{what}: shape {got.shape}, expected {want.shape}"
    if got.dtype.kind in "biu":
        want = np.asarray(want).astype(got.dtype)
        if not np.array_equal(got, want):
            k = int(np.argmax((got != want).reshape(-1)))
            return f"{what}: element {k} is {got.reshape(-1)[k]}, expected {want.reshape(-1)[k]}"
        return None
    wide = got.astype(np.float64)
    scale = np.maximum(np.abs(want), 1.0)
    bad = ~(np.abs(wide - want) <= _TOLERANCE[got.dtype.name] * 8 * scale)
    if bad.any():
        k = int(np.argmax(bad.reshape(-1)))
        return f"{what}: element {k} is {wide.reshape(-1)[k]}, expected {want.reshape(-1)[k]}"
    return None


def _same(got: np.ndarray, want: np.ndarray, what: str) -> "str | None":
    if got.shape != want.shape or got.dtype != want.dtype:
        return f"{what}: {got.dtype}{list(got.shape)}, expected {want.dtype}{list(want.shape)}"
    if got.tobytes() != np.ascontiguousarray(want).tobytes():
        return f"{what}: wrong values"
    return None


def make_object(number: int, rank: int, label: Any) -> Any:
    if label == "lock":
        return threading.Lock()
    if label == "lambda":
        return lambda: rank
    return {"case": number, "rank": rank, "payload": [label] * (label % 5), "text": "x" * (label % 7)}


# -- running a case on this rank ---------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Outcome:
    """What one rank saw: ``ok`` (with a digest of a replicated result), ``error`` (the class), ``wrong``
    (succeeded with a wrong result), or ``skip`` (not in the case)."""

    status: str
    detail: str = ""   # error class, digest, or what was wrong
    message: str = ""  # the error's text (for the report)
    seconds: float = 0.0


def _digest(result: Any) -> str:
    sha = hashlib.sha1()
    for item in (result if isinstance(result, (list, tuple)) else [result]):
        if isinstance(item, np.ndarray):
            sha.update(f"{item.dtype}{item.shape}".encode())
            sha.update(np.ascontiguousarray(item).tobytes())
        else:
            sha.update(pickle.dumps(item))
    return sha.hexdigest()[:16]


class Runner:
    """Runs cases on this rank: one op per case, then every rank's outcome over a private communicator."""

    def __init__(self, seed: int, stall_s: float) -> None:
        self.seed = seed
        self.comm = MPI.COMM_WORLD.Dup()  # the side channel: never the runtime's communicators
        self.rank, self.size = self.comm.Get_rank(), self.comm.Get_size()
        self.lists = set_lists(self.size)
        self.sets = [rr.global_process_set] + [rr.add_process_set(ranks) for ranks in self.lists]
        self.stall_s = stall_s
        # What the run saw (the same on every rank): cases by mode, cases every rank of the set
        # got through, error classes (of the lowest rank of the set), slowest case (seconds, number).
        self.modes: "collections.Counter[str]" = collections.Counter()
        self.succeeded = 0
        self.mixed = 0  # cases whose ranks raised different classes, allowed: refused for different reasons
        self.classes: "collections.Counter[str]" = collections.Counter()
        self.slowest = (0.0, -1)
        self._case: "Case | None" = None
        self._deadline = float("inf")
        self._watch_lock = threading.Lock()
        self._on_hang: "Callable[[], None] | None" = None
        threading.Thread(target=self._watch, name="fuzz-watchdog", daemon=True).start()

    # -- the watchdog -----------------------------------------------------------------------
    def _watch(self) -> None:
        while True:
            time.sleep(0.25)
            with self._watch_lock:
                late = time.monotonic() > self._deadline
                case = self._case
            if late and case is not None:
                text = (f"HANG on rank {self.rank}: case {case.number} did not end within the stall limit "
                        f"({self.stall_s:g}s) + {HANG_MARGIN_S:g}s\n{case.describe(self.seed)}\n"
                        f"replay: {SEED_VARIABLE}={self.seed} {FIRST_VARIABLE}={case.number} {CASES_VARIABLE}=1")
                sys.stdout.write(text + "\n")
                sys.stdout.flush()
                if self._on_hang is not None:
                    self._on_hang()
                MPI.COMM_WORLD.Abort(3)

    def on_hang(self, callback: "Callable[[], None]") -> None:
        """Call ``callback`` (in the watchdog's thread) before a hang ends the job."""
        self._on_hang = callback

    def _arm(self, case: "Case | None") -> None:
        with self._watch_lock:
            self._case = case
            self._deadline = time.monotonic() + self.stall_s + HANG_MARGIN_S if case is not None else float("inf")

    # -- one case -----------------------------------------------------------------------------
    def case(self, number: int) -> Case:
        return generate(self.seed, number, self.size, self.lists)

    def run_case(self, number: int) -> "tuple[Case, list[Outcome], str | None]":
        """Run case ``number`` on every rank; returns it, every rank's outcome, and what failed (None: passed)."""
        case = self.case(number)
        self._arm(case)
        outcome = self._execute(case)
        outcomes = [Outcome(*o) for o in self.comm.allgather(dataclasses.astuple(outcome))]
        self._arm(None)
        failure = judge(case, outcomes)
        self.modes[case.mode] += 1
        if all(outcomes[rank].status == "ok" for rank in case.members):
            self.succeeded += 1
        elif failure is None and len({outcomes[rank].detail for rank in case.members}) > 1:
            self.mixed += 1
        for rank in case.members:
            if outcomes[rank].status == "error":
                self.classes[outcomes[rank].detail] += 1
                break
        slowest = max(o.seconds for o in outcomes)
        if slowest > self.slowest[0]:
            self.slowest = (slowest, number)
        return case, outcomes, failure

    def _execute(self, case: Case) -> Outcome:
        submission = case.submissions.get(self.rank)
        if submission is None:
            return Outcome("skip")
        set_rank = {r: i for i, r in enumerate(case.members)}
        inputs = [self._input(case, self.rank, i, part, submission) for i, part in enumerate(submission.parts)]
        before = [np.array(a, copy=True) for a in inputs if isinstance(a, np.ndarray)]
        begin = time.monotonic()
        try:
            result = self._call(case, submission, inputs)
        except Exception as error:  # the outcome under test
            return Outcome("error", type(error).__name__, str(error)[:400], time.monotonic() - begin)
        seconds = time.monotonic() - begin
        if self.rank not in set_rank:
            return Outcome("wrong", f"rank {self.rank} is outside the set, yet its call succeeded", "", seconds)
        problem = self._check(case, submission, inputs, before, result)
        if problem is not None:
            return Outcome("wrong", problem, "", seconds)
        return Outcome("ok", _digest(result) if submission.kind in REPLICATED else "", "", seconds)

    def _input(self, case: Case, rank: int, index: int, part: Part, submission: Submission) -> Any:
        data = values(self.seed, case.number, rank, index, part, submission.op)
        if submission.as_list:
            return data.tolist()
        return _arrange(data, part.layout) if part.dtype not in BAD_DTYPES else data

    def _process_set(self, submission: Submission, case: Case) -> Any:
        if submission.process_set == "unregistered":
            return rr.ProcessSet(list(case.members))
        if submission.process_set == "list":
            return list(case.members)
        return self.sets[case.set_index]

    def _call(self, case: Case, s: Submission, inputs: "list[Any]") -> Any:
        ps = self._process_set(s, case)
        kind, name = s.kind, s.name
        one = inputs[0] if inputs else None
        reduce_args = dict(op=s.op, name=name, prescale_factor=s.prescale, postscale_factor=s.postscale,
                           process_set=ps)
        if kind == "barrier":
            return rr.barrier(process_set=ps)
        if kind == "broadcast_object":
            return rr.broadcast_object(make_object(case.number, self.rank, s.obj), root_rank=s.root, name=name,
                                       process_set=ps)
        if kind == "allgather_object":
            return rr.allgather_object(make_object(case.number, self.rank, s.obj), name=name, process_set=ps)
        grouped = kind.startswith("grouped_")
        data = inputs if grouped else one
        if kind.rstrip("_").endswith(("allreduce", "reducescatter")):
            args, kwargs = (data,), reduce_args
        elif kind.endswith("broadcast") or kind.endswith("broadcast_"):
            args, kwargs = (data, s.root), dict(name=name, process_set=ps)
        elif kind == "alltoall":
            args, kwargs = (data,), dict(splits=s.splits, name=name, process_set=ps)
        else:  # allgather, grouped_allgather
            args, kwargs = (data,), dict(name=name, process_set=ps)
        if not s.asynchronous:
            return getattr(rr, kind)(*args, **kwargs)
        # allreduce -> allreduce_async, allreduce_ (in place) -> allreduce_async_
        in_place = kind.endswith("_")
        handle = getattr(rr, kind.rstrip("_") + "_async" + ("_" if in_place else ""))(*args, **kwargs)
        return rr.synchronize(handle)

    # -- checking a success against the reference --------------------------------------------
    def _check(self, case: Case, s: Submission, inputs: "list[Any]", before: "list[np.ndarray]",
               result: Any) -> "str | None":
        kind = s.kind
        members = case.members
        me = members.index(self.rank)
        data = {r: [values(self.seed, case.number, r, i, p, case.submissions[r].op)
                    for i, p in enumerate(case.submissions[r].parts)] for r in members}
        grouped = kind.startswith("grouped")
        results = result if grouped else [result]
        if kind not in ARRAYLESS:
            if not isinstance(results, list) or len(results) != len(inputs):
                return f"{kind}: returned {type(result).__name__} for {len(inputs)} input(s)"
            if kind in IN_PLACE:
                if any(r is not a for r, a in zip(results, inputs)):
                    return f"{kind}: in place, but did not return the arrays it was given"
            else:
                for index, (a, b) in enumerate(zip(inputs, before)):
                    if a.tobytes() != b.tobytes():
                        return f"{kind}: changed its input {index} (out of place)"
        if kind in ("allreduce", "allreduce_", "grouped_allreduce", "grouped_allreduce_"):
            for index, got in enumerate(results):
                want = reduction([data[r][index] for r in members], int(s.op), s.prescale, s.postscale)
                problem = _close(np.asarray(got), want, f"{kind} part {index}")
                if problem:
                    return problem
        elif kind in ("reducescatter", "grouped_reducescatter"):
            for index, got in enumerate(results):
                full = reduction([data[r][index] for r in members], int(s.op), s.prescale, s.postscale)
                base, extra = divmod(full.shape[0], len(members))
                lo = me * base + min(me, extra)
                problem = _close(got, full[lo:lo + base + (1 if me < extra else 0)], f"{kind} part {index}")
                if problem:
                    return problem
        elif kind in ("allgather", "grouped_allgather"):
            for index, got in enumerate(results):
                rows = [d[index].reshape(1) if d[index].ndim == 0 else d[index] for d in (data[r] for r in members)]
                problem = _same(got, np.concatenate(rows, axis=0), f"{kind} part {index}")
                if problem:
                    return problem
        elif kind in ("broadcast", "broadcast_"):
            return _same(results[0], data[s.root][0], kind)
        elif kind == "alltoall":
            return self._check_alltoall(case, s, result, data)
        elif kind == "barrier":
            return None if result is None else f"barrier returned {result!r}"
        elif kind == "broadcast_object":
            want = make_object(case.number, s.root, case.submissions[s.root].obj)
            return None if result == want else f"broadcast_object: got {result!r}, expected {want!r}"
        elif kind == "allgather_object":
            want = [make_object(case.number, r, case.submissions[r].obj) for r in members]
            return None if result == want else f"allgather_object: got {result!r}, expected {want!r}"
        return None

    def _check_alltoall(self, case: Case, s: Submission, result: Any, data: dict) -> "str | None":
        members = case.members
        me = members.index(self.rank)
        m = len(members)
        if s.splits is None and not s.asynchronous:
            received, splits = result, None
        else:
            if not (isinstance(result, tuple) and len(result) == 2):
                return f"alltoall: returned {type(result).__name__}, expected (received, splits)"
            received, splits = result
        pieces, counts = [], []
        for r in members:
            theirs = case.submissions[r]
            rows = data[r][0]
            send = ([rows.shape[0] // m] * m if theirs.splits is None else [int(x) for x in np.asarray(theirs.splits)])
            lo = sum(send[:me])
            pieces.append(rows[lo:lo + send[me]])
            counts.append(send[me])
        problem = _same(received, np.concatenate(pieces, axis=0), "alltoall")
        if problem is None and splits is not None and list(np.asarray(splits)) != counts:
            problem = f"alltoall: received splits {list(np.asarray(splits))}, expected {counts}"
        return problem


def judge(case: Case, outcomes: "list[Outcome]") -> "str | None":
    """What is wrong with every rank's outcome of ``case`` (None: it passed). The same on every rank."""
    wrong = [f"rank {r}: {o.detail}" for r, o in enumerate(outcomes) if o.status == "wrong"]
    if wrong:
        return "wrong result: " + "; ".join(wrong)
    if case.stray is not None and outcomes[case.stray].status != "error":
        return f"rank {case.stray} called an op of a set it is not in and did not fail"
    expectation = expect(case)
    mine = {r: outcomes[r] for r in case.members}
    statuses = {o.status for o in mine.values()}
    if expectation.succeed:
        if statuses != {"ok"}:
            return f"expected success ({expectation.why}), but some ranks failed"
        digests = {o.detail for o in mine.values()}
        if len(digests) > 1:
            return "ranks succeeded with different results (not bitwise the same)"
        return None
    if statuses != {"error"}:
        return f"expected an error on every rank ({expectation.why}), but some ranks succeeded"
    classes = {o.detail for o in mine.values()}
    if expectation.same_class and len(classes) > 1:
        return f"ranks raised different error classes ({expectation.why})"
    return None


def report(seed: int, case: Case, outcomes: "list[Outcome]", failure: str) -> str:
    lines = [f"FUZZ FAILURE: {failure}", case.describe(seed), "  outcomes:"]
    for rank, outcome in enumerate(outcomes):
        text = f"    rank {rank}: {outcome.status} {outcome.detail}"
        if outcome.message:
            text += f": {outcome.message}"
        lines.append(text + f" ({outcome.seconds:.2f}s)")
    lines.append(f"  replay: {SEED_VARIABLE}={seed} {FIRST_VARIABLE}={case.number} {CASES_VARIABLE}=1 "
                 f"(or {FIRST_VARIABLE}=0 {CASES_VARIABLE}={case.number + 1} for the run up to it)")
    return "\n".join(lines)


def settings(default_cases: int) -> "tuple[int, int, int]":
    """(seed, first case, number of cases) from the environment."""
    return (int(os.environ.get(SEED_VARIABLE, DEFAULT_SEED)), int(os.environ.get(FIRST_VARIABLE, 0)),
            int(os.environ.get(CASES_VARIABLE, default_cases)))


def resources() -> "tuple[int, int]":
    """(resident set size in KiB, open file descriptors) of this process."""
    rss = 0
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                rss = int(line.split()[1])
    return rss, len(os.listdir("/proc/self/fd"))

