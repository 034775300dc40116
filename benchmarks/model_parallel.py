"""Model parallelism on the "mtrain" torch.distributed backend against gloo, in the same run.

    mpirun -np 4 python benchmarks/model_parallel.py            # or: mtrain run -np 4 ...
    mpirun -np 4 python benchmarks/model_parallel.py --only zero

Two tables (medians over iterations of the slowest rank's time, variants interleaved so a
drifting VM favours none):

* pipeline: one training step of a 4-stage MLP (one Linear+ReLU stage per rank, the loss
  on the last), with torch.distributed.pipelining's ScheduleGPipe over 8 microbatches:
  the activations and their gradients move by send/recv on the group's backend.
* zero: one step (forward, backward, Adam step) of an MLP wrapped in DDP, with
  ZeroRedundancyOptimizer (each rank keeps 1/n of Adam's state and broadcasts its shard
  of the parameters after the step) against plain DDP + Adam; the memory column is this
  rank's optimizer state (the largest over ranks).

Every variant runs on its own process group: the default group on backend "mtrain" and
``new_group(backend="gloo")`` over the same ranks.
"""
from __future__ import annotations

import argparse
import sys
from typing import Callable, Dict

import torch
import torch.distributed as dist
from mpi4py import MPI

import mtrain.distributed as mdist
from allreduce import KiB, MiB, mpi_library, timed_side_by_side


def mlp(width: int, depth: int, seed: int = 0) -> torch.nn.Sequential:
    torch.manual_seed(seed)
    layers: list = []
    for _ in range(depth):
        layers += [torch.nn.Linear(width, width), torch.nn.ReLU()]
    return torch.nn.Sequential(*layers)


def pipeline_variants(rank: int, size: int, groups: Dict[str, object], width: int, batch: int,
                      microbatches: int) -> Dict[str, Callable[[], None]]:
    from torch.distributed.pipelining import PipelineStage, ScheduleGPipe
    variants = {}
    for name, group in groups.items():
        stage_module = mlp(width, 1, seed=rank)
        example = torch.empty(batch // microbatches, width)
        stage = PipelineStage(stage_module, rank, size, torch.device("cpu"), input_args=(example,), group=group)
        schedule = ScheduleGPipe(stage, n_microbatches=microbatches,
                                 loss_fn=lambda out, target: ((out - target) ** 2).mean())
        optimizer = torch.optim.SGD(stage_module.parameters(), lr=1e-3)
        generator = torch.Generator().manual_seed(7)
        inputs, targets = torch.randn(batch, width, generator=generator), torch.randn(batch, width, generator=generator)

        def step(schedule=schedule, optimizer=optimizer, inputs=inputs, targets=targets) -> None:
            optimizer.zero_grad()
            if rank == 0:
                schedule.step(inputs)
            elif rank == size - 1:
                schedule.step(target=targets, losses=[])
            else:
                schedule.step()
            optimizer.step()
        variants[f"pipeline-{name}"] = step
    return variants


def zero_variants(rank: int, groups: Dict[str, object], width: int, depth: int,
                  batch: int) -> "tuple[Dict[str, Callable[[], None]], Dict[str, object]]":
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel
    variants, optimizers = {}, {}
    generator = torch.Generator().manual_seed(100 + rank)
    inputs, targets = torch.randn(batch, width, generator=generator), torch.randn(batch, width, generator=generator)
    for name, group in groups.items():
        for kind in ("zero", "ddp"):
            model = DistributedDataParallel(mlp(width, depth), process_group=group)
            if kind == "zero":
                optimizer = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.Adam,
                                                    process_group=group, lr=1e-4)
            else:
                optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)

            def step(model=model, optimizer=optimizer) -> None:
                optimizer.zero_grad()
                ((model(inputs) - targets) ** 2).mean().backward()
                optimizer.step()
            variants[f"{kind}-{name}"] = step
            optimizers[f"{kind}-{name}"] = optimizer
    return variants, optimizers


def state_bytes(optimizer: object) -> int:
    """Bytes of optimizer state this rank holds (Adam's moments and step counters)."""
    inner = getattr(optimizer, "optim", optimizer)  # ZeroRedundancyOptimizer keeps its shard's optimizer
    return sum(v.numel() * v.element_size() for state in inner.state.values()  # type: ignore[attr-defined]
               for v in state.values() if torch.is_tensor(v))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", choices=("pipeline", "zero"), help="one table only")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--width", type=int, default=1024, help="the MLPs' width")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--zero-depth", type=int, default=4, help="layers of the ZeRO benchmark's MLP")
    args = parser.parse_args()
    if args.batch % args.microbatches:
        parser.error("--batch must be a multiple of --microbatches")
    mdist.init_process_group()
    comm = MPI.COMM_WORLD
    rank, size = dist.get_rank(), dist.get_world_size()
    groups = {"mtrain": dist.group.WORLD, "gloo": dist.new_group(backend="gloo")}
    header = (f"{size} ranks, torch {torch.__version__}, width {args.width}, batch {args.batch}, "
              f"{args.iters} iterations, {mpi_library()}")
    if args.only in (None, "pipeline"):
        if size < 2:
            print("# pipeline: needs at least 2 ranks (one stage each); skipped", flush=True)
        else:
            variants = pipeline_variants(rank, size, groups, args.width, args.batch, args.microbatches)
            times = timed_side_by_side(comm, variants, 0, 0.0, 0, iters=args.iters)
            activation = args.batch // args.microbatches * args.width * 4
            if rank == 0:
                print(f"# pipeline step: {size} stages (Linear {args.width}x{args.width} + ReLU each), ScheduleGPipe, "
                      f"{args.microbatches} microbatches of {activation // KiB} KiB activations; {header}")
                print(f"{'impl':>16} {'step(ms)':>10} {'vs gloo':>8}")
                for name, seconds in times.items():
                    print(f"{name:>16} {seconds * 1e3:10.2f} {times['pipeline-gloo'] / seconds:7.2f}x")
                sys.stdout.flush()
    if args.only in (None, "zero"):
        variants, optimizers = zero_variants(rank, groups, args.width, args.zero_depth, args.batch)
        times = timed_side_by_side(comm, variants, 0, 0.0, 0, iters=args.iters)
        memory = {name: comm.allreduce(state_bytes(opt), op=MPI.MAX) for name, opt in optimizers.items()}
        if rank == 0:
            params = sum(p.numel() for p in mlp(args.width, args.zero_depth).parameters())
            print(f"# ZeRO step: DDP + Adam on an MLP of {args.zero_depth} layers ({params * 4 / MiB:.0f} MiB of "
                  f"float32 parameters); {header}")
            print(f"{'impl':>16} {'step(ms)':>10} {'optimizer state/rank (MiB)':>27}")
            for name, seconds in times.items():
                print(f"{name:>16} {seconds * 1e3:10.2f} {memory[name] / MiB:27.1f}")
            sys.stdout.flush()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
