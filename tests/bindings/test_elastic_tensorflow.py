"""mtrain.elastic with TensorFlow / Keras 3: states, callbacks and resuming from a snapshot.

TensorFlow takes seconds to import, so one rank body checks everything.
"""
import os
import shutil
import tempfile

import numpy as np

from tests.bindings.requires import require
from tests.bindings.tf_setup import TF_POOL, setup_tensorflow
from tests.mpi.harness import mpi_test

require("tensorflow", "pip install '.[tensorflow]'")


_setup = setup_tensorflow


def _model(keras, seed: int):
    keras.utils.set_random_seed(seed)
    return keras.Sequential([keras.Input((4,)), keras.layers.Dense(5, activation="tanh"),
                             keras.layers.BatchNormalization(), keras.layers.Dense(2)])


def _flat(values) -> np.ndarray:
    return np.concatenate([np.asarray(v).reshape(-1) for v in values])


def _identical(rr, array: np.ndarray, what: str) -> None:
    everyone = rr.allgather_object(array)
    assert all(np.array_equal(other, array) for other in everyone), f"{what}: ranks differ"


@mpi_test(pool=TF_POOL, nps=(2,), timeout=240)
def test_tensorflow_and_keras_states_callbacks_and_resume():
    tf, keras = _setup()
    import mtrain.ringreduce as rr
    from mtrain.elastic import snapshot
    from mtrain.elastic import tensorflow as elastic
    n, me = rr.size(), rr.rank()
    for name in ("MTRAIN_ELASTIC", "MTRAIN_ELASTIC_STATE_DIR", "MTRAIN_ELASTIC_UPDATES", "MTRAIN_ELASTIC_VERSION",
                 "MTRAIN_JOB_SECRET"):
        os.environ.pop(name, None)

    # --- TensorFlowState: variables and attributes, outside an elastic job ----------------------
    variables = [tf.Variable(np.arange(6.0).reshape(2, 3) * (me + 1) + me), tf.Variable(float(10 * me + 1))]
    tf_state = elastic.TensorFlowState(variables, step=me)

    @elastic.run
    def tf_train(state):
        _identical(rr, _flat(state.variables), "TensorFlowState after sync")
        assert state.step == 0
        state.variables[0].assign_add(np.full((2, 3), 0.5))
        state.step = 1
        state.commit()
        committed = _flat(state.variables)
        state.variables[1].assign(-7.0)
        state.step = 2
        state.restore()
        assert np.array_equal(_flat(state.variables), committed) and state.step == 1
        return state.commit_number

    assert tf_train(tf_state) == 0

    # --- KerasState + callbacks through model.fit ----------------------------------------------
    model = _model(keras, seed=20 + me)  # different on every rank until the state syncs
    model.compile(optimizer=keras.optimizers.SGD(learning_rate=0.05, momentum=0.9), loss="mse")
    rng = np.random.default_rng(100 + me)
    x, y = rng.standard_normal((20, 4)), rng.standard_normal((20, 2))  # distinct per rank
    state = elastic.KerasState(model, batch=0, epoch=0)
    assert state.optimizer is model.optimizer
    resets = []
    state.register_reset_callbacks([lambda: resets.append(1)])

    @elastic.run
    def fit(state):
        _identical(rr, _flat(state.model.get_weights()), "Keras weights after sync")
        # The update callbacks first, so that an epoch's last commit holds the epoch count.
        callbacks = [elastic.UpdateBatchStateCallback(state), elastic.UpdateEpochStateCallback(state),
                     elastic.CommitStateCallback(state, batches_per_commit=2)]
        state.model.fit(x, y, batch_size=4, epochs=2, shuffle=False, verbose=0, callbacks=callbacks)
        return state.commit_number

    # 5 batches per epoch, a commit every 2 batches (counting on across epochs) and at each epoch's end.
    assert fit(state) == 6, state.commit_number
    assert (state.epoch, state.batch) == (2, 0) and resets == []
    committed = _flat(state.model.get_weights()), _flat(state.optimizer.variables)
    state.model.set_weights([w * 0 + 3.0 for w in state.model.get_weights()])
    state.epoch = 9
    state.restore()
    assert np.array_equal(_flat(state.model.get_weights()), committed[0]) and state.epoch == 2
    assert np.array_equal(_flat(state.optimizer.variables), committed[1])
    assert elastic.TensorFlowKerasState is not elastic.KerasState and issubclass(elastic.KerasState,
                                                                               elastic.TensorFlowKerasState)

    # --- a new generation resumes from the snapshot rank 1's "host" holds ----------------------
    base = rr.broadcast_object(tempfile.mkdtemp(prefix="mtrain-elastic-tf-") if me == 0 else None, 0)
    os.environ.update({"MTRAIN_ELASTIC": "1", "MTRAIN_ELASTIC_VERSION": "0",
                       "MTRAIN_ELASTIC_STATE_DIR": os.path.join(base, f"rank{me}", "{host}"),
                       "MTRAIN_ELASTIC_UPDATES": os.path.join(base, "updates-{host}"),
                       "MTRAIN_JOB_SECRET": "fedcba9876543210" * 4})
    if me == 1:  # this "host" committed the trained state (optimizer built) as commit 11
        snapshot.write(os.path.join(base, "rank1", os.uname().nodename), snapshot.new_header(11, 2),
                       state.committed_values(), os.environ["MTRAIN_JOB_SECRET"].encode())
    want = rr.broadcast_object(committed, 1)
    fresh = _model(keras, seed=40 + me)
    fresh.compile(optimizer=keras.optimizers.SGD(learning_rate=0.05, momentum=0.9), loss="mse")
    resumed = elastic.KerasState(fresh, batch=0, epoch=0)  # a fresh optimizer: no slots built yet
    resumed.register_reset_callbacks([lambda: resets.append(rr.size())])

    @elastic.run
    def resume(state):
        return state.commit_number

    assert resume(resumed) == 11
    assert resets == [n]
    assert np.array_equal(_flat(resumed.model.get_weights()), want[0])
    assert np.array_equal(_flat(resumed.optimizer.variables), want[1])
    assert resumed.epoch == 2
    rr.barrier()
    if me == 0:
        shutil.rmtree(base)
    for name in ("MTRAIN_ELASTIC", "MTRAIN_ELASTIC_STATE_DIR", "MTRAIN_ELASTIC_UPDATES", "MTRAIN_ELASTIC_VERSION",
                 "MTRAIN_JOB_SECRET"):
        os.environ.pop(name, None)
