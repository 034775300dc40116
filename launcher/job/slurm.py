"""Inside a Slurm allocation: the ranks' nodes reached through Slurm itself, never over SSH.

    mtrain run                      (the batch script's node, or salloc's shell)
      ├─ srun -N K --ntasks-per-node=1 PYTHON -c PROBE       the preflight: every node at once
      └─ mpirun --prtemca plm slurm --prtemca prte_launch_agent "PYTHON -m mtrain.launcher.remote_guard --slurm PRTED"
           └─ srun --ntasks-per-node=1 … (PRRTE's plm slurm)  one task per node but mpirun's own
                └─ remote_guard --slurm: the job's layout written ($MTRAIN_JOB_LAYOUT), then
                     └─ prted ─ rank wrappers ─ ranks      and the job's files removed at the end

Slurm passes mpirun's environment to the srun tasks, so the layout (the preflight's ports and
addresses) travels as a variable, and the guard leaves it where the rank wrappers look
(job_files.py).  A node that fails, or `scancel`, ends the step: Slurm signals every process
of it, the guards end their trees, and mpirun ends the job.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from typing import Mapping, Sequence

from mtrain.common.records.exit_record import signal_name

ENV_SLURM_JOB = "SLURM_JOB_ID"
# The probe's own line is JSON; slurmstepd's lines about a node (what went wrong there) and srun's
# (how its task ended) name it like this.
_STEPD_LINE = re.compile(r"^slurmstepd-(?P<node>[^:\s]+): error: ")
_SRUN_LINE = re.compile(r"^srun: error: (?P<node>[^:\s]+): ")


def job_id(env: Mapping[str, str]) -> str:
    """The id of the Slurm allocation this process runs in ("" outside one)."""
    if env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST"):
        return env.get(ENV_SLURM_JOB, "")
    return ""


def missing_tools() -> str | None:
    """Why Slurm cannot start anything from here (None: it can)."""
    if shutil.which("srun") is None:
        return "no srun on PATH (load the cluster's Slurm module, or use --launcher ssh)"
    return None


def step_argv(nodes: Sequence[str], name: str) -> list[str]:
    """srun's start of a step of one task on each of `nodes`, beside whatever else runs in the job."""
    return ["srun", f"--nodes={len(nodes)}", f"--ntasks={len(nodes)}", "--ntasks-per-node=1",
            f"--nodelist={','.join(nodes)}", "--overlap", "--kill-on-bad-exit=0", "--mpi=none",
            "--cpu-bind=none", "--quiet", f"--job-name={name}"]


def launch_agent(python: str, mpirun: str) -> list[str]:
    """The words PRRTE's plm slurm runs on each node instead of plain `prted` (its daemon beside mpirun)."""
    prted = os.path.join(os.path.dirname(os.path.realpath(mpirun)), "prted")
    if not os.access(prted, os.X_OK):
        prted = "prted"  # the MPI's own search path then
    return [python, "-m", "mtrain.launcher.remote_guard", "--slurm", prted]


def run_step(nodes: Sequence[str], command: Sequence[str], timeout: float, name: str) -> "tuple[int | None, str, str]":
    """Run `command` once on each of `nodes` through srun: (srun's status or None when it ran out
    of time, stdout, stderr).  Never waits past `timeout`."""
    argv = step_argv(nodes, name) + list(command)
    try:
        process = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                   stderr=subprocess.PIPE, text=True, start_new_session=True)
    except OSError as error:
        return 127, "", f"srun: cannot run it: {error.strerror or error}"
    deadline = time.monotonic() + timeout
    status: int | None = None
    try:
        while status is None and time.monotonic() < deadline:
            try:
                status = process.wait(timeout=0.1)
            except subprocess.TimeoutExpired:
                pass
    finally:  # also when a signal to mtrain ends it meanwhile (SystemExit)
        if status is None:
            _stop(process)
    out, err = process.communicate()
    return status, out, err


def _stop(process: subprocess.Popen) -> None:
    """End an srun: the first SIGTERM cancels its step, a second makes it leave at once."""
    for sig in (signal.SIGTERM, signal.SIGTERM, signal.SIGKILL):
        try:
            process.send_signal(sig)
            process.wait(timeout=2)
            return
        except subprocess.TimeoutExpired:
            continue
        except ProcessLookupError:
            return


