"""A throwaway multi-host cluster on one machine: network namespaces + sshd.

Layout (all names start with ``mtr`` so they never collide with anything else):

    root namespace                      namespace mtr-a           namespace mtr-b
    bridge mtrbr0 10.77.0.1/24          eth0 10.77.0.11/24        eth0 10.77.0.12/24
      ├── veth mtrva ─────────────────── eth0                       │
      └── veth mtrvb ───────────────────────────────────────────── eth0

Each namespace runs its own ``sshd`` under ``unshare --uts`` with its own
hostname (``mtr-a``, ``mtr-b``): with equal hostnames Open MPI believes the
hosts are one node and hangs in the first collective.  The filesystem is
shared, so every "host" has the same Python and the same mtrain.

A fake HOME holds the client key, ``known_hosts`` and an ``~/.ssh/config`` that
maps the host names to the private addresses, so the launcher finds them the
way a user's config would.  Only addresses created here are ever contacted.

Used by ``tests/cluster/conftest.py`` and ``benchmarks/launch.py``.
"""
from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Iterator

BRIDGE = "mtrbr0"
SUBNET = "10.77.0.0/24"
BRIDGE_ADDRESS = "10.77.0.1"
LOCK_FILE = Path(tempfile.gettempdir()) / "mtrain-netcluster.lock"
MAX_HOSTS = 8
NAME_PREFIX = "mtr-"
LOCK_WAIT = 120.0


@dataclasses.dataclass(frozen=True)
class ClusterHost:
    """One namespace 'host' of the cluster."""

    name: str          # hostname inside the namespace and ssh alias
    address: str       # its private address
    netns: str         # network namespace name
    veth_root: str     # root-side end of its veth pair (cut it to "pull the cable")
    sshd_pid: int


@dataclasses.dataclass(frozen=True)
class Cluster:
    """A running cluster and the HOME whose ~/.ssh describes it."""

    hosts: tuple[ClusterHost, ...]
    home: Path
    identity_file: Path
    known_hosts: Path

    def env(self) -> dict[str, str]:
        """Environment for a launcher process that should see this cluster."""
        env = dict(os.environ)
        env["HOME"] = str(self.home)
        env.pop("SSH_AUTH_SOCK", None)  # only the fixture's key, never a real agent
        return env

    def cut_link(self, name: str) -> None:
        """Pull the cable of host `name`: its veth goes down, no FIN is sent."""
        host = next(h for h in self.hosts if h.name == name)
        _run(["ip", "link", "set", host.veth_root, "down"])

    def restore_link(self, name: str) -> None:
        """Plug the cable of host `name` back in, and wait until it and every other host reach
        each other. While it was out, their tries to reach each other left neighbour entries
        FAILED or INCOMPLETE, and a connection made right after fails at once ("no route to
        host") until the kernel probes again: the next test's Open MPI links between the hosts
        did, and its ranks died in MPI_Init. The entries are flushed, and each pair is tried."""
        host = next(h for h in self.hosts if h.name == name)
        _run(["ip", "link", "set", host.veth_root, "up"])
        for each in self.hosts:
            _run(["ip", "-n", each.netns, "neigh", "flush", "all"], check=False)
        _run(["ip", "neigh", "flush", "dev", BRIDGE], check=False)
        deadline = time.monotonic() + 20
        for other in self.hosts:
            if other is host:
                continue
            for source, target in ((other, host), (host, other)):
                while not _reaches(source.netns, target.address):
                    if time.monotonic() > deadline:
                        raise RuntimeError(f"{source.name} cannot reach {target.name} after its link came back")
                    time.sleep(0.1)

    def namespace_pids(self, name: str) -> list[int]:
        """Processes living in host `name`'s network namespace."""
        host = next(h for h in self.hosts if h.name == name)
        out = subprocess.run(["ip", "netns", "pids", host.netns], capture_output=True,
                             text=True, timeout=10).stdout
        return [int(p) for p in out.split()]


