"""Integer tensors with prescale/postscale factors, through mtrain.tensorflow: as Horovod, the
factor is applied in float64 and the result cast back truncating toward zero (-7 * 0.5 -> -3);
Average is a sum scaled once by postscale / size."""
import numpy as np

from tests.bindings.requires import require
from tests.bindings.tf_setup import TF_POOL, setup_threads
from tests.mpi.harness import mpi_test

require("tensorflow", "pip install '.[tensorflow]'")


def _setup():
    tf = setup_threads()
    import mtrain.tensorflow as hvd
    n, me = hvd.size(), hvd.rank()
    mine = lambda r: np.arange(-7, 7).reshape(7, 2) * (r + 1) + 3 * r  # noqa: E731  (odd and negative values)
    trunc = lambda a, f: np.trunc(a.astype(np.float64) * f).astype(np.int64)  # noqa: E731
    summed = sum(trunc(mine(r), 0.5) for r in range(n))
    return tf, hvd, n, me, mine, trunc, summed


def _reducescatter_integer_scaling_truncates_toward_zero():
    tf, hvd, n, me, mine, trunc, summed = _setup()
    lo = 7 // n * me + min(me, 7 % n)
    rows = slice(lo, lo + 7 // n + (1 if me < 7 % n else 0))
    for dtype in (tf.int32, tf.int64):
        x = tf.constant(mine(me), dtype)
        for op, post, factor in ((hvd.Sum, -0.5, -0.5), (hvd.Average, 3.0, 3.0 / n), (hvd.Average, 1.0, 1.0 / n)):
            got = hvd.reducescatter(x, op=op, prescale_factor=0.5, postscale_factor=post)
            assert got.dtype == dtype and np.array_equal(got, trunc(summed, factor)[rows]), \
                f"reducescatter {op} post={post} {dtype}: {got} != {trunc(summed, factor)[rows]}"
        got = tf.function(lambda t: hvd.grouped_reducescatter([t], op=hvd.Average, prescale_factor=0.5))(x)[0]
        assert np.array_equal(got, trunc(summed, 1.0 / n)[rows]), f"grouped_reducescatter in a graph {dtype}"


def _allreduce_integer_average_is_one_scaling():
    tf, hvd, n, me, _, trunc, _ = _setup()
    # Non-negative values here: how the runtime rounds a negative scaled integer is its own test.
    mine = lambda r: np.arange(14).reshape(7, 2) * (r + 1) + 3 * r  # noqa: E731
    summed = sum(trunc(mine(r), 0.5) for r in range(n))
    for dtype in (tf.int32, tf.int64):
        x = tf.constant(mine(me), dtype)
        for post in (1.0, 3.0, 0.7):
            got = hvd.allreduce(x, op=hvd.Average, prescale_factor=0.5, postscale_factor=post)
            assert got.dtype == dtype and np.array_equal(got, trunc(summed, post / n)), f"allreduce {post} {dtype}"
        floats = tf.constant(mine(me) + 0.25)
        got = tf.function(lambda a, b: hvd.grouped_allreduce([a, b], op=hvd.Average, prescale_factor=0.5,
                                                             name="int_scaling.mixed"))(x, floats)
        assert np.array_equal(got[0], trunc(summed, 1.0 / n)), f"grouped_allreduce mixed, integers {dtype}"
        assert np.allclose(got[1], sum(0.5 * (mine(r) + 0.25) for r in range(n)) / n), "mixed, floats"


def _allreduce_negative_integers_truncate_toward_zero():
    tf, hvd, n, me, mine, trunc, summed = _setup()
    for dtype in (tf.int32, tf.int64):
        x = tf.constant(mine(me), dtype)
        got = hvd.allreduce(x, op=hvd.Sum, prescale_factor=0.5, postscale_factor=-0.5)
        assert got.dtype == dtype and np.array_equal(got, trunc(summed, -0.5)), f"allreduce Sum {dtype}"
        got = hvd.grouped_allreduce([x], op=hvd.Average, prescale_factor=0.5, postscale_factor=3.0)[0]
        assert np.array_equal(got, trunc(summed, 3.0 / n)), f"grouped_allreduce Average {dtype}"
        got = tf.function(lambda t: hvd.allreduce(t, op=hvd.Average, prescale_factor=0.5))(x)
        assert np.array_equal(got, trunc(summed, 1.0 / n)), f"allreduce Average in a graph {dtype}"


@mpi_test(pool=TF_POOL, nps=(2, 3), timeout=300)
def test_integer_scaling_truncates_toward_zero_in_one_scaling():
    """The three checks above in one job per size (TensorFlow's start-up is most of a job)."""
    _reducescatter_integer_scaling_truncates_toward_zero()
    _allreduce_integer_average_is_one_scaling()
    _allreduce_negative_integers_truncate_toward_zero()
