"""A real Slurm on top of a running netcluster ``Cluster`` (see netcluster.py).

    root namespace, hostname mtr-ctl          namespace mtr-a          namespace mtr-b
    munged (private key and socket)           slurmd -N mtr-a          slurmd -N mtr-b
    slurmctld on 10.77.0.1 (the bridge)       10.77.0.11               10.77.0.12

Everything lives in one private temp dir: the munge key, socket, pid, log and seed
files, slurm.conf, slurmctld's state, the slurmds' spool dirs, pid files and logs,
and the job-completion log.  Nothing of the machine's own Slurm or munge
(/etc/slurm, /etc/munge, /run/munge) is read or touched, and the ports are not
Slurm's defaults, so a real Slurm on the machine does not get in the way.

All daemons run as root (SlurmUser=root); munged runs as root too, which it
accepts in 0.5.15 without ``--force``.  Its socket is a file, so the slurmds in
the other network namespaces reach it through the shared filesystem
(``AuthInfo=socket=...``).  Clients (srun, sbatch, salloc, scontrol, squeue,
scancel, sinfo) find the cluster through ``SLURM_CONF`` in ``SlurmCluster.env()``.

No cgroups (proctrack/linuxproc, task/none), no accounting (no slurmdbd, so
no sacct): a finished job's exit code is read with ``scontrol show job ID``,
which keeps it for MinJobAge seconds.  KillWait is Slurm's default (30 s), so a
step that ignores SIGTERM is only SIGKILLed 30 s later.
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Iterator

try:
    from tests.cluster.netcluster import BRIDGE_ADDRESS, Cluster
except ImportError:  # loaded from its file by benchmarks/repo_helpers.py, which loaded netcluster.py first
    from mtrain_benchmarks_netcluster import BRIDGE_ADDRESS, Cluster  # type: ignore[no-redef]

CONTROLLER = "mtr-ctl"
# Not Slurm's defaults (6817/6818), so a real Slurm on the machine never collides.
SLURMCTLD_PORT = 6917
SLURMD_PORT = 6918
CPUS_PER_NODE = 2
MIN_JOB_AGE = 600  # seconds a finished job stays visible in `scontrol show job`
UP_TIMEOUT = 60.0
# The "hosts" share one filesystem, but Slurm expects each node to have its own TmpFS: the
# pmix plugin makes /tmp/spmix_appdir_<uid>_<job>.<step> on every node of a step, and the
# second node fails with "File exists".  TmpFS is <workdir>/node-tmp; each slurmd's mount
# namespace (`ip netns exec` gives it a private one) has <workdir>/node-tmp-<host> bound
# there, and its steps inherit that.
NODE_TMP = "node-tmp"
BINARIES = ("munged", "mungekey", "slurmctld", "slurmd", "slurmstepd", "srun", "sbatch", "salloc",
            "scontrol", "squeue", "scancel", "sinfo", "unshare", "ip")


def _which(name: str) -> str | None:
    # munged, slurmctld and slurmd live in /usr/sbin, which a non-root PATH may lack.
    return shutil.which(name) or shutil.which(name, path="/usr/sbin:/sbin:/usr/bin")


def pmix_missing() -> str | None:
    """Why `srun --mpi=pmix` cannot work here (None: it can).  Debian's Slurm PMIx plugin loads the
    unversioned libpmix.so of the PMIx it was built with, which only libpmix-dev installs."""
    import glob
    if glob.glob("/usr/lib/*/pmix*/lib/libpmix.so") or glob.glob("/usr/lib*/libpmix.so"):
        return None
    return "srun --mpi=pmix needs libpmix.so (apt-get install libpmix-dev)"


def prerequisites_missing() -> str | None:
    """Why this machine cannot run the Slurm test cluster, or None if it can
    (beyond what netcluster.prerequisites_missing already asks)."""
    if os.geteuid() != 0:
        return "needs root (Slurm daemons in network namespaces)"
    for binary in BINARIES:
        if _which(binary) is None:
            return (f"needs `{binary}` (apt-get install --no-install-recommends "
                    "slurmctld slurmd slurm-client munge)")
    return None


@dataclasses.dataclass
class SlurmCluster:
    """A running Slurm: its config, its temp dir and its daemons."""

    cluster: Cluster
    workdir: Path
    conf: Path
    munge_socket: Path
    daemons: dict[str, subprocess.Popen]   # "munged", "slurmctld", "slurmd mtr-a", ...
    nodes: tuple[str, ...]

    def env(self) -> dict[str, str]:
        """The netcluster's environment plus SLURM_CONF: Slurm's clients find this cluster."""
        env = self.cluster.env()
        env["SLURM_CONF"] = str(self.conf)
        # Nothing of a surrounding Slurm job may leak into ours (tests run inside one on some CI).
        for key in list(env):
            if key.startswith(("SLURM_", "SBATCH_", "SALLOC_", "SRUN_")) and key != "SLURM_CONF":
                del env[key]
        return env

    def daemon_pids(self) -> set[int]:
        return {proc.pid for proc in self.daemons.values()}

    def run(self, argv: list[str], timeout: float = 60, **kwargs) -> subprocess.CompletedProcess:
        """Run a Slurm client command against this cluster (bounded)."""
        kwargs.setdefault("env", self.env())
        return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, **kwargs)

    def node_states(self) -> dict[str, str]:
        out = self.run(["sinfo", "-h", "-N", "-o", "%N %T"], timeout=15).stdout
        return dict(line.split()[:2] for line in out.splitlines() if len(line.split()) >= 2)

    def job_exit_code(self, job_id: str) -> str | None:
        """`ExitCode=` of `scontrol show job` ("3:0": exit status 3, signal 0), None if unknown."""
        out = self.run(["scontrol", "show", "job", job_id], timeout=15).stdout
        found = re.search(r"\bExitCode=(\S+)", out)
        return found.group(1) if found else None

    def wait_idle(self, timeout: float = UP_TIMEOUT) -> None:
        """Wait until every node is idle (bounded); raise with the daemons' log tails if not."""
        deadline = time.monotonic() + timeout
        states: dict[str, str] = {}
        while True:
            for name, proc in self.daemons.items():
                if proc.poll() is not None:
                    raise RuntimeError(f"{name} exited with {proc.returncode}:\n" + self.log_tails())
            with contextlib.suppress(subprocess.TimeoutExpired):
                states = self.node_states()
                # "idle*" means not responding; a trailing "~", "#", "!", "%", "$", "@" are other states.
                if all(states.get(node) == "idle" for node in self.nodes):
                    return
            if time.monotonic() > deadline:
                raise RuntimeError(f"Slurm nodes not idle after {timeout:g} s ({states}):\n"
                                   + self.log_tails())
            time.sleep(0.2)

    def log_tails(self, lines: int = 30) -> str:
        """The end of every daemon's log file; a daemon's captured output where it has no log
        (it failed before opening it)."""
        parts = []
        for out in sorted(self.workdir.glob("*.out")):
            log = out.with_suffix(".log")
            path = log if log.exists() and log.stat().st_size else out
            text = path.read_text(errors="replace").splitlines()[-lines:]
            parts.append(f"--- {path.name} (last {len(text)} lines)\n" + "\n".join(text))
        return "\n".join(parts)