def prerequisites_missing() -> str | None:
    """Why this machine cannot build a cluster, or None if it can."""
    if os.geteuid() != 0:
        return "needs root (network namespaces and sshd)"
    for tool in ("ip", "unshare", "ssh-keygen"):
        if shutil.which(tool) is None:
            return f"needs the `{tool}` command (apt-get install iproute2 util-linux openssh-client)"
    if not Path("/usr/sbin/sshd").exists():
        return "needs /usr/sbin/sshd (apt-get install openssh-server)"
    probe = subprocess.run(["ip", "netns", "add", "mtr-probe"], capture_output=True, text=True)
    if probe.returncode != 0:
        return f"cannot create network namespaces: {probe.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", "mtr-probe"], capture_output=True)
    return None


def _run(argv: list[str], check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(argv, capture_output=True, text=True, timeout=30, check=check)


def _reaches(netns: str, address: str) -> bool:
    """Whether a TCP connection from namespace `netns` to `address`'s sshd succeeds."""
    probe = f"import socket; socket.create_connection(({address!r}, 22), timeout=1).close()"
    return _run(["ip", "netns", "exec", netns, sys.executable, "-c", probe], check=False).returncode == 0


def cleanup_leftovers() -> None:
    """Remove whatever a crashed earlier run left: our namespaces, their processes, the bridge."""
    out = _run(["ip", "netns", "list"], check=False).stdout
    for line in out.splitlines():
        name = line.split()[0] if line.split() else ""
        if not name.startswith(NAME_PREFIX):
            continue
        pids = _run(["ip", "netns", "pids", name], check=False).stdout.split()
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, ValueError):
                os.kill(int(pid), signal.SIGKILL)
        _run(["ip", "netns", "del", name], check=False)
    _run(["ip", "link", "del", BRIDGE], check=False)
    for index in range(MAX_HOSTS):
        _run(["ip", "link", "del", f"mtrv{chr(ord('a') + index)}"], check=False)


# bash runs ~/.bashrc for every command sshd starts, and root's on these machines initialises
# pyenv: 0.14 s of CPU per SSH session, several per job. The hosts stand for clean machines, so
# inside a host (whose mount namespace `ip netns exec` made its own) an empty file covers it.
_QUIET_ROOT_BASHRC = '{ [ ! -f /root/.bashrc ] || mount --bind /dev/null /root/.bashrc; } && '


def _sshd_config(directory: Path, address: str, host_key: Path, authorized_keys: Path) -> Path:
    config = directory / "sshd_config"
    config.write_text(
        f"ListenAddress {address}\n"
        "Port 22\n"
        f"HostKey {host_key}\n"
        f"AuthorizedKeysFile {authorized_keys}\n"
        "PidFile none\n"
        "PermitRootLogin prohibit-password\n"
        "PasswordAuthentication no\n"
        "KbdInteractiveAuthentication no\n"
        "UsePAM no\n"
        "StrictModes no\n"
        # Keep the per-connection bookkeeping small: tests open many sessions.
        "MaxStartups 100:30:200\n"
        "MaxSessions 50\n"
        "LogLevel ERROR\n"
    )
    return config


def _wait_for_port(netns: str, address: str, deadline: float) -> None:
    # Poll from the root namespace, over the bridge, as the launcher will connect.
    import socket
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError):
            with socket.create_connection((address, 22), timeout=0.5) as sock:
                if sock.recv(4).startswith(b"SSH"):
                    return
        time.sleep(0.1)
    raise RuntimeError(f"sshd in {netns} did not come up on {address}:22")


