"""An mtrain job whose nodes are reached through TaskServices (Ray actors, Spark tasks), not SSH.

    driver: run_through_tasks ── mpirun --prtemca plm_ssh_agent "PYTHON -m mtrain.launcher.tasks.agent …"
                                   ├─ ranks on the driver's own node: mpirun's children, as in `mtrain run`
                                   └─ task_agent HOST ══ TaskService on HOST (launcher/tasks/service.py)
                                                          └─ remote guard ─ prted ─ rank wrappers ─ ranks

The argv is `mtrain run`'s (launch.build_job_argv) and the job is watched by the same supervisor
(supervise.Job), so a failing rank is named on stderr as `mtrain run` names it, and stopping
the job ends it everywhere.  There is no preflight over SSH: the services are up and
authenticated by the time this runs (their owner started them), and no job layout is handed
out (torchrun's variables are `mtrain run`'s; the ranks here use MPI and mtrain's own API).
"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
from typing import Mapping, Sequence

from mtrain.launcher.cli.config import LaunchConfig, MpiKind, SshOptions, StepSettings
from mtrain.launcher.job.hosts import HostSlots

AGENT_MODULE = "mtrain.launcher.tasks.agent"


def job_subnets(services: Mapping[str, tuple[str, int]], local: str) -> tuple[str, ...]:
    """Our subnets on the routes to the other nodes' services, for MPI's interface choice
    (() when one is unknown: MPI then excludes only the interfaces that never connect hosts)."""
    from mtrain.launcher.job.netif import source_address, subnet_of
    found = set()
    for host, (address, port) in services.items():
        if host == local:
            continue
        source = source_address(address, port)
        subnet = subnet_of(source) if source else None
        if subnet is None or subnet.startswith("127."):
            return ()  # (PRRTE's daemons cannot be told to talk over loopback alone)
        found.add(subnet)
    return tuple(sorted(found))


def run_through_tasks(command: Sequence[str], services: Mapping[str, tuple[str, int]], slots: Mapping[str, int],
                      key: bytes, env: Mapping[str, str] | None = None, timeout_s: float | None = None,
                      verbose: int = 1, *, mpi_args: Sequence[str] = (), network_interfaces: Sequence[str] = (),
                      prefix_timestamp: bool = False) -> int:
    """Run `command` (a rank's argv) as one mtrain job of sum(slots) ranks: hosts in `slots`'
    order, slots[host] ranks each, every host other than this one reached through its service
    in `services` ({hostname: (address, port)}) with `key`.  `env`: more variables for every
    rank (forwarded by name, never on a command line).  `mpi_args`, `network_interfaces` and
    `prefix_timestamp` are `mtrain run`'s --mpi-args, --network-interface and
    --prefix-output-with-timestamp.  The job's exit status: nonzero when a rank failed, which is
    named on stderr."""
    from mtrain.common.private import temporary_folder
    from mtrain.common.records.daemon_env import ENV_MPIRUN_TMPDIR, ENV_USER_TMPDIR, ENV_USER_UMASK
    from mtrain.common.records.elastic import ENV_JOB_SECRET, new_job_secret
    from mtrain.launcher.job import launch
    from mtrain.launcher.job.mpirun import find_mpirun
    from mtrain.launcher.supervise import supervisor as supervise
    from mtrain.launcher.tasks import agent as task_agent
    plan = tuple(HostSlots(host, count) for host, count in slots.items() if count > 0)
    if not plan:
        raise ValueError("no slots: nothing to run")
    local = socket.gethostname()
    missing = [h.name for h in plan if h.name != local and h.name not in services]
    if missing:
        raise ValueError(f"no task service for host(s) {', '.join(missing)}")
    remote = tuple(h.name for h in plan if h.name != local)
    mpi = find_mpirun()
    if remote and mpi.kind is not MpiKind.OPENMPI:
        raise ValueError(f"{mpi.path}: starting ranks through task services needs Open MPI 5 (plm_ssh_agent)")
    steps = StepSettings(report=False)
    config = LaunchConfig(plan=plan, command=tuple(command), remote_hosts=remote, ssh=SshOptions(),
                          mpi=mpi, start_timeout=timeout_s or 30.0, verbose=verbose > 1, steps=steps,
                          env_pass=tuple(env or {}), mpi_args=tuple(mpi_args),
                          network_interfaces=tuple(network_interfaces), prefix_timestamp=prefix_timestamp)
    mask = os.umask(0o077)  # the only way to read it is to set it
    os.umask(mask)
    job_env = {ENV_JOB_SECRET: new_job_secret(), ENV_USER_UMASK: f"{mask:03o}",
               **launch.step_environment(steps), **dict(env or {})}
    with tempfile.TemporaryDirectory(prefix="mtrain-tasks-", dir=temporary_folder()) as scratch:
        events = os.path.join(scratch, "events")
        agent = None
        if remote:
            config_path = os.path.join(scratch, "task-agent.json")
            task_agent.write_config(config_path, key, {h: services[h] for h in remote}, sys.executable, events)
            agent = [sys.executable, "-m", AGENT_MODULE, "--config", config_path]
        subnets = () if network_interfaces else job_subnets({h: services[h] for h in remote}, local)
        argv = launch.build_job_argv(config, agent, subnets, job_env)
        environment = launch.job_environment(job_env)
        # Open MPI's launcher keeps its folder in our private scratch, as `mtrain run`'s does.
        if "TMPDIR" in environment:
            environment[ENV_USER_TMPDIR] = environment["TMPDIR"]
        environment["TMPDIR"] = environment[ENV_MPIRUN_TMPDIR] = scratch
        job = supervise.Job(argv, environment, config.num_proc, None, config.verbose,
                            events if agent else None, steps=steps, prefix_timestamp=prefix_timestamp)
        return job.run()


def start_through_tasks(command: Sequence[str], services: Mapping[str, tuple[str, int]], slots: Mapping[str, int],
                        key: bytes, env: Mapping[str, str] | None = None, timeout_s: float | None = None,
                        verbose: int = 1, **options) -> "subprocess.Popen":
    """run_through_tasks in a process of its own, started now: for a driver that goes on while
    the job runs (mtrain.ray's executor), and can stop it with SIGTERM (the job then ends
    everywhere, as `mtrain run` ends on SIGTERM).  The key and `env`'s values travel in the
    child's environment and a 0600 file it removes, never on a command line; the child dies
    with us.  Its stdout and stderr are ours.  `options`: run_through_tasks' keywords."""
    import json

    from mtrain.common.private import temporary_folder, write_private
    folder = tempfile.mkdtemp(prefix="mtrain-tasks-", dir=temporary_folder())  # 0700
    spec = os.path.join(folder, "job.json")
    write_private(spec, json.dumps({
        "command": list(command), "services": {h: [a, int(p)] for h, (a, p) in services.items()},
        "slots": dict(slots), "env_names": sorted(env or {}), "timeout_s": timeout_s, "verbose": verbose,
        "options": {name: list(value) if isinstance(value, (list, tuple)) else value
                    for name, value in options.items()}}).encode())
    child_env = {**os.environ, **dict(env or {}), ENV_TASK_KEY: key.hex()}
    return subprocess.Popen([sys.executable, "-m", "mtrain.launcher.tasks.launch", spec], env=child_env,
                            stdin=subprocess.DEVNULL)


ENV_TASK_KEY = "MTRAIN_TASK_KEY"


def main(argv: "list[str] | None" = None) -> int:
    """`python -m mtrain.launcher.tasks.launch SPEC`: what start_through_tasks starts."""
    import json
    import shutil

    from mtrain.common.private import read_private
    from mtrain.launcher.process_tools import die_with_parent
    argv = sys.argv[1:] if argv is None else argv
    die_with_parent(signal.SIGTERM)
    key_text = os.environ.pop(ENV_TASK_KEY, "")
    if len(argv) != 1 or not key_text:
        print("mtrain: python -m mtrain.launcher.tasks.launch is started by mtrain.ray / mtrain.spark, not by hand",
              file=sys.stderr)
        return 2
    try:
        spec = json.loads(read_private(argv[0]))
    finally:
        shutil.rmtree(os.path.dirname(argv[0]), ignore_errors=True)
    env = {name: os.environ[name] for name in spec["env_names"] if name in os.environ}
    try:
        return run_through_tasks(spec["command"], {h: (a, int(p)) for h, (a, p) in spec["services"].items()},
                                 spec["slots"], bytes.fromhex(key_text), env, spec["timeout_s"], spec["verbose"],
                                 **spec["options"])
    except ValueError as error:
        print(f"mtrain: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
