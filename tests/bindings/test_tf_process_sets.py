"""Process sets and join() through mtrain.tensorflow (Horovod 0.28's API).

At np=3 the sets are A = [0, 2] and B = [1] (registered by ``hvd.init(process_sets=...)``), and
C = [1, 2] (``hvd.add_process_set``), so rank 2 interleaves ops on A, C and the global set.
Every rank's data differs per rank and per element; expected values are computed in NumPy
from the set members' inputs. root_rank is a global rank, Average divides by the set's size.
"""
import numpy as np
import pytest

from tests.bindings.requires import require
from tests.bindings.tf_setup import TF_POOL, setup_tensorflow
from tests.mpi.harness import mpi_test

require("tensorflow", "pip install '.[tensorflow]'")


def _rows(r: int, count: int, width: int = 2, salt: float = 0.0) -> np.ndarray:
    """Rank r's data: distinct per rank and per element."""
    return (np.arange(count * width, dtype=np.float64).reshape(count, width) + 1) * (r + 1.5) + 100 * r + salt


def _ints(r: int, count: int = 5) -> np.ndarray:
    """Odd and negative integers, distinct per rank and element (integer Average must truncate)."""
    return (np.arange(-count, count).reshape(count, 2) * (r + 2) + 3 * r + 1).astype(np.int64)


def _trunc(a: np.ndarray, factor: float) -> np.ndarray:
    return np.trunc(a.astype(np.float64) * factor).astype(np.int64)


