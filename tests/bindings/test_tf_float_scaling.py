"""Float tensors with prescale/postscale factors and Average through mtrain.tensorflow, bit for bit.

Horovod 0.28's CPU rule (horovod/common/ops/collective_operations.cc ``HorovodOp::ScaleBuffer``,
collective_operations.h ``ScaleBufferCPUImpl``): float32 is multiplied in float32 by
``(float)factor``, float64 in float64, float16 in float32 by the factor rounded to float32.
Average is a sum scaled once by ``postscale / size`` (horovod/common/ops/mpi_operations.cc for
allreduce, horovod/common/operations.cc ``EnqueueTensorReducescatters`` for reducescatter).
The second body follows test/parallel/test_tensorflow.py
``test_horovod_reducescatter_cpu_prescale`` / ``_postscale``, whose exact (threshold 0)
comparison a float32 product taken in float64 fails by one ulp on some rank.
"""
import numpy as np

from tests.bindings.requires import require
from tests.bindings.tf_setup import TF_POOL, setup_threads
from tests.horovod_scaling import assert_same_bits, horovod_scaled, owned, reducescatter_rows
from tests.mpi.harness import mpi_test

require("tensorflow", "pip install '.[tensorflow]'")


def _float_scaling_is_horovods_rule_bit_for_bit():
    tf = setup_threads()
    import mtrain.tensorflow as hvd
    n, me = hvd.size(), hvd.rank()
    shape = (7, 5)
    rows = reducescatter_rows(7, n, me)
    # Factors float32 cannot hold; Average at np 3 makes postscale / 3 inexact too.
    for op, pre, post in ((hvd.Sum, 0.37, 1.0), (hvd.Sum, 1.0, 0.1), (hvd.Average, 1 / 3, 1.0),
                          (hvd.Average, 1.0, 2.9), (hvd.Average, 1.0, 1.0)):
        for dtype in (np.float16, np.float32, np.float64):
            total = sum(horovod_scaled(owned(r, n, shape).astype(dtype), pre) for r in range(n))
            want = horovod_scaled(total, post / n if op == hvd.Average else post)
            x = tf.constant(owned(me, n, shape).astype(dtype))
            what = f"{dtype.__name__} op={op} pre={pre:g} post={post:g}"
            assert_same_bits(hvd.allreduce(x, op=op, prescale_factor=pre, postscale_factor=post), want,
                       f"allreduce {what}")
            assert_same_bits(hvd.reducescatter(x, op=op, prescale_factor=pre, postscale_factor=post), want[rows],
                       f"reducescatter {what}")
            graph = tf.function(lambda t: hvd.grouped_reducescatter([t, t], op=op, prescale_factor=pre,
                                                                    postscale_factor=post))(x)
            for got in graph:
                assert_same_bits(got, want[rows], f"grouped_reducescatter in a graph {what}")


def _horovods_reducescatter_scaling_test_is_exact():
    tf = setup_threads()
    import mtrain.tensorflow as hvd
    n, me = hvd.size(), hvd.rank()
    rng = np.random.RandomState(12345)
    for scale in ("prescale", "postscale"):
        for dtype, dim in ((tf.float16, 1), (tf.float32, 1), (tf.float32, 2), (tf.float32, 3)):
            factor = rng.uniform()
            tf.random.set_seed(1234)  # the same tensor on every rank, as Horovod's test has it
            tensor = tf.random.uniform([n * 4] * dim, -100, 100, dtype=dtype)
            got = hvd.reducescatter(tensor, op=hvd.Sum, **{f"{scale}_factor": factor})
            mine = tensor.numpy()[me * 4:(me + 1) * 4]
            wide = np.float32 if dtype == tf.float16 else mine.dtype.type
            # Prescale scales each rank's tensor before the (exact, n equal terms) sum; postscale
            # scales the sum.
            if scale == "prescale":
                want = (mine.astype(wide) * wide(factor)).astype(mine.dtype) * mine.dtype.type(n)
            else:
                want = ((mine * mine.dtype.type(n)).astype(wide) * wide(factor)).astype(mine.dtype)
            assert_same_bits(got, want, f"{scale} {dtype.name} dim {dim} factor {factor!r}")


@mpi_test(pool=TF_POOL, nps=(2, 3), timeout=300)
def test_float_scaling_is_horovods_rule_in_tensorflow():
    """Both checks above in one job per size (TensorFlow's start-up is most of a job)."""
    _float_scaling_is_horovods_rule_bit_for_bit()
    _horovods_reducescatter_scaling_test_is_exact()
