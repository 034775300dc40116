"""All-reduce bandwidth: ringreduce (ring, shared memory, hierarchical) vs MPI_Allreduce (mpi4py) vs gloo.

Run as ``mpirun -np 2 python benchmarks/allreduce.py`` (or ``mtrain run -np 2 …``).
Prints an nccl-tests-style table per implementation and size:

    time  = median over iterations of the slowest rank's time for one call
    algbw = bytes / time
    busbw = algbw · 2(n-1)/n   (the traffic each rank's link actually carries)
    bound = busbw as a share of the "memcpy" row's: every rank copying its buffer
            at the same time, the physical bound on one host

Implementations: ``ringreduce`` is the public API (engine included, with the
algorithm MTRAIN_ALLREDUCE_ALGORITHM picks, auto by default); ``rr-ring``,
``rr-shm`` and ``rr-hierarchical`` (auto's transport: the shared segment),
``-cma`` (the peers' buffers read by cross-memory attach) and
``-segment`` (one transport forced) are the Executor's all-reduce paths called
directly (what the engine runs for a fused buffer, without its ~40-250 us per op),
each where it applies. The variants run interleaved, one call each per round, so
a drifting VM favours none. ``--plot FILE.png`` also draws busbw vs size.

Several hosts: ``--cluster 2x2`` (root, tests/cluster prerequisites) builds the
namespace test cluster (tests/cluster/netcluster.py) and runs this benchmark on
it through ``mtrain run``; with ranks on several hosts a second table counts the
bytes each host sent over its network interface per all-reduce (/proc/net/dev of
the host's namespace), next to what the algorithm says it must send.
"""
from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import time
from typing import Callable

import numpy as np
from mpi4py import MPI

import mtrain.ringreduce as rr
from mtrain.ringreduce.transport import ring
from mtrain.ringreduce.transport.backend import NumpyBackend
from mtrain.ringreduce.transport.executor import Executor
from repo_helpers import ROOT, netcluster

KiB, MiB = 1 << 10, 1 << 20


def parse_size(text: str) -> int:
    units = {"K": KiB, "M": MiB, "G": 1 << 30}
    text = text.strip().upper().rstrip("IB")
    return int(float(text[:-1]) * units[text[-1]]) if text[-1] in units else int(text)


def mpi_library() -> str:
    """The first line of MPI's library version (Open MPI pads it with NULs)."""
    return MPI.Get_library_version().replace("\0", "").splitlines()[0].strip().rstrip(",")


def cluster_spec(text: str) -> str:
    """An argparse type for ``--cluster HOSTSxRANKS`` (e.g. 2x2): refused in one line, not a traceback."""
    hosts, _, ranks = text.lower().partition("x")
    if not (hosts.isdigit() and ranks.isdigit() and int(hosts) >= 1 and int(ranks) >= 1):
        raise argparse.ArgumentTypeError(f"{text!r} is not HOSTSxRANKS, e.g. 2x2")
    return text


def timed(comm: MPI.Comm, fn: Callable[[], None], nbytes: int, budget_s: float, min_iters: int) -> float:
    """Median over iterations of the slowest rank's time for one call of ``fn``."""
    for _ in range(2):  # warm-up: page in buffers, fill caches and MPI's free lists
        fn()
    iters = max(min_iters, min(200, int(budget_s / max(nbytes / 2e9, 2e-5))))
    iters = comm.bcast(iters, root=0)
    samples = np.empty(iters)
    for i in range(iters):
        comm.Barrier()
        start = time.perf_counter()
        fn()
        samples[i] = time.perf_counter() - start
    slowest = np.empty_like(samples)
    comm.Allreduce(samples, slowest, op=MPI.MAX)
    return float(statistics.median(slowest))


def timed_side_by_side(comm: MPI.Comm, fns: "dict[str, Callable[[], None]]", nbytes: int,
                       budget_s: float, min_iters: int, iters: "int | None" = None) -> "dict[str, float]":
    """``timed`` for several variants at once, interleaved: round i runs every variant
    once, so a machine whose speed drifts (a shared VM) biases none of them. ``iters``:
    that many rounds (after one warm-up call each), instead of as many as fit the budget."""
    round_s = 0.0
    for fn in fns.values():
        fn()  # warm-up, then one timed call to size the rounds to the budget
        if iters is None:
            start = time.perf_counter()
            fn()
            round_s += time.perf_counter() - start
    if iters is None:
        iters = max(min_iters, min(200, int(budget_s / max(round_s, 1e-6))))
    iters = comm.bcast(iters, root=0)
    samples = {label: np.empty(iters) for label in fns}
    for i in range(iters):
        for label, fn in fns.items():
            comm.Barrier()
            start = time.perf_counter()
            fn()
            samples[label][i] = time.perf_counter() - start
    medians = {}
    for label, mine in samples.items():
        slowest = np.empty_like(mine)
        comm.Allreduce(mine, slowest, op=MPI.MAX)
        medians[label] = float(statistics.median(slowest))
    return medians


