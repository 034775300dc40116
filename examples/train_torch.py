"""Data-parallel PyTorch training on scikit-learn's handwritten digits (no download).

    mtrain run -np 2 python examples/train_torch.py

A Horovod script becomes an mtrain script by one import line: the rest is
Horovod's usual recipe (shard the data, scale the learning rate by the number
of ranks, wrap the optimizer, broadcast the initial state from rank 0).
Needs: pip install torch scikit-learn
"""
import argparse
import time

import numpy as np
import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits

import mtrain.torch as hvd  # was: import horovod.torch as hvd


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--batch-size", type=int, default=32, help="per rank")
    parser.add_argument("--lr", type=float, default=0.05, help="for one rank; scaled by the number of ranks")
    parser.add_argument("--seed", type=int, default=42)
    return parser.parse_args()


def load_data(seed: int):
    """Digits as float tensors: 8x8 images scaled to [0, 1], a fixed 80/20 train/test split."""
    digits = load_digits()
    images = torch.tensor(digits.images / 16.0, dtype=torch.float32).unsqueeze(1)
    labels = torch.tensor(digits.target, dtype=torch.int64)
    order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(seed))
    cut = int(0.8 * len(labels))
    return (images[order[:cut]], labels[order[:cut]]), (images[order[cut:]], labels[order[cut:]])


def shard(count: int, epoch: int, seed: int) -> torch.Tensor:
    """This rank's indices for one epoch: a shuffle shared by all ranks, cut into equal shares
    (every rank must run the same number of steps)."""
    order = torch.randperm(count, generator=torch.Generator().manual_seed(seed + epoch))
    per_rank = count // hvd.size()
    return order[hvd.rank() * per_rank:(hvd.rank() + 1) * per_rank]


def build_model() -> torch.nn.Module:
    return torch.nn.Sequential(
        torch.nn.Conv2d(1, 16, 3, padding=1), torch.nn.ReLU(),
        torch.nn.Conv2d(16, 32, 3, padding=1), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
        torch.nn.Flatten(), torch.nn.Linear(32 * 4 * 4, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))


def evaluate(model: torch.nn.Module, images: torch.Tensor, labels: torch.Tensor):
    """Loss and accuracy over the whole test set: each rank scores its share, sums are all-reduced."""
    mine = torch.arange(hvd.rank(), len(labels), hvd.size())
    with torch.no_grad():
        logits = model(images[mine])
        totals = torch.tensor([F.cross_entropy(logits, labels[mine], reduction="sum").item(),
                               (logits.argmax(1) == labels[mine]).sum().item(), len(mine)], dtype=torch.float64)
    loss_sum, correct, count = hvd.allreduce(totals, op=hvd.Sum, name="evaluate").tolist()
    return loss_sum / count, correct / count


def main() -> None:
    args = parse_args()
    hvd.init()
    torch.manual_seed(args.seed + hvd.rank())  # different on purpose: the broadcast makes them equal
    torch.set_num_threads(1)  # one core per rank
    (train_x, train_y), (test_x, test_y) = load_data(args.seed)

    model = build_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr * hvd.size(), momentum=0.9)
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)

    if hvd.rank() == 0:
        print(f"{hvd.size()} ranks, {len(train_y)} training images "
              f"({len(train_y) // hvd.size()} per rank), {len(test_y)} test images", flush=True)
    for epoch in range(args.epochs):
        model.train()
        indices = shard(len(train_y), epoch, args.seed)
        losses = []
        started = time.perf_counter()
        for start in range(0, len(indices), args.batch_size):
            batch = indices[start:start + args.batch_size]
            optimizer.zero_grad()
            loss = F.cross_entropy(model(train_x[batch]), train_y[batch])
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
        train_loss = hvd.allreduce(torch.tensor(np.mean(losses)), name="train_loss").item()
        # Every rank trained an equal share in the same time (the all-reduces keep them in step):
        # the job's throughput is all ranks' samples over this epoch's wall time.
        samples_per_s = len(indices) * hvd.size() / (time.perf_counter() - started)
        model.eval()
        test_loss, accuracy = evaluate(model, test_x, test_y)
        if hvd.rank() == 0:
            print(f"epoch {epoch + 1:2d}: train loss {train_loss:.4f}  test loss {test_loss:.4f}  "
                  f"test accuracy {accuracy:.4f}  {samples_per_s:.0f} samples/s", flush=True)
    if hvd.rank() == 0:
        print(f"final test accuracy: {accuracy:.4f}", flush=True)


if __name__ == "__main__":
    main()
