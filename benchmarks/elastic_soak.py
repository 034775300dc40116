"""A soak of one elastic job through many resets: a host lost, then the same host back after
its cooldown, again and again.  Per generation: the rss and open fds of every rank on the
surviving hosts (and of the driver, the one process that lives through every generation);
at the end: the committed steps (exactly the requested number, none lost, none repeated)
and what the job left in /tmp and /dev/shm.

Needs root: it builds the namespace test cluster (tests/cluster/netcluster.py, two sshd
"hosts" mtr-a and mtr-b, 2 slots each) and runs benchmarks/elastic_soak_train.py under
`mtrain run -np 4 --min-np 2 --max-np 4 --host-discovery-script … --blacklist-cooldown-range`.
The discovery script always lists both hosts, so the driver's blacklist decides when a
lost host comes back.  Once a generation has trained --sample-after steps, the rss and
fds of its ranks are read from /proc (the rank processes are found by a token on their
command lines); in a generation on both hosts, --kill-later steps after that (between two
commits, so some uncommitted work is lost and done again) every rank on mtr-b is SIGKILLed
at once, as tests/cluster/test_elastic.py loses a host (--kill daemon kills Open MPI's daemon
there instead; --kill host also kills the rank wrappers, the daemon and mtrain's guard:
everything of the job in that namespace).  A
generation on mtr-a alone runs until the cooldown brings mtr-b back.

Committed steps are checked three ways: every generation resumes from the last commit
the previous one logged (none lost); the final committed history is 0..STEPS-1 once each
and Adam counted STEPS steps (none repeated); the parameters equal those of one process
replaying the STEPS steps (to float rounding: the training program's global batch is the
same whatever the number of ranks).

    sudo .venv/bin/python benchmarks/elastic_soak.py [--resets 12] [--steps 3000]

The namespace hosts share this machine's filesystem, so "left on every host" is what
appeared in /tmp and /dev/shm during the run: names with the job's ids or the hosts' names,
and whatever the job's processes were seen referring to (command lines, environments,
open files, mappings, Open MPI session folders of their pids).  Other new mtrain or
Open MPI entries are listed apart, as possibly another user's.  A shared filesystem also
means that what only the launcher's host removes (the driver removes the whole snapshot
folder, every host's) cannot be told from what each host removes itself.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import queue
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

from repo_helpers import netcluster

HERE = Path(__file__).resolve().parent
TRAIN = HERE / "elastic_soak_train.py"
PYTHON = sys.executable
SHARED_DIRS = ("/tmp", "/dev/shm")
VICTIM, SURVIVOR, SLOTS = "mtr-b", "mtr-a", 2
RESET_LINE = re.compile(r"mtrain: elastic reset (\d+): (.*?); now (\d+) ranks on (.*?); resumed from (.*)$")
PATH_IN_SHARED = re.compile(r"(?:/tmp|/dev/shm)/([^/\s:=,;\"'\x00]+)")
JOB_ID = re.compile(r"[0-9a-f]{32}")   # the driver's job id, in the names of the job's folders
# Names a new entry of /tmp or /dev/shm may have when mtrain or Open MPI made it.
SUSPECT = re.compile(r"mtrain|ompi|prte|pmix|sm_segment|vader|mtr-")


# -- /proc ------------------------------------------------------------------------------------
def _read(path: str, binary: bool = False):
    try:
        with open(path, "rb" if binary else "r") as handle:
            return handle.read()
    except OSError:
        return b"" if binary else ""


def cmdline(pid: int) -> str:
    return _read(f"/proc/{pid}/cmdline", True).replace(b"\0", b" ").decode(errors="replace")


def environ(pid: int) -> dict[str, str]:
    found = {}
    for item in _read(f"/proc/{pid}/environ", True).split(b"\0"):
        name, _, value = item.decode(errors="replace").partition("=")
        if name:
            found[name] = value
    return found


@dataclasses.dataclass(frozen=True)
class Usage:
    rss_mib: float
    fds: int
    threads: int


def usage(pid: int) -> Usage | None:
    status = _read(f"/proc/{pid}/status")
    fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
    try:
        fds = len(os.listdir(f"/proc/{pid}/fd"))
        return Usage(int(fields["VmRSS"].split()[0]) / 1024, fds, int(fields["Threads"]))
    except (OSError, KeyError, ValueError):
        return None


def descendants(root: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            stat = _read(f"/proc/{entry}/stat")
            if stat:
                parent = int(stat.rsplit(")", 1)[1].split()[1])
                children.setdefault(parent, []).append(int(entry))
    found, todo = [], [root]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def shared_paths(pid: int) -> set[str]:
    """Top-level names in /tmp or /dev/shm that process `pid` refers to right now."""
    text = cmdline(pid) + " " + " ".join(environ(pid).values()) + " " + _read(f"/proc/{pid}/maps")
    try:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                text += " " + os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                pass
    except OSError:
        pass
    return set(PATH_IN_SHARED.findall(text))


def listing() -> dict[str, set[str]]:
    return {folder: set(os.listdir(folder)) for folder in SHARED_DIRS if os.path.isdir(folder)}


# -- the job's processes ----------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class RankProcess:
    rank: int
    host: str
    pid: int
    use: Usage


@dataclasses.dataclass
class Sample:
    at_step: int
    ranks: list[RankProcess]
    host_processes: dict[str, int]      # processes of the job in each namespace (sshd sessions too)
    driver: Usage | None
    job_entries: int                    # the job's entries in /tmp and /dev/shm at that moment


class Soak:
    def __init__(self, cluster, args: argparse.Namespace, scratch: Path) -> None:
        self.cluster, self.args, self.scratch = cluster, args, scratch
        self.token = f"mtrsoak{uuid.uuid4().hex[:10]}"
        self.listeners = {host.sshd_pid for host in cluster.hosts}
        self.referenced: set[str] = set()   # names in /tmp and /dev/shm the job's processes used
        self.before = listing()
        self.proc: subprocess.Popen | None = None

    # what belongs to the job -------------------------------------------------------------------
    def namespace_processes(self, host: str) -> list[int]:
        return [pid for pid in self.cluster.namespace_pids(host) if pid not in self.listeners and cmdline(pid)]

    def job_processes(self) -> list[int]:
        found = set(descendants(self.proc.pid)) | {self.proc.pid} if self.proc else set()
        for host in self.cluster.hosts:
            found.update(self.namespace_processes(host.name))
        for entry in os.listdir("/proc"):
            if entry.isdigit() and int(entry) != os.getpid() and self.token in cmdline(int(entry)):
                found.add(int(entry))
        return sorted(found)

    def note_references(self, pids: list[int]) -> None:
        for pid in pids:
            self.referenced |= shared_paths(pid)
            self.referenced.add(f"ompi.{pid}")  # Open MPI's session folder of a launcher or daemon

    def job_entries(self) -> dict[str, list[str]]:
        """New entries of /tmp and /dev/shm that are the job's, by name or by reference."""
        now, found = listing(), {}
        for folder, names in now.items():
            new = names - self.before.get(folder, set())
            found[folder] = sorted(n for n in new if self.is_job_entry(n))
        return found

    def is_job_entry(self, name: str) -> bool:
        ids = set(JOB_ID.findall(" ".join(self.referenced)))  # the driver's and each generation's
        return (name in self.referenced or self.token in name
                or any(host.name in name for host in self.cluster.hosts)
                or any(job_id in name for job_id in ids))

    def sample(self, at_step: int) -> Sample:
        ranks, per_host = [], {}
        for host in self.cluster.hosts:
            pids = self.namespace_processes(host.name)
            per_host[host.name] = len(pids)
            for pid in pids:
                line = cmdline(pid)
                if self.token not in line or "mtrain.launcher.rank" in line:
                    continue  # not a rank program (its wrapper, the daemon, the guard, sshd)
                use, rank = usage(pid), environ(pid).get("OMPI_COMM_WORLD_RANK", "")
                if use is not None and rank.isdigit():
                    ranks.append(RankProcess(int(rank), host.name, pid, use))
        self.note_references(self.job_processes())
        entries = self.job_entries()
        if self.args.verbose:
            log(f"the job's entries now: {entries}")
        driver = usage(self.proc.pid) if self.proc else None
        return Sample(at_step, sorted(ranks, key=lambda r: r.rank), per_host, driver,
                      sum(len(v) for v in entries.values()))

    def kill_victim(self) -> list[int]:
        """Processes of the job on VICTIM die at once: its ranks (--kill ranks), its MPI daemon
        (--kill daemon), or everything but sshd (--kill host)."""
        pids = self.namespace_processes(VICTIM)
        if self.args.kill == "ranks":
            pids = [p for p in pids if self.token in cmdline(p) and "mtrain.launcher.rank" not in cmdline(p)]
        elif self.args.kill == "daemon":
            pids = [p for p in pids if _read(f"/proc/{p}/comm").strip() == "prted"]
        else:
            pids = [p for p in pids if not cmdline(p).startswith("sshd")]
        self.note_references(pids)
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        return pids


