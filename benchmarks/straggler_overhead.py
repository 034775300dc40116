"""What the straggler report and the flight recorder cost: mlp_step.py and fusion.py with both
on (as users get them) and both off.

Run as ``python benchmarks/straggler_overhead.py [--rounds 5] [--np 2]``. Each round runs both
benchmarks under ``mtrain run -np N`` twice, once as users get it (every rank's engine times each
step and sends its samples to mtrain run, and keeps its flight recorder) and once with
``--no-straggler-report -x MTRAIN_FLIGHT_RECORDER_SIZE=0`` (nothing timed, nothing recorded), in
alternating order so a drifting machine favours neither. The compared figure is each
benchmark's own ratio to its in-run peer (mtrain's step over the hand-written mpi4py step in
mlp_step.py, the fused all-reduce over one MPI_Allreduce per tensor in fusion.py), which cancels
most of the machine's drift between runs; the table gives the median over rounds of that ratio,
on and off, and on/off - 1 as the overhead.
"""
from __future__ import annotations

import argparse
import re
import statistics
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
# (benchmark, its arguments, row label, the column holding the ratio to its peer)
ROWS = (
    ("mlp_step.py", (), "mtrain.torch DistributedOptimizer", "vs hand"),
    ("fusion.py", ("--no-gloo",), "resnet50  ringreduce fused (8 MiB), ring, Average", "vs MPI"),
    ("fusion.py", ("--no-gloo",), "1000x1KiB  ringreduce fused (8 MiB), ring, Average", "vs MPI"),
)


def run(script: str, args: "tuple[str, ...]", np: int, budget: float, measured: bool) -> str:
    argv = [sys.executable, "-m", "mtrain.launcher.cli", "run", "-np", str(np)]
    if not measured:
        argv += ["--no-straggler-report", "-x", "MTRAIN_FLIGHT_RECORDER_SIZE=0"]
    argv += [sys.executable, str(HERE / script), "--budget", str(budget), *args]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=900)
    if done.returncode != 0:
        raise SystemExit(f"{script} failed:\n{done.stderr[-3000:]}")
    return done.stdout


def ratio(output: str, label: str) -> float:
    """The last column of the row ``label`` (the ratio to the benchmark's peer)."""
    words = label.split()
    pattern = re.compile(r"^\[0\]<stdout>:\s*" + r"\s+".join(map(re.escape, words)) + r"\s+(.*)$")
    for line in output.splitlines():
        match = pattern.match(line)
        if match:
            return float(match.group(1).split()[-1])
    raise SystemExit(f"no row {label!r} in:\n{output[-3000:]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--np", type=int, default=2)
    parser.add_argument("--budget", type=float, default=1.0, help="each benchmark's --budget")
    args = parser.parse_args()
    scripts = {(script, extra) for script, extra, _, _ in ROWS}
    ratios: "dict[tuple[str, bool], list[float]]" = {}
    for round_ in range(args.rounds):
        for measured in ((True, False) if round_ % 2 == 0 else (False, True)):
            for script, extra in sorted(scripts):
                output = run(script, extra, args.np, args.budget, measured)
                for row_script, _, label, _ in ROWS:
                    if row_script == script:
                        ratios.setdefault((label, measured), []).append(ratio(output, label))
    print(f"# straggler report + flight recorder overhead, {args.np} ranks, {args.rounds} rounds (median of each row's ratio "
          "to its in-run peer)")
    print(f"{'benchmark row':<56} {'peer':>8} {'on':>7} {'off':>7} {'overhead':>9}")
    for script, _, label, peer in ROWS:
        on = statistics.median(ratios[(label, True)])
        off = statistics.median(ratios[(label, False)])
        print(f"{script + ': ' + label:<56} {peer:>8} {on:7.3f} {off:7.3f} {on / off - 1:+9.1%}")


if __name__ == "__main__":
    main()
