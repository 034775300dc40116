"""A NumPy reference of Horovod's Adasum recursion (horovod/common/ops/adasum/adasum.h), for tests.

Ranks pair up as (0,1), (2,3), ..., then the pairs' results pair up, and so on; each pair
combines tensor by tensor as a' = (1 - a·b/(2‖a‖²)) a + (1 - a·b/(2‖b‖²)) b, dot products and
norms in float64, a squared norm below sqrt(DBL_MIN) leaving its coefficient at 1, and each
level's result rounded to the dtype. The whole vectors are combined here, never halves.
"""
import math
import sys

import numpy as np

SQRT_DBL_MIN = math.sqrt(sys.float_info.min)
# Dot products summed in another order move a coefficient by an ulp of float64 at most: the
# results then differ by an ulp of the dtype, now and then.
RTOL = {"float16": 2e-3, "float32": 1e-6, "float64": 1e-13}


def pair(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """One tensor of two ranks (or groups) combined."""
    wide_a, wide_b = a.astype(np.float64).ravel(), b.astype(np.float64).ravel()
    dot, a_sq, b_sq = wide_a @ wide_b, wide_a @ wide_a, wide_b @ wide_b
    a_weight = 1.0 - dot / a_sq * 0.5 if a_sq >= SQRT_DBL_MIN else 1.0
    b_weight = 1.0 - dot / b_sq * 0.5 if b_sq >= SQRT_DBL_MIN else 1.0
    return (a_weight * wide_a + b_weight * wide_b).astype(a.dtype).reshape(a.shape)


def reference(per_rank: "list[list[np.ndarray]]") -> "list[np.ndarray]":
    """Every tensor of ``per_rank[r]`` (rank r's tensors) reduced by the recursion."""
    level = per_rank
    while len(level) > 1:
        level = [[pair(a, b) for a, b in zip(level[i], level[i + 1])] for i in range(0, len(level), 2)]
    return level[0]


def rank_tensors(rank: int, shapes, dtype, salt: int = 0) -> "list[np.ndarray]":
    """Distinct per rank, per tensor and per element; each tensor of another magnitude (so a
    coefficient computed over the fused buffer instead of per tensor gives another result)."""
    tensors = []
    for t, shape in enumerate(shapes):
        i = np.arange(math.prod(shape), dtype=np.float64)
        scale = 4.0 ** (t % 4 - 1)
        v = scale * (np.sin(0.37 * i + 1.3 * rank + 0.7 * t + salt) + 0.25 * (rank + 1) * np.cos(0.11 * i * (t + 1)))
        tensors.append(v.astype(dtype).reshape(shape))
    return tensors


def assert_close(got: np.ndarray, want: np.ndarray, what: str) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape, f"{what}: {got.dtype}{got.shape} vs {want.dtype}{want.shape}"
    rtol = RTOL[got.dtype.name]
    scale = float(np.max(np.abs(want.astype(np.float64)))) if want.size else 0.0
    np.testing.assert_allclose(got.astype(np.float64), want.astype(np.float64), rtol=rtol, atol=rtol * scale,
                               err_msg=what)