@dataclasses.dataclass
class Generation:
    index: int
    size: int
    resume_step: int
    resume_commit: int
    started: float
    why: str = "start"
    hosts: set[str] = dataclasses.field(default_factory=set)
    rank0_steps: int = 0
    highest_step: int = 0
    last_commit: tuple[int, int] | None = None   # (commit, step) of the last commit rank 0 logged
    sample: Sample | None = None
    action: str = ""
    killed_at: float | None = None


def start_job(soak: Soak, args: argparse.Namespace) -> subprocess.Popen:
    hosts = soak.scratch / "hosts.txt"
    hosts.write_text(f"{SURVIVOR}:{SLOTS}\n{VICTIM}:{SLOTS}\n")
    script = soak.scratch / "discover.sh"
    script.write_text(f"#!/bin/sh\ncat {hosts}\n")
    script.chmod(0o755)
    env = soak.cluster.env()
    env["PATH"] = os.path.dirname(PYTHON) + os.pathsep + env.get("PATH", "")
    argv = [PYTHON, "-m", "mtrain.launcher.cli.main", "run", "-np", str(2 * SLOTS), "--min-np", str(SLOTS),
            "--max-np", str(2 * SLOTS), "--host-discovery-script", str(script),
            "--blacklist-cooldown-range", str(args.cooldown[0]), str(args.cooldown[1]),
            "--elastic-timeout", "120", *(["--verbose"] if args.mtrain_verbose else []), PYTHON, str(TRAIN), str(args.steps), str(args.commit_every),
            str(args.pause), soak.token]
    return subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            cwd=soak.scratch)