def gloo_group(comm: MPI.Comm):
    """torch.distributed's gloo group over ``comm``'s ranks, or (None, None) without torch.

    The rendezvous listens on rank 0's address on the job's network: ``MASTER_ADDR`` where
    the launcher sets it (``mtrain run`` and torchrun do: rank 0's address on the
    ``--network-interface`` subnet, and GLOO_SOCKET_IFNAME for gloo's own connections),
    127.0.0.1 when every rank is on one host, else rank 0's hostname."""
    try:
        import torch
        import torch.distributed as dist
    except ImportError:
        return None, None
    local = comm.Split_type(MPI.COMM_TYPE_SHARED)
    one_host = local.Get_size() == comm.Get_size()
    local.Free()
    address = None
    if comm.Get_rank() == 0:
        host = os.environ.get("MASTER_ADDR") or ("127.0.0.1" if one_host else socket.gethostname())
        with socket.socket() as s:
            s.bind((host, 0))  # a free port on that address
            address = f"tcp://{host}:{s.getsockname()[1]}"
    address = comm.bcast(address, root=0)
    dist.init_process_group("gloo", init_method=address, rank=comm.Get_rank(), world_size=comm.Get_size())
    return torch, dist


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--min-bytes", default="4K")
    parser.add_argument("--max-bytes", default="256M")
    parser.add_argument("--budget", type=float, default=0.4, help="seconds of timing per point (approx.)")
    parser.add_argument("--min-iters", type=int, default=7)
    parser.add_argument("--only", help="comma-separated implementations to run (default: all)")
    parser.add_argument("--no-gloo", action="store_true")
    parser.add_argument("--plot", help="write busbw vs size to this PNG")
    parser.add_argument("--cluster", metavar="HOSTSxRANKS", type=cluster_spec,
                        help="build the namespace test cluster (root) and run there, e.g. 2x2")
    parser.add_argument("--cupy", action="store_true",
                        help="CuPy device buffers (ringreduce staged or CUDA-aware per MTRAIN_CUDA_AWARE; "
                             "the memcpy row is a device-to-device copy)")
    args = parser.parse_args()
    if args.cupy:
        main_cupy(args)
        return

    if args.cluster:
        sys.exit(run_on_cluster(args.cluster, [a for a in sys.argv[1:]]))
    rr.init()
    comm = MPI.COMM_WORLD
    n, me = comm.Get_size(), comm.Get_rank()
    torch, dist = (None, None) if args.no_gloo else gloo_group(comm)
    bus_factor = 2 * (n - 1) / n if n > 1 else 1.0
    local = comm.Split_type(MPI.COMM_TYPE_SHARED, key=me)
    cross = comm.Split(color=local.Get_rank(), key=me)
    hosts = comm.allreduce(1 if local.Get_rank() == 0 else 0)
    executors = {}
    # rr-shm (or rr-hierarchical on several hosts) is what auto runs (the shared segment);
    # the -cma and -segment variants force one transport.
    for algorithm, transport in (("ring", None), ("shm", "auto"), ("shm", "cma"), ("shm", "segment")):
        executor = Executor(comm, ring.DEFAULT_SEGMENT_BYTES, ring.DEFAULT_SMALL_BYTES, local, cross,
                            algorithm=algorithm, shm_transport=transport)
        name = f"rr-{executor.allreduce_path}"
        if executor.shared is not None and transport != "auto":
            name += f"-{executor.shared.transport}"
        executors.setdefault(name, executor)
    backend = NumpyBackend()

    sizes = []
    size = parse_size(args.min_bytes)
    while size <= parse_size(args.max_bytes):
        sizes.append(size)
        size *= 2

    rows, traffic = [], []
    for nbytes in sizes:
        count = nbytes // 4
        # In-place sums double the buffer every call; starting near 2**-100 keeps
        # hundreds of calls finite and normal (no inf, no denormal slow paths).
        data = ((np.arange(count, dtype=np.float32) % 1000 + 1) * (me + 1) * np.float32(2.0 ** -100))
        out = np.empty_like(data)
        buffers = {name: data.copy() for name in executors}
        ring_buf = data.copy()
        copy_dst = np.empty_like(data)
        impls: "dict[str, Callable[[], None]]" = {
            # Named, as gradients are in training: the engine's response cache then
            # skips the coordinator round trip that an unnamed op pays every time.
            "ringreduce": lambda: rr.allreduce_(ring_buf, op=rr.Sum, name="bench"),
        }
        for name, executor in executors.items():
            impls[name] = (lambda e=executor, b=buffers[name]: e.allreduce_flat([b], rr.Sum, backend))
        impls["MPI_Allreduce"] = lambda: comm.Allreduce(data, out, op=MPI.SUM)
        impls["memcpy"] = lambda: np.copyto(copy_dst, data)
        if torch is not None:
            tensor = torch.from_numpy(data.copy())
            impls["gloo"] = lambda: dist.all_reduce(tensor)
        if args.only:
            impls = {k: v for k, v in impls.items() if k in args.only.split(",")}
        seconds = timed_side_by_side(comm, impls, nbytes, args.budget, args.min_iters)
        bound = nbytes / seconds["memcpy"] / 1e9 if "memcpy" in seconds else None
        for name in impls:
            algbw = nbytes / seconds[name] / 1e9
            busbw = algbw * (1.0 if name == "memcpy" else bus_factor)
            rows.append((name, nbytes, seconds[name], algbw, busbw, busbw / bound if bound else None))
        if hosts > 1:
            traffic += host_traffic(comm, local, impls, nbytes, n, hosts)

    if me == 0:
        print_table([f"all-reduce, float32, {n} ranks on {hosts} host(s), "
                     f"{mpi_library()} via mpi4py",
                     "busbw = algbw * 2(n-1)/n; memcpy row: every rank copies its buffer at once (busbw = its rate); "
                     "bound = busbw / memcpy's busbw"],
                    rows)
        if traffic:
            print_traffic(traffic)
        if args.plot:
            write_plot(rows, args.plot, n)
    if dist is not None:
        dist.destroy_process_group()