def _shares(rows: int, k: int) -> "list[int]":
    """Rows each set rank keeps in a reducescatter: the first rows % k get one extra."""
    return [rows // k + (1 if i < rows % k else 0) for i in range(k)]


def _check_set(tf, hvd, ps, tag: str) -> None:
    """Every collective on ``ps`` (this rank belongs to it), eagerly and in a graph."""
    me = hvd.rank()
    members = list(ps.ranks)
    k, mine = len(members), members.index(me)
    assert ps.size() == k and ps.rank() == mine and ps.included(), tag
    assert int(hvd.size_op(ps.process_set_id)) == k and int(hvd.process_set_included_op(ps.process_set_id)) == 1
    x = _rows(me, 3)
    total = sum(_rows(r, 3) for r in members)
    for graph in (False, True):
        run = (lambda f, *a: tf.function(f)(*a)) if graph else (lambda f, *a: f(*a))
        where = f"{tag} {'graph' if graph else 'eager'}"
        got = run(lambda t: hvd.allreduce(t, op=hvd.Sum, process_set=ps), x)
        assert np.allclose(got, total), f"{where} allreduce Sum"
        got = run(lambda t: hvd.allreduce(t, process_set=ps, prescale_factor=0.5, postscale_factor=3.0), x)
        assert np.allclose(got, 1.5 * total / k), f"{where} allreduce Average over the set's size"
        got = run(lambda t: hvd.allreduce(t, op=hvd.Max, process_set=ps), x)
        assert np.allclose(got, np.max([_rows(r, 3) for r in members], 0)), f"{where} allreduce Max"
        # Integers: one float64 scaling of the sum by postscale / set size, truncated toward zero.
        ints = tf.constant(_ints(me), tf.int32)
        got = run(lambda t: hvd.allreduce(t, op=hvd.Average, postscale_factor=3.0, process_set=ps), ints)
        want = _trunc(sum(_ints(r) for r in members), 3.0 / k)
        assert got.dtype == tf.int32 and np.array_equal(got, want), f"{where} integer Average: {got} != {want}"
        got = run(lambda a, b: hvd.grouped_allreduce([a, b], op=hvd.Average, process_set=ps), x, ints)
        assert np.allclose(got[0], total / k), f"{where} grouped_allreduce floats"
        assert np.array_equal(got[1], _trunc(sum(_ints(r) for r in members), 1.0 / k)), f"{where} grouped ints"
        # allgather: first dimensions differ per rank; blocks in set-rank order.
        got = run(lambda t: hvd.allgather(t, process_set=ps), _rows(me, me + 1))
        assert np.array_equal(got, np.concatenate([_rows(r, r + 1) for r in members])), f"{where} allgather"
        got = run(lambda a, b: hvd.grouped_allgather([a, b], process_set=ps), _rows(me, me + 1), _ints(me, 1 + me))
        assert np.array_equal(got[1], np.concatenate([_ints(r, 1 + r) for r in members])), f"{where} grouped_allgather"
        # broadcast: root_rank is a global rank (the set's last member: its set rank differs from it).
        root = members[-1]
        got = run(lambda t: hvd.broadcast(t, root_rank=root, process_set=ps), x)
        assert np.array_equal(got, _rows(root, 3)), f"{where} broadcast from global rank {root}"
        # reducescatter: 2k+1 rows, split in set-rank order.
        tall = _rows(me, 2 * k + 1)
        start = sum(_shares(2 * k + 1, k)[:mine])
        rows = slice(start, start + _shares(2 * k + 1, k)[mine])
        summed = sum(_rows(r, 2 * k + 1) for r in members)
        got = run(lambda t: hvd.reducescatter(t, op=hvd.Sum, process_set=ps), tall)
        assert np.allclose(got, summed[rows]), f"{where} reducescatter Sum"
        got = run(lambda t: hvd.grouped_reducescatter([t], op=hvd.Average, process_set=ps)[0], tall)
        assert np.allclose(got, summed[rows] / k), f"{where} grouped_reducescatter Average"
        tall_ints = np.concatenate([_ints(me, k), _ints(me, k + 1)])
        got = run(lambda t: hvd.reducescatter(t, op=hvd.Average, process_set=ps), tall_ints)
        ints_rows = slice(sum(_shares(len(tall_ints), k)[:mine]),
                          sum(_shares(len(tall_ints), k)[:mine + 1]))
        want = _trunc(sum(np.concatenate([_ints(r, k), _ints(r, k + 1)]) for r in members), 1.0 / k)[ints_rows]
        assert np.array_equal(got, want), f"{where} integer reducescatter Average"
        # alltoall: splits[i] rows to the set's i-th rank.
        sends = {s: [(members.index(s) * 2 + d) % 3 + 1 for d in range(k)] for s in members}
        data = np.concatenate([np.full((c, 2), 10 * me + d + 0.5) for d, c in enumerate(sends[me])])
        got, got_splits = run(lambda t: hvd.alltoall(t, splits=sends[me], process_set=ps), data)
        assert got_splits.numpy().tolist() == [sends[s][mine] for s in members], f"{where} alltoall splits"
        assert np.array_equal(got, np.concatenate([np.full((sends[s][mine], 2), 10 * s + mine + 0.5)
                                                   for s in members])), f"{where} alltoall"
        equal = _rows(me, 2 * k)
        got = run(lambda t: hvd.alltoall(t, process_set=ps), equal)
        assert np.array_equal(got, np.concatenate([_rows(s, 2 * k)[2 * mine:2 * mine + 2] for s in members]))

    # Objects and variables, root a global rank.
    root = members[-1]
    assert hvd.broadcast_object({"from": me}, root_rank=root, process_set=ps) == {"from": root}
    assert hvd.broadcast_object_fn(root_rank=root, process_set=ps)(("obj", me)) == ("obj", root)
    assert hvd.allgather_object((me, tag), process_set=ps) == [(r, tag) for r in members]
    variables = [tf.Variable(_rows(me, 2)), tf.Variable(_ints(me, 2))]
    hvd.broadcast_variables(variables, root_rank=root, process_set=ps)
    assert np.array_equal(variables[0], _rows(root, 2)) and np.array_equal(variables[1], _ints(root, 2)), tag
    variables = [tf.Variable(_rows(me, 3, salt=0.5))]
    values = hvd.broadcast_(variables, root, process_set=ps)
    assert np.array_equal(values[0], _rows(root, 3, salt=0.5)) and np.array_equal(variables[0], values[0]), tag
    hvd.barrier(process_set=ps)

    # Gradients: the backward op runs on the same set (Horovod's registered gradients).
    w = lambda r, rows: _rows(r, rows, salt=0.25)  # noqa: E731  (each rank's loss weights)

    def grad_of(collective, x0, rows):
        x = tf.constant(x0)
        with tf.GradientTape() as tape:
            tape.watch(x)
            loss = tf.reduce_sum(w(me, rows) * collective(x))
        return tape.gradient(loss, x).numpy()
    mean_w = np.mean([w(r, 3) for r in members], 0)
    assert np.allclose(grad_of(lambda t: hvd.allreduce(t, process_set=ps), x, 3), mean_w), f"{tag} d allreduce"
    rows_all = sum(r + 1 for r in members)
    offset = sum(r + 1 for r in members[:mine])
    got = grad_of(lambda t: hvd.allgather(t, process_set=ps), _rows(me, me + 1), rows_all)
    want = np.mean([w(r, rows_all) for r in members], 0)[offset:offset + me + 1]
    assert np.allclose(got, want), f"{tag} d allgather"
    got = grad_of(lambda t: hvd.broadcast(t, root_rank=root, process_set=ps), x, 3)
    assert np.allclose(got, mean_w if me == root else 0 * x), f"{tag} d broadcast"
    got = grad_of(lambda t: hvd.reducescatter(t, op=hvd.Sum, process_set=ps), tall, _shares(2 * k + 1, k)[mine])
    assert np.allclose(got, k * np.concatenate([w(r, _shares(2 * k + 1, k)[members.index(r)]) for r in members]))


@mpi_test(pool=TF_POOL, nps=(3,), timeout=420)
def test_every_op_on_process_sets():
    tf, _ = setup_tensorflow()
    import mtrain.tensorflow as hvd
    me = hvd.rank()
    a, b = hvd.ProcessSet([0, 2]), hvd.ProcessSet([1])
    hvd.init(process_sets=[a, b])  # already started by the harness: registers the sets
    c = hvd.add_process_set([1, 2])
    assert (a.ranks, b.ranks, c.ranks) == ([0, 2], [1], [1, 2])
    assert hvd.global_process_set.process_set_id == 0 and len({a.process_set_id, b.process_set_id,
                                                               c.process_set_id}) == 3
    mine = [ps for ps in (a, b, c) if me in ps.ranks]
    for ps in (a, b, c):
        assert ps.included() == (me in ps.ranks)
        assert int(hvd.process_set_included_op(ps.process_set_id)) == int(me in ps.ranks)
        assert int(tf.function(lambda: hvd.size_op(ps.process_set_id))()) == len(ps.ranks)
    for ps in mine:
        _check_set(tf, hvd, ps, f"set {ps.ranks}")

    # Interleaved across sets: rank 2 alternates between A, C and the global set; each set's ops
    # only wait for that set's members. Names repeat across sets on purpose.
    values = {}
    for step in range(3):
        for ps in mine + [hvd.global_process_set]:
            got = hvd.allreduce(_rows(me, 2, salt=step), op=hvd.Sum, name=f"interleaved.{step}", process_set=ps)
            members = ps.ranks if ps is not hvd.global_process_set else list(range(3))
            assert np.allclose(got, sum(_rows(r, 2, salt=step) for r in members)), (step, members)
            values[(step, tuple(members))] = got
        both = tf.function(lambda t: [hvd.allgather(t, process_set=ps) for ps in mine + [hvd.global_process_set]])
        for ps, got in zip(mine + [hvd.global_process_set], both(_rows(me, 1, salt=step))):
            members = ps.ranks if ps is not hvd.global_process_set else list(range(3))
            assert np.array_equal(got, np.concatenate([_rows(r, 1, salt=step) for r in members]))

    # A rank outside a set: a clear error, tf.errors.InvalidArgumentError (also a RuntimeError and a
    # ValueError), eagerly and in a graph; the set's members are not held up.
    outside = next(ps for ps in (a, b, c) if me not in ps.ranks)
    for call in (lambda: hvd.allreduce(_rows(me, 2), process_set=outside),
                 lambda: hvd.allgather(_rows(me, 2), process_set=outside),
                 lambda: hvd.broadcast(_rows(me, 2), root_rank=outside.ranks[0], process_set=outside),
                 lambda: hvd.broadcast_object(1, root_rank=outside.ranks[0], process_set=outside),
                 lambda: hvd.barrier(process_set=outside)):
        with pytest.raises(tf.errors.InvalidArgumentError, match="not part of process set") as caught:
            call()
        assert isinstance(caught.value, RuntimeError) and isinstance(caught.value, ValueError)
    with pytest.raises(tf.errors.InvalidArgumentError, match="not part of process set"):
        tf.function(lambda t: hvd.allreduce(t, process_set=outside))(tf.constant(_rows(me, 2)))
    # A root outside the set, an unregistered set, something that is not a set.
    inside = mine[0]
    stranger = next(r for r in range(3) if r not in inside.ranks)
    with pytest.raises(tf.errors.InvalidArgumentError, match="root_rank"):
        hvd.broadcast(_rows(me, 2), root_rank=stranger, process_set=inside)
    with pytest.raises(tf.errors.InvalidArgumentError, match="not registered"):
        hvd.allreduce(_rows(me, 2), process_set=hvd.ProcessSet([0, 1]))
    with pytest.raises(tf.errors.InvalidArgumentError, match="ProcessSet"):
        hvd.allreduce(_rows(me, 2), process_set=[0, 2])
    assert int(hvd.process_set_included_op(99)) == -3  # Horovod's code for an unknown set

    # remove_process_set: every rank, the set's ops refused afterwards; the global set stays.
    assert hvd.remove_process_set(c) is True and hvd.remove_process_set(hvd.global_process_set) is False
    with pytest.raises(tf.errors.InvalidArgumentError, match="not registered"):
        hvd.allreduce(_rows(me, 2), process_set=c)
    got = hvd.allreduce(_rows(me, 2), op=hvd.Sum, name="after.remove")
    assert np.allclose(got, sum(_rows(r, 2) for r in range(3)))


@mpi_test(pool=TF_POOL, nps=(3,), timeout=420)
def test_training_on_a_process_set_matches_one_process_on_its_batch():
    tf, keras = setup_tensorflow()
    import mtrain.keras as khvd
    import mtrain.tensorflow as hvd
    import mtrain.tensorflow.keras as tkhvd
    me, b, steps = hvd.rank(), 4, 3
    a, single = hvd.ProcessSet([0, 2]), hvd.ProcessSet([1])
    hvd.init(process_sets=[a, single])
    ps = a if me in a.ranks else single
    members = ps.ranks
    assert khvd.ProcessSet is hvd.ProcessSet and tkhvd.global_process_set is hvd.global_process_set
    assert khvd.add_process_set is hvd.add_process_set and tkhvd.remove_process_set is hvd.remove_process_set

    def model(seed):
        keras.utils.set_random_seed(seed)
        return keras.Sequential([keras.Input((3,)), keras.layers.Dense(4, activation="tanh"), keras.layers.Dense(2)])

    def batch(r, step):  # rank r's batch at a step: distinct per rank, element and step
        return _rows(r, b, 3, salt=0.1 * step) / 100, _rows(r, b, 2, salt=0.3 + step) / 100

    def loss_of(net, x, y):
        return tf.reduce_mean((net(x) - y) ** 2)

    # Single-process reference: the same model trained on the set's concatenated batches.
    reference = model(7)
    sgd = keras.optimizers.SGD(0.5)
    for step in range(steps):
        x = np.concatenate([batch(r, step)[0] for r in members])
        y = np.concatenate([batch(r, step)[1] for r in members])
        with tf.GradientTape() as tape:
            loss = loss_of(reference, tf.constant(x), tf.constant(y))
        sgd.apply(tape.gradient(loss, reference.trainable_variables), reference.trainable_variables)
    want = [v.numpy() for v in reference.trainable_variables]

    # DistributedGradientTape(process_set=...) on each rank's own batch, eagerly and in a graph.
    for graph in (False, True):
        net, opt = model(7), keras.optimizers.SGD(0.5)

        def train_step(x, y):
            with tf.GradientTape() as tape:
                loss = loss_of(net, x, y)
            tape = hvd.DistributedGradientTape(tape, process_set=ps)
            opt.apply(tape.gradient(loss, net.trainable_variables), net.trainable_variables)
        step_fn = tf.function(train_step) if graph else train_step
        for step in range(steps):
            step_fn(*[tf.constant(t) for t in batch(me, step)])
        for got, expected in zip(net.trainable_variables, want):
            assert np.allclose(got.numpy(), expected, atol=1e-12), f"tape graph={graph} set {members}"

    # The Keras DistributedOptimizer(process_set=...) in model.fit: the same weights.
    for wrap in (hvd.DistributedOptimizer, khvd.DistributedOptimizer):
        net = model(7)
        net.compile(optimizer=wrap(keras.optimizers.SGD(0.5), process_set=ps), loss="mse")
        x = np.concatenate([batch(me, step)[0] for step in range(steps)])
        y = np.concatenate([batch(me, step)[1] for step in range(steps)])
        net.fit(x, y, batch_size=b, shuffle=False, verbose=0)
        for got, expected in zip(net.trainable_variables, want):
            assert np.allclose(got.numpy(), expected, atol=1e-12), f"{wrap.__module__} fit set {members}"

    # Local layers: divided by the SET's size; Sum over the set; a rank outside the set keeps its own
    # gradients (Horovod's tapes and optimizers skip the reduction there).
    net = model(11 + me)
    x, y = [tf.constant(t) for t in batch(me, 0)]
    with tf.GradientTape(persistent=True) as tape:
        loss = loss_of(net, x, y)
    plain = [g.numpy() for g in tape.gradient(loss, net.trainable_variables)]
    everyone = hvd.allgather_object(plain[:2], process_set=ps)
    partial = hvd.PartialDistributedGradientTape(tape, local_layers=[net.layers[1]], process_set=ps)
    got = partial.gradient(loss, net.trainable_variables)
    for i in range(2):
        assert np.allclose(got[i], np.mean([e[i] for e in everyone], 0)), f"partial shared {i}"
    for i in range(2, 4):
        assert np.allclose(got[i], plain[i] / len(members)), f"partial local {i}"
    got = hvd.DistributedGradientTape(tape, op=hvd.Sum, process_set=ps).gradient(loss, net.trainable_variables)
    for i in range(4):
        assert np.allclose(got[i], np.sum([e[i] for e in hvd.allgather_object(plain, process_set=ps)], 0))
    foreign = a if ps is single else single
    got = hvd.DistributedGradientTape(tape, process_set=foreign).gradient(loss, net.trainable_variables)
    assert all(np.array_equal(g, p) for g, p in zip(got, plain)), "outside the set: local gradients"
    opt = tkhvd.PartialDistributedOptimizer(keras.optimizers.SGD(1.0), local_layers=[net.layers[1]], process_set=ps)
    before = [v.numpy() for v in net.trainable_variables]
    opt.apply([tf.constant(g) for g in plain], net.trainable_variables)
    for i, v in enumerate(net.trainable_variables):
        step = np.mean([e[i] for e in everyone], 0) if i < 2 else plain[i] / len(members)
        assert np.allclose(v.numpy(), before[i] - step), f"PartialDistributedOptimizer {i}"


@mpi_test(pool=TF_POOL, nps=(3,), timeout=300)
def test_join_with_ranks_finishing_at_different_steps():
    tf, keras = setup_tensorflow()
    import mtrain.tensorflow as hvd
    n, me = hvd.size(), hvd.rank()
    steps = lambda r: 2 * (r + 1)  # noqa: E731  (rank r runs out of data after this many steps)
    active = lambda step: [r for r in range(n) if steps(r) > step]  # noqa: E731
    allreduce_in_graph = tf.function(lambda t: hvd.allreduce(t, op=hvd.Sum, name="join.graph"))
    for round_ in range(2):
        for step in range(steps(me)):
            x = _rows(me, 2, salt=step + 10 * round_)
            got = hvd.allreduce(x, op=hvd.Sum, name="join.sum")
            want = sum(_rows(r, 2, salt=step + 10 * round_) for r in active(step))
            assert np.allclose(got, want), f"round {round_} step {step}: joined ranks count as zeros"
            assert np.allclose(allreduce_in_graph(tf.constant(x)), want), f"graph step {step}"
            got = hvd.allreduce(x, op=hvd.Average, name="join.average")
            assert np.allclose(got, want / n), f"step {step}: Average divides by the job's size"
            if len(active(step)) < n:  # Horovod's controller refuses it while a rank has joined
                with pytest.raises(RuntimeError, match="Allgather is not supported with Join"):
                    hvd.allgather(_rows(me, me + 1, salt=step), name="join.gather")
            else:
                got = hvd.allgather(_rows(me, me + 1, salt=step), name="join.gather")
                assert np.array_equal(got, np.concatenate([_rows(r, r + 1, salt=step) for r in range(n)]))
            # The tape under join: the joined ranks' gradients are zeros in the average.
            w = tf.Variable(_rows(me, 1, salt=step))
            with tf.GradientTape() as tape:
                loss = tf.reduce_sum(w * w)
            grad = hvd.DistributedGradientTape(tape).gradient(loss, [w])[0]
            assert np.allclose(grad, sum(2 * _rows(r, 1, salt=step) for r in active(step)) / n), "tape"
        if me == n - 1:  # the last rank: everyone else has joined (or will), so a broadcast from 0 fails
            with pytest.raises(RuntimeError, match="Broadcast is not supported with Join"):
                hvd.broadcast(_rows(me, 2), root_rank=0, name="join.broadcast")
        last = hvd.join() if round_ == 0 else tf.function(hvd.join)()
        assert isinstance(last, tf.Tensor) and last.dtype == tf.int32, type(last)
        assert int(last) == n - 1, f"round {round_}: the last rank to join is {int(last)}"
        # After join every rank takes part in ops again.
        got = hvd.allreduce(_rows(me, 2), op=hvd.Sum, name=f"after.join.{round_}")
        assert np.allclose(got, sum(_rows(r, 2) for r in range(n)))


def test_dir_lists_only_the_horovod_api():
    """dir(hvd) of the TensorFlow modules: the API (process sets and join included), no private helpers
    or imported modules; ``import *`` gives exactly ``__all__``."""
    import types

    import mtrain.keras as khvd
    import mtrain.tensorflow as hvd
    import mtrain.tensorflow.keras as tkhvd
    for module in (hvd, tkhvd, khvd):
        names = dir(module)
        assert not [x for x in names if x.startswith("_") and not x.startswith("__")], (module.__name__, names)
        for leaked in ("np", "tf", "rr", "keras", "Any", "Optional", "annotations"):
            assert leaked not in names, (module.__name__, leaked)
        for wanted in ("ProcessSet", "global_process_set", "add_process_set", "remove_process_set",
                       "DistributedOptimizer", "allreduce", "init"):
            assert wanted in names, (module.__name__, wanted)
        namespace: dict = {}
        exec(f"from {module.__name__} import *", namespace)
        imported = set(namespace) - {"__builtins__"}
        assert all(hasattr(module, x) for x in imported), module.__name__
        assert not [x for x in imported if isinstance(namespace[x], types.ModuleType)
                    and x not in ("elastic", "callbacks")], module.__name__
    for wanted in ("join", "process_set_included_op", "size_op", "DistributedGradientTape", "is_homogeneous"):
        assert wanted in dir(hvd), wanted
    assert set(dir(hvd)) == set(hvd.__all__) and set(dir(tkhvd)) == set(tkhvd.__all__)
