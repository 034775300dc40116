"""The tests' reference for Horovod's CPU scaling rule, bit for bit, and the data that reveals it.

Horovod 0.28 (horovod/common/ops/collective_operations.cc ``HorovodOp::ScaleBuffer``,
collective_operations.h ``ScaleBufferCPUImpl``): float32 is multiplied in float32 by
``(float)factor``, float64 in float64; float16 is widened to float32, multiplied by the factor
rounded to float32 and rounded back; integers are multiplied by the float64 factor and truncated
toward zero. The reference goes element by element with NumPy and Python scalars, apart from the
vectorised code it checks.
"""
from __future__ import annotations

import numpy as np


def horovod_scaled(values: np.ndarray, factor: float) -> np.ndarray:
    """``values`` scaled by ``factor`` as Horovod does on the CPU: same dtype and shape."""
    flat = values.ravel().tolist()
    if values.dtype.kind in "iu":
        scaled = [int(float(v) * factor) for v in flat]  # int(): truncation toward zero
    elif values.dtype == np.float16:
        f32 = np.float32(factor)
        scaled = [np.float16(np.float32(v) * f32) for v in flat]
    else:
        own = values.dtype.type(factor)  # (float)factor for float32: rounded before the product
        scaled = [values.dtype.type(v) * own for v in flat]
    return np.array(scaled, dtype=values.dtype).reshape(values.shape)


def owned(rank: int, n: int, shape) -> np.ndarray:
    """float64 values distinct per rank and per element, non-zero only where ``rank`` owns the
    element (element i on rank i % n): the sum over ranks is exact in any order, so the expected
    bits depend on the scaling rule alone. Cast them to the dtype under test."""
    index = np.arange(int(np.prod(shape)))
    values = (index * 2.375 - 31.0 + 7.125 * rank) * np.where(index % 2, -1.0, 1.0)
    return np.where(index % n == rank, values, 0.0).reshape(shape)


def reducescatter_rows(rows: int, n: int, rank: int) -> slice:
    """The first-dimension rows a reduce-scatter leaves on ``rank``: the first ``rows % n`` ranks
    take one more."""
    lo = rows // n * rank + min(rank, rows % n)
    return slice(lo, lo + rows // n + (1 if rank < rows % n else 0))


def assert_same_bits(got, want: np.ndarray, what: str) -> None:
    """``got`` (anything ``np.asarray`` takes) has ``want``'s dtype, shape and bits."""
    have = np.asarray(got)
    assert have.dtype == want.dtype and have.shape == want.shape, (what, have.dtype, have.shape, want.shape)
    differ = have.view(np.uint8).reshape(-1, have.itemsize) != want.view(np.uint8).reshape(-1, want.itemsize)
    bad = np.flatnonzero(differ.any(axis=1))
    assert not bad.size, f"{what}: {bad.size} elements differ, e.g. {have.ravel()[bad[:3]]} != {want.ravel()[bad[:3]]}"
