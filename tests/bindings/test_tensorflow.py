"""mtrain.tensorflow and mtrain.tensorflow.keras (Keras 3): equal to large-batch training, callbacks, errors.

TensorFlow takes seconds to import, so each rank body checks many things.
Every body trains its single-process reference itself, on the concatenated batch.
"""
import numpy as np
import pytest

from tests.bindings.requires import require
from tests.bindings.tf_setup import TF_POOL, setup_tensorflow
from tests.mpi.harness import mpi_test

require("tensorflow", "pip install '.[tensorflow]'")


_setup = setup_tensorflow


def _model(keras, seed: int):
    keras.utils.set_random_seed(seed)
    model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(8, activation="tanh"), keras.layers.Dense(3)])
    return model


def _data(steps: int, rows: int):
    rng = np.random.default_rng(1234)
    return rng.standard_normal((steps, rows, 6)), rng.standard_normal((steps, rows, 3))


def _flat(model) -> np.ndarray:
    return np.concatenate([np.asarray(w).reshape(-1) for w in model.get_weights()])


def _assert_identical_across_ranks(hvd, array: np.ndarray, what: str) -> None:
    everyone = hvd.allgather_object(array.tobytes())
    assert all(b == everyone[0] for b in everyone), f"{what}: ranks differ"


