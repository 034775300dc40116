"""Graphs through mtrain.tensorflow as Horovod 0.28 runs them: the error class of ranks that disagree
inside a ``tf.function`` and a ``tf.compat.v1.Session``, and ``DistributedOptimizer`` wrapping a TF1
``tf.compat.v1.train`` optimizer (Horovod's legacy path), with process sets.

Every rank's data differs per rank and per element; the expected values come from the same TF1
optimizer run in one process on the data of the ranks it averages over.
"""
import numpy as np
import pytest

from tests.bindings.requires import require
from tests.bindings.tf_setup import TF_POOL, setup_threads
from tests.mpi.harness import mpi_test

require("tensorflow", "pip install '.[tensorflow]'")


def _rows(r: int, count: int, width: int = 2, salt: float = 0.0) -> np.ndarray:
    """Rank r's data: distinct per rank and per element."""
    return (np.arange(count * width, dtype=np.float64).reshape(count, width) + 1) * (r + 1.5) + 100 * r + salt


@mpi_test(pool=TF_POOL, nps=(2, 3), timeout=240)
def test_ranks_that_disagree_in_a_graph_raise_failed_precondition():
    """In a graph (a tf.function, a TF1 session) ranks that disagree raise
    tf.errors.FailedPreconditionError, as eagerly: Horovod's test/parallel/test_tensorflow.py
    (test_horovod_allreduce_error, ..._type_error, test_horovod_allgather_error,
    test_horovod_broadcast_error, run in graph and eager modes), whose kernels map a
    PRECONDITION_ERROR status to FailedPrecondition (horovod/tensorflow/mpi_ops.cc)."""
    tf = setup_threads()
    import mtrain.tensorflow as hvd
    n, me = hvd.size(), hvd.rank()
    last = n - 1  # only the last rank differs: every rank still hears of it
    mismatched = {
        "allreduce shape": lambda: hvd.allreduce(tf.zeros([3, 2 + (me == last)], tf.float64), op=hvd.Sum),
        "allreduce dtype": lambda: hvd.allreduce(tf.ones([17, 3], tf.int32 if me % 2 == 0 else tf.float32)),
        "allgather trailing dims": lambda: hvd.allgather(tf.zeros([me + 1, 2 + me])),
        "broadcast shape": lambda: hvd.broadcast(tf.zeros([2 + me]), root_rank=0),
        "grouped allreduce": lambda: hvd.grouped_allreduce([tf.ones([4]), tf.ones([1 + (me == last)])]),
        "reducescatter shape": lambda: hvd.reducescatter(tf.zeros([2 * n, 1 + me]), op=hvd.Sum),
    }
    for what, build in mismatched.items():
        with pytest.raises(tf.errors.FailedPreconditionError, match="different arguments") as caught:
            tf.function(build)()
        assert not isinstance(caught.value, tf.errors.InvalidArgumentError), what
        with pytest.raises(tf.errors.FailedPreconditionError):  # eagerly, as before
            build()
    # A TF1 graph run by a session: the same class, and the session runs collectives after it
    # (a graph of their own: a graph's later collectives run its earlier ones' submit ops first).
    with tf.Graph().as_default():
        bad = hvd.allreduce(tf.constant(_rows(me, 2 + (me == last))), op=hvd.Sum)
        with tf.compat.v1.Session() as session:
            with pytest.raises(tf.errors.FailedPreconditionError, match="different arguments"):
                session.run(bad)
    with tf.Graph().as_default():
        good = hvd.grouped_allreduce([tf.constant(_rows(me, 3)), tf.constant(_rows(me, 1, 4))], op=hvd.Sum)
        with tf.compat.v1.Session() as session:
            got = session.run(good)
    assert np.allclose(got[0], sum(_rows(r, 3) for r in range(n))), "a session's collective after the error"
    assert np.allclose(got[1], sum(_rows(r, 1, 4) for r in range(n))), "a session's collective after the error"
    # Errors of one rank's own arguments keep their class (InvalidArgumentError) in a graph.
    with pytest.raises(tf.errors.InvalidArgumentError, match="root_rank"):
        tf.function(lambda: hvd.broadcast(tf.zeros([2]), root_rank=n + 1))()
    got = tf.function(lambda t: hvd.allreduce(t, op=hvd.Sum))(tf.constant(_rows(me, 2, 3)))
    assert np.allclose(got, sum(_rows(r, 2, 3) for r in range(n))), "a graph's collectives after the errors"


