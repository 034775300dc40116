"""Time per step at a job's starting settings vs the settings autotune chose for it, in the same job.

Run as ``python benchmarks/autotune.py`` (it starts its own jobs with ``mtrain run -np 2 --autotune``:
autotune is set up at ``init()``, so each starting point is a job of its own). Workloads, as in
benchmarks/fusion.py: the 161 gradient tensors of ResNet-50 (25.6 M float32 parameters), and
1,000 tensors of 1 KiB (the per-op overhead). Each step submits every tensor
(``allreduce_async``, Average, named as a training step names them), then waits for each.
Starting points, each a job:

* ``default``: the engine's defaults;
* ``bad start``: MTRAIN_FUSION_THRESHOLD_BYTES=1024 (fusion all but off, on purpose; with
  autotune the variable is where tuning starts, not a fixed value).

Each job tunes with a short schedule (``--schedule``). Once tuning has ended it times the
starting settings and the tuned ones side by side, taking turns one step each, so that the
VM's drifting bandwidth favours neither (jobs run one after another, and compare only within
themselves). The settings are switched between steps, when no op is in flight, on every rank
before it submits the next step (the engine's private ``_apply``; the response cache stays as
tuned, since only the engine thread may turn it). Time per step: the median over rounds of the
slowest rank's step.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

MiB = 1 << 20
RESULT = "autotune-benchmark-result "


def shapes_of(workload: str) -> "list[tuple[int, ...]]":
    if workload == "resnet50":
        from fusion import resnet50_gradient_shapes  # a sibling benchmark (repo_helpers.py says why so)
        return resnet50_gradient_shapes()
    return [(256,)] * 1000  # 1 KiB of float32 each


def worker(workload: str, budget: float) -> None:
    import numpy as np
    from mpi4py import MPI

    import mtrain.ringreduce as rr
    from mtrain.ringreduce import runtime
    from allreduce import timed_side_by_side  # a sibling benchmark (repo_helpers.py says why so)
    rr.init()
    engine = runtime.current().engine
    tuner = engine.tuner
    if tuner is None:
        raise SystemExit("autotune is off in this job; run it with --autotune")
    start = tuner.current
    rng = np.random.default_rng(rr.rank())
    arrays = [rng.standard_normal(shape).astype(np.float32) for shape in shapes_of(workload)]
    names = [f"grad.{i}" for i in range(len(arrays))]

    def step() -> None:
        handles = [rr.allreduce_async(a, op=rr.Average, name=n) for a, n in zip(arrays, names)]
        for handle in handles:
            rr.synchronize(handle)

    taken = 0
    while True:  # tune, deciding together every 10 steps so every rank stops alike
        for _ in range(10):
            step()
        taken += 10
        if rr.allreduce(np.array([int(engine.tuner is None)]), op=rr.Min, name="bench.done")[0]:
            break
    tuned = tuner.current
    cache = tuned.cache_enabled  # as the tuner left it (only the engine thread may turn the cache)

    def at(knobs):
        knobs = knobs._replace(cache_enabled=cache)

        def run() -> None:
            engine.apply(knobs)
            step()
        return run

    nbytes = sum(a.nbytes for a in arrays)
    times = timed_side_by_side(MPI.COMM_WORLD, {"start": at(start), "tuned": at(tuned)}, nbytes, budget, 10)
    if rr.rank() == 0:
        print(RESULT + json.dumps({"start": times["start"], "tuned": times["tuned"], "steps": taken,
                                   "settings": describe(tuned)}), flush=True)


def describe(k) -> str:
    return (f"fusion {k.fusion_threshold_bytes / MiB:.3g} MiB, cycle {k.cycle_time_ms:.3g} ms, segment "
            f"{k.segment_bytes >> 10} KiB, {k.algorithm}" + (f"/{k.transport}" if k.transport else "")
            + (f", stripe {k.stripe_bytes >> 10} KiB" if k.stripe_bytes else "")
            + f", cache {'on' if k.cache_enabled else 'off'}")


def job(workload: str, args: argparse.Namespace, bad: bool) -> dict:
    env = dict(os.environ)
    env.pop("MTRAIN_FUSION_THRESHOLD_BYTES", None)
    if bad:
        env["MTRAIN_FUSION_THRESHOLD_BYTES"] = "1024"
    warm, per, most = args.schedule
    command = [sys.executable, "-m", "mtrain.launcher.cli.main", "run", "-np", str(args.np), "--autotune",
               "--autotune-warmup-samples", str(warm), "--autotune-steps-per-sample", str(per),
               "--autotune-bayes-opt-max-samples", str(most),
               sys.executable, os.path.abspath(__file__), "--worker", workload, "--budget", str(args.budget)]
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=600)
    for line in done.stdout.splitlines():
        if RESULT in line:
            return json.loads(line.split(RESULT, 1)[1])
    raise SystemExit(f"job failed ({done.returncode}): {done.stderr[-2000:]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--np", type=int, default=2)
    parser.add_argument("--budget", type=float, default=4.0, help="seconds of side-by-side timing per job (approx.)")
    parser.add_argument("--schedule", type=int, nargs=3, default=(1, 5, 10),
                        metavar=("WARMUP", "STEPS", "BAYES"), help="autotune's warm-up samples, steps per "
                        "sample and Bayesian samples (default: 1 5 10)")
    parser.add_argument("--workloads", nargs="+", default=["resnet50", "1k"], choices=["resnet50", "1k"])
    parser.add_argument("--worker", choices=["resnet50", "1k"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker, args.budget)
        return
    print(f"{'workload':<9} {'start':<10} {'ms/step at start':>16} {'ms/step tuned':>13} {'tuned/start':>11} "
          f"{'tuning steps':>12}  tuned settings")
    for workload in args.workloads:
        for name, bad in (("default", False), ("bad start", True)):
            row = job(workload, args, bad)
            print(f"{workload:<9} {name:<10} {row['start'] * 1e3:16.2f} {row['tuned'] * 1e3:13.2f} "
                  f"{row['tuned'] / row['start']:11.2f} {row['steps']:12d}  {row['settings']}", flush=True)


if __name__ == "__main__":
    main()
