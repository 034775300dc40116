"""Reduction operators and the dtypes the runtime accepts.

The operator values match Horovod's (``Average=0, Sum=1, Adasum=2, Min=3,
Max=4, Product=5``) so code that stores or compares them keeps working.
"""
from __future__ import annotations

import enum
import functools
from typing import Any, Callable

import numpy as np

from mtrain.ringreduce.core.errors import (
    InvalidArgumentError,  # a RuntimeError, as Horovod's refusals; and the ValueError of before
)


class Kind(enum.IntEnum):
    """Which collective an op is."""

    ALLREDUCE = 1
    ALLGATHER = 2
    BROADCAST = 3
    REDUCESCATTER = 4
    ALLTOALL = 5
    BARRIER = 6
    BROADCAST_OBJECT = 7
    ALLGATHER_OBJECT = 8


class ReduceOp(enum.IntEnum):
    Average = 0
    Sum = 1
    Adasum = 2  # adaptive summation (adasum.py): float arrays, a power-of-two number of ranks
    Min = 3
    Max = 4
    Product = 5


Average = ReduceOp.Average
Sum = ReduceOp.Sum
Adasum = ReduceOp.Adasum
Min = ReduceOp.Min
Max = ReduceOp.Max
Product = ReduceOp.Product

SUPPORTED_OPS = (Average, Sum, Adasum, Min, Max, Product)
# Every accepted op (and its int value) -> the ReduceOp: one dict lookup on the per-tensor
# path instead of an Enum call.
_SUPPORTED = {op: op for op in SUPPORTED_OPS}


def check_op(op: object) -> ReduceOp:
    """Return ``op`` as a ReduceOp, or raise naming the bad value."""
    try:
        known = _SUPPORTED.get(op)  # type: ignore[call-overload]
    except TypeError:  # unhashable
        known = None
    if known is not None and type(op) is not bool:
        return known
    try:
        value = ReduceOp(op)
    except (ValueError, TypeError):
        names = ", ".join(o.name for o in SUPPORTED_OPS)
        raise ValueError(f"unsupported reduction op {op!r}; use one of {names}") from None
    if value not in SUPPORTED_OPS:
        names = ", ".join(o.name for o in SUPPORTED_OPS)
        raise InvalidArgumentError(f"reduction op {value.name} is not supported by mtrain; use one of {names}")
    return value


class Reducers:
    """One array module's elementwise reductions: ``reducers(op, dtype)(dst, src, out=dst)``.

    Built from the module's functions by attribute, not by name, so NumPy and CuPy (whose
    ufuncs share NumPy's names and signatures) take the same table. Average sums here:
    the all-reduce scales once after the sum (``backend.finishing_factor``).
    """

    __slots__ = ("_any", "_bool")

    def __init__(self, xp: Any) -> None:
        self._any = {Average: xp.add, Sum: xp.add, Min: xp.minimum, Max: xp.maximum,
                     Product: xp.multiply}
        # Bool buffers: Min is logical and, Max logical or (what check_reducible allows).
        self._bool = {**self._any, Min: xp.logical_and, Max: xp.logical_or}

    def __call__(self, op: ReduceOp, dtype: np.dtype) -> Callable:
        """The function that reduces two ``dtype`` arrays under ``op``."""
        return (self._bool if dtype.kind == "b" else self._any)[op]


# Array module -> its Reducers, NumPy's made here and any other's on first use.
_REDUCERS: "dict[Any, Reducers]" = {np: Reducers(np)}


def reducers(xp: Any) -> Reducers:
    """The reductions of array module ``xp`` (``numpy``, ``cupy``)."""
    found = _REDUCERS.get(xp)
    if found is None:
        # Two threads may both build one: equal tables, and the dict assignment is atomic.
        found = _REDUCERS[xp] = Reducers(xp)
    return found


def reducer(xp: Any, op: ReduceOp, dtype: np.dtype) -> Callable:
    """The function of array module ``xp`` that reduces two ``dtype`` arrays under ``op``,
    called as ``reducer(xp, op, dtype)(dst, src, out=dst)``."""
    return reducers(xp)(op, dtype)


# The order of these is the wire code used in metadata checks: append, never reorder.
_BUILTIN_DTYPES: tuple = tuple(np.dtype(t) for t in (
    np.float16, np.float32, np.float64,
    np.int8, np.int16, np.int32, np.int64,
    np.uint8, np.uint16, np.uint32, np.uint64,
    np.bool_,
))
BFLOAT16_CODE = len(_BUILTIN_DTYPES)  # ml_dtypes' bfloat16, where that package is installed
_CODE = {dt: i for i, dt in enumerate(_BUILTIN_DTYPES)}


@functools.cache
def _bfloat16() -> "np.dtype | None":
    """NumPy's bfloat16 (from ``ml_dtypes``, optional), looked for on first need: importing
    ml_dtypes takes about 0.7 s, which every rank of every job paid at ``import mtrain.ringreduce``
    when it was looked for there.  A program with bfloat16 arrays has imported it already."""
    try:
        import ml_dtypes  # optional: only present where the user installed it
    except ImportError:
        return None
    found = np.dtype(ml_dtypes.bfloat16)
    _CODE[found] = BFLOAT16_CODE
    return found


def supported_dtypes() -> tuple:
    """Every dtype the runtime accepts, in wire-code order (bfloat16 last, where ml_dtypes is installed)."""
    found = _bfloat16()
    return _BUILTIN_DTYPES + ((found,) if found is not None else ())


def __getattr__(name: str) -> Any:
    if name == "SUPPORTED_DTYPES":  # (looked up on use: it may import ml_dtypes)
        return supported_dtypes()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def dtype_code(dtype: object) -> int:
    """Small integer naming a supported dtype; TypeError for anything else."""
    dt = np.dtype(dtype)
    code = _CODE.get(dt)
    if code is None and _bfloat16() is not None:  # bfloat16's code is known once ml_dtypes is looked for
        code = _CODE.get(dt)
    if code is None:
        names = ", ".join(str(d) for d in supported_dtypes())
        hint = "" if _bfloat16() is not None else " (bfloat16 needs the ml_dtypes package)"
        raise TypeError(f"unsupported dtype {dt}; mtrain supports {names}{hint}")
    return code


def dtype_from_code(code: int) -> np.dtype:
    if code == BFLOAT16_CODE:
        found = _bfloat16()
        if found is None:
            raise TypeError("another rank sent bfloat16, which needs the ml_dtypes package on this rank too: "
                            "pip install ml_dtypes")
        return found
    return _BUILTIN_DTYPES[code]


# What Adasum reduces (Horovod's ``Adasum::DispatchFusedAllreduce``): its dot products need floats.
ADASUM_DTYPES = (np.dtype(np.float16), np.dtype(np.float32), np.dtype(np.float64))


def check_reducible(dtype: np.dtype, op: ReduceOp) -> None:
    """Bool buffers only take Min/Max (logical and/or); Adasum takes float16/32/64 only; everything
    else takes every op."""
    if op is Adasum and dtype not in ADASUM_DTYPES:
        raise TypeError(f"op Adasum reduces float16, float32 or float64 arrays, got {dtype}; "
                        "cast the array to a float dtype, or use op=Sum or op=Average")
    if dtype.kind == "b" and op not in (Min, Max):
        raise TypeError(f"op {op.name} is not defined for bool arrays; use Min (logical and) or Max (logical or)")