def _train_v1(tf, hvd, xs, ys, make_optimizer, steps: int, distributed=None, local=()):
    """A linear model trained by a TF1 optimizer in a session, on (xs, ys): wrapped by
    hvd.DistributedOptimizer(**distributed) unless ``distributed`` is None, with the variables
    named in ``local`` registered as local. Returns (weights, bias, slots)."""
    with tf.Graph().as_default():
        w = tf.compat.v1.get_variable("w", initializer=np.linspace(-0.5, 0.7, 6).reshape(3, 2))
        b = tf.compat.v1.get_variable("b", initializer=np.array([0.1, -0.2]))
        unused = tf.compat.v1.get_variable("unused", initializer=np.array([1.0]))  # its gradient is None
        loss = tf.reduce_mean(tf.square(tf.matmul(tf.constant(xs), w) + b - tf.constant(ys)))
        inner = make_optimizer()
        opt = hvd.DistributedOptimizer(inner, **distributed) if distributed is not None else inner
        for var in local:
            opt.register_local_var({"w": w, "b": b}[var])
        pairs = opt.compute_gradients(loss, var_list=[w, b, unused])
        assert pairs[2][0] is None, "a None gradient stays None"
        train = opt.apply_gradients(pairs)
        with tf.compat.v1.Session() as session:
            session.run(tf.compat.v1.global_variables_initializer())
            for _ in range(steps):
                session.run(train)
            slots = [session.run(opt.get_slot(v, name)) for v in (w, b) for name in opt.get_slot_names()]
            assert len(opt.variables()) == len(inner.variables())
            return session.run(w), session.run(b), slots


@mpi_test(pool=TF_POOL, nps=(2, 3), timeout=300)
def test_tf1_optimizer_trains_as_one_process_on_the_ranks_data():
    """hvd.DistributedOptimizer(tf.compat.v1.train optimizer) in a TF1 session equals that optimizer
    in one process on the concatenated data (equal batches: the mean of the ranks' mean losses),
    with a process set, Sum, a predivide factor, a local variable; and Horovod's own process-set
    case (test/parallel/test_tensorflow_process_sets.py, test_legacy_DistributedOptimizer_process_sets).
    Follows horovod/tensorflow/__init__.py (_DistributedOptimizer, DistributedOptimizer)."""
    tf = setup_threads()
    import mtrain.tensorflow as hvd
    n, me = hvd.size(), hvd.rank()
    data = {r: (_rows(r, 4, 3) / 100.0, _rows(r, 4, 2, salt=0.5) / 50.0) for r in range(n)}
    xs, ys = data[me]
    momentum = lambda: tf.compat.v1.train.MomentumOptimizer(0.05, 0.9)  # noqa: E731  (slots)
    adam = lambda: tf.compat.v1.train.AdamOptimizer(0.01)  # noqa: E731

    def alone(ranks, make=momentum, steps=3):
        """One process, the plain optimizer, on the ranks' data concatenated."""
        return _train_v1(tf, hvd, np.concatenate([data[r][0] for r in ranks]),
                         np.concatenate([data[r][1] for r in ranks]), make, steps)

    def same(got, want, what):
        for g, w in zip(got[:2] + tuple(got[2]), want[:2] + tuple(want[2])):
            assert np.allclose(g, w, rtol=1e-9, atol=1e-12), f"{what}: {g} != {w}"

    everyone = list(range(n))
    same(_train_v1(tf, hvd, xs, ys, momentum, 3, {}), alone(everyone), "Average, momentum")
    same(_train_v1(tf, hvd, xs, ys, adam, 2, dict(gradient_predivide_factor=2.0)), alone(everyone, adam, 2),
         "Average with a predivide factor, Adam")
    _check_predivide_keeps_the_sum_finite(tf, hvd)
    # Sum: n times the mean gradient, which plain SGD with n times the learning rate reproduces
    # (rates a float32 holds exactly: TF1 optimizers keep their rate as a float32 tensor).
    sgd = lambda rate: (lambda: tf.compat.v1.train.GradientDescentOptimizer(rate))  # noqa: E731
    same(_train_v1(tf, hvd, xs, ys, sgd(0.125), 2, dict(op=hvd.Sum)), alone(everyone, sgd(0.125 * n), 2), "Sum")
    # A process set (even ranks): its members average over it alone, the others train on their own.
    evens = hvd.add_process_set([r for r in range(n) if r % 2 == 0])
    try:
        _horovod_legacy_process_set_case(tf, hvd, evens)
        want = alone(evens.ranks) if me in evens.ranks else alone([me])
        same(_train_v1(tf, hvd, xs, ys, momentum, 3, dict(process_set=evens)), want, f"process set {evens.ranks}")
        # A local variable: its gradient stays this rank's, divided by the set's size (on every
        # rank, as Horovod's), the others' reduced over the set.
        got = _train_v1(tf, hvd, xs, ys, sgd(0.125), 1, dict(process_set=evens), local=["b"])
        plain_b = _train_v1(tf, hvd, xs, ys, sgd(0.125 / evens.size()), 1)[1]
        want_w = (alone(evens.ranks, sgd(0.125), 1) if me in evens.ranks else alone([me], sgd(0.125), 1))[0]
        assert np.allclose(got[0], want_w) and np.allclose(got[1], plain_b), "local variable"
    finally:
        hvd.remove_process_set(evens)

    _check_backward_passes(tf, hvd, data)

    # Eagerly: minimize() with a callable loss, one step of averaged gradients.
    w = tf.Variable(np.linspace(-0.5, 0.7, 6).reshape(3, 2))
    opt = hvd.DistributedOptimizer(tf.compat.v1.train.GradientDescentOptimizer(0.2))
    opt.minimize(lambda: tf.reduce_mean(tf.square(tf.matmul(tf.constant(xs), w) - ys)), var_list=[w])
    x_all, y_all = np.concatenate([data[r][0] for r in everyone]), np.concatenate([data[r][1] for r in everyone])
    w0 = np.linspace(-0.5, 0.7, 6).reshape(3, 2)
    grad = 2 * x_all.T @ (x_all @ w0 - y_all) / y_all.size  # the mean over every rank's rows
    assert np.allclose(w.numpy(), w0 - 0.2 * grad), "eager minimize"

    # Arguments Horovod refuses, with a clear error.
    v1 = tf.compat.v1.train.GradientDescentOptimizer(0.1)
    with pytest.raises(ValueError, match="groups"):
        hvd.DistributedOptimizer(v1, groups=-1)
    with pytest.raises(ValueError, match="gradient_predivide_factor"):
        hvd.DistributedOptimizer(v1, op=hvd.Sum, gradient_predivide_factor=2.0)
    with pytest.raises(ValueError, match="op=Average or op=Sum"):
        hvd.DistributedOptimizer(v1, op=hvd.Max)
    # (op=Adasum with a TF1 optimizer: tests/bindings/test_tf_adasum.py.)