@mpi_test(pool=TF_POOL, nps=(2, 3), timeout=240)
def test_keras_fit_and_gradient_tape_equal_one_process_on_the_concatenated_batch():
    tf, keras = _setup()
    import mtrain.tensorflow as tfhvd
    import mtrain.tensorflow.keras as hvd
    n, me, b, steps = hvd.size(), hvd.rank(), 4, 3
    xs, ys = _data(steps, n * b)
    mine_x = np.concatenate([x[me * b:(me + 1) * b] for x in xs])
    mine_y = np.concatenate([y[me * b:(me + 1) * b] for y in ys])
    full_x, full_y = xs.reshape(-1, 6), ys.reshape(-1, 3)
    init = _flat(_model(keras, 0))
    sgd = lambda lr=0.1: keras.optimizers.SGD(learning_rate=lr, momentum=0.9)  # noqa: E731
    adam = lambda: keras.optimizers.Adam(learning_rate=0.05)  # noqa: E731
    # (name, reference optimizer, distributed optimizer, tolerance, through model.fit?)
    # model.fit traces a graph per model (slow to build), so only some cases go through it;
    # the others call the same wrapped optimizer's apply() eagerly.
    cases = [
        ("sgd-momentum fit", sgd(), hvd.DistributedOptimizer(sgd()), 1e-12, True),
        ("adam passes=2 averaged fit", adam(),
         hvd.DistributedOptimizer(adam(), backward_passes_per_step=2, average_aggregated_gradients=True),
         1e-12, True),
        ("adam", adam(), hvd.DistributedOptimizer(adam()), 1e-12, False),
        # Horovod's default sums the accumulated passes: twice the gradient, like twice the learning rate.
        ("sgd passes=2 summed", sgd(0.2), hvd.DistributedOptimizer(sgd(), backward_passes_per_step=2), 1e-12, False),
        ("sgd fp16", sgd(), hvd.DistributedOptimizer(sgd(), compression=hvd.Compression.fp16), 3e-3, False),
    ]
    for what, ref_opt, opt, tol, fit in cases:
        assert isinstance(opt, type(ref_opt)) and type(opt).__name__ == type(ref_opt).__name__, what
        passes = opt.gradient_accumulation_steps or 1
        reference, model = _model(keras, 0), _model(keras, 0)
        if fit:
            reference.compile(optimizer=ref_opt, loss="mse")
            model.compile(optimizer=opt, loss="mse")
            reference.fit(full_x, full_y, batch_size=n * b, epochs=1, shuffle=False, verbose=0)
            model.fit(mine_x, mine_y, batch_size=b // passes, epochs=1, shuffle=False, verbose=0)
        else:
            for net, optimizer, x, y, rows in ((reference, ref_opt, full_x, full_y, n * b),
                                               (model, opt, mine_x, mine_y, b // passes)):
                for start in range(0, len(x), rows):
                    with tf.GradientTape() as tape:
                        loss = tf.reduce_mean((net(x[start:start + rows]) - y[start:start + rows]) ** 2)
                    optimizer.apply(tape.gradient(loss, net.trainable_variables), net.trainable_variables)
        got, want = _flat(model), _flat(reference)
        assert np.allclose(got, want, rtol=tol, atol=tol), f"{what}: max diff {np.abs(got - want).max()}"
        assert not np.allclose(want, init), f"{what}: training did not move the weights"
        _assert_identical_across_ranks(hvd, got, what)
    # A custom loop with DistributedGradientTape and a plain Keras optimizer.
    reference, model = _model(keras, 0), _model(keras, 0)
    ref_opt, opt = adam(), adam()
    for x, y in zip(xs, ys):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean((reference(x) - y) ** 2)
        ref_opt.apply(tape.gradient(loss, reference.trainable_variables), reference.trainable_variables)
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean((model(x[me * b:(me + 1) * b]) - y[me * b:(me + 1) * b]) ** 2)
        tape = tfhvd.DistributedGradientTape(tape)
        opt.apply(tape.gradient(loss, model.trainable_variables), model.trainable_variables)
    assert np.allclose(_flat(model), _flat(reference), rtol=1e-12, atol=1e-12), "DistributedGradientTape"
    _assert_identical_across_ranks(hvd, _flat(model), "DistributedGradientTape")


@mpi_test(pool=TF_POOL, nps=(2,), timeout=240)
def test_callbacks_collectives_and_errors():
    tf, keras = _setup()
    import mtrain.tensorflow as tfhvd
    import mtrain.tensorflow.keras as hvd
    n, me, b = hvd.size(), hvd.rank(), 4

    # BroadcastGlobalVariablesCallback: ranks start different (weights and a stepped optimizer);
    # after one fit step they match the reference that started from rank 0's weights.
    xs, ys = _data(2, n * b)
    model = _model(keras, 10 + me)
    root_init = hvd.broadcast_object(model.get_weights(), root_rank=0)
    reference = _model(keras, 0)
    reference.set_weights(root_init)
    reference.compile(optimizer=keras.optimizers.Adam(0.05), loss="mse")
    reference.fit(xs.reshape(-1, 6), ys.reshape(-1, 3), batch_size=n * b, shuffle=False, verbose=0)
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.Adam(0.05)), loss="mse")
    if me != 0:  # leave some rank's optimizer state non-zero: the broadcast must overwrite it
        model.optimizer.build(model.trainable_variables)
        for v in model.optimizer.variables:
            v.assign(tf.ones_like(v) * (me + 1))
    seen = []
    record = keras.callbacks.LambdaCallback(on_epoch_end=lambda epoch, logs: seen.append(dict(logs)))
    before = keras.callbacks.LambdaCallback(on_epoch_end=lambda epoch, logs: seen.append(dict(logs)))
    mine = lambda a, width: np.concatenate([s[me * b:(me + 1) * b] for s in a]).reshape(-1, width)  # noqa: E731
    model.fit(mine(xs, 6), mine(ys, 3), batch_size=b, shuffle=False, verbose=0,
              callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0), before,
                         hvd.callbacks.MetricAverageCallback(), record])
    assert np.allclose(_flat(model), _flat(reference), rtol=1e-12, atol=1e-12), "broadcast before the first step"
    _assert_identical_across_ranks(hvd, _flat(model), "after BroadcastGlobalVariablesCallback")
    local_loss, averaged = seen[0]["loss"], seen[1]["loss"]
    assert np.isclose(averaged, np.mean(hvd.allgather_object(local_loss))), "MetricAverageCallback"
    assert len(set(hvd.allgather_object(averaged))) == 1, "MetricAverageCallback: ranks differ"

    # LearningRateWarmupCallback: initial_lr/size to initial_lr over warmup_epochs, batch by batch.
    model = _model(keras, 0)
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.1)), loss="mse")
    rates = []
    probe = keras.callbacks.LambdaCallback(
        on_train_batch_begin=lambda batch, logs: rates.append(float(model.optimizer.learning_rate.numpy())))
    model.fit(np.zeros((4 * b, 6)), np.zeros((4 * b, 3)), batch_size=b, epochs=3, shuffle=False, verbose=0,
              callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0),
                         hvd.callbacks.LearningRateWarmupCallback(initial_lr=0.1, warmup_epochs=2), probe])
    want = [0.1 / n * ((e + s / 4) * (n - 1) / 2 + 1) for e in range(2) for s in range(4)] + [0.1] * 4
    assert np.allclose(rates, want), f"warmup learning rates {rates} != {want}"

    # Collectives on tensors, eager and inside tf.function.
    base = tf.reshape(tf.range(12, dtype=tf.float32), (3, 4))
    mine_t = base * (me + 1) - me
    want_sum = sum(base * (r + 1) - r for r in range(n))
    assert np.array_equal(tfhvd.allreduce(mine_t, op=tfhvd.Sum), want_sum)
    assert np.allclose(tfhvd.allreduce(mine_t), want_sum / n)
    assert np.allclose(tf.function(lambda t: tfhvd.allreduce(t, op=tfhvd.Sum, name="in_graph"))(mine_t), want_sum)
    fp = tfhvd.allreduce(tf.constant([1.5 + me], tf.float64), compression=tfhvd.Compression.fp16)
    assert fp.dtype == tf.float64 and np.allclose(fp, [1.5 + (n - 1) / 2])
    grouped = tfhvd.grouped_allreduce([mine_t, tf.constant([me], tf.int64)], op=tfhvd.Sum)
    assert np.array_equal(grouped[0], want_sum) and grouped[1].numpy().tolist() == [n * (n - 1) // 2]
    gathered = tfhvd.allgather(tf.fill((me + 1, 2), me))
    assert gathered.numpy().tolist() == [[r, r] for r in range(n) for _ in range(r + 1)]
    assert tfhvd.broadcast(tf.constant([me, 7]), root_rank=n - 1).numpy().tolist() == [n - 1, 7]
    variable = tf.Variable([float(me)] * 3)
    tfhvd.broadcast_variables([variable], root_rank=1)
    assert variable.numpy().tolist() == [1.0] * 3
    rows = tf.reshape(tf.range(n * 2 + 1, dtype=tf.float64), (-1, 1)) * (me + 1)
    share = tfhvd.reducescatter(rows, op=tfhvd.Sum).numpy().reshape(-1).tolist()
    lo, total = me * 2 + min(me, 1), n * (n + 1) / 2
    assert share == [k * total for k in range(lo, lo + 2 + (1 if me < 1 else 0))]
    splits = [(me + r) % 2 + 1 for r in range(n)]
    data = tf.concat([tf.fill((s,), 100 * me + dest) for dest, s in enumerate(splits)], 0)
    received, received_splits = tfhvd.alltoall(data, splits=splits)
    assert received_splits.numpy().tolist() == [(src + me) % 2 + 1 for src in range(n)]
    assert received.numpy().tolist() == [100 * src + me for src in range(n) for _ in range((src + me) % 2 + 1)]

    # Errors.
    with pytest.raises(ValueError, match="Adasum"):
        hvd.DistributedOptimizer(keras.optimizers.SGD(0.1), op=hvd.Adasum)
    with pytest.raises(ValueError, match="op=Average"):
        hvd.DistributedOptimizer(keras.optimizers.SGD(0.1), op=hvd.Sum, gradient_predivide_factor=2.0)
    with pytest.raises(TypeError, match="wraps a Keras optimizer"):
        hvd.DistributedOptimizer(tf.Variable(1.0))
    with pytest.raises(ValueError, match="positive integer"):
        hvd.DistributedOptimizer(keras.optimizers.SGD(0.1), backward_passes_per_step=0)
    with pytest.raises(ValueError, match="either"):
        hvd.DistributedOptimizer(keras.optimizers.SGD(0.1, gradient_accumulation_steps=2), backward_passes_per_step=2)
    with pytest.raises(TypeError, match="tf.GradientTape"):
        tfhvd.DistributedGradientTape(model)
    odd = keras.Sequential([keras.Input((3 + me,)), keras.layers.Dense(2)])
    odd.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.1)), loss="mse")
    # Inside model.fit TensorFlow re-raises the runtime's MismatchError as an OpError, message intact.
    with pytest.raises((hvd.MismatchError, tf.errors.OpError), match="DistributedOptimizer.*different arguments"):
        odd.train_on_batch(np.zeros((2, 3 + me)), np.zeros((2, 2)))
