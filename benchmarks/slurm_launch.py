"""Launch time inside a Slurm allocation: `mtrain run` (Slurm launcher) vs `srun` starting the
same program directly vs `mtrain run --launcher ssh`, at 2 nodes x 2 tasks.

Needs root: it builds the namespace test cluster and its real Slurm
(tests/cluster/netcluster.py, slurmcluster.py).  Each run submits one batch job with
`sbatch`; the job's script notes when it started, and each rank prints the time as the
first thing its program does.  The variants are interleaved, run after run, so machine
noise hits them alike.  Printed, as medians over the runs:

    sbatch -> script    from sbatch's start to the batch script's first line (Slurm's part)
    script -> ranks     from the script's first line until all 4 ranks have printed (the launcher's part)
    sbatch -> ranks     the two together

    mtrain (slurm)   mtrain run python first.py          (srun starts the MPI daemons; no SSH)
    srun --mpi=pmix  srun --mpi=pmix python first.py     (no launcher: Slurm starts the ranks)
    mtrain (ssh)     mtrain run --launcher ssh python first.py

    sudo .venv/bin/python benchmarks/slurm_launch.py [--repeat 7]
"""
from __future__ import annotations

import argparse
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from repo_helpers import slurmcluster

PYTHON = sys.executable
FIRST = "import socket, time; print('first', time.time(), socket.gethostname(), flush=True)\n"
VARIANTS = {
    "mtrain (slurm)": [PYTHON, "-m", "mtrain.launcher.cli.main", "run"],
    "srun --mpi=pmix": ["srun", "--mpi=pmix"],
    "mtrain (ssh)": [PYTHON, "-m", "mtrain.launcher.cli.main", "run", "--launcher", "ssh"],
}
RANKS = 4


def one_run(slurm, folder: Path, name: str, launcher: list[str], program: Path, number: int) -> "tuple[float, float]":
    """(sbatch -> script, script -> all ranks up) of one batch job, in seconds."""
    output = folder / f"out-{number}.txt"
    script = folder / f"job-{number}.sh"
    script.write_text("#!/bin/sh\n#SBATCH -N2 --ntasks-per-node=2 --time=5\n"
                      f"#SBATCH -o {output}\n"
                      f"{shlex.quote(PYTHON)} -c 'import time; print(\"script\", time.time(), flush=True)'\n"
                      f"{shlex.join(launcher + [PYTHON, str(program)])}\n")
    env = slurm.env()
    env["PATH"] = os.path.dirname(PYTHON) + os.pathsep + env["PATH"]
    submitted = time.time()
    done = subprocess.run(["sbatch", "--parsable", str(script)], env=env, capture_output=True, text=True, timeout=60)
    if done.returncode != 0:
        raise SystemExit(f"{name}: sbatch failed: {done.stderr}")
    job = done.stdout.split(";")[0].strip()
    deadline = time.monotonic() + 120
    while True:
        text = output.read_text() if output.exists() else ""
        firsts = [float(line.split()[1]) for line in text.splitlines() if line.partition(">:")[2].startswith("first ")
                  or line.startswith("first ")]
        if len(firsts) == RANKS:
            break
        if time.monotonic() > deadline:
            raise SystemExit(f"{name}: ranks not up after 120 s:\n{text}")
        time.sleep(0.01)
    while slurm.run(["squeue", "-h", "-j", job], timeout=15).stdout.strip():  # the next run starts on a free cluster
        time.sleep(0.05)
    started = next(float(line.split()[1]) for line in text.splitlines() if line.startswith("script "))
    return started - submitted, max(firsts) - started


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=7)
    args = parser.parse_args()
    tools = slurmcluster()
    netcluster = sys.modules["mtrain_benchmarks_netcluster"]
    missing = netcluster.prerequisites_missing() or tools.prerequisites_missing()
    if missing:
        print(f"cannot run: {missing}", file=sys.stderr)
        return 2
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in VARIANTS}
    with netcluster.running_cluster(2) as cluster, tools.running_slurm(cluster) as slurm, \
            tempfile.TemporaryDirectory(prefix="mtrain-slurm-bench-") as scratch:
        folder = Path(scratch)
        os.chmod(folder, 0o755)
        program = folder / "first.py"
        program.write_text(FIRST)
        number = 0
        for run in range(args.repeat + 1):  # the first round warms up (page cache, Slurm's first job)
            for name, launcher in VARIANTS.items():
                number += 1
                measured = one_run(slurm, folder, name, launcher, program, number)
                if run:
                    times[name].append(measured)
    print(f"Launch inside a Slurm allocation, 2 nodes x 2 tasks, median of {args.repeat} interleaved runs (s)")
    print(f"{'variant':<17} {'sbatch -> script':>17} {'script -> ranks':>16} {'sbatch -> ranks':>16}")
    for name, runs in times.items():
        queue = statistics.median(r[0] for r in runs)
        launch = statistics.median(r[1] for r in runs)
        total = statistics.median(r[0] + r[1] for r in runs)
        print(f"{name:<17} {queue:>17.2f} {launch:>16.2f} {total:>16.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