def pump(stream, into: "queue.Queue | None", keep: list[str]) -> None:
    for line in stream:
        keep.append(line)
        if into is not None:
            into.put(line)
    if into is not None:
        into.put(None)


def cooldown_of(failure: int, cooldown: tuple[int, int]) -> int:
    return min(cooldown[0] * failure, cooldown[1])


@dataclasses.dataclass
class RunResult:
    outcome: str                  # "finished", or what went wrong (a hang, a timeout)
    returncode: int
    stderr: list[str]             # mtrain's
    finals: dict[int, dict]       # every rank's final JSON line, by rank
    reset_lines: list[str]        # mtrain's one line per reset
    kills: list[float]            # when VICTIM was killed (time.time())


def run_soak(soak: Soak, args: argparse.Namespace) -> tuple[list[Generation], RunResult]:
    kills_wanted = math.ceil(args.resets / 2)
    soak.proc = proc = start_job(soak, args)
    lines: queue.Queue = queue.Queue()
    out: list[str] = []
    err: list[str] = []
    threads = [threading.Thread(target=pump, args=(proc.stdout, lines, out), daemon=True),
               threading.Thread(target=pump, args=(proc.stderr, None, err), daemon=True)]
    for thread in threads:
        thread.start()
    generations: list[Generation] = []
    finals: dict[int, dict] = {}
    kills: list[float] = []
    outcome = "finished"
    began = time.monotonic()
    try:
        while True:
            try:
                line = lines.get(timeout=args.stall)
            except queue.Empty:
                outcome = f"hang: no output for {args.stall:g} s"
                break
            if line is None:
                break
            if time.monotonic() - began > args.timeout:
                outcome = f"timeout: still running after {args.timeout:g} s"
                break
            _, _, text = line.partition(">:")
            words = text.split()
            if not words:
                continue
            if words[0] == "soak-resume":
                generation = Generation(len(generations), int(words[1]), int(words[2]), int(words[3]), time.time())
                generations.append(generation)
                log(f"generation {generation.index}: {generation.size} ranks from step {generation.resume_step}")
            elif words[0] == "soak-step" and generations:
                generation = generations[-1]
                rank, host, step = int(words[1]), words[2], int(words[3])
                generation.hosts.add(host)
                generation.highest_step = max(generation.highest_step, step)
                if rank != 0:
                    continue
                generation.rank0_steps += 1
                if generation.rank0_steps == args.sample_after and generation.sample is None:
                    generation.sample = soak.sample(step)
                if (generation.rank0_steps == args.sample_after + args.kill_later and generation.size == 2 * SLOTS
                        and len(kills) < kills_wanted and generation.killed_at is None):
                    killed = soak.kill_victim()
                    generation.killed_at = time.time()
                    kills.append(generation.killed_at)
                    generation.action = f"killed {VICTIM} ({len(killed)} processes) after step {step}"
                    log(f"generation {generation.index}: {generation.action}")
            elif words[0] == "soak-commit" and generations:
                generations[-1].last_commit = (int(words[1]), int(words[2]))
            elif text.startswith("{"):
                data = json.loads(text)
                finals[data["rank"]] = data
    finally:
        if outcome == "finished":
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                outcome = "mtrain did not end within 30 s of its output"
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
        proc.wait()
        for thread in threads:
            thread.join(timeout=10)
    resets = [match for match in map(RESET_LINE.search, err) if match is not None]
    for match in resets:
        number = int(match.group(1))
        if number < len(generations):
            generations[number].why = match.group(2)
    return generations, RunResult(outcome, proc.returncode, err, finals, [m.group(0) for m in resets], kills)


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


