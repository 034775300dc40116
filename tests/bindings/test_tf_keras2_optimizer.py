"""What Keras 2 programs call on Horovod's wrapped optimizer, and the Keras elastic states' restore,
at np 2 and 3, with values distinct per rank and per element.

The Keras 2 bodies (tf_keras under ``TF_USE_LEGACY_KERAS=1``, which must be set before TensorFlow
is imported) share one job per size (``KERAS2_POOL``, their own environment); the Keras 3 bodies
share the TensorFlow binding tests' jobs (``TF_POOL``). Each body names the Horovod file it follows.
"""
import os

import numpy as np

from tests.bindings.requires import require
from tests.bindings.tf_setup import TF_POOL, setup_tensorflow, setup_threads
from tests.mpi.harness import mpi_test

require("tensorflow", "pip install '.[tensorflow]'")
require("tf_keras", "pip install '.[dev]' (tf-keras)")

KERAS2_POOL = "tensorflow-keras2"
KERAS2_ENV = {"TF_USE_LEGACY_KERAS": "1"}
K = 3  # backward_passes_per_step: odd, so that summed, averaged and last-pass-only all differ


def _setup_keras2():
    """(tf, tf_keras) in a Keras 2 rank, float64."""
    tf = setup_threads()
    import tf_keras
    assert tf.keras.optimizers.Adam is tf_keras.optimizers.Adam, "TF_USE_LEGACY_KERAS=1 did not reach the rank"
    tf_keras.backend.set_floatx("float64")
    return tf, tf_keras


def _values(r: int, size: int, salt: float = 0.0) -> np.ndarray:
    """Rank ``r``'s values: distinct per rank and per element."""
    return np.sin(np.arange(size, dtype=np.float64) * (r + 1.3) + salt) * (r + 2) + 0.1 * r


def _rows(r: int, count: int, width: int, salt: float = 0.0) -> np.ndarray:
    return _values(r, count * width, salt).reshape(count, width)


def _close(a, b, tol: float = 1e-10) -> bool:
    return np.allclose(np.asarray(a, np.float64), np.asarray(b, np.float64), rtol=tol, atol=tol)


def _round_factor(j: int, average: bool) -> float:
    """Pass k (from 0) has gradient (k + 1) * g: the sum over round j's K passes, or its mean."""
    total = sum(k + 1.0 for k in range(K * j, K * j + K))
    return total / K if average else total


def _expected_after(idx: int, average: bool, local: bool, a, b, me: int, n: int):
    """x and y after pass ``idx`` of the aggregation tests: their start (7s, 5s) until the first
    round applies, then the rounds' gradients; y's rows 0 and 2 only, this rank's own when local."""
    rounds = (idx + 1) // K
    want_x, want_y = np.full(3, 7.0), np.full(4, 5.0)
    if rounds:
        factor = _round_factor(rounds - 1, average)
        want_x = factor * np.mean(a, 0)
        want_y = np.zeros(4)
        want_y[[0, 2]] = factor * (b[me] / n if local else np.mean(b, 0))
    return want_x, want_y


