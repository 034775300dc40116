"""Per-step gradient all-reduce time: the engine's fusion vs one collective per tensor.

Run as ``mpirun -np 2 python benchmarks/fusion.py`` (or ``mtrain run -np 2 …``).
Workload 1: the 161 gradient tensors of ResNet-50 (25.6 M float32 parameters),
shapes built from the architecture. Workload 2: 1,000 tensors of 1 KiB (the
per-op overhead). Every variant moves the same bytes in the same run, and the
variants take turns (one step each per round), so a drifting machine favours none:

* ringreduce, engine with fusion (defaults; Average as training uses, and Sum
  to match the peers, which only sum), under each all-reduce path the job can
  take: ``ring`` (point-to-point) and ``shm`` (through shared memory, where the
  ranks share a host; MTRAIN_ALLREDUCE_ALGORITHM: auto's transport, the shared
  segment, and ``shm-cma``, the peers' buffers read by cross-memory attach), and
  with fusion off,
* Horovod-style user code through mtrain.torch: ``allreduce_async_`` on every
  tensor (names formatted once, as ``DistributedOptimizer`` does), then
  ``synchronize`` each,
* mpi4py ``Allreduce`` in place per tensor (and, to average, a division after each),
* torch.distributed gloo ``all_reduce`` per tensor, and in DDP-style 25 MiB buckets.

Each step submits every tensor, then waits for each, the way a training step does.
The last column is a variant's time over the same workload's MPI_Allreduce per
tensor (Sum). ``--sweep`` also times the engine over fusion thresholds (how the
default was chosen). ``--adasum`` also times the engine with op=Adasum (adasum.py: fused,
per-tensor dot products; vector halving over point-to-point messages) beside its Sum.
"""
from __future__ import annotations

import argparse
import dataclasses

import numpy as np
from mpi4py import MPI

import mtrain.ringreduce as rr
from mtrain.ringreduce import runtime
from mtrain.ringreduce.transport import shm
from allreduce import gloo_group, timed_side_by_side  # a sibling benchmark (repo_helpers.py says why so)

MiB = 1 << 20


