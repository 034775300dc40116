"""A Horovod PyTorch program that leans on Horovod's wider API, run by mtrain unchanged
but for its import line: process sets, join() for uneven data, sparse embedding
gradients, SyncBatchNorm, grouped ops and gradients through a collective.

    mtrain run -np 3 python examples/horovod_features.py

The task: scikit-learn's handwritten digits (no download). Each 8x8 image becomes 64
tokens (pixel position x intensity) whose embeddings an ``nn.EmbeddingBag(sparse=True)``
sums. Ranks hold shards of different sizes, so they run out of batches at different
steps: each calls ``hvd.join()`` when it is done, and the others keep training, the
ranks that joined standing in with zeros. Sparse gradients are all-gathered (indices
and values), which Horovod refuses while a rank has joined, so the optimizer takes
``sparse_as_dense=True``: the embedding's gradient is all-reduced dense and made sparse
again for the update, as Horovod does. A penalty on the embeddings' mean over every
rank goes through ``hvd.allreduce``, which autograd differentiates.
The even ranks form a process set that evaluates the test set among themselves with
one grouped all-reduce of their counts.
Needs: pip install torch scikit-learn
"""
import argparse
import time

import numpy as np
import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits

import mtrain.torch as hvd  # was: import horovod.torch as hvd

LEVELS = 4  # digit pixels take the values 0..16: four intensity levels


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=0.5)
    parser.add_argument("--seed", type=int, default=7)
    return parser.parse_args()


def tokens_of(images: np.ndarray) -> torch.Tensor:
    """(n, 64) token ids: position * LEVELS + intensity level."""
    return torch.as_tensor(np.arange(64) * LEVELS + np.minimum(images.astype(np.int64) // 4, LEVELS - 1))


class DigitNet(torch.nn.Module):
    def __init__(self, hidden: int = 64) -> None:
        super().__init__()
        self.embed = torch.nn.EmbeddingBag(64 * LEVELS, hidden, mode="sum", sparse=True)
        self.norm = hvd.SyncBatchNorm(hidden)
        self.out = torch.nn.Linear(hidden, 10)

    def forward(self, tokens: torch.Tensor) -> "tuple[torch.Tensor, torch.Tensor]":
        h = self.embed(tokens) / 8.0
        return self.out(F.relu(self.norm(h))), h


def drift_penalty(h: torch.Tensor) -> torch.Tensor:
    """Squared norm of the embeddings' mean over every rank's batch: a differentiable all-reduce
    (its gradient is the all-reduce of the incoming gradient, as in Horovod)."""
    return hvd.allreduce(h.mean(dim=0), name="drift").pow(2).sum()


def main() -> None:
    args = parse_args()
    hvd.init(process_sets="dynamic")
    torch.manual_seed(args.seed)
    size, rank = hvd.size(), hvd.rank()
    evaluators = hvd.add_process_set(list(range(0, size, 2))) if size > 1 else hvd.global_process_set

    digits = load_digits()
    order = np.random.default_rng(args.seed).permutation(len(digits.target))
    split = int(0.8 * len(order))
    train, test = order[:split], order[split:]
    # Uneven shards: rank r holds a share proportional to r + 1.
    weights = np.arange(1, size + 1)
    bounds = np.concatenate([[0], np.cumsum(weights)]) * len(train) // weights.sum()
    mine = train[bounds[rank]:bounds[rank + 1]]
    x, y = tokens_of(digits.images.reshape(-1, 64)[mine]), torch.as_tensor(digits.target[mine])

    model = DigitNet()
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(), sparse_as_dense=True)

    batches = 0
    for epoch in range(args.epochs):
        model.train()
        perm = torch.randperm(len(y))
        started, losses = time.perf_counter(), []
        for start in range(0, len(y), args.batch_size):
            index = perm[start:start + args.batch_size]
            optimizer.zero_grad()
            logits, h = model(x[index])
            loss = F.cross_entropy(logits, y[index]) + 0.01 * drift_penalty(h)
            loss.backward()
            optimizer.step()
            batches += 1
            losses.append(loss.item())
        if rank == 0:
            # The shards are uneven and the ranks' epochs do not line up (they join at the end):
            # rank 0 reports its own loss and throughput.
            print(f"epoch {epoch + 1}: rank 0 loss {np.mean(losses):.4f}, "
                  f"{len(y) / (time.perf_counter() - started):.0f} samples/s on rank 0", flush=True)
    last = hvd.join()
    print(f"rank {rank}: {batches} batches on {len(y)} samples; the last rank to join was {last}", flush=True)

    # Every rank holds the same model again: the one of the rank that trained longest.
    hvd.broadcast_parameters(model.state_dict(), root_rank=last)
    if evaluators.included():
        model.eval()
        share = np.array_split(test, evaluators.size())[evaluators.rank()]
        with torch.no_grad():
            logits, _ = model(tokens_of(digits.images.reshape(-1, 64)[share]))
            labels = torch.as_tensor(digits.target[share])
            correct = (logits.argmax(dim=1) == labels).sum().double()
            loss_sum = F.cross_entropy(logits, labels, reduction="sum").double()
        correct, loss_sum, count = hvd.grouped_allreduce(
            [correct, loss_sum, torch.tensor(float(len(share)), dtype=torch.float64)],
            op=hvd.Sum, process_set=evaluators)
        if evaluators.rank() == 0:
            print(f"evaluated by ranks {evaluators.ranks}: test loss {loss_sum.item() / count.item():.3f}, "
                  f"final test accuracy: {correct.item() / count.item():.3f}", flush=True)


if __name__ == "__main__":
    main()