@mpi_test(pool=KERAS2_POOL, env=KERAS2_ENV, nps=(2, 3), timeout=300)
def test_keras2_compute_gradients_get_gradients_aggregate_gradients_and_variables():
    """horovod/_keras/__init__.py create_distributed_optimizer: ``_compute_gradients`` and
    ``compute_gradients`` (new and legacy tf_keras optimizers) return the ranks' reduced gradients;
    ``minimize`` and a legacy ``get_gradients`` reduce exactly once (op=Sum would show a second
    reduction); ``_aggregate_gradients`` is the base's, with no reduction over ranks; ``variables``
    is both a list and a call; ``_agg_helper`` is None at one pass."""
    tf, keras = _setup_keras2()
    import mtrain.tensorflow.keras as hvd
    n, me = hvd.size(), hvd.rank()
    grads = [_values(r, 5) for r in range(n)]
    mean, total = np.mean(grads, 0), np.sum(grads, 0)
    for kind, make in (("new", keras.optimizers.SGD), ("legacy", keras.optimizers.legacy.SGD)):
        v = tf.Variable(np.zeros(5))

        def loss():
            return tf.reduce_sum(v * grads[me])

        opt = hvd.DistributedOptimizer(make(0.5))
        assert opt._agg_helper is None and opt._HAS_AGGREGATE_GRAD, kind
        (g, var), = opt._compute_gradients(loss, var_list=[v])
        assert var is v and _close(g, mean), (kind, g)
        with tf.GradientTape() as tape:
            value = loss()
        (g, _), = opt.compute_gradients(value, [v], tape=tape)
        assert _close(g, mean), (kind, "compute_gradients", g)
        (g, var), = opt._aggregate_gradients([(tf.constant(grads[me]), v)])
        assert var is v and _close(g, grads[me]), (kind, "_aggregate_gradients reduced over ranks", g)

        summing = hvd.DistributedOptimizer(make(0.5), op=hvd.Sum)
        summing.minimize(loss, var_list=[v])
        assert _close(v.numpy(), -0.5 * total), (kind, "minimize", v.numpy(), -0.5 * total)

        @tf.function
        def step():  # as fit does: compute and apply inside one graph
            summing.apply_gradients(summing._compute_gradients(loss, var_list=[v]))

        step()
        assert _close(v.numpy(), -1.0 * total), (kind, "tf.function step", v.numpy())
        listed = summing.variables
        assert [id(x) for x in listed] == [id(x) for x in summing.variables()] and len(listed) >= 1, kind
        assert int(listed[0].numpy()) == 2, (kind, "iterations first", listed[0])
        if kind == "legacy":  # get_gradients: graph code (tf.gradients), only the legacy optimizers have it
            got = tf.function(lambda: summing.get_gradients(loss(), [v]))()[0]
            assert _close(got, total), ("get_gradients", got)
            (g, _), = opt._compute_gradients(loss, [v], grad_loss=tf.constant(3.0, tf.float64))
            assert _close(g, 3 * mean), ("grad_loss", g)


