"""tf.IndexedSlices (embedding gradients) through mtrain.tensorflow, as Horovod 0.28 reduces them.

horovod/tensorflow/__init__.py (``allreduce``, ``grouped_allreduce``): an IndexedSlices is
reduced by allgathering its values and its indices over the process set, the values divided by
the set's size for Average, and comes back as an IndexedSlices with the same ``dense_shape``
(None stays None). Adasum, ops other than Sum/Average and scale factors raise
NotImplementedError. ``_make_allreduce_grads_fn`` and horovod/_keras (the tape and the Keras
optimizer) pass IndexedSlices gradients down that path, or densify them with
``sparse_as_dense=True``.

Every rank's rows differ per rank and per element, and ranks hold different numbers of rows.
"""
import numpy as np
import pytest

from tests.bindings.requires import require
from tests.bindings.tf_setup import TF_POOL, setup_tensorflow
from tests.mpi.harness import mpi_test

require("tensorflow", "pip install '.[tensorflow]'")

_VOCAB, _WIDTH, _IDS, _BATCH = 7, 3, 4, 2


def _values(r: int, salt: float = 0.0) -> np.ndarray:
    """Rank r's slice values: r + 1 rows, distinct per rank and per element."""
    return (np.arange((r + 1) * 2, dtype=np.float64).reshape(r + 1, 2) + 1) * (r + 1.5) + 100 * r + salt


def _indices(r: int) -> np.ndarray:
    """Rank r's row indices (they repeat across ranks, as embedding rows do)."""
    return ((np.arange(r + 1) * 3 + r) % 5).astype(np.int64)


def _batch(r: int):
    """Rank r's token ids and targets (repeated ids within and across ranks)."""
    ids = (np.arange(_BATCH * _IDS).reshape(_BATCH, _IDS) * (r + 2) + r) % _VOCAB
    return ids.astype(np.int32), (np.arange(_BATCH, dtype=np.float64).reshape(_BATCH, 1) + 0.25 * r - 1.0)


def _check_collectives(tf, hvd, n: int, me: int) -> None:
    members = [0, n - 1] if n > 2 else [n - 1]  # a set that is not the global one; rank 1 (np=3) or 0 is outside
    ps = hvd.add_process_set(members)  # every rank registers it
    everyone_values = np.concatenate([_values(r) for r in range(n)])
    everyone_indices = np.concatenate([_indices(r) for r in range(n)])
    for graph in (False, True):
        run = (lambda f, *a: tf.function(f)(*a)) if graph else (lambda f, *a: f(*a))
        where = "graph" if graph else "eager"
        # No dense_shape: what raised "Tensor conversion requested for IndexedSlices without dense_shape".
        for op, scale in ((hvd.Average, 1.0 / n), (hvd.Sum, 1.0)):
            got = run(lambda v, i: hvd.allreduce(tf.IndexedSlices(v, i), op=op), _values(me), _indices(me))
            assert isinstance(got, tf.IndexedSlices) and got.dense_shape is None, (where, op)
            assert np.allclose(got.values, everyone_values * scale, rtol=1e-14), (where, op)
            assert np.array_equal(got.indices, everyone_indices), (where, op)

        # Grouped, dense first (Horovod 0.28 took a slice's dense_shape from the wrong list entry here).
        def grouped(d, v, i, w):
            return hvd.grouped_allreduce([d, tf.IndexedSlices(v, i),
                                          tf.IndexedSlices(w, i, dense_shape=tf.constant([5, 2], tf.int64))])
        got = run(grouped, _values(me, 0.5)[:1], _values(me), _indices(me), _values(me, 0.25))
        assert np.allclose(got[0], sum(_values(r, 0.5)[:1] for r in range(n)) / n), where
        assert got[1].dense_shape is None and np.allclose(got[1].values, everyone_values / n), where
        assert np.array_equal(got[2].indices, everyone_indices), where
        assert got[2].dense_shape.numpy().tolist() == [5, 2], where
        want = np.zeros((5, 2))
        np.add.at(want, everyone_indices, np.concatenate([_values(r, 0.25) for r in range(n)]) / n)
        assert np.allclose(tf.convert_to_tensor(got[2]), want), f"{where}: repeated rows add up when densified"

        # On a process set: gathered over its ranks, Average divided by its size.
        if ps.included():
            got = run(lambda v, i: hvd.allreduce(tf.IndexedSlices(v, i), process_set=ps), _values(me), _indices(me))
            want = np.concatenate([_values(r) for r in members]) / len(members)
            assert np.allclose(got.values, want), where
            assert np.array_equal(got.indices, np.concatenate([_indices(r) for r in members])), where

        # What an allgather cannot do is refused before anything is submitted, on every rank.
        sparse = tf.IndexedSlices(tf.constant(_values(me)), tf.constant(_indices(me)))
        for kwargs, message in ((dict(op=hvd.Adasum), "sparse_as_dense=True"), (dict(op=hvd.Max), "Sum and Average"),
                                (dict(op=hvd.Product), "Sum and Average"),
                                (dict(prescale_factor=2.0), "prescale_factor"),
                                (dict(op=hvd.Sum, postscale_factor=0.5), "postscale_factor")):
            with pytest.raises(NotImplementedError, match=message):
                run(lambda: hvd.allreduce(sparse, **kwargs))


