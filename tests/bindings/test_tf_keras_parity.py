"""Horovod 0.28 parity for the Keras side: SyncBatchNormalization, DistributedOptimizer in
mtrain.tensorflow, PartialDistributedGradientTape / PartialDistributedOptimizer (local layers),
BroadcastGlobalVariablesCallback(local_variables=...), load_model. Data distinct per rank and per element.
"""
import os
import shutil
import tempfile

import numpy as np
import pytest

from tests.bindings.requires import require
from tests.bindings.tf_setup import TF_POOL, setup_tensorflow
from tests.mpi.harness import mpi_test

require("tensorflow", "pip install '.[tensorflow]'")


_setup = setup_tensorflow


def _rows(r: int, count: int, width: int, salt: float = 0.0) -> np.ndarray:
    values = np.arange(count * width, dtype=np.float64).reshape(count, width)
    return np.sin(values * (r + 1.3) + salt) * (r + 2) + 0.1 * r


def _model(keras, seed: int):
    keras.utils.set_random_seed(seed)
    return keras.Sequential([keras.Input((4,)), keras.layers.Dense(3, activation="tanh"), keras.layers.Dense(2)])


@mpi_test(pool=TF_POOL, nps=(3,), timeout=300)
def test_sync_batch_norm_partial_optimizers_and_callback():
    tf, keras = _setup()
    import mtrain.keras as khvd
    import mtrain.ringreduce as rr
    import mtrain.tensorflow as hvd
    import mtrain.tensorflow.keras as tkhvd
    n, me, b = hvd.size(), hvd.rank(), 4

    # SyncBatchNormalization on each rank's batch == BatchNormalization on the concatenated batch:
    # outputs, moving statistics, and the input gradient of the summed loss (through the allreduce).
    xs = [_rows(r, b, 3) for r in range(n)]
    ws = [_rows(r, b, 3, salt=0.7) for r in range(n)]
    gamma, beta = np.array([1.5, 0.5, 2.0]), np.array([0.1, -0.2, 0.3])
    sync = hvd.SyncBatchNormalization(momentum=0.5)
    reference = keras.layers.BatchNormalization(momentum=0.5)
    for layer in (sync, reference):
        layer.build((None, 3))
        layer.gamma.assign(gamma)
        layer.beta.assign(beta)
    x = tf.constant(xs[me])
    with tf.GradientTape() as tape:
        tape.watch(x)
        out = sync(x, training=True)
        loss = tf.reduce_sum(ws[me] * out)
    grad = tape.gradient(loss, x)
    x_all = tf.constant(np.concatenate(xs))
    with tf.GradientTape() as tape:
        tape.watch(x_all)
        out_all = reference(x_all, training=True)
        loss_all = tf.reduce_sum(np.concatenate(ws) * out_all)
    grad_all = tape.gradient(loss_all, x_all)
    mine = slice(me * b, (me + 1) * b)
    assert np.allclose(out, out_all[mine], atol=1e-12), "SyncBatchNormalization output"
    assert np.allclose(grad, grad_all[mine], atol=1e-12), "SyncBatchNormalization input gradient"
    assert np.allclose(sync.moving_mean, reference.moving_mean, atol=1e-12), "moving_mean"
    assert np.allclose(sync.moving_variance, reference.moving_variance, atol=1e-12), "moving_variance"
    assert np.allclose(sync(x, training=False), reference(x, training=False), atol=1e-12), "inference"
    with pytest.raises(ValueError, match="fused"):
        hvd.SyncBatchNormalization(fused=True)

    # mtrain.tensorflow.DistributedOptimizer takes a Keras optimizer (Horovod's TF2 behaviour).
    model = _model(keras, 0)
    before = [v.numpy() for v in model.trainable_variables]
    grads = [_rows(me, int(np.prod(v.shape)), 1, salt=i).reshape(v.shape) for i, v in enumerate(before)]
    everyone = hvd.allgather_object(grads)
    opt = hvd.DistributedOptimizer(keras.optimizers.SGD(1.0))
    assert isinstance(opt, keras.optimizers.SGD)
    opt.apply([tf.constant(g) for g in grads], model.trainable_variables)
    for i, v in enumerate(model.trainable_variables):
        assert np.allclose(v.numpy(), before[i] - np.mean([e[i] for e in everyone], 0)), f"tf DistributedOptimizer {i}"
    with pytest.raises(TypeError, match="Keras"):
        hvd.DistributedOptimizer(object())

    # Local layers: shared gradients are averaged, a local layer's stay on the rank, divided by size
    # (Horovod's scale_local_gradients=True), or unscaled with scale_local_gradients=False.
    model = _model(keras, 10 + me)  # the local layer may differ per rank
    local = model.layers[1]
    x, y = tf.constant(_rows(me, b, 4)), tf.constant(_rows(me, b, 2, salt=2.0))
    for scale in (True, False):
        with tf.GradientTape(persistent=True) as tape:
            loss = tf.reduce_mean((model(x) - y) ** 2)
        plain = [g.numpy() for g in tape.gradient(loss, model.trainable_variables)]
        partial = hvd.PartialDistributedGradientTape(tape, local_layers=[local], scale_local_gradients=scale)
        got = partial.gradient(loss, model.trainable_variables)
        shared = hvd.allgather_object(plain[:2])
        for i in range(2):
            assert np.allclose(got[i], np.mean([s[i] for s in shared], 0)), f"partial tape shared {i}"
        for i in range(2, 4):
            assert np.allclose(got[i], plain[i] / (n if scale else 1)), f"partial tape local {i} scale={scale}"
    # The same rule in the Keras optimizer, eagerly and inside tf.function; register_local_var too.
    for how in ("eager", "graph", "register_local_var"):
        if how == "register_local_var":
            opt = tkhvd.DistributedOptimizer(keras.optimizers.SGD(1.0))
            for v in local.trainable_variables:
                opt.register_local_var(v)
        else:
            opt = khvd.PartialDistributedOptimizer(keras.optimizers.SGD(1.0), local_layers=[local])
        variables = model.trainable_variables
        before = [v.numpy() for v in variables]
        grads = [_rows(me, int(np.prod(v.shape)), 1, salt=3 + i).reshape(v.shape) for i, v in enumerate(before)]
        everyone = hvd.allgather_object(grads)
        step = lambda: opt.apply([tf.constant(g) for g in grads], variables)  # noqa: E731
        tf.function(step)() if how == "graph" else step()
        for i in range(2):
            want = before[i] - np.mean([e[i] for e in everyone], 0)
            assert np.allclose(variables[i].numpy(), want), f"{how}: shared {i}"
        for i in range(2, 4):
            assert np.allclose(variables[i].numpy(), before[i] - grads[i] / n), f"{how}: local {i}"

    # BroadcastGlobalVariablesCallback(root_rank, local_variables=...): the local layer keeps its own values.
    model = _model(keras, 20 + me)
    own_local = [w.numpy() for w in model.layers[1].weights]
    root_shared = hvd.broadcast_object([w.numpy() for w in model.layers[0].weights], root_rank=n - 1)
    model.compile(optimizer=khvd.DistributedOptimizer(keras.optimizers.SGD(0.0)), loss="mse")
    callback = khvd.callbacks.BroadcastGlobalVariablesCallback(n - 1, local_variables=model.layers[1].weights)
    model.fit(_rows(me, b, 4), _rows(me, b, 2), batch_size=b, verbose=0, callbacks=[callback])
    assert all(np.array_equal(w, r) for w, r in zip(model.layers[0].get_weights(), root_shared)), "shared"
    assert all(np.array_equal(w, o) for w, o in zip(model.layers[1].get_weights(), own_local)), "local"

    # A local layer whose shape differs per rank (model parallelism), with Adam: its moments stay local too.
    keras.utils.set_random_seed(30 + me)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3, name="shared"),
                              keras.layers.Dense(2 + me, name="local")])
    model.compile(optimizer=khvd.PartialDistributedOptimizer(keras.optimizers.Adam(0.0), local_layers=[model.layers[1]]),
                  loss="mse")
    model.optimizer.build(model.trainable_variables)
    for v in model.optimizer.variables:
        if v.name != "iteration":
            v.assign(tf.ones_like(v) * (me + 1))
    root_shared = hvd.broadcast_object([w.numpy() for w in model.layers[0].weights], root_rank=0)
    callback = khvd.callbacks.BroadcastGlobalVariablesCallback(0, local_variables=[model.layers[1]])
    callback.set_model(model)
    callback.on_train_begin()
    assert all(np.array_equal(w, r) for w, r in zip(model.layers[0].get_weights(), root_shared)), "shared (Adam)"
    slots = {v.name: float(np.ravel(v.numpy())[0]) for v in model.optimizer.variables if v.name != "iteration"}
    for name, value in slots.items():
        want = float(me + 1) if "local" in name else 1.0
        assert value == want, f"optimizer slot {name}: {value} != {want}"

    # load_model (Horovod's test_load_model*): a model saved with a wrapped optimizer loads back wrapped,
    # with its state (the optimizer tracks none of the model's variables), custom_optimizers and
    # custom_objects; training it goes on reducing.
    class MyAdam(keras.optimizers.Adam):
        pass

    def my_loss(y_true, y_pred):
        return keras.ops.mean((y_true - y_pred) ** 2)

    folder = tempfile.mkdtemp(prefix=f"mtrain-keras3-{me}-")
    for make, loss, extra in ((lambda: keras.optimizers.Adam(0.01), "mse", {}),
                              (lambda: MyAdam(0.01), my_loss, {"custom_optimizers": [MyAdam],
                                                               "custom_objects": {"my_loss": my_loss}})):
        model = _model(keras, 40)
        model.compile(optimizer=tkhvd.DistributedOptimizer(make()), loss=loss)
        model.fit(_rows(me, b, 4), _rows(me, b, 2), batch_size=b, verbose=0)
        assert len(model.optimizer.variables) == 2 + 2 * len(model.trainable_variables), model.optimizer.variables
        path = os.path.join(folder, f"{type(make()).__name__}.keras")
        model.save(path)
        loaded = khvd.load_model(path, **extra)
        assert type(loaded.optimizer).__name__ == type(make()).__name__ and isinstance(loaded.optimizer, type(make()))
        assert hasattr(loaded.optimizer, "register_local_var"), type(loaded.optimizer).__mro__
        for mine, saved in zip(loaded.optimizer.variables, model.optimizer.variables):
            assert np.array_equal(mine.numpy(), saved.numpy()), (mine.path, saved.path)
        loaded.fit(_rows(me, b, 4), _rows(me, b, 2), batch_size=b, verbose=0)
        everyone = hvd.allgather_object([w.numpy() for w in loaded.weights])
        assert all(np.array_equal(w, z) for e in everyone for w, z in zip(e, everyone[0])), "load_model: reduces"
    shutil.rmtree(folder)

    # Names.
    assert khvd.HorovodInternalError is hvd.HorovodInternalError
    if hasattr(rr, "HorovodInternalError"):
        assert hvd.HorovodInternalError is rr.HorovodInternalError
