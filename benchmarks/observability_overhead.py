"""What the straggler report's step timing and the flight recorder cost a training step: the
same steps with them on and off, alternating.

Run as ``mpirun -np 2 python benchmarks/observability_overhead.py [--what both|steps|recorder]``
(or ``mtrain run -np 2 …``). One process, one runtime: every step swaps the global engine's
step meter (``Engine.steps``) and/or its flight recorder (``Engine.flight_recorder``), both read by the
engine once per batch, in or out, in lockstep on every rank and in the order on-off-off-on, so
a machine whose speed drifts favours neither side. (Whole runs with the two on and off, taking
turns, differ by more than 2% from run to run on a 2-core host: only steps within one run can
show a cost that small.) The workloads are those of
benchmarks/mlp_step.py (mtrain.torch's DistributedOptimizer on a 3-layer MLP) and of
benchmarks/fusion.py (1000 tensors of 1 KiB, one op each and grouped). The last column is
the median over step pairs of on/off.
"""
from __future__ import annotations

import argparse
import statistics
import time
from typing import Callable

import numpy as np


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300, help="step pairs per workload")
    parser.add_argument("--what", choices=("both", "steps", "recorder"), default="both",
                        help="what is swapped in and out (default: both)")
    args = parser.parse_args()
    import torch

    import mtrain.ringreduce as rr
    import mtrain.torch as hvd
    from mtrain.ringreduce import runtime

    torch.set_num_threads(1)
    hvd.init()
    engine = runtime.current().engine
    recorder, meter = engine.flight_recorder, engine.steps
    if recorder is None and args.what != "steps":
        raise SystemExit("the flight recorder is off (MTRAIN_FLIGHT_RECORDER_SIZE=0): unset it to compare")
    if meter is None and args.what != "recorder":
        raise SystemExit("step timing is off (MTRAIN_STRAGGLER_REPORT_DISABLE=1): unset it to compare")
    swap_recorder, swap_meter = args.what in ("both", "recorder"), args.what in ("both", "steps")
    me = hvd.rank()

    def use(on: bool) -> None:
        if swap_recorder:
            engine.flight_recorder = recorder if on else None
        if swap_meter:
            engine.steps = meter if on else None

    def compare(name: str, step: Callable[[], None], pairs: int) -> None:
        for _ in range(20):
            step()
        on: "list[float]" = []
        off: "list[float]" = []
        for i in range(2 * pairs):
            turn = i % 4 in (0, 3)  # on off off on: neither side is always the first of its pair
            use(turn)
            start = time.perf_counter()
            step()
            (on if turn else off).append(time.perf_counter() - start)
        use(True)
        ratio = statistics.median(a / b for a, b in zip(on, off))
        if me == 0:
            print(f"{name:46s} {statistics.median(on) * 1e6:10.1f} {statistics.median(off) * 1e6:10.1f} "
                  f"{ratio:8.4f}", flush=True)

    model = torch.nn.Sequential(torch.nn.Linear(128, 256), torch.nn.ReLU(), torch.nn.Linear(256, 256),
                                torch.nn.ReLU(), torch.nn.Linear(256, 10))
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                                         named_parameters=model.named_parameters())
    x, y = torch.randn(32, 128), torch.randint(0, 10, (32,))

    def mlp() -> None:
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()

    tiny = [np.full(256, me + 1.0, np.float32) for _ in range(1000)]

    def per_tensor() -> None:
        handles = [rr.allreduce_async_(t, name=f"t{i}", op=rr.Average) for i, t in enumerate(tiny)]
        for handle in handles:
            rr.synchronize(handle)

    def grouped() -> None:
        rr.grouped_allreduce_(tiny, name="tiny", op=rr.Average)

    if me == 0:
        swapped = {"both": "step timing and the flight recorder", "steps": "step timing",
                   "recorder": "the flight recorder"}[args.what]
        print(f"# {hvd.size()} ranks; median us/step with {swapped} on and off, alternating steps")
        print(f"{'workload':46s} {'on':>10s} {'off':>10s} {'on/off':>8s}")
    compare("mlp_step: DistributedOptimizer step", mlp, args.steps)
    compare("fusion: 1000x1KiB, one allreduce_async_ each", per_tensor, max(1, args.steps // 3))
    compare("fusion: 1000x1KiB, one grouped all-reduce", grouped, max(1, args.steps // 3))
    hvd.shutdown()


if __name__ == "__main__":
    main()
