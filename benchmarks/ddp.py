"""torch DDP on the "mtrain" torch.distributed backend vs DDP on gloo, same run.

Run as ``mpirun -np 2 python benchmarks/ddp.py`` (or ``mtrain run -np 2 …``).
Both DDP models live in one job (the default group is "mtrain", a second group
gloo) and take turns, one step each per round, so a drifting machine favours
neither. Two workloads:

* the ResNet-50 gradient set (161 tensors, 25.6 M float32, shapes from
  ``fusion.py``) as the parameters of a model whose forward is nearly free:
  one step is backward plus DDP's bucketed gradient all-reduce;
* ``train.py``'s MLP (forward, backward, SGD step), reported in samples/s.

Time per step = median over rounds of the slowest rank's step. Each rank uses
one torch thread (one core per rank on the 2-core VM).
"""
from __future__ import annotations

import argparse

import numpy as np
from mpi4py import MPI

import mtrain.ringreduce as rr
from allreduce import timed_side_by_side  # the sibling benchmarks (repo_helpers.py says why so)
from fusion import resnet50_gradient_shapes
from train import build_model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget", type=float, default=6.0, help="seconds of timing per workload (approx.)")
    parser.add_argument("--min-iters", type=int, default=7)
    parser.add_argument("--batch", type=int, default=32, help="train.py model: samples per rank per step")
    parser.add_argument("--width", type=int, default=4096, help="train.py model: hidden width")
    args = parser.parse_args()

    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP
    import mtrain.distributed as mtrain_distributed

    torch.set_num_threads(1)
    rr.init()
    comm = MPI.COMM_WORLD
    me, n = comm.Get_rank(), comm.Get_size()
    mtrain_distributed.init_process_group()  # default group: backend "mtrain"
    gloo = dist.new_group(backend="gloo")
    groups = {"gloo": gloo, "mtrain": None}

    class GradientSet(torch.nn.Module):
        """Parameters of ResNet-50's shapes; every gradient is all ones, computed for free."""

        def __init__(self) -> None:
            super().__init__()
            self.weights = torch.nn.ParameterList(torch.nn.Parameter(torch.zeros(s))
                                                  for s in resnet50_gradient_shapes())

        def forward(self, scale: torch.Tensor) -> torch.Tensor:
            return sum(w.sum() for w in self.weights) * scale

    def gradient_step(model: torch.nn.Module):
        scale = torch.ones(())

        def run() -> None:
            model(scale).backward()  # DDP all-reduces the buckets during backward, waits at its end
        return run

    def train_step(model: torch.nn.Module):
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        g = torch.Generator().manual_seed(me)
        x = torch.randn(args.batch, 1024, generator=g)
        y = torch.randint(0, 10, (args.batch,), generator=g)

        def run() -> None:
            optimizer.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            optimizer.step()
        return run

    rows = []
    sets = {name: DDP(GradientSet(), process_group=group) for name, group in groups.items()}
    nbytes = sum(int(np.prod(s)) * 4 for s in resnet50_gradient_shapes())
    times = timed_side_by_side(comm, {name: gradient_step(m) for name, m in sets.items()},
                               nbytes, args.budget, args.min_iters)
    rows.append((f"ResNet-50 gradient set ({len(resnet50_gradient_shapes())} tensors, "
                 f"{nbytes / 2**20:.0f} MiB), backward + reduce", times, None))
    del sets

    torch.manual_seed(0)
    models = {name: DDP(build_model(args.width), process_group=group) for name, group in groups.items()}
    params = sum(p.numel() for p in models["gloo"].parameters())
    times = timed_side_by_side(comm, {name: train_step(m) for name, m in models.items()},
                               params * 4, args.budget, args.min_iters)
    rows.append((f"train.py MLP ({params / 1e6:.1f} M parameters, batch {args.batch}/rank), train step",
                 times, n * args.batch))

    if me == 0:
        print(f"\nDDP at np={n}, one thread per rank: median ms per step (slowest rank), same run, interleaved\n")
        print(f"{'workload':<70} {'gloo ms':>9} {'mtrain ms':>10} {'mtrain/gloo':>12} {'gloo sps':>9} "
              f"{'mtrain sps':>11}")
        for label, t, samples in rows:
            gloo_s, mtrain_s = t["gloo"], t["mtrain"]
            rates = (f"{samples / gloo_s:>9.1f} {samples / mtrain_s:>11.1f}" if samples
                     else f"{'—':>9} {'—':>11}")
            print(f"{label:<70} {1e3 * gloo_s:>9.1f} {1e3 * mtrain_s:>10.1f} {mtrain_s / gloo_s:>12.2f} {rates}")
        print("\nsps: samples/s over all ranks. mtrain/gloo < 1: the mtrain backend is faster.")
    del models
    dist.destroy_process_group()
    rr.shutdown()


if __name__ == "__main__":
    main()
