"""mtrain.tensorflow against Horovod 0.28's TensorFlow API: gradients through the collectives,
error types, int32 splits, the *_op queries, grouped allgather/reducescatter, and the TF1/TF2 helpers.

Every rank's data differs per rank and per element; the expected values are computed
in NumPy from every rank's inputs (gathered with allgather_object).
"""
import numpy as np
import pytest

from tests.bindings.requires import require
from tests.bindings.tf_setup import TF_POOL, setup_threads
from tests.mpi.harness import mpi_test

require("tensorflow", "pip install '.[tensorflow]'")


_setup = setup_threads


def _rows(r: int, count: int, width: int = 2, salt: float = 0.0) -> np.ndarray:
    """Rank r's data: distinct per rank and per element."""
    return (np.arange(count * width, dtype=np.float64).reshape(count, width) + 1) * (r + 1.5) + 100 * r + salt


def _check_gradients(tf, hvd, graph: bool) -> None:
    """tape.gradient through each collective equals Horovod's backward rule, computed in NumPy."""
    n, me = hvd.size(), hvd.rank()
    everyone = lambda value: hvd.allgather_object(np.asarray(value))  # noqa: E731
    tag = "graph" if graph else "eager"

    def grad_of(collective, x0):
        """d(sum(w * collective(x)))/dx on this rank, with w distinct per rank; returns (grad, all ws)."""
        def run(x):
            with tf.GradientTape() as tape:
                tape.watch(x)
                y = collective(x)
                rows, cols = tf.shape(y)[0], tf.shape(y)[1]
                w = tf.reshape(tf.range(tf.cast(rows * cols, tf.float64)), [rows, cols])
                w = (w + 1) * (me + 1.5) + 100 * me + 0.25  # as _rows(me, rows, cols, 0.25)
                loss = tf.reduce_sum(w * tf.cast(y, tf.float64))
            return tape.gradient(loss, x), w
        fn = tf.function(run) if graph else run
        grad, w = fn(tf.constant(x0))
        assert grad is not None, f"{tag}: no gradient"
        return grad.numpy(), [np.asarray(a) for a in everyone(w.numpy())]

    x = _rows(me, 3)
    # allreduce: the same allreduce of the gradient (op, prescale, postscale).
    for op, pre, post in ((hvd.Sum, 1.0, 1.0), (hvd.Average, 1.0, 1.0), (hvd.Sum, 0.5, 3.0), (hvd.Average, 2.0, 0.25)):
        grad, ws = grad_of(lambda t: hvd.allreduce(t, op=op, prescale_factor=pre, postscale_factor=post), x)
        want = pre * post * (np.sum(ws, 0) if op == hvd.Sum else np.mean(ws, 0))
        assert np.allclose(grad, want), f"{tag} allreduce {op} {pre} {post}: {grad} != {want}"
    grad, ws = grad_of(lambda t: hvd.grouped_allreduce([t, 2 * t], op=hvd.Sum)[1], x)
    assert np.allclose(grad, 2 * np.sum(ws, 0)), f"{tag} grouped_allreduce"
    # allgather: the gradient averaged over ranks, this rank's rows.
    mine = _rows(me, me + 1)
    offsets = np.cumsum([0] + [r + 1 for r in range(n)])
    grad, ws = grad_of(lambda t: hvd.allgather(t), mine)
    assert np.allclose(grad, np.mean(ws, 0)[offsets[me]:offsets[me + 1]]), f"{tag} allgather"
    grad, ws = grad_of(lambda t: hvd.grouped_allgather([3 * t, t])[0], mine)
    assert np.allclose(grad, 3 * np.mean(ws, 0)[offsets[me]:offsets[me + 1]]), f"{tag} grouped_allgather"
    scalar = np.float64(me + 0.5)
    grad, ws = grad_of(lambda t: tf.reshape(hvd.allgather(t), [-1, 1]), scalar)  # a scalar is one row
    assert np.allclose(grad, np.mean(ws, 0)[me, 0]), f"{tag} allgather of a scalar"
    # broadcast: the averaged gradient on the root, zeros elsewhere.
    root = n - 1
    grad, ws = grad_of(lambda t: hvd.broadcast(t, root_rank=root), x)
    assert np.allclose(grad, np.mean(ws, 0) if me == root else 0 * x), f"{tag} broadcast"
    # reducescatter: allgather of the gradient (times size for Sum).
    tall = _rows(me, 2 * n + 1)
    for op, factor in ((hvd.Sum, n), (hvd.Average, 1)):
        grad, ws = grad_of(lambda t: hvd.reducescatter(t, op=op), tall)
        assert np.allclose(grad, factor * np.concatenate(ws)), f"{tag} reducescatter {op}"
    grad, ws = grad_of(lambda t: hvd.grouped_reducescatter([t], op=hvd.Sum, prescale_factor=0.5)[0], tall)
    assert np.allclose(grad, 0.5 * n * np.concatenate(ws)), f"{tag} grouped_reducescatter"
    # alltoall: the gradient goes back the way the rows came.
    sends = [[(s + d) % 3 for d in range(n)] for s in range(n)]  # rows rank s sends to rank d
    data = _rows(me, sum(sends[me]))
    grad, ws = grad_of(lambda t: hvd.alltoall(t, splits=tf.constant(sends[me], tf.int32))[0], data)
    blocks = []
    for d in range(n):  # my block for d was received by d after the blocks of ranks before me
        start = sum(sends[s][d] for s in range(me))
        blocks.append(ws[d][start:start + sends[me][d]])
    assert np.allclose(grad, np.concatenate(blocks)), f"{tag} alltoall"


