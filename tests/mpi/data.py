"""Test data that can reveal a wrong index: distinct per rank and per element."""
from __future__ import annotations

import math

import numpy as np

from mtrain.ringreduce.core.ops import SUPPORTED_DTYPES, Average, Max, Min, Product, Sum

DTYPES = [d for d in SUPPORTED_DTYPES if d != np.bool_]
OPS = [Sum, Average, Min, Max, Product]


def values(rank: int, shape: "tuple[int, ...]", dtype: np.dtype, op=Sum) -> np.ndarray:
    """Rank ``rank``'s input. Every element and every rank differ (within the dtype's range)."""
    dtype = np.dtype(dtype)
    i = np.arange(math.prod(shape), dtype=np.int64)
    if op == Product:  # keep products of up to 4 ranks inside every dtype's range
        if dtype.kind == "f" or dtype.name == "bfloat16":
            v = 1.0 + ((i * 7 + rank * 3) % 17 - 8) / 64.0
        else:
            v = (i + rank) % 3 + (rank % 2)
    elif dtype.kind == "f" or dtype.name == "bfloat16":
        span = 2048 if dtype.itemsize <= 2 else 1 << 40
        v = (i % span) * 0.5 + rank * 0.25 - 3.0 * ((i * 13 + rank) % 5)
    elif dtype.kind == "u":
        v = (i * 7 + rank * 31) % min(np.iinfo(dtype).max, 1 << 30)
    else:
        hi = min(np.iinfo(dtype).max, 1 << 30)
        v = (i * 7 + rank * 31) % hi - hi // 2
    return np.asarray(v).astype(dtype).reshape(shape)


def reference(inputs: "list[np.ndarray]", op) -> np.ndarray:
    """The reduction computed in float64 (floats) or int64 with wrap-around (ints)."""
    dtype = inputs[0].dtype
    wide = np.float64 if (dtype.kind == "f" or dtype.name == "bfloat16") else np.int64
    stack = np.stack([a.astype(wide) for a in inputs])
    if op in (Sum, Average):
        out = stack.sum(axis=0)
        if op == Average:
            if wide is np.float64:
                out = out / len(inputs)
            else:  # integers: the sum wraps in the dtype first, then is scaled by 1/N in float64 and
                # truncated toward zero (Horovod's average: a postscale of 1/N)
                wrapped = out.astype(dtype).astype(np.float64)
                out = np.trunc(wrapped * np.float64(1.0 / len(inputs))).astype(np.int64)
    elif op == Min:
        out = stack.min(axis=0)
    elif op == Max:
        out = stack.max(axis=0)
    else:
        out = stack.prod(axis=0)
    return out


def tolerance(dtype: np.dtype) -> float:
    name = np.dtype(dtype).name
    return {"float16": 1e-2, "bfloat16": 2e-2, "float32": 1e-5, "float64": 1e-12}.get(name, 0.0)


def assert_matches(result: np.ndarray, expected: np.ndarray, what: str) -> None:
    dtype = result.dtype
    assert result.shape == expected.shape, f"{what}: shape {result.shape} != {expected.shape}"
    if dtype.kind == "f" or dtype.name == "bfloat16":
        got = result.astype(np.float64)
        scale = np.maximum(np.abs(expected), 1.0)
        bad = np.abs(got - expected) > tolerance(dtype) * scale * 4
        if bad.any():
            k = int(np.argmax(bad.reshape(-1)))
            raise AssertionError(f"{what}: element {k} is {got.reshape(-1)[k]}, expected "
                                 f"{expected.reshape(-1)[k]} ({int(bad.sum())} bad of {bad.size})")
    else:
        want = expected.astype(dtype)  # int64 -> narrower wraps like the real arithmetic
        if not np.array_equal(result, want):
            k = int(np.argmax((result != want).reshape(-1)))
            raise AssertionError(f"{what}: element {k} is {result.reshape(-1)[k]}, expected {want.reshape(-1)[k]}")