def _slurm_conf(workdir: Path, munge_socket: Path, cluster: Cluster) -> str:
    nodes = "\n".join(f"NodeName={host.name} NodeAddr={host.address} CPUs={CPUS_PER_NODE} "
                      f"RealMemory=1000 State=UNKNOWN" for host in cluster.hosts)
    names = ",".join(host.name for host in cluster.hosts)
    return f"""\
# Written by tests/cluster/slurmcluster.py for one test session.
ClusterName=mtrain
SlurmctldHost={CONTROLLER}({BRIDGE_ADDRESS})
SlurmctldPort={SLURMCTLD_PORT}
SlurmdPort={SLURMD_PORT}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={munge_socket}
StateSaveLocation={workdir}/state
SlurmdSpoolDir={workdir}/spool-%n
# Each node's own /tmp for Slurm (see NODE_TMP); the pmix plugin puts its per-step dirs there.
TmpFS={workdir}/{NODE_TMP}
SlurmctldPidFile={workdir}/slurmctld.pid
SlurmdPidFile={workdir}/slurmd-%n.pid
SlurmctldLogFile={workdir}/slurmctld.log
SlurmdLogFile={workdir}/slurmd-%n.log
SlurmctldDebug=info
SlurmdDebug=info
MailProg=/bin/true
# No cgroups, no accounting daemon.
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/filetxt
JobCompLoc={workdir}/jobcomp.txt
MpiDefault=none
SwitchType=switch/none
# The nodes say what this file says, whatever the machine has.
SlurmdParameters=config_overrides
ReturnToService=2
MinJobAge={MIN_JOB_AGE}
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
{nodes}
# Jobs of 2 nodes x 2 tasks fill the cluster: let a job start while an earlier one is
# still ending (KillWait is the default 30 s) instead of queueing behind it.
PartitionName=mtr Nodes={names} Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:4
"""


