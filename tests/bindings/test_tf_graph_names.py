"""Unnamed collectives inside a tf.function: named when the graph is built, so every rank pairs the
same tensors whatever order TensorFlow's inter-op threads run them in.

Horovod names an unnamed op from its graph node (horovod/tensorflow/mpi_ops.py: the op's name,
normalized, when it is created). A counter advanced as the ops run pairs different tensors on
ranks whose threads ran them in a different order ("ranks submitted op 'noname.0.0' with
different arguments (rank 0: uint8[17, 17, 17]; rank 1: float64[17, 17])"). And an op that waits
must not hold one of the inter-op threads while it waits, or ranks that picked ops in different
orders hang.
"""
import numpy as np

from tests.bindings.requires import require
from tests.mpi.harness import mpi_test

require("tensorflow", "pip install '.[tensorflow]'")

# Independent ops of different dtypes and shapes: any two paired wrongly fail the job.
_SPECS = [("uint8", (17, 17, 17)), ("float64", (17, 17)), ("int32", (5,)), ("float32", (3, 4)),
          ("int64", (2, 3, 1)), ("float64", (9,)), ("float32", (1,)), ("int32", (4, 4)),
          ("float16", (6,)), ("float64", (2, 2, 2)), ("int64", (13,)), ("float32", (7, 1))]


def _value(rank: int, step: int, index: int, dtype: str, shape) -> np.ndarray:
    """Distinct per rank, step, op and element; small enough that uint8 and float16 sums stay exact."""
    count = int(np.prod(shape))
    values = (np.arange(count) * (index + 1) + 3 * rank + step) % 23
    return values.reshape(shape).astype(dtype)


@mpi_test(nps=(2, 3), timeout=240)
def test_unnamed_ops_in_a_graph_pair_alike_on_every_rank():
    import os
    import time
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import tensorflow as tf
    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(8)
    import mtrain.tensorflow as hvd
    hvd.init()
    n, me = hvd.size(), hvd.rank()

    def held(i, x):
        """``x`` after a wait that differs per op and per rank, as uneven work before each op does in
        a real step: the collectives then become ready in a different order on each rank."""
        def wait(value):
            time.sleep(0.003 * ((5 * i + 7 * me) % len(_SPECS)))
            return value
        out = tf.numpy_function(wait, [x], x.dtype, stateful=True)
        out.set_shape(x.shape)
        return out

    @tf.function
    def many(*xs):
        xs = [held(i, x) for i, x in enumerate(xs)]
        sums = [hvd.allreduce(x, op=hvd.Sum) for x in xs]
        return sums + [hvd.allgather(xs[1]), hvd.broadcast(xs[4], root_rank=n - 1), hvd.allgather(xs[0])]

    # A TF1 graph run by a session: no automatic control dependencies there (a tf.function orders
    # its stateful ops as written), so the ops run in whatever order the inter-op threads pick.
    # Fewer threads than collectives: an op that held its thread while it waited for the other
    # ranks left each rank's threads all waiting in ops the others could not reach (a hang).
    graph = tf.Graph()
    with graph.as_default():
        inputs = [tf.compat.v1.placeholder(dtype, shape) for dtype, shape in _SPECS]
        outputs = many.python_function(*inputs)
    session = tf.compat.v1.Session(graph=graph, config=tf.compat.v1.ConfigProto(
        inter_op_parallelism_threads=2, intra_op_parallelism_threads=1))

    def in_session(*xs):
        return [tf.constant(v) for v in session.run(outputs, dict(zip(inputs, [x.numpy() for x in xs])))]

    for step in range(12):
        mine = [_value(me, step, i, dtype, shape) for i, (dtype, shape) in enumerate(_SPECS)]
        everyone = [[_value(r, step, i, dtype, shape) for i, (dtype, shape) in enumerate(_SPECS)]
                    for r in range(n)]
        got = (many if step % 2 else in_session)(*[tf.constant(x) for x in mine])
        for i, (dtype, _) in enumerate(_SPECS):
            want = sum(e[i] for e in everyone).astype(dtype)
            assert got[i].dtype.name == dtype and np.array_equal(got[i].numpy(), want), (step, i)
        k = len(_SPECS)
        assert np.array_equal(got[k].numpy(), np.concatenate([e[1] for e in everyone])), step
        assert np.array_equal(got[k + 1].numpy(), everyone[n - 1][4]), step
        assert np.array_equal(got[k + 2].numpy(), np.concatenate([e[0] for e in everyone])), step

    # A collective in a tf.while_loop (the same op, under the same name, every iteration; the
    # iterations' inputs do not wait for each other) and in a tf.cond branch.
    @tf.function
    def looped(x):
        def body(i, acc):
            return i + 1, acc + hvd.allreduce(x * tf.cast(i, x.dtype), op=hvd.Sum)
        _, acc = tf.while_loop(lambda i, acc: i < 4, body, [tf.constant(1), tf.zeros_like(x)])
        return acc, tf.cond(acc[0] > 0, lambda: hvd.allgather(acc), lambda: acc)

    for step in range(2):
        mine = _value(me, step, 0, "float64", (5,))
        acc, gathered = looped(tf.constant(mine))
        want = sum(_value(r, step, 0, "float64", (5,)) for r in range(n)) * (1 + 2 + 3)
        assert np.array_equal(acc.numpy(), want), step
        assert np.array_equal(gathered.numpy(), np.concatenate([want] * n)), step

    # A DistributedGradientTape over many variables, inside a tf.function.
    variables = [tf.Variable(_value(me, 0, i, "float64", shape)) for i, (_, shape) in enumerate(_SPECS)]

    @tf.function
    def gradients():
        with tf.GradientTape() as tape:
            loss = tf.add_n([tf.reduce_sum(v * v) * (i + 1) for i, v in enumerate(variables)])
        return hvd.DistributedGradientTape(tape).gradient(loss, variables)

    for step in range(3):
        for i, grad in enumerate(gradients()):
            want = sum(2 * (i + 1) * _value(r, 0, i, "float64", _SPECS[i][1]) for r in range(n)) / n
            assert np.allclose(grad.numpy(), want), (step, i)
