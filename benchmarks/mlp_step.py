"""Latency of a small training step: ``hvd.DistributedOptimizer`` vs a hand-written step.

Run as ``mpirun -np 2 python benchmarks/mlp_step.py`` (or ``mtrain run -np 2 …``).
A 3-layer MLP (6 gradient tensors, a few hundred KiB in all), one training step
each way, taking turns in the same run so a drifting machine favours neither:

* mtrain.torch: ``loss.backward()`` (the optimizer's hooks submit each gradient as
  it is produced), then ``optimizer.step()`` (waits for the averages, updates);
* hand-written: ``loss.backward()``, then one mpi4py ``Allreduce`` in place per
  gradient and a division by the number of ranks, then the plain optimizer's step;
* no communication at all (the compute floor).

Both sides start from the same parameters and see the same data; time per step
is the median over rounds of the slowest rank's step. One torch thread per rank
(one core per rank on the 2-core VM). The last column is each variant's time
over the hand-written step's.
"""
from __future__ import annotations

import argparse

from mpi4py import MPI

from allreduce import timed_side_by_side  # a sibling benchmark (repo_helpers.py says why so)


def build_mlp(torch, inputs: int, width: int, outputs: int):
    return torch.nn.Sequential(torch.nn.Linear(inputs, width), torch.nn.ReLU(),
                               torch.nn.Linear(width, width), torch.nn.ReLU(),
                               torch.nn.Linear(width, outputs))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget", type=float, default=4.0, help="seconds of timing (approx.)")
    parser.add_argument("--min-iters", type=int, default=50)
    parser.add_argument("--batch", type=int, default=32, help="samples per rank per step")
    parser.add_argument("--inputs", type=int, default=128)
    parser.add_argument("--width", type=int, default=256)
    args = parser.parse_args()

    import torch
    import mtrain.torch as hvd

    torch.set_num_threads(1)
    hvd.init()
    comm = MPI.COMM_WORLD
    me, n = comm.Get_rank(), comm.Get_size()
    torch.manual_seed(0)
    ours_model = build_mlp(torch, args.inputs, args.width, 10)
    hand_model = build_mlp(torch, args.inputs, args.width, 10)
    hand_model.load_state_dict(ours_model.state_dict())
    bare_model = build_mlp(torch, args.inputs, args.width, 10)
    bare_model.load_state_dict(ours_model.state_dict())
    ours = hvd.DistributedOptimizer(torch.optim.SGD(ours_model.parameters(), lr=0.01),
                                    named_parameters=ours_model.named_parameters())
    hand = torch.optim.SGD(hand_model.parameters(), lr=0.01)
    bare = torch.optim.SGD(bare_model.parameters(), lr=0.01)
    generator = torch.Generator().manual_seed(1 + me)
    data = torch.randn(args.batch, args.inputs, generator=generator)
    target = torch.randint(0, 10, (args.batch,), generator=generator)
    loss_fn = torch.nn.CrossEntropyLoss()

    def ours_step() -> None:
        ours.zero_grad()
        loss_fn(ours_model(data), target).backward()
        ours.step()

    def hand_step() -> None:
        hand.zero_grad()
        loss_fn(hand_model(data), target).backward()
        for p in hand_model.parameters():
            grad = p.grad.numpy()
            comm.Allreduce(MPI.IN_PLACE, grad, op=MPI.SUM)
            grad /= n
        hand.step()

    def bare_step() -> None:
        bare.zero_grad()
        loss_fn(bare_model(data), target).backward()
        bare.step()

    variants = {"mtrain.torch DistributedOptimizer": ours_step,
                "hand-written: mpi4py Allreduce per gradient": hand_step,
                "no communication (compute only)": bare_step}
    nbytes = sum(p.numel() * p.element_size() for p in ours_model.parameters())
    medians = timed_side_by_side(comm, variants, nbytes, args.budget, args.min_iters)
    # The two communicating variants must have trained identically (same data, same averages).
    for a, b in zip(ours_model.parameters(), hand_model.parameters()):
        if not torch.allclose(a, b, rtol=1e-5, atol=1e-6):
            raise SystemExit("mlp_step: mtrain's and the hand-written step diverged")
    if me == 0:
        params = len(list(ours_model.parameters()))
        print(f"# one training step, {n} ranks; MLP {args.inputs}-{args.width}-{args.width}-10, "
              f"{params} gradient tensors, {nbytes / 1024:.0f} KiB, batch {args.batch}/rank")
        hand_s = medians["hand-written: mpi4py Allreduce per gradient"]
        print(f"{'variant':<46} {'us/step':>9} {'vs hand':>8}")
        for label, seconds in medians.items():
            print(f"{label:<46} {seconds * 1e6:9.1f} {seconds / hand_s:8.2f}")
    hvd.shutdown()


if __name__ == "__main__":
    main()