def _check_predivide_keeps_the_sum_finite(tf, hvd) -> None:
    """gradient_predivide_factor (horovod/tensorflow/__init__.py: Average with a factor f is prescale 1/f
    before the sum, postscale f / size after it): gradients each finite but whose sum over the ranks
    overflows float64. Without the factor the mean is inf (the sum is taken first); with f = 4 each rank's
    part is divided before the sum and the mean comes back finite."""
    n, me = hvd.size(), hvd.rank()
    # Distinct per rank and per element, up to 1.25e308: any two of them sum past float64's 1.8e308.
    huge = {r: (1.0 + 0.1 * r + 0.01 * np.arange(6.0)).reshape(3, 2) * 1e308 for r in range(n)}

    def reduced(**distributed) -> np.ndarray:
        with tf.Graph().as_default():
            w = tf.compat.v1.get_variable("w", initializer=np.ones((3, 2)))
            loss = tf.reduce_sum(w * tf.constant(huge[me]))  # d loss / d w: this rank's huge values
            opt = hvd.DistributedOptimizer(tf.compat.v1.train.GradientDescentOptimizer(1.0), **distributed)
            (grad, _), = opt.compute_gradients(loss, var_list=[w])
            with tf.compat.v1.Session() as session:
                session.run(tf.compat.v1.global_variables_initializer())
                return session.run(grad)

    plain = reduced()
    assert np.all(np.isinf(plain)), f"the data should overflow a plain Average's sum: {plain}"
    got = reduced(gradient_predivide_factor=4.0)
    want = sum(huge[r] / n for r in range(n))  # the mean, taken without overflowing
    assert np.all(np.isfinite(got)) and np.allclose(got, want, rtol=1e-12, atol=0), \
        f"Average with a predivide factor of 4 over {n} ranks: {got} != {want}"