@mpi_test(pool=KERAS2_POOL, env=KERAS2_ENV, nps=(2, 3), timeout=300)
def test_keras2_gradient_aggregation_local_vars_sparse_and_inf():
    """horovod/tensorflow/gradient_aggregation_eager.py LocalGradientAggregationHelperEager (through
    horovod/_keras/__init__.py, test_tensorflow2_keras.py test_gradient_aggregation*,
    test_grad_aggregation_with_inf_grad, test_sparse_as_dense_with_grad_aggregation):
    K passes are summed on the rank (averaged with ``average_aggregated_gradients``), reduced on the
    K-th and applied only then; a ``register_local_var`` variable keeps its own gradient divided by the
    set's size; IndexedSlices need ``sparse_as_dense``; an inf round is cleared; ``_agg_helper.counter``
    counts the passes of the open round; ``iterations`` counts every pass."""
    tf, keras = _setup_keras2()
    import mtrain.tensorflow.keras as hvd
    n, me = hvd.size(), hvd.rank()
    a = [_values(r, 3) for r in range(n)]
    b = [_values(r, 2, salt=1.0) for r in range(n)]

    class NewAssign(keras.optimizers.Optimizer):
        """Sets each variable to its gradient: the applied gradient is read back exactly."""

        def __init__(self, name="assign", **kwargs):
            super().__init__(name=name, **kwargs)
            self._learning_rate = self._build_learning_rate(0.1)  # as Horovod's TestingOptimizer

        def update_step(self, gradient, variable):
            variable.assign(gradient)

    class LegacyAssign(keras.optimizers.legacy.Optimizer):
        def get_config(self):
            return super().get_config()

        def _create_slots(self, var_list):
            pass

        def _resource_apply_dense(self, grad, var, apply_state=None):
            return var.assign(grad)

    for kind, average, local in (("new", True, False), ("new", False, True), ("legacy", True, True),
                                 ("legacy", False, False)):
        plain = NewAssign() if kind == "new" else LegacyAssign("assign")
        opt = hvd.DistributedOptimizer(plain, backward_passes_per_step=K, average_aggregated_gradients=average,
                                       sparse_as_dense=True)
        x, y = tf.Variable(np.full(3, 7.0)), tf.Variable(np.full(4, 5.0))
        if local:
            opt.register_local_var(y)
        k = tf.Variable(0.0, dtype=tf.float64)

        def loss():  # pass k: d/dx = (k + 1) a_rank, d/dy = (k + 1) b_rank at rows 0 and 2 (IndexedSlices)
            return (k + 1) * (tf.reduce_sum(x * a[me]) + tf.reduce_sum(tf.gather(y, [0, 2]) * b[me]))

        @tf.function
        def step():
            opt.apply_gradients(opt._compute_gradients(loss, var_list=[x, y]), experimental_aggregate_gradients=False)

        for idx in range(2 * K + 1):
            step()
            k.assign_add(1.0)
            want_x, want_y = _expected_after(idx, average, local, a, b, me, n)
            tag = (kind, f"average={average}", f"local={local}", f"pass {idx}")
            assert _close(x.numpy(), want_x) and _close(y.numpy(), want_y), (tag, x.numpy(), want_x, y.numpy(), want_y)
            assert int(opt.iterations.numpy()) == idx + 1 and int(opt._agg_helper.counter.numpy()) == (idx + 1) % K, \
                (tag, opt.iterations.numpy(), opt._agg_helper.counter.numpy())
        assert opt._agg_helper.backward_passes_per_step == K

    # IndexedSlices over several passes: only as dense (Horovod's ValueError).
    opt = hvd.DistributedOptimizer(keras.optimizers.SGD(0.1), backward_passes_per_step=2)
    y = tf.Variable(np.ones(4))
    try:
        opt._compute_gradients(lambda: tf.reduce_sum(tf.gather(y, [1])), var_list=[y])
    except ValueError as error:
        assert "sparse_as_dense=True" in str(error), error
    else:
        raise AssertionError("IndexedSlices aggregated without sparse_as_dense")

    # An inf gradient in the first round does not reach the second (test_grad_aggregation_with_inf_grad).
    for kind, make in (("new", keras.optimizers.SGD), ("legacy", keras.optimizers.legacy.SGD)):
        opt = hvd.DistributedOptimizer(make(), backward_passes_per_step=2, sparse_as_dense=True)
        count, x = tf.Variable(0), tf.Variable(0.0, dtype=tf.float64)

        def inf_loss():
            count.assign_add(1)
            return tf.cond(count > 2, lambda: x * (me + 1.5) * tf.cast(count, tf.float64),
                           lambda: x * float("inf"))

        seen = []
        for _ in range(4):
            pairs = opt._compute_gradients(loss=inf_loss, var_list=[x])
            opt.apply_gradients(pairs)
            seen.append(float(pairs[0][0].numpy()))
        # pass 3 returns this rank's sum so far (3 (me + 1.5)), pass 4 the reduced round: mean of 7 (r + 1.5)
        assert np.isinf(seen[1]) and _close(seen[2], 3 * (me + 1.5)), (kind, seen)
        assert _close(seen[3], 7 * np.mean([r + 1.5 for r in range(n)])), (kind, seen)
        assert int(opt._agg_helper.counter.numpy()) == 0, kind

    # fit, sparse_as_dense, two passes (test_sparse_as_dense_with_grad_aggregation): an embedding's rows move
    # by the sum of the two batches' mean gradients, at the second batch; the third only aggregates.
    table = _rows(0, 7, 3, salt=2.0)
    model = keras.Sequential([keras.Input((2,), dtype="int32"), keras.layers.Embedding(7, 3)])
    model.layers[0].set_weights([table])
    opt = hvd.DistributedOptimizer(keras.optimizers.SGD(0.25), sparse_as_dense=True, backward_passes_per_step=2)
    model.compile(optimizer=opt, loss="mse")

    def batch(r, step):
        ids = ((np.arange(4).reshape(2, 2) * (r + 2) + 3 * step + r) % 7).astype(np.int32)
        return ids, _rows(r, 4, 3, salt=step).reshape(2, 2, 3)

    def table_grad(r, step):
        ids, target = batch(r, step)
        out = np.zeros((7, 3))
        np.add.at(out, ids.reshape(-1), (2.0 * (table[ids] - target) / target.size).reshape(-1, 3))
        return out

    for step in range(3):
        model.train_on_batch(*batch(me, step))
    want = table - 0.25 * sum(np.mean([table_grad(r, s) for r in range(n)], 0) for s in (0, 1))
    got = model.layers[0].get_weights()[0]
    assert _close(got, want), ("fit with aggregation", got - want)
    assert int(opt._agg_helper.counter.numpy()) == 3 % 2