# slurmd 22.05 always loads a cgroup plugin, even with proctrack/linuxproc and task/none,
# and its autodetection fails in a namespace host: `ip netns exec` mounts a fresh /sys there,
# without /sys/fs/cgroup ("No filesystem mounted on /sys/fs/cgroup").  Naming the v1 plugin
# skips the detection; the plugin is then loaded but never used.
CGROUP_CONF = "CgroupPlugin=cgroup/v1\nCgroupAutomount=no\n"


def _start(argv: list[str], log: Path, env: dict[str, str]) -> subprocess.Popen:
    return subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=open(log, "ab"),
                            stderr=subprocess.STDOUT, env=env, start_new_session=True)


def _stop(procs: list[subprocess.Popen], grace: float = 10.0) -> None:
    for proc in procs:
        with contextlib.suppress(ProcessLookupError):
            proc.terminate()
    deadline = time.monotonic() + grace
    for proc in procs:
        try:
            proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=5)


def _kill_slurmstepds(workdir: Path) -> None:
    """SIGKILL the step daemons of this cluster still alive (a step never reaped)."""
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            comm = Path(f"/proc/{entry}/comm").read_text().strip()
            environ = Path(f"/proc/{entry}/environ").read_bytes()
        except OSError:
            continue
        if comm == "slurmstepd" and str(workdir).encode() in environ:
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(entry), signal.SIGKILL)


@contextlib.contextmanager
def running_slurm(cluster: Cluster, base_dir: Path | None = None,
                  up_timeout: float = UP_TIMEOUT) -> Iterator[SlurmCluster]:
    """Start munged, slurmctld and a slurmd per host of `cluster`; yield; stop them all."""
    workdir = Path(tempfile.mkdtemp(prefix="mtrain-slurm-", dir=base_dir))
    # munged wants execute permission for all on the directories above its socket.
    workdir.chmod(0o711)
    (workdir / "state").mkdir(mode=0o700)
    for host in cluster.hosts:
        (workdir / f"spool-{host.name}").mkdir(mode=0o700)
        (workdir / f"{NODE_TMP}-{host.name}").mkdir()
        (workdir / f"{NODE_TMP}-{host.name}").chmod(0o1777)
    (workdir / NODE_TMP).mkdir()
    munge_socket = workdir / "munge.socket"
    conf = workdir / "slurm.conf"
    conf.write_text(_slurm_conf(workdir, munge_socket, cluster))
    (workdir / "cgroup.conf").write_text(CGROUP_CONF)
    env = cluster.env()
    env["SLURM_CONF"] = str(conf)
    daemons: dict[str, subprocess.Popen] = {}
    handle = SlurmCluster(cluster, workdir, conf, munge_socket, daemons,
                          tuple(host.name for host in cluster.hosts))
    try:
        key = workdir / "munge.key"
        subprocess.run([_which("mungekey"), "--create", "--keyfile", str(key)], check=True,
                       capture_output=True, timeout=30)
        daemons["munged"] = _start(
            [_which("munged"), "--foreground", f"--socket={munge_socket}", f"--key-file={key}",
             f"--pid-file={workdir}/munged.pid", f"--seed-file={workdir}/munged.seed"],
            workdir / "munged.out", env)  # in the foreground it logs to stderr
        deadline = time.monotonic() + up_timeout
        while not munge_socket.exists():
            if daemons["munged"].poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("munged did not come up:\n" + handle.log_tails())
            time.sleep(0.05)

        # slurmctld takes its name from the hostname: give it its own UTS namespace.
        daemons["slurmctld"] = _start(
            ["unshare", "--uts", "sh", "-c", 'hostname "$0" && exec "$1" -D -f "$2"',
             CONTROLLER, _which("slurmctld"), str(conf)],
            workdir / "slurmctld.out", env)
        for host in cluster.hosts:
            daemons[f"slurmd {host.name}"] = _start(
                ["ip", "netns", "exec", host.netns, "unshare", "--uts", "sh", "-c",
                 'hostname "$0" && mount --bind "$3" "$4" && exec "$1" -D -N "$0" -f "$2"',
                 host.name, _which("slurmd"), str(conf), str(workdir / f"{NODE_TMP}-{host.name}"),
                 str(workdir / NODE_TMP)],
                workdir / f"slurmd-{host.name}.out", env)

        handle.wait_idle(max(1.0, deadline - time.monotonic()))
        yield handle
    finally:
        with contextlib.suppress(Exception):
            handle.run(["scancel", "--full", "--user", "root"], timeout=10)
        slurmds = [proc for name, proc in daemons.items() if name.startswith("slurmd ")]
        _stop(slurmds)
        _stop([daemons[name] for name in ("slurmctld", "munged") if name in daemons])
        _kill_slurmstepds(workdir)
        shutil.rmtree(workdir, ignore_errors=True)

