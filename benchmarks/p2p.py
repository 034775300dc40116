"""Point-to-point latency and bandwidth: mtrain's send/recv vs mpi4py's Send/Recv vs gloo's.

Run as ``mpirun -np 2 python benchmarks/p2p.py`` (or ``mtrain run -np 2 …``); two ranks,
and everything is measured between rank 0 and rank 1. Two tables:

Ping-pong. Rank 0 sends N bytes to rank 1, rank 1 sends them back:

    time      = half the round trip: median over iterations of the slowest rank's time
                for one call, divided by twice the round trips per call (small sizes
                repeat the round trip within a call, so the timer's and the barrier's
                cost do not swamp a few microseconds)
    bandwidth = bytes / time (one way)

Implementations, each with a buffer of its own: ``mtrain`` is ``rr.send``/``rr.recv``
on float32 NumPy arrays (transfers up to MTRAIN_P2P_EAGER_BYTES go as one message,
larger ones as a header then the payload; see mtrain.ringreduce.transport.p2p); ``mpi4py`` is
``comm.Send``/``comm.Recv`` on buffer objects (no pickling) on a private duplicate of
COMM_WORLD; ``gloo`` is torch.distributed's ``send``/``recv`` on CPU tensors (when torch
is installed; ``--no-gloo`` leaves it out). They run interleaved, one call each per
round, so a drifting VM favours none.

Collectives beside a transfer. The median time of a small named ``rr.allreduce`` (4 KiB)
on both ranks while nothing else runs ("idle"), and while a 64 MiB ``rr.send_async`` /
``rr.recv_async`` between the same two ranks is in flight ("beside"): the transfer is
started first, the all-reduces run until it has ended on both ranks (each all-reduce
carries whether its rank's transfer was still in flight when it was submitted, so both
ranks stop at the same one; only those submitted while a transfer was in flight count),
then the transfer is waited for. The transfer's own time, alone and beside the
all-reduces, is in the same table. The engine thread runs the all-reduces and the p2p
threads drive the transfer, so "beside" close to "idle" means a large transfer does not
stall the engine's collectives on that rank.

Several hosts: ``--cluster 2x1`` (root, tests/cluster prerequisites) builds the namespace
test cluster (tests/cluster/netcluster.py) and runs this benchmark there through
``mtrain run``, rank 0 and rank 1 on two hosts. gloo's rendezvous then listens on
MASTER_ADDR, rank 0's address on the ``--network-interface`` subnet that ``mtrain run``
sets (with GLOO_SOCKET_IFNAME for gloo's own connections).
"""
from __future__ import annotations

import argparse
import os
import socket
import sys
import time
from typing import Callable

import numpy as np
from mpi4py import MPI

import mtrain.ringreduce as rr
from mtrain.ringreduce.transport import p2p
# A sibling benchmark (repo_helpers.py says why so).
from allreduce import (KiB, MiB, cluster_spec, gloo_group, mpi_library, parse_size, run_on_cluster,
                       timed_side_by_side)

IMPLS = ("mtrain", "mpi4py", "gloo")
# The environment settings printed in the header, where set (mpirun sets many OMPI_MCA_ of its own).
KNOBS = ("MTRAIN_P2P_", "MTRAIN_SHM_", "MTRAIN_ALLREDUCE_", "MTRAIN_CYCLE", "OMPI_MCA_mpi_yield", "OMPI_MCA_btl",
         "OMPI_MCA_pml", "OMPI_MCA_smsc")
TAG = 3  # the ping-pong's tag; the transfer beside the all-reduces takes another


def size_list(text: str) -> "list[int]":
    """An argparse type: comma-separated sizes in bytes (8, 64K, 1M), each a multiple of 4 (float32)."""
    sizes = []
    for item in text.split(","):
        try:
            size = parse_size(item)
        except (ValueError, IndexError):
            raise argparse.ArgumentTypeError(f"{item!r} is not a size (8, 64K, 1M, 1.5G)") from None
        if size < 4 or size % 4:
            raise argparse.ArgumentTypeError(f"{item!r}: sizes are whole float32 arrays, a multiple of 4 bytes")
        sizes.append(size)
    return sizes


def one_size(text: str) -> int:
    sizes = size_list(text)
    if len(sizes) != 1:
        raise argparse.ArgumentTypeError(f"{text!r}: one size, not a list")
    return sizes[0]


def impl_list(text: str) -> "list[str]":
    names = [name.strip() for name in text.split(",") if name.strip()]
    unknown = [name for name in names if name not in IMPLS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"unknown implementation(s) {', '.join(unknown) or text!r}; "
                                         f"choose from {', '.join(IMPLS)}")
    return names


