"""Data-parallel Keras 3 training (TensorFlow backend) on scikit-learn's handwritten digits (no download).

    mtrain run -np 2 python examples/train_keras.py

Horovod's Keras recipe with one changed import: shard the data, scale the
learning rate by the number of ranks (warming it up), wrap the optimizer,
broadcast the initial weights from rank 0, average the metrics.
Needs: pip install tensorflow-cpu scikit-learn
"""
import argparse
import os
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from sklearn.datasets import load_digits  # noqa: E402

import mtrain.tensorflow.keras as hvd  # noqa: E402  (was: import horovod.tensorflow.keras as hvd)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--batch-size", type=int, default=32, help="per rank")
    parser.add_argument("--lr", type=float, default=0.05, help="for one rank; scaled by the number of ranks")
    parser.add_argument("--seed", type=int, default=42)
    return parser.parse_args()


class Throughput(keras.callbacks.Callback):
    """Rank 0's line per epoch: the loss (averaged over ranks by MetricAverageCallback, which
    runs before this one) and the job's throughput: every rank's samples over the epoch's time."""

    def __init__(self, samples_per_epoch: int) -> None:
        super().__init__()
        self.samples_per_epoch = samples_per_epoch
        self.started = 0.0

    def on_epoch_begin(self, epoch, logs=None):
        self.started = time.perf_counter()

    def on_epoch_end(self, epoch, logs=None):
        if hvd.rank() == 0:
            rate = self.samples_per_epoch / (time.perf_counter() - self.started)
            print(f"epoch {epoch + 1:2d}: loss {(logs or {}).get('loss', float('nan')):.4f}  "
                  f"{rate:.0f} samples/s", flush=True)


def main() -> None:
    args = parse_args()
    hvd.init()
    tf.config.threading.set_intra_op_parallelism_threads(1)  # one core per rank
    keras.utils.set_random_seed(args.seed + hvd.rank())  # different on purpose: the broadcast makes them equal

    digits = load_digits()
    images = (digits.images / 16.0).astype("float32")[..., None]
    order = np.random.default_rng(args.seed).permutation(len(images))
    cut = int(0.8 * len(images))
    train, test = order[:cut], order[cut:]
    per_rank = len(train) // hvd.size()  # equal shares: every rank runs the same number of steps
    mine = train[hvd.rank() * per_rank:(hvd.rank() + 1) * per_rank]

    model = keras.Sequential([
        keras.Input((8, 8, 1)),
        keras.layers.Conv2D(16, 3, padding="same", activation="relu"),
        keras.layers.Conv2D(32, 3, padding="same", activation="relu"),
        keras.layers.MaxPooling2D(), keras.layers.Flatten(),
        keras.layers.Dense(64, activation="relu"), keras.layers.Dense(10),
    ])
    lr = args.lr * hvd.size()
    optimizer = hvd.DistributedOptimizer(keras.optimizers.SGD(learning_rate=lr, momentum=0.9))
    model.compile(optimizer=optimizer, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])
    callbacks = [
        hvd.callbacks.BroadcastGlobalVariablesCallback(0),
        hvd.callbacks.MetricAverageCallback(),
        hvd.callbacks.LearningRateWarmupCallback(initial_lr=lr, warmup_epochs=2, verbose=1),
        Throughput(per_rank * hvd.size()),
    ]
    if hvd.rank() == 0:
        print(f"{hvd.size()} ranks, {len(train)} training images ({per_rank} per rank), "
              f"{len(test)} test images", flush=True)
    # Each rank validates on its share of the test set; MetricAverageCallback averages the results.
    history = model.fit(images[mine], digits.target[mine], batch_size=args.batch_size, epochs=args.epochs,
                        validation_data=(images[test[hvd.rank()::hvd.size()]],
                                         digits.target[test[hvd.rank()::hvd.size()]]),
                        callbacks=callbacks, verbose=2 if hvd.rank() == 0 else 0)
    if hvd.rank() == 0:
        print(f"final test accuracy: {history.history['val_accuracy'][-1]:.4f}", flush=True)


if __name__ == "__main__":
    main()