@mpi_test(pool=TF_POOL, nps=(3,), timeout=240)
def test_gradients_errors_splits_and_ops():
    tf = _setup()
    import mtrain.ringreduce as rr
    import mtrain.tensorflow as hvd
    n, me = hvd.size(), hvd.rank()

    _check_gradients(tf, hvd, graph=False)
    _check_gradients(tf, hvd, graph=True)

    # Forward values of the grouped collectives and alltoall with int32 and int64 splits.
    a, b = _rows(me, me + 1), _rows(me, 2, width=3, salt=0.5)
    got = hvd.grouped_allgather([a, b])
    assert np.array_equal(got[0], np.concatenate([_rows(r, r + 1) for r in range(n)]))
    assert np.array_equal(got[1], np.concatenate([_rows(r, 2, 3, 0.5) for r in range(n)]))
    tall = [_rows(me, n + 1), np.arange(2 * n * 2, dtype=np.int64).reshape(2 * n, 2) * (me + 1)]
    got = hvd.grouped_reducescatter(tall, op=hvd.Sum)
    lo = me + (1 if me else 0)  # n + 1 rows: rank 0 gets two, the others one
    want = sum(_rows(r, n + 1) for r in range(n))[lo:lo + (2 if me == 0 else 1)]
    assert np.allclose(got[0], want), "grouped_reducescatter[0]"
    assert np.array_equal(got[1], (np.arange(4 * n).reshape(2 * n, 2) * (n * (n + 1) // 2))[2 * me:2 * me + 2])
    sends = [[(s * 2 + d) % 3 + 1 for d in range(n)] for s in range(n)]
    data = np.concatenate([np.full((k, 2), 10 * me + d + 0.5) for d, k in enumerate(sends[me])])
    for dtype in (tf.int32, tf.int64):
        received, received_splits = hvd.alltoall(data, splits=tf.constant(sends[me], dtype))
        assert received_splits.numpy().tolist() == [sends[s][me] for s in range(n)], dtype
        assert np.array_equal(received, np.concatenate([np.full((sends[s][me], 2), 10 * s + me + 0.5)
                                                        for s in range(n)])), dtype
    in_graph = tf.function(lambda t, s: hvd.alltoall(t, splits=s))(tf.constant(data), tf.constant(sends[me]))
    assert in_graph[1].numpy().tolist() == [sends[s][me] for s in range(n)], "int32 splits in a graph"

    # The *_op queries: tensors, eagerly and when a graph runs.
    want = [me, rr.local_rank(), n, rr.local_size()]
    ops = lambda: [hvd.rank_op(), hvd.local_rank_op(), hvd.size_op(), hvd.local_size_op()]  # noqa: E731
    for values in (ops(), tf.function(ops)()):
        assert [int(v) for v in values] == want and all(v.dtype == tf.int32 for v in values)

    # Mismatched ranks: FailedPreconditionError on every rank, eagerly (also a MismatchError).
    with pytest.raises(tf.errors.FailedPreconditionError) as caught:
        hvd.allreduce(tf.zeros([2 + me]), op=hvd.Sum, name="parity.mismatch.eager")
    assert isinstance(caught.value, hvd.MismatchError)
    # In a graph too (test_tf_v1_graphs.py checks more ops, and a TF1 session).
    with pytest.raises(tf.errors.FailedPreconditionError, match="different arguments"):
        tf.function(lambda: hvd.allreduce(tf.zeros([3, 1 + me]), name="parity.mismatch.graph"))()
    with pytest.raises(tf.errors.FailedPreconditionError):
        hvd.allgather(tf.zeros([2, 1 + me]), name="parity.mismatch.allgather")
    try:  # the way Horovod programs catch it
        hvd.broadcast(tf.zeros([1 + me]), root_rank=0, name="parity.mismatch.broadcast")
        raise AssertionError("broadcast of mismatched shapes did not raise")
    except tf.errors.FailedPreconditionError as error:
        assert error.message
    assert np.allclose(hvd.allreduce(tf.constant([1.0 + me]), op=hvd.Sum), [n + n * (n - 1) / 2]), "after errors"

    # Names Horovod programs use.
    assert issubclass(hvd.HorovodInternalError, RuntimeError)
    if hasattr(rr, "HorovodInternalError"):
        assert hvd.HorovodInternalError is rr.HorovodInternalError
    assert hvd.broadcast_object_fn(root_rank=n - 1)({"from": me}) == {"from": n - 1}
    with pytest.raises(RuntimeError, match="broadcast_variables"):
        hvd.broadcast_global_variables(0)
    with tf.Graph().as_default():  # TF1: a graph with global variables, run in a session
        variable = tf.compat.v1.Variable(_rows(me, 2))
        sync = hvd.broadcast_global_variables(1)
        with tf.compat.v1.Session() as session:
            session.run(variable.initializer)
            session.run(sync)
            assert np.array_equal(session.run(variable), _rows(1, 2)), "broadcast_global_variables"