@mpi_test(pool=KERAS2_POOL, env=KERAS2_ENV, nps=(2, 3), timeout=300)
def test_keras2_partial_distributed_optimizer():
    """horovod/keras/__init__.py PartialDistributedOptimizer (test_tensorflow2_keras.py
    test_partial_distributed_optimizer), through mtrain.keras and mtrain.tensorflow.keras, new and legacy
    Adam: ``_compute_gradients`` gives the local layers' weights this rank's gradient divided by the size
    (as is with ``scale_local_gradients=False``), and every other weight the ranks' mean."""
    tf, keras = _setup_keras2()
    import mtrain.keras as hvd_keras
    import mtrain.tensorflow.keras as hvd
    n, me = hvd.size(), hvd.rank()
    for local_count in range(3):
        for module, make, scale in ((hvd_keras, keras.optimizers.legacy.Adam, True),
                                    (hvd, keras.optimizers.Adam, local_count != 1)):
            init = keras.initializers.Constant(me + 0.5)
            model = keras.Sequential([keras.Input((3,)),
                                      keras.layers.Dense(2, kernel_initializer=init, bias_initializer=init),
                                      keras.layers.Dense(3, kernel_initializer=init, bias_initializer=init)])
            with tf.GradientTape(persistent=True) as tape:
                loss = tf.reduce_mean((model(_rows(me, 2, 3), training=True) - _rows(me, 2, 3, salt=5.0)) ** 2)
            plain = [g.numpy() for g in tape.gradient(loss, model.trainable_weights)]
            every = hvd.allgather_object(plain)
            opt = module.PartialDistributedOptimizer(make(), sparse_as_dense=True,
                                                     local_layers=model.layers[:local_count],
                                                     scale_local_gradients=scale)
            got = [g.numpy() for g, _ in opt._compute_gradients(loss, model.trainable_weights, tape=tape)]
            for i in range(4):
                local = i < 2 * local_count
                want = plain[i] / (n if scale else 1) if local else np.mean([e[i] for e in every], 0)
                assert _close(got[i], want), (module.__name__, make.__name__, local_count, i, got[i], want)


def _elastic_outside_a_job() -> None:
    for name in ("MTRAIN_ELASTIC", "MTRAIN_ELASTIC_STATE_DIR", "MTRAIN_ELASTIC_UPDATES", "MTRAIN_ELASTIC_VERSION",
                 "MTRAIN_JOB_SECRET"):
        os.environ.pop(name, None)


def _known(r: int, template) -> "list[np.ndarray]":
    """Rank ``r``'s values in the shapes and dtypes of ``template`` (arrays), distinct per rank, per array
    and per element, known to every rank without a collective: counts (ints) 3 + r + i, floats small and
    positive (they stand for learning rates, second moments and variances too)."""
    out = []
    for i, like in enumerate(np.asarray(t) for t in template):
        if like.dtype.kind in "iu":
            out.append(np.full(like.shape, 3 + r + i, like.dtype))
        else:
            out.append((0.01 + 0.01 * np.abs(_values(r, like.size, salt=i))).reshape(like.shape).astype(like.dtype))
    return out


def _all_differ(left, right) -> bool:
    """Every array of ``left`` differs from its counterpart in ``right`` (lists of different lengths differ)."""
    return len(left) != len(right) or all(not np.array_equal(p, q) for p, q in zip(left, right))


