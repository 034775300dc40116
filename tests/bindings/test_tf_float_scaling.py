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
from tests.mpi.harness import mpi_test

require("tensorflow", "pip install '.[tensorflow]'")


def _owned(rank: int, n: int, shape, dtype) -> np.ndarray:
    """Distinct per rank and element, non-zero only where ``rank`` owns the element (i % n), so
    the sum over ranks is exact and the expected bits depend on the scaling rule alone."""
    index = np.arange(int(np.prod(shape)))
    values = (index * 2.375 - 31.0 + 7.125 * rank) * np.where(index % 2, -1.0, 1.0)
    return np.where(index % n == rank, values, 0.0).reshape(shape).astype(dtype)


def _scaled(values: np.ndarray, factor: float) -> np.ndarray:
    """Horovod's rule for floats: float16 in float32, the others in their own dtype."""
    if values.dtype == np.float16:
        return (values.astype(np.float32) * np.float32(factor)).astype(np.float16)
    return values * values.dtype.type(factor)


def _same_bits(got, want: np.ndarray, what: str) -> None:
    have = np.asarray(got)
    assert have.dtype == want.dtype and have.shape == want.shape, (what, have.dtype, have.shape, want.shape)
    differ = have.view(np.uint8).reshape(-1, have.itemsize) != want.view(np.uint8).reshape(-1, want.itemsize)
    bad = np.flatnonzero(differ.any(axis=1))
    assert not bad.size, f"{what}: {bad.size} elements differ, e.g. {have.ravel()[bad[:3]]} != {want.ravel()[bad[:3]]}"


def _float_scaling_is_horovods_rule_bit_for_bit():
    tf = setup_threads()
    import mtrain.tensorflow as hvd
    n, me = hvd.size(), hvd.rank()
    shape = (7, 5)
    lo = 7 // n * me + min(me, 7 % n)
    rows = slice(lo, lo + 7 // n + (1 if me < 7 % n else 0))
    # Factors float32 cannot hold; Average at np 3 makes postscale / 3 inexact too.
    for op, pre, post in ((hvd.Sum, 0.37, 1.0), (hvd.Sum, 1.0, 0.1), (hvd.Average, 1 / 3, 1.0),
                          (hvd.Average, 1.0, 2.9), (hvd.Average, 1.0, 1.0)):
        for dtype in (np.float16, np.float32, np.float64):
            total = sum(_scaled(_owned(r, n, shape, dtype), pre) for r in range(n))
            want = _scaled(total, post / n if op == hvd.Average else post)
            x = tf.constant(_owned(me, n, shape, dtype))
            what = f"{dtype.__name__} op={op} pre={pre:g} post={post:g}"
            _same_bits(hvd.allreduce(x, op=op, prescale_factor=pre, postscale_factor=post), want,
                       f"allreduce {what}")
            _same_bits(hvd.reducescatter(x, op=op, prescale_factor=pre, postscale_factor=post), want[rows],
                       f"reducescatter {what}")
            graph = tf.function(lambda t: hvd.grouped_reducescatter([t, t], op=op, prescale_factor=pre,
                                                                    postscale_factor=post))(x)
            for got in graph:
                _same_bits(got, want[rows], f"grouped_reducescatter in a graph {what}")


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
            _same_bits(got, want, f"{scale} {dtype.name} dim {dim} factor {factor!r}")


@mpi_test(pool=TF_POOL, nps=(2, 3), timeout=300)
def test_float_scaling_is_horovods_rule_in_tensorflow():
    """Both checks above in one job per size (TensorFlow's start-up is most of a job)."""
    _float_scaling_is_horovods_rule_bit_for_bit()
    _horovods_reducescatter_scaling_test_is_exact()