# -- after the job ---------------------------------------------------------------------------
def wait_processes_gone(soak: Soak, within: float) -> list[str]:
    deadline = time.monotonic() + within
    while True:
        alive = [p for p in soak.job_processes() if cmdline(p) and not cmdline(p).startswith("sshd")]
        if not alive or time.monotonic() > deadline:
            return [f"{pid}: {cmdline(pid)[:100]}" for pid in alive]
        time.sleep(0.2)


def leftovers(soak: Soak) -> tuple[dict[str, list[str]], dict[str, list[str]]]:
    """(the job's new entries, other new mtrain/Open MPI entries) of /tmp and /dev/shm."""
    ours = soak.job_entries()
    others = {}
    for folder, names in listing().items():
        new = names - soak.before.get(folder, set()) - set(ours.get(folder, []))
        others[folder] = sorted(n for n in new if SUSPECT.search(n))
    return ours, others


@dataclasses.dataclass
class StepCheck:
    """The committed steps against the request."""

    lost: int = 0          # committed steps a later generation did not resume from
    redone: int = 0        # steps done after a generation's last commit, done again after the reset (expected)
    committed: int = -1    # the final state's step (-1: no rank printed one)
    repeated: int = 0      # steps twice in the final committed history
    missing: int = 0       # steps absent from it
    ranks: list[int] = dataclasses.field(default_factory=list)
    max_param_diff: float | None = None   # from one process replaying the steps
    problems: list[str] = dataclasses.field(default_factory=list)