def _keras_state_restores(tf, keras, hvd, optimizers) -> None:
    """KerasState, for each (name, optimizer maker, whether the last rank's optimizer starts fresh): sync
    takes rank 0's weights and slots (a rank whose optimizer never stepped builds its slots) and a restore
    goes back to them; a restore after a commit (also one made by CommitStateCallback in fit) gives the
    committed weights, BatchNormalization statistics and slots, which differ per rank, and the committed
    attributes."""
    n, me = hvd.size(), hvd.rank()

    def current(model, opt):
        variables = opt.variables() if callable(opt.variables) else opt.variables
        return [w.numpy() for w in model.weights], [v.numpy() for v in variables]

    def equal(left, right):
        return all(len(x) == len(y) and all(np.array_equal(p, q) for p, q in zip(x, y)) for x, y in zip(left, right))

    x, y = _rows(me, 6, 3), _rows(me, 6, 2, salt=1.0)
    for kind, make, fresh in optimizers:
        keras.utils.set_random_seed(50 + me)
        model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(4, activation="tanh"),
                                  keras.layers.BatchNormalization(), keras.layers.Dense(2)])
        opt = make()  # not distributed (but one): the ranks' weights and slots drift apart
        model.compile(optimizer=opt, loss="mse")
        stepped = not (fresh and me == n - 1)  # the last rank's optimizer has not stepped: no slots yet (a new host)
        if stepped:
            model.fit(x, y, batch_size=3, verbose=0)
        # Every rank's weights and slots become known values of its own, so that rank 0's (what sync must
        # give every rank) are known here without a collective. Where a rank starts fresh, rank 0's optimizer
        # variables (their number, shapes and dtypes) are those of a like optimizer whose slots are built.
        own = opt.variables() if callable(opt.variables) else opt.variables
        slots = [v.numpy() for v in own]
        if fresh:
            like = make()
            with tf.init_scope():
                (like._create_all_weights if hasattr(like, "_create_all_weights") else like.build)(
                    list(model.trainable_variables))
            slots = [v.numpy() for v in (like.variables() if callable(like.variables) else like.variables)]
            if stepped:
                assert [(v.numpy().shape, v.numpy().dtype) for v in own] == [(a.shape, a.dtype) for a in slots], \
                    (kind, "a like optimizer's variables differ from this stepped one's")
        weights = [w.numpy() for w in model.weights]
        for variable, value in zip(model.weights, _known(me, weights)):
            variable.assign(value)
        if stepped:
            for variable, value in zip(own, _known(me, slots)):
                variable.assign(value)
        root = (_known(0, weights), _known(0, slots))
        before = current(model, opt)
        if stepped:
            assert equal(before, (_known(me, weights), _known(me, slots))), (kind, "the known values before sync")
        if me != 0:
            assert _all_differ(before[0], root[0]) and _all_differ(before[1], root[1]), \
                (kind, "this rank's weights and slots should differ from rank 0's before sync")
        state = hvd.elastic.KerasState(model, opt, batch=me, epoch=10 + me)
        state.sync()
        assert equal(current(model, opt), root) and (state.batch, state.epoch) == (0, 10), (kind, "sync")
        model.fit(x * 2, y, batch_size=3, verbose=0)
        state.batch = 5
        state.restore()
        assert equal(current(model, opt), root) and state.batch == 0, (kind, "restore after sync")

        model.fit(x, y * (me + 1), batch_size=2, verbose=0)
        state.batch, committed = 7, current(model, opt)
        state.commit()
        assert not equal(committed, root), (kind, "the commit should differ from the synced state")
        model.fit(x, y, batch_size=3, epochs=2, verbose=0)
        model.layers[0].kernel.assign(tf.zeros_like(model.layers[0].kernel))
        state.batch = 9
        state.restore()
        assert equal(current(model, opt), committed) and state.batch == 7, (kind, "restore after commit")

        callbacks = [hvd.elastic.UpdateBatchStateCallback(state), hvd.elastic.UpdateEpochStateCallback(state),
                     hvd.elastic.CommitStateCallback(state, batches_per_commit=2)]
        model.fit(x, y, batch_size=3, epochs=2, verbose=0, callbacks=callbacks)  # commits at its end
        committed = current(model, opt)
        model.fit(x, y * 3, batch_size=3, verbose=0)
        state.restore()
        assert equal(current(model, opt), committed) and (state.batch, state.epoch) == (0, 12), \
            (kind, "restore after CommitStateCallback", state.batch, state.epoch)


@mpi_test(pool=KERAS2_POOL, env=KERAS2_ENV, nps=(2, 3), timeout=300)
def test_keras2_elastic_state_restores_committed_weights_and_slots():
    """horovod/tensorflow/elastic.py TensorFlowKerasState (save / restore / sync, which keeps what it synced as
    the commit) and horovod/tensorflow/keras/elastic.py KerasState and its callbacks (tf.keras.callbacks.Callback,
    here tf_keras'), with tf_keras' new and legacy Adam, plain and wrapped."""
    tf, keras = _setup_keras2()
    import mtrain.tensorflow.keras as hvd
    _elastic_outside_a_job()
    assert isinstance(hvd.elastic.CommitStateCallback(hvd.elastic.ObjectState(), 1), keras.callbacks.Callback)
    _keras_state_restores(tf, keras, hvd, (
        ("new", lambda: keras.optimizers.Adam(0.05), True),
        ("legacy", lambda: keras.optimizers.legacy.Adam(0.05), True),
        ("legacy wrapped", lambda: hvd.DistributedOptimizer(keras.optimizers.legacy.RMSprop(0.05)), False)))


