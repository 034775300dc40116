"""Per-op cost through the public API against the MPI library and gloo, then bandwidth.

Run as ``mpirun -np 2 python benchmarks/per_op.py`` (and ``-np 3``; or ``mtrain run``).
One interleaved run (every variant once per round, so a drifting VM favours none):

* per op, 4 KiB to 1 MiB of float32 Sum, one tensor at a time:
  ``rr.allreduce_`` (synchronous, named: the steady state of a training step's op),
  ``rr.allreduce_async_`` then ``rr.synchronize``, one mpi4py ``Allreduce(sendbuf, recvbuf)``,
  and torch.distributed gloo ``all_reduce`` on the same bytes (in a pass of its own, right
  after: see ``with_gloo``); the ratio columns are each against MPI;
* bandwidth, 1 MiB to 256 MiB: the same sync op, MPI and gloo, as time, algbw and
  busbw = algbw * 2(n-1)/n.

Times are medians over rounds of the slowest rank's call. The buffers hold zeros (sums of
zeros stay zero: every call does the same work, with no overflow and no denormals).
"""
from __future__ import annotations

import argparse

import numpy as np
from mpi4py import MPI

import mtrain.ringreduce as rr

from allreduce import gloo_group, mpi_library, parse_size, timed_side_by_side  # sibling benchmark

KiB, MiB = 1 << 10, 1 << 20


def sizes_between(low: int, high: int, factor: int) -> "list[int]":
    sizes = [low]
    while sizes[-1] * factor <= high:
        sizes.append(sizes[-1] * factor)
    return sizes


def size_text(nbytes: int) -> str:
    return f"{nbytes // MiB} MiB" if nbytes >= MiB else f"{nbytes // KiB} KiB"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--small", default="4K:1M", help="per-op sizes, LOW:HIGH (powers of 4 between)")
    parser.add_argument("--large", default="1M:256M", help="bandwidth sizes, LOW:HIGH (powers of 4 between)")
    parser.add_argument("--budget", type=float, default=1.0, help="seconds of timing per size (approx.)")
    parser.add_argument("--min-iters", type=int, default=30)
    parser.add_argument("--no-gloo", action="store_true")
    args = parser.parse_args()
    rr.init()
    comm = MPI.COMM_WORLD
    n, me = comm.Get_size(), comm.Get_rank()
    torch, dist = (None, None) if args.no_gloo else gloo_group(comm)
    bus = 2 * (n - 1) / n if n > 1 else 1.0

    def variants(nbytes: int, with_async: bool) -> dict:
        count = nbytes // 4
        mine, send, recv = np.zeros(count, np.float32), np.zeros(count, np.float32), np.empty(count, np.float32)
        name = f"per_op.{nbytes}"
        fns = {"sync": lambda: rr.allreduce_(mine, op=rr.Sum, name=name)}
        if with_async:
            other = np.zeros(count, np.float32)
            fns["async+sync"] = lambda: rr.synchronize(rr.allreduce_async_(other, op=rr.Sum, name=name + ".a"))
        fns["MPI"] = lambda: comm.Allreduce(send, recv, op=MPI.SUM)
        return fns

    def with_gloo(nbytes: int, seconds: "dict[str, float]", min_iters: int) -> "dict[str, float]":
        """gloo timed in a pass of its own: its threads keep a core busy for a while after each
        call, which slowed whichever variant came next in a shared round (2-4x at 4 KiB)."""
        if torch is None:
            return seconds
        tensor = torch.zeros(nbytes // 4, dtype=torch.float32)
        alone = timed_side_by_side(comm, {"gloo": lambda: dist.all_reduce(tensor)}, nbytes, args.budget / 2,
                                   min_iters)
        return {**seconds, **alone}

    low, high = (parse_size(s) for s in args.small.split(":"))
    small_rows = []
    for nbytes in sizes_between(low, high, 4):
        seconds = timed_side_by_side(comm, variants(nbytes, True), nbytes, args.budget, args.min_iters)
        small_rows.append((nbytes, with_gloo(nbytes, seconds, args.min_iters)))
    low, high = (parse_size(s) for s in args.large.split(":"))
    large_rows = []
    for nbytes in sizes_between(low, high, 4):
        seconds = timed_side_by_side(comm, variants(nbytes, False), nbytes, args.budget, min(args.min_iters, 10))
        large_rows.append((nbytes, with_gloo(nbytes, seconds, min(args.min_iters, 10))))
    if me == 0:
        print(f"# per op, float32 Sum, {n} ranks, {mpi_library().split(',')[0]} via mpi4py; median of the "
              "slowest rank; gloo in a pass of its own")
        labels = list(small_rows[0][1])
        print("| size | " + " | ".join(f"{label} (us)" for label in labels) + " | "
              + " | ".join(f"{label}/MPI" for label in labels if label != "MPI") + " |")
        print("|---" * (1 + 2 * len(labels) - 1) + "|")
        for nbytes, seconds in small_rows:
            mpi = seconds["MPI"]
            print(f"| {size_text(nbytes)} | " + " | ".join(f"{seconds[label] * 1e6:,.1f}" for label in labels) + " | "
                  + " | ".join(f"{seconds[label] / mpi:.2f}x" for label in labels if label != "MPI") + " |")
        print(f"\n# bandwidth, float32 Sum, {n} ranks: busbw = algbw * 2(n-1)/n (GB/s)")
        labels = list(large_rows[0][1])
        print("| size | " + " | ".join(f"{label} time (ms) | {label} busbw" for label in labels)
              + " | sync/MPI busbw |")
        print("|---" * (2 + 2 * len(labels)) + "|")
        for nbytes, seconds in large_rows:
            cells = [f"{seconds[label] * 1e3:,.2f} | {nbytes / seconds[label] / 1e9 * bus:.2f}" for label in labels]
            print(f"| {size_text(nbytes)} | " + " | ".join(cells) + f" | {seconds['MPI'] / seconds['sync']:.2f}x |")
    if dist is not None:
        dist.destroy_process_group()
    rr.shutdown()


if __name__ == "__main__":
    main()
