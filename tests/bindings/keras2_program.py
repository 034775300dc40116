"""One rank of tests/bindings/test_tf_keras2.py: Horovod's Keras 2 test patterns under TF_USE_LEGACY_KERAS=1.

Every check compares with a NumPy rule computed from every rank's (distinct) data, so an
un-averaged gradient shows. Prints "rank R checks NAMES" and a weights digest at the end.
"""
import hashlib
import os
import shutil
import sys
import tempfile

import numpy as np
import tensorflow as tf
import tf_keras

assert os.environ.get("TF_USE_LEGACY_KERAS") == "1", "run with TF_USE_LEGACY_KERAS=1"
keras = tf.keras
assert keras.optimizers.Adam is tf_keras.optimizers.Adam, "tf.keras is not tf_keras"

import keras as keras3  # noqa: E402

import mtrain.keras as hvd_keras  # noqa: E402
import mtrain.tensorflow.keras as hvd  # noqa: E402

hvd.init()
tf.config.threading.set_intra_op_parallelism_threads(1)
tf.config.threading.set_inter_op_parallelism_threads(2)
keras.backend.set_floatx("float64")
n, me = hvd.size(), hvd.rank()
CHECKS = []


def check(name, ok, detail=""):
    if not ok:
        raise AssertionError(f"rank {me}: {name} {detail}")
    CHECKS.append(name)


def close(a, b, tol=1e-10):
    return np.allclose(np.asarray(a, np.float64), np.asarray(b, np.float64), rtol=tol, atol=tol)


def rows(r, count, width, salt=0.0):
    values = np.arange(count * width, dtype=np.float64).reshape(count, width)
    return np.sin(values * (r + 1.3) + salt) * (r + 2) + 0.1 * r


def linear_model(seed):
    keras.utils.set_random_seed(seed)
    return keras.Sequential([keras.Input((4,)), keras.layers.Dense(2, name="dense")])


def mse_grads(w, b, x, y):
    err = x @ w + b - y
    scale = 2.0 / err.size
    return scale * x.T @ err, scale * err.sum(0), float(np.mean(err ** 2))


# --- DistributedOptimizer in compile/fit (new and legacy tf_keras optimizers), BroadcastGlobalVariablesCallback,
# MetricAverageCallback: the weights follow SGD on the ranks' average gradient (test_tensorflow2_keras.py).
B, LR, EPOCHS = 3, 0.125, 3  # LR exact in float32 (legacy optimizers keep hyperparameters so)
xs, ys = [rows(r, B, 4) for r in range(n)], [rows(r, B, 2, salt=1.0) for r in range(n)]
for kind, make in (("new", lambda: keras.optimizers.SGD(LR)), ("legacy", lambda: keras.optimizers.legacy.SGD(LR))):
    model = linear_model(100 + me)  # distinct start per rank: the callback must broadcast rank 0's
    w, b = hvd.broadcast_object([v.numpy() for v in model.weights], root_rank=0)
    plain = make()
    opt = hvd.DistributedOptimizer(plain)
    check(f"fit.{kind}.class", type(opt).__name__ == "SGD" and isinstance(opt, type(plain)), type(opt).__mro__)
    model.compile(optimizer=opt, loss="mse")
    history = model.fit(xs[me], ys[me], batch_size=B, epochs=EPOCHS, verbose=0, shuffle=False,
                        callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0),
                                   hvd.callbacks.MetricAverageCallback()])
    losses = []
    for _ in range(EPOCHS):
        steps = [mse_grads(w, b, xs[r], ys[r]) for r in range(n)]
        losses.append(np.mean([s[2] for s in steps]))
        w = w - LR * np.mean([s[0] for s in steps], 0)
        b = b - LR * np.mean([s[1] for s in steps], 0)
    check(f"fit.{kind}.weights", close(model.weights[0], w) and close(model.weights[1], b),
          (model.weights[0].numpy() - w, model.weights[1].numpy() - b))
    check(f"fit.{kind}.metric_average", close(history.history["loss"], losses, 1e-9), history.history["loss"])