def label(nbytes: int) -> str:
    if nbytes >= MiB and nbytes % MiB == 0:
        return f"{nbytes // MiB}M"
    if nbytes >= KiB and nbytes % KiB == 0:
        return f"{nbytes // KiB}K"
    return f"{nbytes}B"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=size_list, default=size_list("8,64K,1M,16M,64M"),
                        help="ping-pong sizes in bytes, comma-separated (default 8,64K,1M,16M,64M)")
    parser.add_argument("--budget", type=float, default=0.5, help="seconds of timing per size (approx.)")
    parser.add_argument("--min-iters", type=int, default=7)
    parser.add_argument("--only", type=impl_list, help=f"comma-separated implementations ({', '.join(IMPLS)})")
    parser.add_argument("--no-gloo", action="store_true")
    parser.add_argument("--transfer-bytes", type=one_size, default=64 * MiB,
                        help="the transfer in flight beside the all-reduces (default 64M)")
    parser.add_argument("--allreduce-bytes", type=one_size, default=4 * KiB,
                        help="the all-reduce timed beside it (default 4K)")
    parser.add_argument("--rounds", type=int, default=8,
                        help="rounds of the second table (each: idle all-reduces, the transfer alone, both)")
    parser.add_argument("--cluster", metavar="HOSTSxRANKS", type=cluster_spec,
                        help="build the namespace test cluster (root) and run there, e.g. 2x1")
    args = parser.parse_args()
    if args.budget <= 0 or args.min_iters < 1 or args.rounds < 1:
        parser.error("--budget, --min-iters and --rounds must be positive")
    if args.cluster:
        sys.exit(run_on_cluster(args.cluster, sys.argv[1:], script=__file__))

    comm = MPI.COMM_WORLD
    n, me = comm.Get_size(), comm.Get_rank()
    if n != 2:
        if me == 0:
            print(f"benchmarks/p2p.py: measures between two ranks; run it with 2, not {n}", file=sys.stderr)
        sys.exit(2)
    rr.init()
    wanted = args.only or list(IMPLS)
    torch, dist = (None, None) if args.no_gloo or "gloo" not in wanted else gloo_group(comm)
    hosts = comm.allgather(socket.gethostname())

    rows = []
    for nbytes in args.sizes:
        rows += ping_pong(comm, nbytes, wanted, torch, dist, args)
    beside = collectives_beside_transfer(comm, args)

    if me == 0:
        print_header(hosts)
        print_ping_pong(rows)
        print_beside(beside, args)
    if dist is not None:
        dist.destroy_process_group()