def preflight(nodes: Sequence[str], python: str, version: str, timeout: float, ports: Mapping[str, int]) -> dict:
    """The SSH preflight's checks (launcher/job/preflight.py) on every node at once, through one srun:
    {node: HostReport}, a node without an answer reported with what Slurm said of it."""
    from mtrain.launcher.job.preflight import PROBE, HostReport, judge
    wanted = max((ports.get(node, 0) for node in nodes), default=0)
    status, out, err = run_step(nodes, [python, "-c", PROBE, str(wanted)], timeout, "mtrain-preflight")
    answers: dict[str, dict] = {}
    for line in out.splitlines():
        try:
            found = json.loads(line)
        except ValueError:
            continue
        if isinstance(found, dict) and found.get("node") in nodes:
            answers[found["node"]] = found
    reports = {}
    for node in nodes:
        found = answers.get(node)
        if found is None:
            reports[node] = HostReport(node, _no_answer(node, python, status, err, timeout))
            continue
        report = judge(node, python, version, 0, found, "", "", "")
        if report.error is None:
            report = HostReport(node, None, report.gpus, report.addresses, tuple(report.ports[:ports.get(node, 0)]))
        reports[node] = report
    return reports


def _no_answer(node: str, python: str, status: int | None, err: str, timeout: float) -> str:
    if status is None:
        return (f"host {node}: no answer through srun within --start-timeout {timeout:g} s (is the "
                "allocation's step limit reached, or the node down? `scontrol show node` says)")
    lines = [line.strip() for line in err.splitlines() if line.strip()]
    said = next((line for pattern in (_STEPD_LINE, _SRUN_LINE) for line in lines
                 if (match := pattern.match(line)) and match.group("node") == node),
                (lines or ["srun said nothing"])[-1])
    if "No such file" in said or "execve" in said:
        return (f"host {node}: no Python at {python} (mtrain needs the same environment at the same path "
                f"on every node): {said}")
    return f"host {node}: the probe through srun failed: {said}"


def job_fields(job: str, timeout: float = 3.0) -> dict[str, str]:
    """`scontrol show job -o JOB`'s fields ({} when Slurm cannot say)."""
    try:
        out = subprocess.run(["scontrol", "show", "job", "-o", job], capture_output=True, text=True,
                             timeout=timeout, stdin=subprocess.DEVNULL).stdout
    except (OSError, subprocess.TimeoutExpired):
        return {}
    return dict(re.findall(r"(?:^|\s)([A-Za-z/:]+)=(\S*)", out))


def seconds(text: str) -> float | None:
    """Slurm's `[days-]hours:minutes:seconds` (or minutes:seconds) in seconds; None for UNLIMITED and the like."""
    found = re.fullmatch(r"(?:(\d+)-)?(?:(\d+):)?(\d+):(\d+)", text)
    if found is None:
        return None
    days, hours, minutes, secs = (int(part or 0) for part in found.groups())
    return ((days * 24 + hours) * 60 + minutes) * 60 + secs


_ENDED_BY = {"CANCELLED": "was cancelled (scancel)", "TIMEOUT": "reached its time limit",
             "PREEMPTED": "was preempted", "NODE_FAIL": "lost a node (NODE_FAIL)",
             "DEADLINE": "reached its deadline"}


def ended_by(fields: Mapping[str, str]) -> str | None:
    """Why Slurm is ending the job these fields describe ("reached its time limit", …), or None
    while it runs.  A job Slurm is ending shows as COMPLETING until its last process is gone
    (ours among them), so the time limit is told by the run time."""
    state = fields.get("JobState", "")
    if state in _ENDED_BY:
        return _ENDED_BY[state]
    if state != "COMPLETING":
        return None
    limit, ran = seconds(fields.get("TimeLimit", "")), seconds(fields.get("RunTime", ""))
    if limit is not None and ran is not None and ran >= limit:
        return f"reached its time limit ({fields['TimeLimit']})"
    return "was cancelled (scancel, or Slurm ended it)"


def interrupted_line(job: str, number: int) -> str | None:
    """What mtrain says when a signal stopped it inside Slurm job `job` and Slurm is ending the job
    (scancel, the time limit: Slurm signals every process of the job at once, so the ranks' own
    deaths are consequences, not failures); None when Slurm is not (the supervisor's own line)."""
    why = ended_by(job_fields(job))
    if why is None:
        return None
    return (f"mtrain: Slurm job {job} {why}: Slurm sent {signal_name(number)} to every process of the job; "
            "all ranks were stopped")


def main(argv: "list[str]") -> int:
    """`python -m mtrain.launcher.job.slurm update TEMPLATE VERSION`: the step an elastic job's launcher runs
    on the other nodes of a generation to leave the new host-set version for the ranks there."""
    from mtrain.common.records.elastic import HostUpdates, host_path, updates_file
    if len(argv) != 3 or argv[0] != "update" or "{host}" not in argv[1] or not argv[2].isdigit():
        print("usage: python -m mtrain.launcher.job.slurm update JOB-FILE-TEMPLATE VERSION", file=sys.stderr)
        return 2
    try:
        HostUpdates(int(argv[2])).write(host_path(updates_file(argv[1]), os.uname().nodename))
    except OSError as error:  # the generation ended here meanwhile
        print(f"mtrain: {os.uname().nodename}: cannot leave host-set version {argv[2]}: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
