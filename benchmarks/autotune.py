"""Time per step with the engine's defaults vs autotuned (after tuning ends), and from a bad start.

Run as ``python benchmarks/autotune.py`` (it starts its own jobs with ``mtrain run -np 2``:
autotune is set up at ``init()``, so each variant is a job of its own). Workloads, as in
benchmarks/fusion.py: the 161 gradient tensors of ResNet-50 (25.6 M float32 parameters), and
1,000 tensors of 1 KiB (the per-op overhead). Each step submits every tensor
(``allreduce_async``, Average, named as a training step names them), then waits for each.
Variants, each a job:

* ``default``: the engine's defaults;
* ``autotune``: ``--autotune`` with a short schedule (``--schedule``), timed once tuning has ended;
* ``bad start``: MTRAIN_FUSION_THRESHOLD_BYTES=1024 (fusion all but off, on purpose);
* ``bad start + autotune``: the same, tuned (the variable is where tuning starts, not a fixed value).

Untuned jobs take as many warm-up steps as a tuned one took to tune, at most --warmup, so that
every job is timed after its pages are in. Time per step is the slowest rank's mean over
--steps steps. Jobs run one after another: the VM's bandwidth drifts, so compare rows of one run.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

MiB = 1 << 20
RESULT = "autotune-benchmark-result "


def shapes_of(workload: str) -> "list[tuple[int, ...]]":
    if workload == "resnet50":
        from fusion import resnet50_gradient_shapes  # a sibling benchmark (repo_helpers.py says why so)
        return resnet50_gradient_shapes()
    return [(256,)] * 1000  # 1 KiB of float32 each


def worker(workload: str, steps: int, warmup: int) -> None:
    import numpy as np

    import mtrain.ringreduce as rr
    from mtrain.ringreduce import runtime
    rr.init()
    engine = runtime._rt().engine
    rng = np.random.default_rng(rr.rank())
    arrays = [rng.standard_normal(shape).astype(np.float32) for shape in shapes_of(workload)]
    names = [f"grad.{i}" for i in range(len(arrays))]

    def step() -> None:
        handles = [rr.allreduce_async(a, op=rr.Average, name=n) for a, n in zip(arrays, names)]
        for handle in handles:
            rr.synchronize(handle)

    tuning = engine._tuner is not None
    taken = 0
    while True:  # tune (or warm up), deciding together every 10 steps so every rank stops alike
        for _ in range(10):
            step()
        taken += 10
        done = engine._tuner is None if tuning else taken >= warmup
        if rr.allreduce(np.array([int(done)]), op=rr.Min, name="bench.done")[0]:
            break
    begin = time.perf_counter()
    for _ in range(steps):
        step()
    mine = (time.perf_counter() - begin) / steps
    slowest = float(rr.allreduce(np.array([mine]), op=rr.Max, name="bench.time")[0])
    if rr.rank() == 0:
        c = engine.config
        ex = engine.executor
        chosen = (f"fusion {c.fusion_threshold_bytes / MiB:.3g} MiB, cycle {c.cycle_time_s * 1000:.3g} ms, "
                  f"segment {ex.segment_bytes >> 10} KiB, "
                  f"{'ring' if ex.shm_min_bytes == float('inf') else ('shm' if ex.shm_min_bytes == 0 else 'auto')}"
                  + (f"/{ex.shared.transport}, stripe {ex.shared.stripe_bytes >> 10} KiB" if ex.shared else "")
                  + f", cache {'on' if engine._cache.capacity else 'off'}")
        print(RESULT + json.dumps({"seconds": slowest, "warmup": taken, "chosen": chosen}), flush=True)


def job(workload: str, args: argparse.Namespace, autotune: bool, bad: bool, warmup: int) -> dict:
    env = dict(os.environ)
    env.pop("MTRAIN_FUSION_THRESHOLD_BYTES", None)
    if bad:
        env["MTRAIN_FUSION_THRESHOLD_BYTES"] = "1024"
    command = [sys.executable, "-m", "mtrain.launcher.cli", "run", "-np", str(args.np)]
    if autotune:
        warm, per, most = args.schedule
        command += ["--autotune", "--autotune-warmup-samples", str(warm), "--autotune-steps-per-sample", str(per),
                    "--autotune-bayes-opt-max-samples", str(most)]
    command += [sys.executable, os.path.abspath(__file__), "--worker", workload, "--steps", str(args.steps),
                "--warmup", str(warmup)]
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=600)
    for line in done.stdout.splitlines():
        if RESULT in line:
            return json.loads(line.split(RESULT, 1)[1])
    raise SystemExit(f"job failed ({done.returncode}): {done.stderr[-2000:]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--np", type=int, default=2)
    parser.add_argument("--steps", type=int, default=0, help="timed steps (default: 30 for resnet50, 200 for 1k)")
    parser.add_argument("--warmup", type=int, default=300, help="most warm-up steps of an untuned job")
    parser.add_argument("--schedule", type=int, nargs=3, default=(1, 2, 8),
                        metavar=("WARMUP", "STEPS", "BAYES"), help="autotune's warm-up samples, steps per "
                        "sample and Bayesian samples (default: 1 2 8)")
    parser.add_argument("--workloads", nargs="+", default=["resnet50", "1k"], choices=["resnet50", "1k"])
    parser.add_argument("--worker", choices=["resnet50", "1k"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker, args.steps, args.warmup)
        return
    print(f"{'workload':<10} {'variant':<22} {'ms/step':>9} {'vs default':>10} {'steps before':>12}  settings after")
    for workload in args.workloads:
        sub = argparse.Namespace(**vars(args))
        sub.steps = args.steps or (30 if workload == "resnet50" else 200)
        tuned = job(workload, sub, autotune=True, bad=False, warmup=0)
        cap = min(args.warmup, tuned["warmup"])
        rows = [("default", job(workload, sub, False, False, cap)), ("autotune", tuned),
                ("bad start", job(workload, sub, False, True, cap)),
                ("bad start + autotune", job(workload, sub, True, True, 0))]
        base = rows[0][1]["seconds"]
        for name, row in rows:
            print(f"{workload:<10} {name:<22} {row['seconds'] * 1e3:9.2f} {row['seconds'] / base:10.2f} "
                  f"{row['warmup']:12d}  {row['chosen']}", flush=True)


if __name__ == "__main__":
    main()
