"""Horovod's Keras synthetic benchmark pattern (examples/tensorflow2/tensorflow2_keras_synthetic_benchmark.py),
written with ``import mtrain.tensorflow.keras as hvd`` and a tiny model in place of keras.applications'
ResNet50.

Same flags and defaults as Horovod's (plus --image-size, 224 there), same API calls: sycl_built()
on the default (GPU) path, Compression, ``DistributedOptimizer(opt, compression=...)``,
``model.compile``/``model.fit`` on a repeated tf.data dataset, and the callbacks
``BroadcastGlobalVariablesCallback(0)`` and ``MetricAverageCallback()``. One Keras 3 change:
Horovod's example passes ``experimental_run_tf_function=False`` to ``model.compile``, an argument
only Keras 2 has (Keras 3 refuses it); Keras 3 needs nothing in its place.
Rank 0 prints the img/sec lines; every rank then prints its (averaged) losses and a digest of
its trainable weights.
"""
import argparse
import hashlib
import os
from timeit import default_timer as timer
from typing import Optional

import numpy as np
import tensorflow as tf

import mtrain.tensorflow.keras as hvd
import tiny_applications

parser = argparse.ArgumentParser(description="Keras synthetic benchmark (Horovod's, tiny model)",
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
parser.add_argument("--fp16-allreduce", action="store_true", default=False,
                    help="compress gradients to float16 for the all-reduce")
parser.add_argument("--model", type=str, default="TinyResNet", help="model in tiny_applications")
parser.add_argument("--batch-size", type=int, default=32, help="input batch size")
parser.add_argument("--image-size", type=int, default=224, help="height and width of the synthetic images")
parser.add_argument("--num-batches-per-iter", type=int, default=10, help="batches per epoch")
parser.add_argument("--num-iters", type=int, default=10, help="epochs (the first one is the warmup)")
parser.add_argument("--no-cuda", action="store_true", default=False, help="train on the CPU")
args = parser.parse_args()
args.cuda = not args.no_cuda
device = "GPU" if args.cuda else "CPU"

hvd.init()
if hvd.rank() == 0:
    print(f"Model: {args.model}")
    print(f"Batch size: {args.batch_size}")
    print(f"Number of {device}s: {hvd.size()}", flush=True)

if args.cuda:
    # One accelerator per process (Intel GPUs are 'XPU' devices in a SYCL build).
    kind = "XPU" if hvd.sycl_built() else "GPU"
    accelerators = tf.config.experimental.list_physical_devices(kind)
    for accelerator in accelerators:
        tf.config.experimental.set_memory_growth(accelerator, True)
    if accelerators:
        tf.config.experimental.set_visible_devices(accelerators[hvd.local_rank()], kind)
else:
    os.environ["CUDA_VISIBLE_DEVICES"] = "-1"

model = getattr(tiny_applications, args.model)(weights=None)
opt = tf.optimizers.SGD(0.01)
images = tf.random.uniform([args.batch_size, args.image_size, args.image_size, 3])
labels = tf.random.uniform([args.batch_size, 1], minval=0, maxval=999, dtype=tf.int64)
dataset = tf.data.Dataset.from_tensor_slices((images, labels)).cache().repeat().batch(args.batch_size)

compression = hvd.Compression.fp16 if args.fp16_allreduce else hvd.Compression.none
opt = hvd.DistributedOptimizer(opt, compression=compression)
model.compile(loss=tf.losses.SparseCategoricalCrossentropy(), optimizer=opt)

# The broadcast makes every rank start from rank 0's weights; the metric average must come before
# any callback that reads the metrics.
callbacks = [hvd.callbacks.BroadcastGlobalVariablesCallback(0), hvd.callbacks.MetricAverageCallback()]


class Timing(tf.keras.callbacks.Callback):
    """One img/sec line per epoch; the summary leaves out the first (warmup) epoch."""

    def on_train_begin(self, logs: Optional[dict] = None) -> None:
        self.rates: "list[float]" = []

    def on_epoch_begin(self, epoch: int, logs: Optional[dict] = None) -> None:
        self.started = timer()

    def on_epoch_end(self, epoch: int, logs: Optional[dict] = None) -> None:
        rate = args.batch_size * args.num_batches_per_iter / (timer() - self.started)
        print(f"Iter #{epoch}: {rate:.1f} img/sec per {device}", flush=True)
        if epoch > 0:
            self.rates.append(rate)

    def on_train_end(self, logs: Optional[dict] = None) -> None:
        mean, spread = np.mean(self.rates), 1.96 * np.std(self.rates)
        print(f"Img/sec per {device}: {mean:.1f} +-{spread:.1f}")
        print(f"Total img/sec on {hvd.size()} {device}(s): {hvd.size() * mean:.1f} +-{hvd.size() * spread:.1f}",
              flush=True)


if hvd.rank() == 0:
    callbacks.append(Timing())

history = model.fit(dataset, batch_size=args.batch_size, steps_per_epoch=args.num_batches_per_iter,
                    callbacks=callbacks, epochs=args.num_iters, verbose=0)

digest = hashlib.sha256()
for variable in model.trainable_variables:
    digest.update(variable.path.encode() + variable.numpy().tobytes())
losses = " ".join(f"{loss:.6f}" for loss in history.history["loss"])
print(f"rank {hvd.rank()} losses {losses} trainable digest {digest.hexdigest()}", flush=True)
