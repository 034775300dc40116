"""op=Adasum through mtrain.tensorflow and mtrain.keras: where Horovod runs it, and where it refuses it.

horovod/tensorflow/__init__.py: ``allreduce``/``grouped_allreduce`` pass op=Adasum to the
runtime (eagerly and in a tf.function); ``DistributedGradientTape(op=Adasum)`` combines the
gradients with Adasum; ``DistributedOptimizer`` with a Keras optimizer refuses op=Adasum
(ValueError 'op == Adasum is not supported yet with Keras'), and so does horovod/tensorflow/keras's
(Average and Sum only); IndexedSlices refuse Adasum (tests/bindings/test_tf_sparse.py).
"""
import numpy as np
import pytest

from tests.bindings.requires import require
from tests.bindings.tf_setup import TF_POOL, setup_tensorflow
from tests.mpi.adasum_reference import assert_close, rank_tensors, reference
from tests.mpi.harness import mpi_test

require("tensorflow", "pip install '.[tensorflow]'")


@mpi_test(pool=TF_POOL, nps=(2,), timeout=300)
def test_tensorflow_and_keras_take_adasum_where_horovod_does():
    """The collectives, the gradient tape and the Keras refusals, in one job (TensorFlow's start-up
    is most of a job)."""
    tf, keras = setup_tensorflow()
    import mtrain.keras as khvd
    import mtrain.tensorflow as hvd
    n, me = hvd.size(), hvd.rank()
    shapes = [(3,), (4, 5), (1,)]
    per_rank = [rank_tensors(r, shapes, np.float32, salt=2) for r in range(n)]
    want = reference(per_rank)
    got = hvd.allreduce(tf.constant(per_rank[me][1]), op=hvd.Adasum, name="tf.adasum.one")
    assert_close(got.numpy(), want[1], "allreduce")
    grouped = tf.function(lambda *ts: hvd.grouped_allreduce(list(ts), op=hvd.Adasum, name="tf.adasum.group"))(
        *[tf.constant(t) for t in per_rank[me]])
    for index, (g, w) in enumerate(zip(grouped, want)):
        assert_close(g.numpy(), w, f"grouped_allreduce in a graph, tensor {index}")
    assert_close(khvd.allreduce(tf.constant(per_rank[me][0]), op=khvd.Adasum, name="keras.adasum").numpy(), want[0],
                 "mtrain.keras allreduce")

    # DistributedGradientTape(op=Adasum): each rank's gradients combined by the recursion.
    w = tf.Variable(np.linspace(-1.0, 1.0, 6).reshape(3, 2))
    b = tf.Variable(np.array([0.5, -0.25]))

    def gradients(rank: int, tape_of):
        x = tf.constant(np.arange(12.0).reshape(4, 3) * 0.1 + rank)
        with tape_of(tf.GradientTape()) as tape:
            loss = tf.reduce_sum(tf.tanh(x @ w + b) ** 2) * (rank + 1)
        return [g.numpy() for g in tape.gradient(loss, [w, b])]
    local = [gradients(r, lambda t: t) for r in range(n)]
    combined = gradients(me, lambda t: hvd.DistributedGradientTape(t, op=hvd.Adasum))
    for g, expected in zip(combined, reference(local)):
        assert_close(g, expected, "DistributedGradientTape(op=Adasum)")

    for wrap in (hvd.DistributedOptimizer, khvd.DistributedOptimizer):
        with pytest.raises(ValueError, match="op == Adasum is not supported yet with Keras"):
            wrap(keras.optimizers.SGD(0.1), op=hvd.Adasum)
