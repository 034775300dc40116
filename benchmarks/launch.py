"""Launch overhead: `mtrain run` vs the raw mpirun command it wraps, at 1, 2, … hosts.

Needs root: it builds the namespace test cluster of tests/cluster/netcluster.py
(one sshd "host" per network namespace) and runs a trivial job, `python -c
pass` with one rank per host, several times per configuration, interleaving
the variants so machine noise hits them alike.  Prints the median wall time
from start to exit:

    mtrain      `mtrain run -H …` (CLI, parallel SSH preflight, supervision): the
                preflight's connection and probe session run the job (one SSH
                login and one session per host, launcher/ssh/master.py)
    unshared    the same with MTRAIN_SSH_SHARE=0: every agent makes its own
                connection after the preflight's (how mtrain launched before)
    raw argv    the exact mpirun argv `mtrain run --dry-run` prints (our paramiko
                agent and rank wrapper included, no preflight), run directly
    openssh     for reference: mpirun with OpenSSH as remote shell and no rank
                wrapper (what a bare `mpirun` job costs)

The last columns are mtrain's and unshared's time over openssh's.

    sudo .venv/bin/python benchmarks/launch.py [--hosts 1,2,3] [--repeat 7]
"""
from __future__ import annotations

import argparse
import os
import shlex
import statistics
import subprocess
import sys
import time

from repo_helpers import netcluster

_cluster_tools = netcluster()
SUBNET, prerequisites_missing, running_cluster = (
    _cluster_tools.SUBNET, _cluster_tools.prerequisites_missing, _cluster_tools.running_cluster)

PYTHON = sys.executable


def timed(argv: list[str], env: dict[str, str], extra: dict[str, str] | None = None) -> float:
    env = {**env, **(extra or {})}
    start = time.perf_counter()
    done = subprocess.run(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                          text=True, timeout=120)
    elapsed = time.perf_counter() - start
    if done.returncode != 0:
        raise SystemExit(f"benchmark run failed ({done.returncode}): {shlex.join(argv)}\n{done.stderr[-2000:]}")
    return elapsed


def variants(hosts: list[str], cluster) -> dict[str, tuple[list[str], dict[str, str]]]:
    spec = ",".join(f"{name}:1" for name in hosts)
    job = [PYTHON, "-c", "pass"]
    common = ["-H", spec, "--network-interface", SUBNET]
    mtrain = [PYTHON, "-m", "mtrain.launcher.cli.main", "run", *common, *job]
    dry = subprocess.run([PYTHON, "-m", "mtrain.launcher.cli.main", "run", "--dry-run", *common, *job], env=cluster.env(),
                         capture_output=True, text=True, timeout=60, check=True)
    raw = shlex.split(dry.stdout.strip().splitlines()[-1])
    ssh = (f"ssh -F {cluster.home}/.ssh/config -o UserKnownHostsFile={cluster.known_hosts} "
           "-o BatchMode=yes")
    agent_at = raw.index("plm_ssh_agent") + 1
    openssh = raw[:agent_at] + [ssh] + raw[agent_at + 1:]
    wrapper_at = openssh.index("mtrain.launcher.rank") - 2  # drop `python -m mtrain.launcher.rank --`
    openssh = openssh[:wrapper_at] + openssh[wrapper_at + 4:]
    return {"mtrain": (mtrain, {}), "unshared": (mtrain, {"MTRAIN_SSH_SHARE": "0"}), "raw argv": (raw, {}),
            "openssh": (openssh, {})}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hosts", default="1,2", help="host counts to measure, e.g. 1,2,3")
    parser.add_argument("--repeat", type=int, default=7, help="runs per variant and host count")
    args = parser.parse_args()
    counts = sorted({int(c) for c in args.hosts.split(",")})
    missing = prerequisites_missing()
    if missing:
        print(f"benchmarks/launch.py: cannot build the test cluster: {missing}", file=sys.stderr)
        return 2
    rows = []
    with running_cluster(max(counts)) as cluster:
        env = cluster.env()
        env["PATH"] = os.path.dirname(PYTHON) + os.pathsep + env.get("PATH", "")
        names = [host.name for host in cluster.hosts]
        for count in counts:
            runs = variants(names[:count], cluster)
            times: dict[str, list[float]] = {name: [] for name in runs}
            for argv, extra in runs.values():
                timed(argv, env, extra)  # warm-up: page cache, sshd's first fork
            for _ in range(args.repeat):
                for name, (argv, extra) in runs.items():
                    times[name].append(timed(argv, env, extra))
            rows.append((count, {name: statistics.median(values) for name, values in times.items()}))
    print(f"\nmedian wall time of `python -c pass`, one rank per host, {args.repeat} runs each, interleaved "
          f"(load {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores)\n")
    names = ["mtrain", "unshared", "raw argv", "openssh"]
    print(f"{'hosts':>5}  " + "  ".join(f"{name:>8}" for name in names) + f"  {'mtrain-openssh':>14}  "
          f"{'unshared-openssh':>16}")
    for count, medians in rows:
        print(f"{count:>5}  " + "  ".join(f"{medians[name]:>7.2f}s" for name in names)
              + f"  {medians['mtrain'] - medians['openssh']:>+13.2f}s"
              + f"  {medians['unshared'] - medians['openssh']:>+15.2f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