@mpi_test(pool=TF_POOL, nps=(2, 3), timeout=300)
def test_keras3_elastic_state_and_tensorflow_state_restore_after_sync():
    """horovod/tensorflow/elastic.py TensorFlowKerasState and TensorFlowState: sync keeps what it synced as the
    commit, so a restore after it gives rank 0's values; restore after commit gives the committed weights and
    slots (Keras 3 Adam)."""
    tf, keras = setup_tensorflow()
    import mtrain.tensorflow.keras as hvd
    _elastic_outside_a_job()
    n, me = hvd.size(), hvd.rank()
    _keras_state_restores(tf, keras, hvd, (("keras3", lambda: keras.optimizers.Adam(0.05), True),))
    variables = [tf.Variable(_rows(me, 2, 3)), tf.Variable(float(me))]
    root = [_rows(0, 2, 3), 0.0]  # rank 0's values, known here without a collective
    if me != 0:
        assert all(not np.array_equal(v.numpy(), r) for v, r in zip(variables, root)), "differ before sync"
    state = hvd.elastic.TensorFlowState(variables, step=me)
    state.sync()
    assert all(np.array_equal(v.numpy(), r) for v, r in zip(variables, root)) and state.step == 0, \
        ("TensorFlowState sync", [v.numpy() for v in variables], root)
    variables[0].assign_add(tf.ones((2, 3), tf.float64))
    state.restore()
    assert all(np.array_equal(v.numpy(), r) for v, r in zip(variables, root)) and state.step == 0, \
        ("TensorFlowState restore after sync", [v.numpy() for v in variables], root)


@mpi_test(pool=TF_POOL, nps=(2, 3), timeout=300)
def test_keras3_aggregation_local_vars_sparse_and_inf():
    """The Keras 3 wrapper where Horovod's names carry over (horovod/_keras/__init__.py, with the rule of
    horovod/tensorflow/gradient_aggregation_eager.py): ``backward_passes_per_step`` sums K passes (averages
    them with ``average_aggregated_gradients``) and applies once per round; a ``register_local_var`` variable
    keeps its gradient divided by the size; IndexedSlices with ``sparse_as_dense``; an inf round is cleared."""
    tf, keras = setup_tensorflow()
    import mtrain.tensorflow.keras as hvd
    n, me = hvd.size(), hvd.rank()
    a = [_values(r, 3) for r in range(n)]
    b = [_values(r, 2, salt=1.0) for r in range(n)]

    class Assign(keras.optimizers.Optimizer):
        """Sets each variable to its gradient: the applied gradient is read back exactly."""

        def update_step(self, gradient, variable, learning_rate):
            self.assign(variable, gradient)

    for average, local in ((True, False), (False, True)):
        opt = hvd.DistributedOptimizer(Assign(0.1), backward_passes_per_step=K, average_aggregated_gradients=average,
                                       sparse_as_dense=True)
        x, y = keras.Variable(np.full(3, 7.0)), keras.Variable(np.full(4, 5.0))
        if local:
            opt.register_local_var(y)
        for idx in range(2 * K + 1):
            sparse = tf.IndexedSlices(tf.constant((idx + 1) * b[me]), tf.constant([0, 2]), tf.constant([4]))
            opt.apply([tf.constant((idx + 1) * a[me]), sparse], [x, y])
            want_x, want_y = _expected_after(idx, average, local, a, b, me, n)
            tag = (f"average={average}", f"local={local}", f"pass {idx}")
            assert _close(x.numpy(), want_x) and _close(y.numpy(), want_y), (tag, x.numpy(), want_x, y.numpy(), want_y)

    opt = hvd.DistributedOptimizer(Assign(0.1), backward_passes_per_step=2)
    x = keras.Variable(0.0, dtype="float64")
    for g in (float("inf"), float("inf"), me + 1.0, 2 * me + 3.0):
        opt.apply([tf.constant(g, tf.float64)], [x])
    assert _close(x.numpy(), np.mean([3 * r + 4.0 for r in range(n)])), ("inf round", x.numpy())
