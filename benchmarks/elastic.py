"""What elastic training costs: seconds from a lost host to the next training step, and from a
host added by the discovery script to the grown job's first step.

Needs root: it builds the namespace test cluster (tests/cluster/netcluster.py, two sshd
"hosts"), runs tests/cluster/elastic_train.py under `mtrain run` with a discovery script,
and reads the times from mtrain's one-line reset log (`… resumed from commit N X s after …`).

    sudo .venv/bin/python benchmarks/elastic.py [--repeat 3]
"""
from __future__ import annotations

import argparse
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from repo_helpers import ROOT, netcluster

_cluster_tools = netcluster()
prerequisites_missing, running_cluster = _cluster_tools.prerequisites_missing, _cluster_tools.running_cluster

PYTHON = sys.executable
RESET = re.compile(r"elastic reset 1: .*resumed from commit (-?\d+) ([\d.]+) s after the (failure|change)")


def run_once(cluster, scenario: str) -> float:
    with tempfile.TemporaryDirectory() as scratch:
        hosts = Path(scratch, "hosts.txt")
        hosts.write_text("mtr-a:2\nmtr-b:2\n" if scenario == "lost" else "mtr-a:2\n")
        script = Path(scratch, "discover.sh")
        script.write_text(f"#!/bin/sh\ncat {hosts}\n")
        script.chmod(0o755)
        size = ["-np", "4", "--min-np", "2"] if scenario == "lost" else ["-np", "2", "--max-np", "4"]
        env = cluster.env()
        env["PATH"] = os.path.dirname(PYTHON) + os.pathsep + env.get("PATH", "")
        proc = subprocess.Popen([PYTHON, "-m", "mtrain.launcher.cli.main", "run", *size, "--host-discovery-script",
                                 str(script), PYTHON, str(ROOT / "tests/cluster/elastic_train.py"), "2", "12", "0.2"],
                                env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=scratch)
        victims, acted = [], False
        for line in proc.stdout:
            if "progress" not in line or acted:
                continue
            words = line.split(">:", 1)[1].split()
            if scenario == "lost":
                if words[2] == "mtr-b":
                    victims.append(int(words[5]))
                if len(set(victims)) == 2 and int(words[4]) >= 3:
                    for pid in set(victims):
                        os.kill(pid, signal.SIGKILL)
                    acted = True
            elif int(words[4]) >= 3:
                hosts.write_text("mtr-a:2\nmtr-b:2\n")
                acted = True
        err = proc.stderr.read()
        proc.wait(timeout=120)
        found = RESET.search(err)
        if proc.returncode != 0 or not found:
            raise SystemExit(f"{scenario}: run failed ({proc.returncode}):\n{err[-2000:]}")
        return float(found.group(2))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    missing = prerequisites_missing()
    if missing:
        raise SystemExit(f"cannot build the test cluster: {missing}")
    with running_cluster(2) as cluster:
        rows = {"host lost -> next training step (4 -> 2 ranks)": [run_once(cluster, "lost") for _ in range(args.repeat)],
                "host added -> grown job's first step (2 -> 4 ranks)": [run_once(cluster, "added")
                                                                       for _ in range(args.repeat)]}
    print(f"\nelastic reset cost on the namespace cluster, {args.repeat} runs each (seconds)\n")
    print(f"{'event':<52} {'min':>6} {'median':>7} {'max':>6}")
    for name, times in rows.items():
        print(f"{name:<52} {min(times):>6.1f} {statistics.median(times):>7.1f} {max(times):>6.1f}")


if __name__ == "__main__":
    main()