def minimize_step(opt, grads_of_rank, variables, tape=False):
    """Minimize sum(v * g_rank) (gradient g_rank); the variables' change."""
    before = [v.numpy() for v in variables]

    def loss():
        return tf.add_n([tf.reduce_sum(v * g) for v, g in zip(variables, grads_of_rank(me))])
    opt.minimize(loss, var_list=variables)
    return [v.numpy() - x for v, x in zip(variables, before)]


# --- from_config of the wrapped optimizer: same configuration, and it reduces too.
grad_of = lambda r: [rows(r, 1, 3, salt=2.0)[0]]  # noqa: E731
mean_grad = np.mean([grad_of(r)[0] for r in range(n)], 0)
for kind, plain in (("new", keras.optimizers.Adam(0.01)), ("legacy", keras.optimizers.legacy.Adam(0.01)),
                    ("keras3", keras3.optimizers.SGD(0.5))):
    hopt = hvd.DistributedOptimizer(plain)
    cfg = hopt.get_config()
    copies = [hopt.from_config(cfg), type(hopt).from_config(cfg)]
    check(f"from_config.{kind}.config", all(c.get_config() == cfg and type(c) is type(hopt) for c in copies))
    if kind == "keras3":
        v = keras3.Variable(np.zeros(3))
        copies[0].apply([tf.constant(grad_of(me)[0])], [v])
        check("from_config.keras3.reduces", close(v.numpy(), -0.5 * mean_grad))
    else:
        # Adam's first step from zeros: -lr * g / (|g| + eps)
        v = tf.Variable(np.zeros(3))
        delta = minimize_step(copies[1], grad_of, [v])[0]
        check(f"from_config.{kind}.reduces", close(delta, -0.01 * mean_grad / (np.abs(mean_grad) + 1e-7), 1e-6), delta)
# A legacy optimizer's get_gradients (graph code: tf.gradients, here inside a tf.function) reduces too.
v = tf.Variable(np.zeros(3))
opt = hvd.DistributedOptimizer(keras.optimizers.legacy.SGD(0.5))
got = tf.function(lambda: opt.get_gradients(tf.reduce_sum(v * grad_of(me)[0]), [v]))()[0]
check("get_gradients.legacy", close(got, mean_grad), got)
with_error = None
try:
    hvd.DistributedOptimizer(tf.compat.v1.train.GradientDescentOptimizer(0.1))
except TypeError as error:
    with_error = str(error)
check("not_an_optimizer", with_error is not None and "tf_keras.optimizers" in with_error, with_error)


# --- sparse_as_dense: embedding gradients (IndexedSlices) averaged, dense or sparse (test_sparse_as_dense).
def embedding_grads(opt):
    keras.utils.set_random_seed(7)
    layer = keras.layers.Embedding(6, 2)
    ids = tf.constant(((np.arange(4) * (me + 2) + me) % 6).reshape(2, 2))
    layer.build((None, 2))
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(layer(ids) * (me + 1.5))
    return opt.compute_gradients(loss, layer.trainable_variables, tape=tape)[0][0]


def dense_embedding_grad(r):
    ids = ((np.arange(4) * (r + 2) + r) % 6)
    out = np.zeros((6, 2))
    np.add.at(out, ids, r + 1.5)
    return out


mean_embedding = np.mean([dense_embedding_grad(r) for r in range(n)], 0)
for sparse_as_dense in (True, False):
    got = embedding_grads(hvd.DistributedOptimizer(keras.optimizers.SGD(0.1), sparse_as_dense=sparse_as_dense))
    check(f"sparse_as_dense={sparse_as_dense}",
          isinstance(got, tf.IndexedSlices) != sparse_as_dense and close(tf.convert_to_tensor(got), mean_embedding))