def interface_bytes_sent() -> int:
    """Bytes sent by this network namespace's interfaces other than loopback (/proc/net/dev)."""
    total = 0
    with open("/proc/net/dev") as handle:
        for line in handle.readlines()[2:]:
            name, _, fields = line.partition(":")
            if name.strip() != "lo":
                total += int(fields.split()[8])
    return total


def host_traffic(comm: MPI.Comm, local: MPI.Comm, impls: "dict[str, Callable[[], None]]", nbytes: int,
                 n: int, hosts: int, calls: int = 5) -> list:
    """(impl, bytes, sent per host per call, expected per host) for each all-reduce implementation."""
    rows = []
    per_host = n // hosts
    expected = {
        # Flat ring, ranks in host order: one rank per host sends to the next host, 2(n-1)/n of the buffer.
        "rr-ring": 2 * (n - 1) / n * nbytes,
        # Hierarchical: each local rank rings its n/L chunk over the H hosts: 2(H-1)/H * n per host.
        "rr-hierarchical": 2 * (hosts - 1) / hosts * nbytes,
    }
    expected["rr-hierarchical-segment"] = expected["rr-hierarchical-cma"] = expected["rr-hierarchical"]
    expected["ringreduce"] = expected["rr-hierarchical" if per_host > 1 and n % hosts == 0 else "rr-ring"]
    for name, fn in impls.items():
        if name == "memcpy":
            continue
        comm.Barrier()
        before = interface_bytes_sent() if local.Get_rank() == 0 else 0
        for _ in range(calls):
            fn()
        comm.Barrier()
        sent = (interface_bytes_sent() - before) / calls if local.Get_rank() == 0 else 0.0
        per_host_sent = comm.allreduce(sent) / hosts
        rows.append((name, nbytes, per_host_sent, expected.get(name)))
    return rows


def print_traffic(rows: list) -> None:
    print("# bytes each host sent over its network interface per all-reduce (mean over hosts; "
          "includes TCP/IP headers), and what the algorithm must send")
    print(f"{'size':>10} {'impl':>16} {'sent/host':>14} {'x buffer':>9} {'algorithm':>14}")
    for name, nbytes, sent, expected in rows:
        label = f"{nbytes // MiB}M" if nbytes >= MiB else f"{nbytes // KiB}K"
        want = f"{expected / nbytes:13.2f}x" if expected else f"{'-':>14}"
        print(f"{label:>10} {name:>16} {sent:14.0f} {sent / nbytes:8.2f}x {want}")
    sys.stdout.flush()


