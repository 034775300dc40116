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


@mpi_test(pool=TF_POOL, nps=(2,), timeout=300)
def test_a_tf1_optimizer_combines_its_model_deltas_with_adasum():
    """horovod/tensorflow/__init__.py, ``_DistributedAdasumOptimizer`` and ``DistributedOptimizer``:
    with a TF1 optimizer, op=Adasum makes each rank step on its own gradients and, every
    ``backward_passes_per_step``-th step, sets the model to where it started plus the Adasum of
    the ranks' deltas (the wrapped optimizer's slots stay the rank's own); process sets,
    ``average_aggregated_gradients`` and eager mode are refused as Horovod refuses them."""
    tf, _ = setup_tensorflow()
    import mtrain.tensorflow as hvd
    n, me = hvd.size(), hvd.rank()
    # (TF1 optimizers round a Python learning rate through float32: 0.125 and 0.5 are exact there.)
    lr, momentum, passes, steps = 0.125, 0.5, 2, 5
    # Rank r's loss: sum(c_r * (w - t_r)^2) per variable, each rank its own targets and weights.
    init = [np.linspace(-1.0, 1.0, 5), np.array([0.25, -0.5, 0.75])]
    targets = [[np.arange(5) * 0.3 - r, np.array([1.0, 2.0, -1.0]) * (r + 1)] for r in range(n)]
    weights = [[1.0 + r, 0.5 + 2 * r] for r in range(n)]

    # NumPy: every rank's momentum SGD on its own loss; every `passes`-th step the deltas combined.
    model, start = [x.copy() for x in init], [x.copy() for x in init]
    local = [[x.copy() for x in init] for _ in range(n)]
    accum = [[np.zeros_like(x) for x in init] for _ in range(n)]
    for step in range(steps):
        for r in range(n):
            for i in range(2):
                grad = 2 * weights[r][i] * (local[r][i] - targets[r][i])
                accum[r][i] = momentum * accum[r][i] + grad
                local[r][i] = local[r][i] - lr * accum[r][i]
        if step % passes == passes - 1:
            combined = reference([[local[r][i] - start[i] for i in range(2)] for r in range(n)])
            start = [s + d for s, d in zip(start, combined)]
            local = [[s.copy() for s in start] for _ in range(n)]
    model = local[me]  # after the last, uncombined step each rank holds its own model

    graph = tf.Graph()
    with graph.as_default():
        variables = [tf.compat.v1.Variable(x, name=f"w{i}") for i, x in enumerate(init)]
        loss = tf.add_n([weights[me][i] * tf.reduce_sum((v - targets[me][i]) ** 2) for i, v in enumerate(variables)])
        inner = tf.compat.v1.train.MomentumOptimizer(lr, momentum)
        opt = hvd.DistributedOptimizer(inner, op=hvd.Adasum, backward_passes_per_step=passes)
        train = opt.minimize(loss)
        with tf.compat.v1.Session(graph=graph) as session:
            session.run(tf.compat.v1.global_variables_initializer())
            for _ in range(steps):
                session.run(train)
            got = session.run(variables)
    for index, (g, w) in enumerate(zip(got, model)):
        assert_close(g, w, f"variable {index} after {steps} steps")
    assert not np.allclose(got[0], init[0]), "training moved the model"

    with tf.Graph().as_default():
        evens = hvd.add_process_set([0])
        try:
            with pytest.raises(NotImplementedError, match="Adasum does not support process sets yet"):
                hvd.DistributedOptimizer(tf.compat.v1.train.GradientDescentOptimizer(0.1), op=hvd.Adasum,
                                         process_set=evens)
        finally:
            hvd.remove_process_set(evens)
        with pytest.raises(ValueError, match="average_aggregated_gradients"):
            hvd.DistributedOptimizer(tf.compat.v1.train.GradientDescentOptimizer(0.1), op=hvd.Adasum,
                                     backward_passes_per_step=2, average_aggregated_gradients=True)
    with pytest.raises(ValueError, match="needs a graph"):
        hvd.DistributedOptimizer(tf.compat.v1.train.GradientDescentOptimizer(0.1), op=hvd.Adasum)