keras.utils.set_random_seed(3 + me)
model = keras.Sequential([keras.Input((3,), dtype="int32"), keras.layers.Embedding(10, 4), keras.layers.Flatten(),
                          keras.layers.Dense(1)])
model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.legacy.RMSprop(0.001), sparse_as_dense=True),
              loss="mse")
model.fit((np.arange(12).reshape(4, 3) * (me + 1)) % 10, rows(me, 4, 1), batch_size=2, verbose=0,
          callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0)])
everyone = hvd.allgather_object([v.numpy() for v in model.weights])
check("sparse_as_dense.fit", all(close(a, z, 0) for e in everyone for a, z in zip(e, everyone[0])))


# --- backward_passes_per_step with average_aggregated_gradients, with local variables
# (test_gradient_aggregation, test_gradient_aggregation_with_local_vars; IndexedSlices via tf.gather).
class TestingOptimizer(keras.optimizers.legacy.Optimizer):
    def get_config(self):
        return super().get_config()

    def _create_slots(self, var_list):
        pass

    def _resource_apply_dense(self, grad, var, apply_state=None):
        return var.assign_add(grad)


K = 4
for average in (True, False):
    for local in (False, True):
        opt = hvd.DistributedOptimizer(TestingOptimizer("test"), backward_passes_per_step=K,
                                       average_aggregated_gradients=average, sparse_as_dense=True)
        x, y = tf.Variable(np.array([0.0])), tf.Variable(np.array([1.0, 2.0]))
        if local:
            opt.register_local_var(y)

        def loss():  # d/dx = rank + 1, d/dy = [-(rank + 2), 0]
            return (me + 1.0) * x - (me + 2.0) * tf.gather(y, [0])

        @tf.function
        def step():
            opt.apply_gradients(opt._compute_gradients(loss, var_list=[x, y]), experimental_aggregate_gradients=False)

        for idx in range(6):
            step()
            rounds = (idx + 1) // K
            factor = rounds * (1.0 if average else K)
            want_x = factor * np.mean([r + 1.0 for r in range(n)])
            want_y0 = 1.0 - factor * ((me + 2.0) / n if local else np.mean([r + 2.0 for r in range(n)]))
            tag = f"aggregation.average={average}.local={local}.step{idx}"
            check(tag, close(x.numpy(), [want_x]) and close(y.numpy(), [want_y0, 2.0])
                  and opt.iterations.numpy() == idx + 1, (x.numpy(), y.numpy(), want_x, want_y0))

# An inf gradient in the first aggregation round does not reach the second (test_grad_aggregation_with_inf_grad).
opt = hvd.DistributedOptimizer(keras.optimizers.legacy.SGD(), backward_passes_per_step=2, sparse_as_dense=True)
count, x = tf.Variable(0), tf.Variable(0.0)


def inf_loss():
    count.assign_add(1)
    return tf.cond(count > 1, lambda: x * (me + 1.0), lambda: x * float("inf"))


for _ in range(4):
    pairs = opt._compute_gradients(loss=inf_loss, var_list=[x])
    opt.apply_gradients(pairs)
check("aggregation.inf", close(pairs[0][0], 2 * np.mean([r + 1.0 for r in range(n)])), pairs[0][0])

# fit with backward_passes_per_step=2, the new optimizer: two batches summed, applied once.
model = linear_model(9)
w0, b0 = [v.numpy() for v in model.weights]
model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(LR), backward_passes_per_step=2,
                                                 average_aggregated_gradients=True), loss="mse")
xx, yy = [rows(r, 4, 4, salt=3.0) for r in range(n)], [rows(r, 4, 2, salt=4.0) for r in range(n)]
model.fit(xx[me], yy[me], batch_size=2, epochs=1, shuffle=False, verbose=0)
parts = [mse_grads(w0, b0, xx[r][h:h + 2], yy[r][h:h + 2]) for r in range(n) for h in (0, 2)]
check("aggregation.fit", close(model.weights[0], w0 - LR * np.mean([p[0] for p in parts], 0))
      and close(model.weights[1], b0 - LR * np.mean([p[1] for p in parts], 0)))


