"""Horovod's elastic PyTorch synthetic benchmark pattern
(examples/elastic/pytorch/pytorch_synthetic_benchmark_elastic.py), written with
``import mtrain.torch as hvd`` and a tiny model in place of torchvision's ResNet-50.

Same flags and defaults as Horovod's (plus --image-size, 224 there), same API calls:
Compression, DistributedOptimizer(op=Adasum or Average), ``hvd.elastic.TorchState`` with the
model and optimizer passed positionally and plain attributes as keywords,
``register_reset_callbacks``, ``@hvd.elastic.run`` and ``state.commit()`` every
--num-batches-per-commit batches. No explicit broadcast: the elastic run syncs the state.
Every rank then prints a digest of its parameters and the state's plain attributes.
"""
import argparse
import hashlib
import timeit

import numpy as np
import torch
import torch.backends.cudnn as cudnn
import torch.nn.functional as F
import torch.optim as optim

import mtrain.torch as hvd
import tiny_models

parser = argparse.ArgumentParser(description="PyTorch elastic synthetic benchmark (Horovod's, tiny model)",
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
parser.add_argument("--fp16-allreduce", action="store_true", default=False,
                    help="compress gradients to float16 for the all-reduce")
parser.add_argument("--model", type=str, default="tiny_resnet", help="model in tiny_models")
parser.add_argument("--batch-size", type=int, default=32, help="input batch size")
parser.add_argument("--image-size", type=int, default=224, help="height and width of the synthetic images")
parser.add_argument("--num-warmup-batches", type=int, default=10, help="batches before timing starts")
parser.add_argument("--num-batches-per-iter", type=int, default=10, help="batches per timed iteration")
parser.add_argument("--num-iters", type=int, default=10, help="timed iterations")
parser.add_argument("--num-batches-per-commit", type=int, default=1, help="batches between state commits")
parser.add_argument("--no-cuda", action="store_true", default=False, help="train on the CPU")
parser.add_argument("--use-adasum", action="store_true", default=False, help="reduce gradients with Adasum")
args = parser.parse_args()
args.cuda = not args.no_cuda and torch.cuda.is_available()

hvd.init()
if args.cuda:
    torch.cuda.set_device(hvd.local_rank())
cudnn.benchmark = True

model = getattr(tiny_models, args.model)()


def lr_scaler() -> int:
    """Read at every reset: the job's size may have changed (Adasum needs no scaling)."""
    return 1 if args.use_adasum else hvd.size()


if args.cuda:
    model.cuda()
base_lr = 0.01
optimizer = optim.SGD(model.parameters(), lr=base_lr * lr_scaler())
compression = hvd.Compression.fp16 if args.fp16_allreduce else hvd.Compression.none
optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                     compression=compression,
                                     op=hvd.Adasum if args.use_adasum else hvd.Average)

images = torch.randn(args.batch_size, 3, args.image_size, args.image_size)
labels = torch.LongTensor(args.batch_size).random_() % 1000
if args.cuda:
    images, labels = images.cuda(), labels.cuda()


def train_one_batch(state: hvd.elastic.TorchState) -> None:
    optimizer.zero_grad()
    F.cross_entropy(model(images), labels).backward()
    optimizer.step()
    state.batch += 1
    if state.batch == args.num_batches_per_commit:
        state.batch = 0
        state.commit()


def say(line: str) -> None:
    if hvd.rank() == 0:
        print(line, flush=True)


device = "GPU" if args.cuda else "CPU"
say(f"Model: {args.model}")
say(f"Batch size: {args.batch_size}")
say(f"Number of {device}s: {hvd.size()}")


@hvd.elastic.run
def benchmark(state: hvd.elastic.TorchState) -> None:
    if not state.warm:
        say("Running warmup...")
        timeit.timeit(lambda: train_one_batch(state), number=args.num_warmup_batches)
        state.warm = True
        state.commit()
    if state.iter == 0:
        say("Running benchmark...")
    for iteration in range(state.iter, args.num_iters):
        seconds = timeit.timeit(lambda: train_one_batch(state), number=args.num_batches_per_iter)
        rate = args.batch_size * args.num_batches_per_iter / seconds
        say(f"Iter #{iteration}: {rate:.1f} img/sec per {device}")
        state.img_secs.append(rate)
        state.iter = iteration
        state.commit()


def on_state_reset() -> None:
    """After a reset the job may have another size: scale the learning rate again."""
    for group in optimizer.param_groups:
        group["lr"] = base_lr * lr_scaler()


state = hvd.elastic.TorchState(model, optimizer, img_secs=[], iter=0, batch=0, warm=False)
state.register_reset_callbacks([on_state_reset])
benchmark(state)

mean, spread = np.mean(state.img_secs), 1.96 * np.std(state.img_secs)
say(f"Img/sec per {device}: {mean:.1f} +-{spread:.1f}")
say(f"Total img/sec on {hvd.size()} {device}(s): {hvd.size() * mean:.1f} +-{hvd.size() * spread:.1f}")

digest = hashlib.sha256()
for name, value in sorted(model.named_parameters()):
    digest.update(name.encode() + value.detach().cpu().numpy().tobytes())
print(f"rank {hvd.rank()} parameter digest {digest.hexdigest()} state warm={state.warm} iter={state.iter} "
      f"batch={state.batch} rates={len(state.img_secs)}", flush=True)
