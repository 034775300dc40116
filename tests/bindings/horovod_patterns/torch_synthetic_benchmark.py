"""Horovod's PyTorch synthetic benchmark pattern (examples/pytorch/pytorch_synthetic_benchmark.py),
written with ``import mtrain.torch as hvd`` and a tiny model in place of torchvision's ResNet-50.

Same flags and defaults as Horovod's (plus --image-size, 224 there), same API calls:
SyncBatchNorm as the model's norm_layer, nccl_built(), Compression.fp16/none,
DistributedOptimizer(named_parameters=, compression=, op=Adasum or Average),
broadcast_parameters and broadcast_optimizer_state. Rank 0 prints the img/sec lines; every rank
then prints a digest of its model state (weights and SyncBatchNorm's running statistics).
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

parser = argparse.ArgumentParser(description="PyTorch synthetic benchmark (Horovod's, tiny model)",
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
parser.add_argument("--fp16-allreduce", action="store_true", default=False,
                    help="compress gradients to float16 for the all-reduce")
parser.add_argument("--model", type=str, default="tiny_resnet", help="model in tiny_models")
parser.add_argument("--batch-size", type=int, default=32, help="input batch size")
parser.add_argument("--image-size", type=int, default=224, help="height and width of the synthetic images")
parser.add_argument("--num-warmup-batches", type=int, default=10, help="batches before timing starts")
parser.add_argument("--num-batches-per-iter", type=int, default=10, help="batches per timed iteration")
parser.add_argument("--num-iters", type=int, default=10, help="timed iterations")
parser.add_argument("--no-cuda", action="store_true", default=False, help="train on the CPU")
parser.add_argument("--use-adasum", action="store_true", default=False, help="reduce gradients with Adasum")
args = parser.parse_args()
args.cuda = not args.no_cuda and torch.cuda.is_available()

hvd.init()
if args.cuda:
    torch.cuda.set_device(hvd.local_rank())
cudnn.benchmark = True

model = getattr(tiny_models, args.model)(norm_layer=hvd.SyncBatchNorm)
# Adasum needs no learning-rate scaling, except by the local size on GPUs with NCCL.
lr_scaler = 1 if args.use_adasum else hvd.size()
if args.cuda:
    model.cuda()
    if args.use_adasum and hvd.nccl_built():
        lr_scaler = hvd.local_size()
optimizer = optim.SGD(model.parameters(), lr=0.01 * lr_scaler)

compression = hvd.Compression.fp16 if args.fp16_allreduce else hvd.Compression.none
optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                     compression=compression,
                                     op=hvd.Adasum if args.use_adasum else hvd.Average)
hvd.broadcast_parameters(model.state_dict(), root_rank=0)
hvd.broadcast_optimizer_state(optimizer, root_rank=0)

# The same fixed batch every step (different on every rank: each seeds its own generator).
images = torch.randn(args.batch_size, 3, args.image_size, args.image_size)
labels = torch.LongTensor(args.batch_size).random_() % 1000
if args.cuda:
    images, labels = images.cuda(), labels.cuda()


def train_one_batch() -> None:
    optimizer.zero_grad()
    loss = F.cross_entropy(model(images), labels)
    loss.backward()
    optimizer.step()


def say(line: str) -> None:
    if hvd.rank() == 0:
        print(line, flush=True)


device = "GPU" if args.cuda else "CPU"
say(f"Model: {args.model}")
say(f"Batch size: {args.batch_size}")
say(f"Number of {device}s: {hvd.size()}")
say("Running warmup...")
timeit.timeit(train_one_batch, number=args.num_warmup_batches)
say("Running benchmark...")
rates = []
for iteration in range(args.num_iters):
    seconds = timeit.timeit(train_one_batch, number=args.num_batches_per_iter)
    rates.append(args.batch_size * args.num_batches_per_iter / seconds)
    say(f"Iter #{iteration}: {rates[-1]:.1f} img/sec per {device}")
mean, spread = np.mean(rates), 1.96 * np.std(rates)
say(f"Img/sec per {device}: {mean:.1f} +-{spread:.1f}")
say(f"Total img/sec on {hvd.size()} {device}(s): {hvd.size() * mean:.1f} +-{hvd.size() * spread:.1f}")

digest = hashlib.sha256()
for name, value in sorted(model.state_dict().items()):
    digest.update(name.encode() + value.detach().cpu().numpy().tobytes())
print(f"rank {hvd.rank()} state digest {digest.hexdigest()}", flush=True)