def run_on_cluster(spec: str, argv: "list[str]", script: str = __file__) -> int:
    """Build the namespace cluster (HOSTSxRANKS) and run ``script`` (this benchmark by default)
    on it through mtrain run, with ``argv`` less its --cluster."""
    cluster_tools = netcluster()
    SUBNET, prerequisites_missing, running_cluster = (
        cluster_tools.SUBNET, cluster_tools.prerequisites_missing, cluster_tools.running_cluster)
    host_count, ranks = (int(x) for x in spec.lower().split("x"))
    missing = prerequisites_missing()
    if missing:
        print(f"benchmarks/{os.path.basename(script)}: cannot build the test cluster: {missing}", file=sys.stderr)
        return 2
    passed = []
    skip = False
    for arg in argv:
        if skip:
            skip = False
            continue
        if arg == "--cluster":
            skip = True
            continue
        if arg.startswith("--cluster="):
            continue
        passed.append(arg)
    with running_cluster(host_count) as cluster:
        env = cluster.env()
        env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
        spec_hosts = ",".join(f"{h.name}:{ranks}" for h in cluster.hosts)
        # All "hosts" share this machine's cores: ranks must yield while they wait (busy-polling
        # ranks on an oversubscribed machine starve the ones doing the work).
        cmd = [sys.executable, "-m", "mtrain.launcher.cli.main", "run", "-np", str(host_count * ranks), "-H", spec_hosts,
               "--network-interface", SUBNET, "-x", "OMPI_MCA_mpi_yield_when_idle=1",
               sys.executable, os.path.abspath(script), *passed]
        return subprocess.run(cmd, env=env, cwd=ROOT).returncode


def main_cupy(args: argparse.Namespace) -> None:
    """The same table for CuPy buffers: ringreduce on the device vs a device-to-device copy."""
    import cupy

    from mtrain.ringreduce.transport import cuda
    rr.init()  # binds this rank to its GPU
    comm = MPI.COMM_WORLD
    n, me = comm.Get_size(), comm.Get_rank()
    bus_factor = 2 * (n - 1) / n if n > 1 else 1.0
    stream = cupy.cuda.Stream.null  # the stream the runtime queues its device work on (mtrain.ringreduce.transport.cuda)
    mode = "cuda-aware" if cuda.cuda_aware() else "staged"
    rows = []
    size = parse_size(args.min_bytes)
    while size <= parse_size(args.max_bytes):
        count = size // 4
        data = (cupy.arange(count, dtype=cupy.float32) % 1000 + 1) * (me + 1) * cupy.float32(2.0 ** -100)
        ring_buf, copy_dst = data.copy(), cupy.empty_like(data)

        def ring_once() -> None:
            rr.allreduce_(ring_buf, op=rr.Sum)
            stream.synchronize()  # the ring queues its last copies: time until they land

        def copy_once() -> None:
            cupy.copyto(copy_dst, data)
            stream.synchronize()

        impls = {f"rr-{mode}": ring_once, "d2d-copy": copy_once}
        if args.only:
            impls = {k: v for k, v in impls.items() if any(k.startswith(o) for o in args.only.split(","))}
        for name, fn in impls.items():
            rows.append(measured_row(comm, name, fn, size, args, bus_factor, copy=name == "d2d-copy"))
        del data, ring_buf, copy_dst
        size *= 2
    if me == 0:
        print_table([f"all-reduce, CuPy float32 on GPU {cupy.cuda.Device().id}, {n} ranks, transfers {mode}",
                     "busbw = algbw * 2(n-1)/n; d2d-copy row: every rank copies its buffer on its GPU at once"],
                    rows)


def measured_row(comm: MPI.Comm, name: str, fn: Callable[[], None], nbytes: int,
                 args: argparse.Namespace, bus_factor: float, copy: bool) -> tuple:
    """(name, bytes, seconds, algbw, busbw); a copy row's busbw is its plain rate."""
    seconds = timed(comm, fn, nbytes, args.budget, args.min_iters)
    algbw = nbytes / seconds / 1e9
    return name, nbytes, seconds, algbw, algbw * (1.0 if copy else bus_factor)


def print_table(notes: "list[str]", rows: list) -> None:
    for note in notes:
        print(f"# {note}")
    print(f"{'size':>10} {'impl':>16} {'time(us)':>12} {'algbw(GB/s)':>12} {'busbw(GB/s)':>12} {'bound':>7}")
    for name, nbytes, seconds, algbw, busbw, *rest in rows:
        label = f"{nbytes // MiB}M" if nbytes >= MiB else f"{nbytes // KiB}K"
        share = f"{rest[0] * 100:6.0f}%" if rest and rest[0] is not None else f"{'':>7}"
        print(f"{label:>10} {name:>16} {seconds * 1e6:12.1f} {algbw:12.2f} {busbw:12.2f} {share}")
    sys.stdout.flush()


def write_plot(rows: list, path: str, n: int) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("# matplotlib is not installed: no plot written (pip install matplotlib)")
        return
    fig, ax = plt.subplots(figsize=(8, 5))
    for name in dict.fromkeys(r[0] for r in rows):
        points = [(r[1], r[4]) for r in rows if r[0] == name]
        ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=name)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")  # memcpy in cache is 10x the rest at small sizes
    ax.set_xlabel("buffer size (bytes, float32)")
    ax.set_ylabel("bus bandwidth (GB/s)")
    ax.set_title(f"all-reduce busbw, {n} ranks")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"# plot written to {path}")


if __name__ == "__main__":
    main()
