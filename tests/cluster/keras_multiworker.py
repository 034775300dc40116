"""A plain tf.distribute.MultiWorkerMirroredStrategy program (no mtrain import): TF_CONFIG does it all.

Keras 3's `fit` does not support MultiWorkerMirroredStrategy (keras-team/keras#20585), so,
as such programs do today, it runs on Keras 2 (`tf_keras`, TF_USE_LEGACY_KERAS=1).
Prints one JSON line per worker: its task index, host and the trained weights.
"""
import json
import os
import socket

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

strategy = tf.distribute.MultiWorkerMirroredStrategy()
index = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
with strategy.scope():
    tf.keras.utils.set_random_seed(0)
    model = tf.keras.Sequential([tf.keras.Input((6,)), tf.keras.layers.Dense(4, activation="tanh"),
                                 tf.keras.layers.Dense(2)])
    model.compile(optimizer=tf.keras.optimizers.SGD(0.05), loss="mse")
rng = np.random.default_rng(7)
features = rng.standard_normal((64, 6)).astype(np.float32)
labels = rng.standard_normal((64, 2)).astype(np.float32)
dataset = tf.data.Dataset.from_tensor_slices((features, labels)).batch(16)
model.fit(dataset, epochs=2, verbose=0)
print(json.dumps({"index": index, "workers": strategy.num_replicas_in_sync, "host": socket.gethostname(),
                  "weights": [w.astype(np.float64).ravel().tolist() for w in model.get_weights()]}), flush=True)