def check_steps(generations: list[Generation], finals: dict[int, dict], steps: int) -> StepCheck:
    check = StepCheck(ranks=sorted(finals))
    for before, after in zip(generations, generations[1:]):
        if before.last_commit is not None and after.resume_step < before.last_commit[1]:
            check.lost += before.last_commit[1] - after.resume_step
        check.redone += max(0, before.highest_step - after.resume_step)
    if check.lost:
        check.problems.append(f"{check.lost} committed steps lost")
    if not finals:
        check.problems.append("no rank printed its final state")
        return check
    reference = finals[min(finals)]
    applied = reference["applied"]
    check.committed = reference["steps"]
    check.repeated = len(applied) - len(set(applied))
    check.missing = len(set(range(steps)) - set(applied))
    for rank, data in sorted(finals.items()):
        if data["steps"] != steps or data["applied"] != list(range(steps)):
            check.problems.append(f"rank {rank}: {data['steps']} steps, history other than 0..{steps - 1}")
        if data["adam_steps"] != [steps]:
            check.problems.append(f"rank {rank}: Adam counted {data['adam_steps']} steps, not {steps}")
        if data["params"] != reference["params"]:
            check.problems.append(f"rank {rank}: parameters differ from rank {min(finals)}'s")
    from elastic_soak_train import replay  # torch, in this process: after the job, off its clock
    check.max_param_diff = max(abs(a - b) for got, want in zip(reference["params"], replay(steps))
                               for a, b in zip(got, want))
    if check.max_param_diff > 1e-4:
        check.problems.append(f"parameters differ from one process replaying {steps} steps by "
                              f"{check.max_param_diff:.2e}")
    return check


def host_cell(sample: Sample | None, host: str) -> str:
    if sample is None:
        return "-"
    ranks = [r for r in sample.ranks if r.host == host]
    return " ".join(f"{r.use.rss_mib:.0f}/{r.use.fds}" for r in ranks) or "-"