@contextlib.contextmanager
def running_cluster(count: int = 2, base_dir: Path | None = None) -> Iterator[Cluster]:
    """Build `count` namespace hosts with sshd, yield them, tear everything down."""
    if not 1 <= count <= MAX_HOSTS:
        raise ValueError(f"count must be in 1..{MAX_HOSTS}")
    LOCK_FILE.touch(exist_ok=True)
    with open(LOCK_FILE) as lock:
        # One cluster at a time on this machine: the names are fixed so leftovers can be found.
        deadline = time.monotonic() + LOCK_WAIT
        while True:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"another test cluster holds {LOCK_FILE} for more than "
                                       f"{LOCK_WAIT:g} s; is a benchmark or test run still going?") from None
                time.sleep(0.5)
        workdir = Path(tempfile.mkdtemp(prefix="mtrain-cluster-", dir=base_dir))
        sshd_procs: list[subprocess.Popen] = []
        try:
            cleanup_leftovers()
            yield _build(count, workdir, sshd_procs)
        finally:
            for proc in sshd_procs:
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(timeout=5)
            cleanup_leftovers()
            shutil.rmtree(workdir, ignore_errors=True)


def _build(count: int, workdir: Path, sshd_procs: list[subprocess.Popen]) -> Cluster:
    home = workdir / "home"
    ssh_dir = home / ".ssh"
    ssh_dir.mkdir(parents=True, mode=0o700)
    identity = ssh_dir / "id_ed25519"
    _run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "mtrain-test", "-f", str(identity)])
    authorized = workdir / "authorized_keys"
    shutil.copy(identity.with_suffix(".pub"), authorized)
    Path("/run/sshd").mkdir(exist_ok=True)  # sshd's privilege-separation directory

    _run(["ip", "link", "add", BRIDGE, "type", "bridge"])
    _run(["ip", "addr", "add", f"{BRIDGE_ADDRESS}/24", "dev", BRIDGE])
    _run(["ip", "link", "set", BRIDGE, "up"])

    hosts: list[ClusterHost] = []
    known_lines: list[str] = []
    config_lines: list[str] = []
    deadline = time.monotonic() + 30
    for index in range(count):
        letter = chr(ord("a") + index)
        name = f"{NAME_PREFIX}{letter}"
        address = f"10.77.0.{11 + index}"
        veth_root, veth_ns = f"mtrv{letter}", f"mtrv{letter}p"
        _run(["ip", "netns", "add", name])
        _run(["ip", "link", "add", veth_root, "type", "veth", "peer", "name", veth_ns])
        _run(["ip", "link", "set", veth_root, "master", BRIDGE])
        _run(["ip", "link", "set", veth_root, "up"])
        _run(["ip", "link", "set", veth_ns, "netns", name])
        inside = ["ip", "netns", "exec", name]
        _run(inside + ["ip", "link", "set", veth_ns, "name", "eth0"])
        _run(inside + ["ip", "addr", "add", f"{address}/24", "dev", "eth0"])
        _run(inside + ["ip", "link", "set", "eth0", "up"])
        _run(inside + ["ip", "link", "set", "lo", "up"])

        host_dir = workdir / name
        host_dir.mkdir()
        host_key = host_dir / "ssh_host_ed25519_key"
        _run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(host_key)])
        config = _sshd_config(host_dir, address, host_key, authorized)
        proc = subprocess.Popen(
            inside + ["unshare", "--uts", "sh", "-c",
                      'hostname "$0" && ' + _QUIET_ROOT_BASHRC + 'exec /usr/sbin/sshd -D -e -f "$1"', name,
                      str(config)],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
            stderr=open(host_dir / "sshd.log", "w"), start_new_session=True)
        sshd_procs.append(proc)
        public = host_key.with_suffix(".pub").read_text().split()
        known_lines.append(f"{address} {public[0]} {public[1]}")
        config_lines.append(f"Host {name}\n    HostName {address}\n    User root\n"
                            f"    IdentityFile {identity}\n")
        hosts.append(ClusterHost(name, address, name, veth_root, proc.pid))

    known_hosts = ssh_dir / "known_hosts"
    known_hosts.write_text("\n".join(known_lines) + "\n")
    (ssh_dir / "config").write_text("\n".join(config_lines))
    for host in hosts:
        _wait_for_port(host.netns, host.address, deadline)
    return Cluster(tuple(hosts), home, identity, known_hosts)