def _check_backward_passes(tf, hvd, data) -> None:
    """backward_passes_per_step=2 (Horovod's LocalGradientAggregationHelper, legacy side,
    horovod/tensorflow/gradient_aggregation.py): the weights move only every second step, by the
    sum of both steps' rank-averaged gradients (halved with average_aggregated_gradients), taken at
    the weights of the round's start; global_step still counts every step."""
    n = hvd.size()
    w0 = np.linspace(-0.5, 0.7, 6).reshape(3, 2)
    batches = [{r: (data[r][0] + 0.01 * s, data[r][1] - 0.02 * s) for r in range(n)} for s in range(4)]
    for average in (False, True):
        with tf.Graph().as_default():
            x, y = (tf.compat.v1.placeholder(tf.float64, [None, k]) for k in (3, 2))
            w = tf.compat.v1.get_variable("w", initializer=w0)
            step = tf.compat.v1.train.get_or_create_global_step()
            opt = hvd.DistributedOptimizer(tf.compat.v1.train.MomentumOptimizer(0.125, 0.5),
                                           backward_passes_per_step=2, average_aggregated_gradients=average)
            train = opt.minimize(tf.reduce_mean(tf.square(tf.matmul(x, w) - y)), global_step=step)
            with tf.compat.v1.Session() as session:
                session.run([tf.compat.v1.global_variables_initializer(),
                             tf.compat.v1.local_variables_initializer()])
                got = []
                for batch in batches:
                    session.run(train, {x: batch[hvd.rank()][0], y: batch[hvd.rank()][1]})
                    got.append(session.run(w))
                assert session.run(step) == 4, "global_step counts every step"
        want, velocity, weights, total = [], np.zeros_like(w0), w0.copy(), np.zeros_like(w0)
        for s, batch in enumerate(batches):
            total += np.mean([2 * bx.T @ (bx @ weights - by) / by.size for bx, by in batch.values()], 0)
            if s % 2 == 1:  # TF1 Momentum: accumulation = momentum * accumulation + gradient
                velocity = 0.5 * velocity + (total / 2 if average else total)
                weights, total = weights - 0.125 * velocity, np.zeros_like(w0)
            want.append(weights.copy())
        for s, (g, w_) in enumerate(zip(got, want)):
            assert np.allclose(g, w_, rtol=1e-9, atol=1e-12), f"average={average} step {s}: {g} != {w_}"
    with pytest.raises(ValueError, match="graph"):  # eagerly, as Horovod's
        hvd.DistributedOptimizer(tf.compat.v1.train.GradientDescentOptimizer(0.1), backward_passes_per_step=2)


def _horovod_legacy_process_set_case(tf, hvd, evens) -> None:
    """Horovod's test_legacy_DistributedOptimizer_process_sets: a TF1 optimizer whose gradient is fixed
    per rank, on a reference (non-resource) variable; the set's members get the set's mean gradient.
    Horovod's gradient is the rank, whose mean over the even ranks of 3 is the world's (1): here it is
    (rank + 1) ** 2, whose mean over the set differs from the world's at every size."""
    n, me = hvd.size(), hvd.rank()
    gradient = {r: float(r + 1) ** 2 for r in range(n)}
    set_mean = np.mean([gradient[r] for r in evens.ranks])
    assert not np.isclose(set_mean, np.mean(list(gradient.values()))), "the set's mean should not be the world's"
    resource_before = tf.compat.v1.resource_variables_enabled()
    tf.compat.v1.disable_resource_variables()
    try:
        with tf.Graph().as_default():
            class RankGradient(tf.compat.v1.train.Optimizer):
                def __init__(self) -> None:
                    super().__init__(name="rank_gradient", use_locking=False)
                    self.variable = tf.compat.v1.get_variable("dummy", initializer=[0.0], use_resource=False)

                def compute_gradients(self, *args, **kwargs):
                    return [(tf.constant([gradient[me]]), self.variable)]

                def _apply_dense(self, grad, var):
                    return var.assign_add(grad)

            inner = RankGradient()
            opt = hvd.DistributedOptimizer(inner, average_aggregated_gradients=True, process_set=evens)
            update = opt.apply_gradients(opt.compute_gradients())
            with tf.compat.v1.Session() as session:
                session.run(tf.compat.v1.global_variables_initializer())
                session.run(update)
                got = session.run(inner.variable.read_value())[0]
        want = set_mean if me in evens.ranks else gradient[me]
        assert np.isclose(got, want), f"Horovod's legacy process-set case: {got} != {want}"
    finally:
        if resource_before:
            tf.compat.v1.enable_resource_variables()