def print_report(soak: Soak, generations: list[Generation], info: RunResult, checks: StepCheck, gone: list[str],
                 ours: dict[str, list[str]], others: dict[str, list[str]], args: argparse.Namespace,
                 seconds: float) -> None:
    hosts = [host.name for host in soak.cluster.hosts]
    print(f"\nelastic soak: {args.steps} steps requested, a commit every {args.commit_every}, "
          f"--blacklist-cooldown-range {args.cooldown[0]} {args.cooldown[1]}, --kill {args.kill}; "
          f"rss (MiB)/open fds of each rank at its generation's step {args.sample_after}, rank order\n")
    header = (["gen", "started by", "hosts", "ranks"] + [f"{h} rss/fds" for h in hosts]
              + ["procs " + "/".join(h[-1] for h in hosts), "driver rss/fds/thr", "job files", "resumed at",
                 "committed", "then"])
    rows = []
    for g in generations:
        s = g.sample
        driver = f"{s.driver.rss_mib:.0f}/{s.driver.fds}/{s.driver.threads}" if s and s.driver else "-"
        procs = "/".join(str(s.host_processes.get(h, 0)) for h in hosts) if s else "-"
        rows.append([str(g.index), g.why, ",".join(sorted(g.hosts)) or "-", str(g.size)]
                    + [host_cell(s, h) for h in hosts]
                    + [procs, driver, str(s.job_entries) if s else "-", str(g.resume_step),
                       str(g.last_commit[1]) if g.last_commit else str(g.resume_step), g.action or "-"])
    widths = [max(len(r[i]) for r in [header] + rows) for i in range(len(header))]
    print("| " + " | ".join(h.ljust(w) for h, w in zip(header, widths)) + " |")
    print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for row in rows:
        print("| " + " | ".join(c.ljust(w) for c, w in zip(row, widths)) + " |")
    returns = [g for g in generations if "added" in g.why]
    print()
    for line in info.reset_lines:
        print(line)
    print(f"\nsummary ({seconds / 60:.1f} min): outcome {info.outcome}, mtrain exit status {info.returncode}")
    print(f"  resets: {len(info.reset_lines)} ({len(info.kills)} hosts killed, {len(returns)} returned)")
    for number, (killed, back) in enumerate(zip(info.kills, returns), 1):
        print(f"  {VICTIM} back {back.started - killed:.1f} s after kill {number} "
              f"(cooldown {cooldown_of(number, args.cooldown):g} s)")
    print(f"  steps: {checks.committed} committed of {args.steps} requested; lost {checks.lost}, "
          f"repeated {checks.repeated}, missing {checks.missing}; "
          f"{checks.redone} uncommitted steps done again after resets (expected)")
    if checks.max_param_diff is not None:
        print(f"  parameters: ranks {checks.ranks} identical; max |difference| from one process replaying "
              f"the {args.steps} steps: {checks.max_param_diff:.1e}")
    print(f"  processes of the job left after it ended: {len(gone)}")
    for line in gone:
        print(f"    {line}")
    for folder in SHARED_DIRS:
        print(f"  left in {folder} by the job: {', '.join(ours.get(folder, [])) or 'nothing'}")
        if others.get(folder):
            print(f"  new in {folder}, not attributed to the job (another process on this VM?): "
                  f"{', '.join(others[folder])}")
    problems = list(checks.problems)
    if len(info.reset_lines) < args.resets:
        problems.append(f"{len(info.reset_lines)} resets of the {args.resets} asked for"
                        + (" (more --steps?)" if info.returncode == 0 else ""))
    for number, (killed, back) in enumerate(zip(info.kills, returns), 1):
        if back.started - killed < cooldown_of(number, args.cooldown):
            problems.append(f"{VICTIM} came back before its cooldown after kill {number}")
    if gone:
        problems.append(f"{len(gone)} processes of the job outlived it")
    if any(ours.values()):
        problems.append("the job left files behind")
    for problem in problems:
        print(f"  PROBLEM: {problem}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--resets", type=int, default=12, help="resets in all: kills plus returns (12)")
    parser.add_argument("--steps", type=int, default=4000, help="committed steps the job trains (4000: time for 12 resets)")
    parser.add_argument("--commit-every", type=int, default=5)
    parser.add_argument("--pause", type=float, default=0.05, help="seconds each rank sleeps after a step")
    parser.add_argument("--sample-after", type=int, default=50,
                        help="steps of a generation before its ranks are sampled (50)")
    parser.add_argument("--kill-later", type=int, default=3,
                        help="steps after the sample that mtr-b is killed, between two commits (3)")
    parser.add_argument("--cooldown", type=int, nargs=2, default=(20, 30), metavar=("MIN", "MAX"),
                        help="--blacklist-cooldown-range of the job (20 30)")
    parser.add_argument("--kill", choices=("ranks", "daemon", "host"), default="ranks",
                        help="ranks: mtr-b's rank processes, as the tests lose a host; daemon: Open MPI's daemon "
                             "there; host: all of the job there")
    parser.add_argument("--stall", type=float, default=240, help="seconds without output that count as a hang")
    parser.add_argument("--timeout", type=float, default=1800)
    parser.add_argument("--log", type=Path, help="write mtrain's stderr here")
    parser.add_argument("--mtrain-verbose", action="store_true", help="run mtrain with --verbose (see --log)")
    parser.add_argument("--verbose", action="store_true", help="list the job's entries in /tmp and /dev/shm at each sample")
    args = parser.parse_args()
    tools = netcluster()
    missing = tools.prerequisites_missing()
    if missing:
        print(f"elastic_soak: cannot build the namespace test cluster: {missing}; run it as root "
              "(sudo .venv/bin/python benchmarks/elastic_soak.py)", file=sys.stderr)
        return 2
    tools.LOCK_WAIT = args.timeout  # type: ignore[attr-defined]  # wait for a test run that holds the cluster, rather than fail
    started = time.monotonic()
    with tools.running_cluster(2) as cluster:
        scratch = Path(tempfile.mkdtemp(prefix="elastic-soak-"))
        try:
            soak = Soak(cluster, args, scratch)
            generations, info = run_soak(soak, args)
            gone = wait_processes_gone(soak, within=20)
            ours, others = leftovers(soak)
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
    seconds = time.monotonic() - started
    if args.log:
        args.log.write_text("".join(info.stderr))
    checks = check_steps(generations, info.finals, args.steps)
    print_report(soak, generations, info, checks, gone, ours, others, args, seconds)
    return 0 if info.outcome == "finished" and info.returncode == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