# --- PartialDistributedOptimizer (test_partial_distributed_optimizer): local layers' gradients / size.
for local_count in range(3):
    init = keras.initializers.Constant(me + 0.5)
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2, kernel_initializer=init, bias_initializer=init),
                              keras.layers.Dense(3, kernel_initializer=init, bias_initializer=init)])
    X, Y = rows(me, 2, 3), rows(me, 2, 3, salt=5.0)
    with tf.GradientTape(persistent=True) as tape:
        loss = tf.reduce_mean((model(X, training=True) - Y) ** 2)
    plain = [g.numpy() for g in tape.gradient(loss, model.trainable_weights)]
    every = hvd.allgather_object(plain)
    opt = hvd_keras.PartialDistributedOptimizer(keras.optimizers.legacy.Adam(), sparse_as_dense=True,
                                                local_layers=model.layers[:local_count])
    got = [g.numpy() for g, _ in opt._compute_gradients(loss, model.trainable_weights, tape=tape)]
    for i in range(4):
        want = plain[i] / n if i < 2 * local_count else np.mean([e[i] for e in every], 0)
        check(f"partial.local{local_count}.var{i}", close(got[i], want))


# --- BroadcastGlobalVariablesCallback with local variables (test_broadcast_global_variables_callback_with_local_vars),
# and the slots of a local layer (legacy Adam) stay local too.
root = n - 1
init = keras.initializers.Constant(float(me))
model = keras.Sequential([keras.Input((3,))] + [keras.layers.Dense(3, kernel_initializer=init, bias_initializer=init,
                                                                   trainable=False) for _ in range(3)])
model.compile(loss="mse")
local_variables = list(model.layers[0].variables)
model.fit(rows(me, 1, 3), rows(me, 1, 3), verbose=0,
          callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(root_rank=root, local_variables=local_variables)])
for i, layer in enumerate(model.layers):
    want = float(me if i == 0 else root)
    check(f"broadcast.local.layer{i}", all(close(v, np.full(v.shape, want), 0) for v in layer.variables))
for kind in ("legacy", "new"):
    keras.utils.set_random_seed(30 + me)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3, name="shared"),
                              keras.layers.Dense(2 + me, name="local")])  # a local layer may differ in shape
    adam = keras.optimizers.legacy.Adam(0.0) if kind == "legacy" else keras.optimizers.Adam(0.0)
    model.compile(optimizer=hvd.PartialDistributedOptimizer(adam, local_layers=[model.layers[1]]), loss="mse")
    callback = hvd.callbacks.BroadcastGlobalVariablesCallback(0, local_variables=[model.layers[1]])
    callback.set_model(model)
    slots = hvd.keras2.optimizer_variables(model.optimizer, model.trainable_variables)
    for v in slots:
        v.assign(tf.cast(tf.ones_like(v) * (me + 1), v.dtype))
    root_shared = hvd.broadcast_object([w.numpy() for w in model.layers[0].weights], root_rank=0)
    callback.on_train_begin()
    check(f"broadcast.slots.{kind}.shared",
          all(close(w, r, 0) for w, r in zip(model.layers[0].get_weights(), root_shared)))
    for v in slots:
        owner = "local" if "local" in v.name else ("shared" if "shared" in v.name else "iteration")
        want = me + 1 if owner == "local" else 1
        check(f"broadcast.slots.{kind}.{owner}", close(np.ravel(v.numpy())[0], want, 0), (v.name, v.numpy()))


# --- LearningRateWarmupCallback, LearningRateScheduleCallback (test_train_model_lr_schedule), momentum correction.
init_lr, steps, momentum = 0.1 * n, 2, 0.9