def ping_pong(comm: MPI.Comm, nbytes: int, wanted: "list[str]", torch, dist, args: argparse.Namespace) -> list:
    """(size, impl, one-way seconds) for each implementation, timed side by side."""
    me = comm.Get_rank()
    peer = 1 - me
    count = nbytes // 4
    # Small sizes: several round trips per timed call (a call of at least ~100 us here).
    trips = max(1, min(50, (256 * KiB) // nbytes))
    buffers = {name: np.full(count, me + 1, np.float32) for name in IMPLS}
    pcomm = comm.Dup()

    def exchange(send: Callable[[], None], recv: Callable[[], None]) -> Callable[[], None]:
        first, second = (send, recv) if me == 0 else (recv, send)

        def call() -> None:
            for _ in range(trips):
                first()
                second()
        return call

    impls: "dict[str, Callable[[], None]]" = {}
    mine = buffers["mtrain"]
    impls["mtrain"] = exchange(lambda: rr.send(mine, peer, tag=TAG), lambda: rr.recv(mine, peer, tag=TAG))
    theirs = [buffers["mpi4py"], MPI.FLOAT]
    impls["mpi4py"] = exchange(lambda: pcomm.Send(theirs, peer, tag=TAG), lambda: pcomm.Recv(theirs, peer, tag=TAG))
    if dist is not None:
        tensor = torch.from_numpy(buffers["gloo"])
        impls["gloo"] = exchange(lambda: dist.send(tensor, peer), lambda: dist.recv(tensor, peer))
    impls = {name: fn for name, fn in impls.items() if name in wanted}
    seconds = timed_side_by_side(comm, impls, nbytes, args.budget, args.min_iters)
    pcomm.Free()
    for name in impls:  # every buffer went to rank 1 and back: both ranks' hold rank 0's values
        assert buffers[name][0] == 1.0, (name, buffers[name][0])
    return [(nbytes, name, seconds[name] / (2 * trips)) for name in impls]


def collectives_beside_transfer(comm: MPI.Comm, args: argparse.Namespace) -> dict:
    """All-reduce times idle and beside a large transfer, and the transfer's times alone and beside."""
    me = comm.Get_rank()
    peer = 1 - me
    small = np.zeros(args.allreduce_bytes // 4, np.float32)
    big = np.full(args.transfer_bytes // 4, me + 1, np.float32)
    name = "p2p.bench.small"  # named, as gradients are: the engine's response cache skips the coordinator
    idle_count = 20
    idle, beside, alone_s, beside_s, spans = [], [], [], [], []

    def start() -> p2p.Transfer:
        return rr.send_async(big, peer, tag=TAG + 1) if me == 0 else rr.recv_async(big, peer, tag=TAG + 1)

    def allreduce(in_flight: bool) -> "tuple[float, bool]":
        small[0] = 1.0 if in_flight else 0.0  # Sum: the result says whether either rank's was
        begin = time.perf_counter()
        result = rr.allreduce(small, op=rr.Sum, name=name)
        return time.perf_counter() - begin, bool(result[0] > 0)

    for _ in range(3):  # warm-up: the engine's cache, the p2p thread, the big buffer's pages
        allreduce(False)
        rr.synchronize(start())
    for round_index in range(args.rounds):
        # Alternate the order of the three parts, so that none always follows another.
        parts = ["idle", "alone", "beside"]
        if round_index % 2:
            parts.reverse()
        for part in parts:
            comm.Barrier()
            if part == "idle":
                idle += [allreduce(False)[0] for _ in range(idle_count)]
            elif part == "alone":
                begin = time.perf_counter()
                rr.synchronize(start())
                alone_s.append(time.perf_counter() - begin)
            else:
                begin = time.perf_counter()
                handle = start()
                ended, count = None, 0
                while True:
                    mine_in_flight = not rr.poll(handle)
                    if not mine_in_flight and ended is None:
                        ended = time.perf_counter()
                    took, any_in_flight = allreduce(mine_in_flight)
                    if not any_in_flight:
                        break
                    beside.append(took)
                    count += 1
                    if count >= 100_000:
                        raise RuntimeError("the transfer beside the all-reduces never ended")
                rr.synchronize(handle)
                beside_s.append((ended or time.perf_counter()) - begin)
                spans.append(count)
    assert me != 1 or big[0] == 1.0  # rank 0's values came
    return {
        "idle": slowest(comm, idle), "beside": slowest(comm, beside),
        "alone_s": slowest(comm, alone_s), "beside_s": slowest(comm, beside_s), "spans": spans,
    }


def slowest(comm: MPI.Comm, samples: "list[float]") -> np.ndarray:
    """Per sample, the slowest rank's (both ranks take the same samples, in the same order)."""
    mine = np.asarray(samples, dtype=np.float64)
    out = np.empty_like(mine)
    comm.Allreduce(mine, out, op=MPI.MAX)
    return out


def print_header(hosts: "list[str]") -> None:
    where = "one host" if hosts[0] == hosts[1] else "two hosts"
    knobs = {key: value for key, value in sorted(os.environ.items())
             if key.startswith(KNOBS) and "directory" not in key}
    knobs.setdefault("MTRAIN_P2P_EAGER_BYTES", f"{p2p.EAGER_BYTES} (default)")
    print(f"# point-to-point, 2 ranks on {where}: rank 0 on {hosts[0]}, rank 1 on {hosts[1]}")
    print(f"# {mpi_library()} via mpi4py {mpi4py_version()}")
    print("# " + ", ".join(f"{key}={value}" for key, value in knobs.items()))


def mpi4py_version() -> str:
    import mpi4py
    return mpi4py.__version__


def print_ping_pong(rows: list) -> None:
    print("# ping-pong: time = half the round trip (median of the slowest rank); bandwidth = bytes / time")
    print(f"{'size':>8} {'impl':>8} {'time(us)':>12} {'GB/s':>8}")
    for nbytes, name, seconds in rows:
        print(f"{label(nbytes):>8} {name:>8} {seconds * 1e6:12.1f} {nbytes / seconds / 1e9:8.4f}")
    sys.stdout.flush()


def print_beside(result: dict, args: argparse.Namespace) -> None:
    size, transfer = label(args.allreduce_bytes), label(args.transfer_bytes)
    print(f"# {size} rr.allreduce (named, Sum) on both ranks: idle, and beside a {transfer} "
          f"rr.send_async/recv_async between them; {transfer} transfer's own time alone and beside them")
    print(f"{'condition':>10} {'allreduces':>10} {'median(us)':>11} {'p90(us)':>9} {'transfer(ms)':>13}")
    for part, key in (("idle", None), ("alone", "alone_s"), ("beside", "beside_s")):
        samples = result.get(part)
        count = len(samples) if samples is not None else 0
        median = f"{np.median(samples) * 1e6:11.1f}" if count else f"{'-':>11}"
        p90 = f"{np.percentile(samples, 90) * 1e6:9.1f}" if count else f"{'-':>9}"
        took = f"{np.median(result[key]) * 1e3:13.2f}" if key else f"{'-':>13}"
        print(f"{part:>10} {count:>10} {median} {p90} {took}")
    spans = result["spans"]
    print(f"# beside: {min(spans)}-{max(spans)} all-reduces ran while each transfer was in flight; "
          "transfer times: median over rounds, to the first poll that found it done")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
