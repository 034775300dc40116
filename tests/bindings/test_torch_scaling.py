"""Pre- and postscale factors and Average through mtrain.torch, bit for bit Horovod's CPU rule.

Horovod 0.28 (horovod/common/ops/collective_operations.cc ``HorovodOp::ScaleBuffer`` and
collective_operations.h ``ScaleBufferCPUImpl``; Average becomes Sum with ``postscale / size``
in horovod/common/ops/mpi_operations.cc for allreduce and horovod/common/operations.cc for
reducescatter): float32 is multiplied in float32 by ``(float)factor``, float64 in float64;
float16 is scaled in float32 with the factor rounded to float32, then rounded back; integers
are multiplied by the float64 factor and truncated toward zero on the way back. Average is
that one scaling by ``postscale / size`` (computed in float64), not a division and a scaling.

Each element is non-zero on one rank only (element i on rank i % n), so the sum is exact
in any order and the expected bits depend on the scaling rule alone.
"""
import numpy as np

from tests.bindings.requires import require

require("torch", "pip install '.[torch]'")

import torch  # noqa: E402

from tests.horovod_scaling import assert_same_bits, horovod_scaled, owned, reducescatter_rows  # noqa: E402
from tests.mpi.harness import mpi_test  # noqa: E402


def _owned(rank: int, n: int, shape, dtype: torch.dtype) -> torch.Tensor:
    return torch.from_numpy(owned(rank, n, shape)).to(dtype)


def _expected(n: int, shape, dtype: torch.dtype, average: bool, pre: float, post: float) -> np.ndarray:
    total = sum(horovod_scaled(_owned(r, n, shape, dtype).numpy(), pre) for r in range(n))  # exact: one non-zero
    return horovod_scaled(total, post / n if average else post)


@mpi_test(nps=(2, 3))
def test_scaling_and_average_are_horovods_rule_bit_for_bit():
    import mtrain.torch as hvd
    hvd.init()
    n, me = hvd.size(), hvd.rank()
    shape = (7, 5)
    rows = reducescatter_rows(7, n, me)
    dtypes = (torch.float16, torch.float32, torch.float64, torch.int32, torch.int64)
    # Factors float32 cannot hold (0.37, 0.1, 1/3, 2.9): a product taken in float64 lands one ulp
    # away on some elements. Average at np 3 makes postscale / 3 inexact as well.
    for op, pre, post in ((hvd.Sum, 0.37, 1.0), (hvd.Sum, 1.0, -0.61), (hvd.Average, 0.37, 1.0),
                          (hvd.Average, 1.0, 2.9), (hvd.Sum, 0.1, 3.3), (hvd.Average, 1 / 3, 1.0),
                          (hvd.Average, 1.0, 1.0)):
        average = op == hvd.Average
        for dtype in dtypes:
            want = _expected(n, shape, dtype, average, pre, post)
            what = f"{dtype} op={op} pre={pre} post={post}"
            mine = _owned(me, n, shape, dtype)
            assert_same_bits(hvd.allreduce(mine, op=op, prescale_factor=pre, postscale_factor=post), want,
                       f"allreduce {what}")
            assert_same_bits(hvd.reducescatter(mine, op=op, prescale_factor=pre, postscale_factor=post), want[rows],
                       f"reducescatter {what}")
        # Grouped forms: every dtype in one group, and an in-place all-reduce.
        mine = [_owned(me, n, shape, dtype) for dtype in dtypes]
        wants = [_expected(n, shape, dtype, average, pre, post) for dtype in dtypes]
        got = hvd.grouped_allreduce(mine, op=op, prescale_factor=pre, postscale_factor=post)
        scattered = hvd.grouped_reducescatter(mine, op=op, prescale_factor=pre, postscale_factor=post)
        hvd.allreduce_(mine[0], op=op, prescale_factor=pre, postscale_factor=post)
        for dtype, g, s, w in zip(dtypes, got, scattered, wants):
            assert_same_bits(g, w, f"grouped_allreduce {dtype} op={op} pre={pre} post={post}")
            assert_same_bits(s, w[rows], f"grouped_reducescatter {dtype} op={op} pre={pre} post={post}")
        assert_same_bits(mine[0], wants[0], f"allreduce_ float16 op={op} pre={pre} post={post}")