class Record(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.seen = []

    def on_train_batch_begin(self, batch, logs=None):
        opt = self.model.optimizer
        self.seen.append((float(opt.learning_rate.numpy()), float(opt.momentum.numpy())))

    def on_train_batch_end(self, batch, logs=None):
        check("lr.momentum_restored", close(self.model.optimizer.momentum.numpy(), momentum, 1e-6))


model = linear_model(11)
model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.legacy.SGD(init_lr, momentum=momentum)), loss="mse")
record = Record()
model.fit(rows(me, 4, 4), rows(me, 4, 2), batch_size=2, epochs=4, shuffle=False, verbose=0, callbacks=[
    hvd.callbacks.LearningRateWarmupCallback(initial_lr=init_lr, warmup_epochs=2),
    hvd.callbacks.LearningRateScheduleCallback(initial_lr=init_lr, multiplier=0.1, start_epoch=2, end_epoch=3),
    hvd.callbacks.LearningRateScheduleCallback(initial_lr=init_lr, multiplier=lambda epoch: epoch, start_epoch=3),
    record])
want_lr = [init_lr / n * ((e + k / steps) * (n - 1) / 2 + 1) for e in range(2) for k in range(steps)]
want_lr += [init_lr * 0.1] * steps + [init_lr * 3] * steps
previous, want = init_lr, []
for i, lr in enumerate(want_lr):
    if i == 2 * steps:  # the warmup ends by setting initial_lr exactly
        previous = init_lr
    want.append((lr, momentum * lr / previous if not np.isclose(lr, previous) else momentum))
    previous = lr
check("lr.schedule", close(record.seen, want, 1e-6), (record.seen, want))


# --- load_model: a model saved with a wrapped optimizer loads back wrapped, with its state; custom_optimizers
# and custom_objects (test_load_model, test_load_model_custom_optimizers, test_load_model_custom_objects).
class MyAdam(keras.optimizers.legacy.Adam):
    pass


def my_loss(y_true, y_pred):
    return tf.reduce_mean((y_true - y_pred) ** 2)


folder = tempfile.mkdtemp(prefix=f"mtrain-keras2-{me}-")
for kind, make, loss, extra in (
        ("legacy", lambda: keras.optimizers.legacy.Adam(0.01), "mse", {}),
        ("new", lambda: keras.optimizers.Adam(0.01), "mse", {}),
        ("custom", lambda: MyAdam(0.01), my_loss, {"custom_optimizers": [MyAdam],
                                                   "custom_objects": {"my_loss": my_loss}})):
    model = linear_model(40)
    model.compile(optimizer=hvd.DistributedOptimizer(make()), loss=loss)
    model.fit(xs[me], ys[me], batch_size=B, verbose=0)
    path = os.path.join(folder, f"{kind}.h5")
    model.save(path)
    loaded = hvd.load_model(path, **extra)
    opt = loaded.optimizer
    check(f"load_model.{kind}.wrapped", type(opt).__name__ == type(make()).__name__
          and hasattr(opt, "register_local_var") and isinstance(opt, type(make())), type(opt).__mro__)
    saved = [v.numpy() for v in hvd.keras2.optimizer_variables(model.optimizer, model.trainable_variables)]
    state = [v.numpy() for v in hvd.keras2.optimizer_variables(opt, loaded.trainable_variables)]
    check(f"load_model.{kind}.state", len(saved) == len(state) and all(close(a, z, 0) for a, z in zip(saved, state)))
    loaded.fit(xs[me], ys[me], batch_size=B, verbose=0)  # reduces: the ranks stay equal
    everyone = hvd.allgather_object([v.numpy() for v in loaded.weights])
    check(f"load_model.{kind}.reduces", all(close(a, z, 0) for e in everyone for a, z in zip(e, everyone[0])))
shutil.rmtree(folder)

digest = hashlib.sha256(b"".join(np.ascontiguousarray(v.numpy()).tobytes() for v in loaded.weights)).hexdigest()
print(f"rank {me} checks {len(CHECKS)} {','.join(sorted(set(CHECKS)))}")
print(f"rank {me} digest {digest}")
sys.stdout.flush()