def resnet50_gradient_shapes() -> "list[tuple[int, ...]]":
    """Parameter shapes of ResNet-50 (torchvision layout), in definition order."""
    shapes: "list[tuple[int, ...]]" = [(64, 3, 7, 7), (64,), (64,)]
    inplanes = 64
    for width, blocks in ((64, 3), (128, 4), (256, 6), (512, 3)):
        for block in range(blocks):
            shapes += [(width, inplanes, 1, 1), (width,), (width,),
                       (width, width, 3, 3), (width,), (width,),
                       (width * 4, width, 1, 1), (width * 4,), (width * 4,)]
            if block == 0:
                shapes += [(width * 4, inplanes, 1, 1), (width * 4,), (width * 4,)]
            inplanes = width * 4
    return shapes + [(1000, 2048), (1000,)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget", type=float, default=3.0, help="seconds of timing per variant (approx.)")
    parser.add_argument("--sweep", action="store_true", help="also sweep the fusion threshold")
    parser.add_argument("--no-gloo", action="store_true")
    parser.add_argument("--adasum", action="store_true", help="also time op=Adasum (power-of-two ranks)")
    args = parser.parse_args()
    rr.init()
    comm = MPI.COMM_WORLD
    me, n = comm.Get_rank(), comm.Get_size()
    torch, dist = (None, None) if args.no_gloo else gloo_group(comm)
    hvd = None
    if torch is not None:
        import mtrain.torch as hvd  # the same runtime: init() above already started it
    engine = runtime.current().sets[0].engine
    defaults = engine.config
    executor = engine.executor
    # The paths this job can take: the ring always; shared memory when the ranks share a host,
    # through the segment (auto: shm) and by cross-memory attach where the kernel allows it.
    shared = getattr(executor, "shared", None)
    paths = {"ring": None} if shared is None else {"ring": None, "shm": shared}
    if shared is not None and shared.cross is None:
        # Its own communicators: the engine thread runs the all-reduce, on its own.
        world = comm.Dup()
        forced = shm.SharedMemoryAllreduce(world, world.Split_type(MPI.COMM_TYPE_SHARED, key=me), None,
                                           executor.segment_bytes, executor.small_bytes, transport="cma")
        if forced.cma and shared.transport != "cma":
            paths["shm-cma"] = forced
        else:
            forced.close()

    shapes = resnet50_gradient_shapes()
    grads = [np.random.default_rng(me * 1000 + i).standard_normal(s).astype(np.float32) * 1e-3
             for i, s in enumerate(shapes)]
    total = sum(g.nbytes for g in grads)
    tiny = [np.full(256, me + 1.0, np.float32) for _ in range(1000)]  # 1 KiB each
    results: "list[tuple[str, str, float]]" = []
    # The summing variants get zeros of the same shapes: repeated sums of real values would
    # double them every step up to inf (and NumPy's overflow warnings cost time); the
    # time of an add does not depend on the values otherwise (zeros are not denormal).
    zeros = {"r": [np.zeros_like(g) for g in grads], "t": [np.zeros_like(t) for t in tiny]}

    def engine_step(arrays, prefix, op=rr.Average, path="ring", **changes):
        # Benchmark-only: each variant runs with its own fusion settings and all-reduce path
        # (every rank switches to the same ones before each of its steps, with nothing in flight).
        config = dataclasses.replace(defaults, **changes)
        names = [f"{prefix}{i}" for i in range(len(arrays))]  # formatted once, as a training loop would

        def run():
            engine.config = config
            if shared is not None:
                executor.shared = paths[path]
            handles = [rr.allreduce_async_(a, op=op, name=name) for a, name in zip(arrays, names)]
            for h in handles:
                rr.synchronize(h)
        return run

    def torch_step(tensors, prefix, path="ring"):
        names = [f"{prefix}{i}" for i in range(len(tensors))]

        def run():
            engine.config = defaults
            if shared is not None:
                executor.shared = paths[path]
            handles = [hvd.allreduce_async_(t, name=name) for t, name in zip(tensors, names)]
            for h in handles:
                hvd.synchronize(h)
        return run

    def mpi_step(arrays, average=False):
        def run():
            for a in arrays:
                comm.Allreduce(MPI.IN_PLACE, a, op=MPI.SUM)
                if average:  # what a plain mpi4py user adds to average gradients
                    np.divide(a, n, out=a)
        return run

    def measure(workload, variants, nbytes):
        medians = timed_side_by_side(comm, variants, nbytes, args.budget * len(variants), 5)
        results.extend((workload, label, seconds) for label, seconds in medians.items())

    fused = f"ringreduce fused ({defaults.fusion_threshold_bytes // MiB} MiB)"
    for workload, arrays, prefix in (("resnet50", grads, "r"), ("1000x1KiB", tiny, "t")):
        summed = zeros[prefix]
        variants = {}
        # Names: one set per op. One name under another op would (rightly) invalidate the
        # response cache entry of the other variant each step; variants with the same op share
        # their names (the same ops, run one variant at a time), which also keeps the job's
        # names within the response cache (negotiation.CACHE_CAPACITY), as a training job's are.
        for path in paths:
            variants[f"{fused}, {path}, Average"] = engine_step(arrays, prefix + "a", path=path)
            variants[f"{fused}, {path}, Sum"] = engine_step(summed, prefix + "s", rr.Sum, path=path)
        variants["ringreduce fusion off, ring, Average"] = engine_step(arrays, prefix + "a",
                                                                       fusion_threshold_bytes=0)
        if args.adasum:
            # Real values: after the first step every rank holds the same vectors, whose Adasum is
            # themselves, so they stay finite; the work does not depend on the values.
            variants[f"{fused}, Adasum"] = engine_step([a.copy() for a in arrays], prefix + "d", rr.Adasum)
        if hvd is not None:
            tensors = [torch.from_numpy(a.copy()) for a in arrays]
            for path in paths:
                variants[f"mtrain.torch allreduce_async_ per tensor, {path}"] = torch_step(tensors, prefix + "a", path)
        variants["MPI_Allreduce per tensor (Sum)"] = mpi_step(summed)
        variants["MPI_Allreduce per tensor, then divide (Average)"] = mpi_step(arrays, average=True)
        if torch is not None:
            tensors = [torch.from_numpy(a) for a in summed]
            variants["gloo per tensor (Sum)"] = lambda tensors=tensors: [dist.all_reduce(t) for t in tensors]
            variants["gloo 25 MiB buckets (Sum)"] = gloo_buckets(torch, dist, tensors, 25 * MiB)
        measure(workload, variants, sum(a.nbytes for a in arrays))
    if args.sweep:
        sweep = {f"sweep fuse {threshold} MiB, alone >= {inplace >> 10} KiB":
                 engine_step(grads, "ra", fusion_threshold_bytes=threshold * MiB,
                             inplace_min_bytes=inplace)
                 for threshold in (1, 2, 4, 8, 16, 32, 64) for inplace in (256 << 10, 1 << 20, 4 << 20)}
        measure("resnet50", sweep, total)
    engine.config = defaults
    if shared is not None:
        executor.shared = shared

    if me == 0:
        print(f"# gradient all-reduce per step, {n} ranks; resnet50 = {len(grads)} tensors, "
              f"{total / MiB:.1f} MiB float32; all-reduce paths: {', '.join(paths)}")
        print(f"{'workload':>10}  {'variant':<52} {'ms/step':>9} {'us/tensor':>10} {'vs MPI':>7}")
        mpi = {w: s for w, label, s in results if label == "MPI_Allreduce per tensor (Sum)"}
        for workload, label, seconds in results:
            count = len(grads) if workload == "resnet50" else len(tiny)
            print(f"{workload:>10}  {label:<52} {seconds * 1e3:9.2f} {seconds * 1e6 / count:10.1f} "
                  f"{seconds / mpi[workload]:7.2f}")
    if dist is not None:
        dist.destroy_process_group()
    rr.shutdown()


def gloo_buckets(torch, dist, tensors, bucket_bytes):
    """DDP-style: flatten gradients into ~bucket_bytes buckets, all-reduce each, copy back."""
    buckets, current, size = [], [], 0
    for t in reversed(tensors):  # DDP fills buckets in reverse parameter order
        current.append(t)
        size += t.numel() * t.element_size()
        if size >= bucket_bytes:
            buckets.append(current)
            current, size = [], 0
    if current:
        buckets.append(current)
    flats = [torch.empty(sum(t.numel() for t in b), dtype=b[0].dtype) for b in buckets]

    def run():
        for bucket, flat in zip(buckets, flats):
            torch.cat([t.reshape(-1) for t in bucket], out=flat)
            dist.all_reduce(flat)
            offset = 0
            for t in bucket:
                t.copy_(flat[offset:offset + t.numel()].view_as(t))
                offset += t.numel()
    return run


if __name__ == "__main__":
    main()
