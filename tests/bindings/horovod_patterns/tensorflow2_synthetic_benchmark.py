"""Horovod's TensorFlow 2 synthetic benchmark pattern (examples/tensorflow2/tensorflow2_synthetic_benchmark.py),
written with ``import mtrain.tensorflow as hvd`` and a tiny model in place of keras.applications' ResNet50.

Same flags and defaults as Horovod's (plus --image-size, 224 there), same API calls: in a
``tf.function``, ``DistributedGradientTape(tape, compression=...)``, the optimizer's
``apply_gradients``, and after the first step ``broadcast_variables(model.variables)`` and
``broadcast_variables`` of the optimizer's variables. One Keras 3 change: Horovod's example
calls ``opt.variables()``, a method of Keras 2 optimizers; in Keras 3 ``variables`` is a property.
Rank 0 prints the img/sec lines; every rank then prints a digest of its trainable weights.
"""
import argparse
import hashlib
import os
import timeit

import numpy as np
import tensorflow as tf

import mtrain.tensorflow as hvd
import tiny_applications

parser = argparse.ArgumentParser(description="TensorFlow 2 synthetic benchmark (Horovod's, tiny model)",
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
parser.add_argument("--fp16-allreduce", action="store_true", default=False,
                    help="compress gradients to float16 for the all-reduce")
parser.add_argument("--model", type=str, default="TinyResNet", help="model in tiny_applications")
parser.add_argument("--batch-size", type=int, default=32, help="input batch size")
parser.add_argument("--image-size", type=int, default=224, help="height and width of the synthetic images")
parser.add_argument("--num-warmup-batches", type=int, default=10, help="batches before timing starts")
parser.add_argument("--num-batches-per-iter", type=int, default=10, help="batches per timed iteration")
parser.add_argument("--num-iters", type=int, default=10, help="timed iterations")
parser.add_argument("--no-cuda", action="store_true", default=False, help="train on the CPU")
args = parser.parse_args()
args.cuda = not args.no_cuda

hvd.init()
if args.cuda:
    # One GPU per process: this rank's local rank picks it.
    gpus = tf.config.experimental.list_physical_devices("GPU")
    for gpu in gpus:
        tf.config.experimental.set_memory_growth(gpu, True)
    if gpus:
        tf.config.experimental.set_visible_devices(gpus[hvd.local_rank()], "GPU")
else:
    os.environ["CUDA_VISIBLE_DEVICES"] = "-1"

model = getattr(tiny_applications, args.model)(weights=None)
opt = tf.optimizers.SGD(0.01)
images = tf.random.uniform([args.batch_size, args.image_size, args.image_size, 3])
labels = tf.random.uniform([args.batch_size, 1], minval=0, maxval=999, dtype=tf.int64)


@tf.function
def train_one_batch(first_batch: bool) -> None:
    compression = hvd.Compression.fp16 if args.fp16_allreduce else hvd.Compression.none
    with tf.GradientTape() as tape:
        probabilities = model(images, training=True)
        loss = tf.losses.sparse_categorical_crossentropy(labels, probabilities)
    tape = hvd.DistributedGradientTape(tape, compression=compression)
    gradients = tape.gradient(loss, model.trainable_variables)
    opt.apply_gradients(zip(gradients, model.trainable_variables))
    # After the first step, so that the optimizer's variables exist: every rank takes rank 0's.
    if first_batch:
        hvd.broadcast_variables(model.variables, root_rank=0)
        hvd.broadcast_variables(opt.variables, root_rank=0)


def say(line: str) -> None:
    if hvd.rank() == 0:
        print(line, flush=True)


device = "GPU" if args.cuda else "CPU"
say(f"Model: {args.model}")
say(f"Batch size: {args.batch_size}")
say(f"Number of {device}s: {hvd.size()}")
with tf.device(device):
    say("Running warmup...")
    train_one_batch(first_batch=True)
    timeit.timeit(lambda: train_one_batch(first_batch=False), number=args.num_warmup_batches)
    say("Running benchmark...")
    rates = []
    for iteration in range(args.num_iters):
        seconds = timeit.timeit(lambda: train_one_batch(first_batch=False), number=args.num_batches_per_iter)
        rates.append(args.batch_size * args.num_batches_per_iter / seconds)
        say(f"Iter #{iteration}: {rates[-1]:.1f} img/sec per {device}")
    mean, spread = np.mean(rates), 1.96 * np.std(rates)
    say(f"Img/sec per {device}: {mean:.1f} +-{spread:.1f}")
    say(f"Total img/sec on {hvd.size()} {device}(s): {hvd.size() * mean:.1f} +-{hvd.size() * spread:.1f}")

digest = hashlib.sha256()
for variable in model.trainable_variables:
    digest.update(variable.path.encode() + variable.numpy().tobytes())
print(f"rank {hvd.rank()} trainable digest {digest.hexdigest()} after {int(opt.iterations.numpy())} steps",
      flush=True)
