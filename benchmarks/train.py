"""Training throughput at np=2: mtrain's DistributedOptimizer vs torch DDP (gloo) vs one process.

    python benchmarks/train.py [--steps 10] [--batch 32] [--width 4096]

One run measures every variant on the same model (an MLP with tens of millions
of parameters, float32, CPU) and prints one table: samples/s over all ranks, ms
per step, and for mtrain the share of the step spent waiting for gradients to be
averaged (``optimizer.synchronize()`` after backward, i.e. communication that
backward did not hide). Each rank uses one thread (one core per rank).
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path


def build_model(width: int):
    import torch
    return torch.nn.Sequential(
        torch.nn.Linear(1024, width), torch.nn.ReLU(), torch.nn.Linear(width, width), torch.nn.ReLU(),
        torch.nn.Linear(width, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 10))


def train(mode: str, args: argparse.Namespace) -> "dict | None":
    """Run warm-up and timed steps in this process; rank 0 returns the measurements."""
    import torch
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model = build_model(args.width)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    rank, size = 0, 1
    if mode == "mtrain":
        import mtrain.torch as hvd
        hvd.init()
        rank, size = hvd.rank(), hvd.size()
        optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    elif mode == "ddp":
        import torch.distributed as dist
        rank, size = int(os.environ["OMPI_COMM_WORLD_RANK"]), int(os.environ["OMPI_COMM_WORLD_SIZE"])
        dist.init_process_group("gloo", rank=rank, world_size=size)
        model = torch.nn.parallel.DistributedDataParallel(model)
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(args.batch, 1024, generator=g)
    y = torch.randint(0, 10, (args.batch,), generator=g)
    waited = 0.0
    for step in range(args.warmup + args.steps):
        if step == args.warmup:
            if mode == "ddp":
                torch.distributed.barrier()
            elif mode == "mtrain":
                hvd.barrier()
            start, waited = time.perf_counter(), 0.0
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        if mode == "mtrain":
            t0 = time.perf_counter()
            optimizer.synchronize()
            waited += time.perf_counter() - t0
            with optimizer.skip_synchronize():
                optimizer.step()
        else:
            optimizer.step()
    elapsed = time.perf_counter() - start
    params = sum(p.numel() for p in model.parameters())
    if mode == "ddp":
        torch.distributed.destroy_process_group()
    if rank != 0:
        return None
    return {"mode": mode, "ranks": size, "threads": args.threads, "params": params,
            "samples_per_s": size * args.batch * args.steps / elapsed,
            "ms_per_step": 1000 * elapsed / args.steps,
            "wait_share": waited / elapsed if mode == "mtrain" else None}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_worker(mode: str, ranks: int, args: argparse.Namespace, threads: int) -> dict:
    argv = [sys.executable, str(Path(__file__).resolve()), "--worker", mode, "--steps", str(args.steps),
            "--warmup", str(args.warmup), "--batch", str(args.batch), "--width", str(args.width),
            "--threads", str(threads)]
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    if ranks > 1:
        mpirun = Path(sys.executable).parent / "mpirun"
        argv = [str(mpirun) if mpirun.exists() else "mpirun", "-np", str(ranks), "--bind-to", "none",
                "--oversubscribe"] + (["--allow-run-as-root"] if os.geteuid() == 0 else []) + argv
    done = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=600)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        raise SystemExit(f"{mode} at np={ranks} failed ({done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    return json.loads(lines[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--batch", type=int, default=32, help="samples per rank per step")
    parser.add_argument("--width", type=int, default=4096, help="hidden width (4096: 25.2 M parameters)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--worker", choices=["single", "mtrain", "ddp"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        result = train(args.worker, args)
        if result is not None:
            print(json.dumps(result), flush=True)
        return
    rows = [run_worker("single", 1, args, 1), run_worker("single", 1, args, 2),
            run_worker("ddp", 2, args, 1), run_worker("mtrain", 2, args, 1)]
    print(f"\nMLP with {rows[0]['params'] / 1e6:.1f} M float32 parameters, batch {args.batch} per rank, "
          f"{args.steps} timed steps after {args.warmup} warm-up steps\n")
    print(f"{'variant':<44} {'ranks':>5} {'samples/s':>10} {'ms/step':>9} {'waiting for comm':>17}")
    names = {"single": "1 process", "ddp": "torch DDP, gloo", "mtrain": "mtrain DistributedOptimizer"}
    for row in rows:
        name = f"{names[row['mode']]} ({row['threads']} thread{'s' if row['threads'] > 1 else ''}/rank)"
        share = "—" if row["wait_share"] is None else f"{100 * row['wait_share']:.0f}% of step"
        print(f"{name:<44} {row['ranks']:>5} {row['samples_per_s']:>10.1f} {row['ms_per_step']:>9.1f} {share:>17}")


if __name__ == "__main__":
    main()