def _embedding_loss(tf, table, dense, ids, targets):
    summed = tf.reduce_sum(tf.gather(table, ids), axis=1)
    return tf.reduce_mean((tf.matmul(summed, dense) - targets) ** 2)


def _check_tape(tf, hvd, n: int, me: int) -> None:
    table = tf.Variable(np.arange(_VOCAB * _WIDTH, dtype=np.float64).reshape(_VOCAB, _WIDTH) / 10 - 1)
    dense = tf.Variable(np.linspace(-1.0, 1.0, _WIDTH).reshape(_WIDTH, 1))
    ids, targets = _batch(me)
    all_ids = np.concatenate([_batch(r)[0] for r in range(n)])
    all_targets = np.concatenate([_batch(r)[1] for r in range(n)])
    with tf.GradientTape() as tape:  # one process, the whole batch
        loss = _embedding_loss(tf, table, dense, all_ids, all_targets)
    want = [tf.convert_to_tensor(g).numpy() for g in tape.gradient(loss, [table, dense])]

    def distributed(sparse_as_dense, ids, targets):
        with tf.GradientTape() as tape:
            loss = _embedding_loss(tf, table, dense, ids, targets)
        return hvd.DistributedGradientTape(tape, sparse_as_dense=sparse_as_dense).gradient(loss, [table, dense])

    for graph in (False, True):
        for sparse_as_dense in (False, True):
            where = f"{'graph' if graph else 'eager'} sparse_as_dense={sparse_as_dense}"
            step = tf.function(distributed) if graph else distributed
            got = step(sparse_as_dense, tf.constant(ids), tf.constant(targets))
            assert isinstance(got[0], tf.IndexedSlices) != sparse_as_dense, where
            assert np.allclose(tf.convert_to_tensor(got[0]), want[0], rtol=1e-12), where
            assert np.allclose(got[1], want[1], rtol=1e-12), where

    # A local embedding (model parallelism) keeps its own sparse gradient, divided by the set's size
    # (horovod/tensorflow/__init__.py, _DistributedGradientTape.gradient, scale_local_gradients).
    with tf.GradientTape() as tape:
        loss = _embedding_loss(tf, table, dense, ids, targets)
    local = tape.gradient(loss, table)
    with tf.GradientTape() as tape:
        loss = _embedding_loss(tf, table, dense, ids, targets)
    tape = hvd.DistributedGradientTape(tape)
    tape.register_local_source(table)
    got = tape.gradient(loss, [table, dense])
    assert isinstance(got[0], tf.IndexedSlices), "local sparse gradient"
    assert np.allclose(tf.convert_to_tensor(got[0]), tf.convert_to_tensor(local) / n, rtol=1e-14)
    assert np.allclose(got[1], want[1], rtol=1e-12), "the shared gradient beside a local one"


def _check_keras(tf, keras, hvd, n: int, me: int) -> None:
    seen = []

    class RecordingSGD(keras.optimizers.SGD):
        """Records the kinds of the reduced gradients the distributed optimizer hands on."""

        def _clip_gradients(self, grads):
            seen.append([type(g).__name__ for g in grads])
            return super()._clip_gradients(grads)

    def model():
        made = keras.Sequential([keras.Input((_IDS,), dtype="int32"), keras.layers.Embedding(_VOCAB, _WIDTH),
                                 keras.layers.Flatten(), keras.layers.Dense(1)])
        made.set_weights([np.arange(w.size, dtype=np.float64).reshape(w.shape) / (w.size + 1) - 0.5
                          for w in made.get_weights()])
        return made

    ids, targets = _batch(me)
    all_ids = np.concatenate([_batch(r)[0] for r in range(n)])
    all_targets = np.concatenate([_batch(r)[1] for r in range(n)])
    reference = model()
    reference.compile(keras.optimizers.SGD(0.05), "mse")
    reference.train_on_batch(all_ids, all_targets)
    for run_eagerly, sparse_as_dense in ((False, False), (True, False), (False, True)):
        where = f"run_eagerly={run_eagerly} sparse_as_dense={sparse_as_dense}"
        seen.clear()
        trained = model()
        trained.compile(hvd.DistributedOptimizer(RecordingSGD(0.05), sparse_as_dense=sparse_as_dense), "mse",
                        run_eagerly=run_eagerly)
        trained.train_on_batch(ids, targets)
        assert ("IndexedSlices" in seen[0][0]) != sparse_as_dense, (where, seen)
        for mine, theirs in zip(trained.get_weights(), reference.get_weights()):
            assert np.allclose(mine, theirs, rtol=1e-12), where


@mpi_test(pool=TF_POOL, nps=(2, 3), timeout=240)
def test_indexed_slices_reduce_by_allgather_as_in_horovod():
    tf, keras = setup_tensorflow()
    import mtrain.tensorflow as hvd
    import mtrain.tensorflow.keras as hvd_keras
    hvd.init()
    n, me = hvd.size(), hvd.rank()
    _check_collectives(tf, hvd, n, me)
    _check_tape(tf, hvd, n, me)
    _check_keras(tf, keras, hvd_keras, n, me)
