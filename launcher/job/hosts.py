"""Pure host handling: parse `-H`, hostfiles and Slurm into [HostSlots]; assign slots.

Hosts are always returned in rank order: slots are filled host by host in the
order the user gave them.  Every parse error is a `HostSpecError` whose message
is one actionable line.
"""
from __future__ import annotations

import dataclasses
import re
import socket
from typing import Mapping, Sequence

# Host names travel into MPI's argv and into ssh; refusing anything that is not
# a plain name/address keeps shell metacharacters out of both.
_NAME = re.compile(r"^(?:[A-Za-z0-9_](?:[A-Za-z0-9_.\-]*[A-Za-z0-9_])?|\[[0-9A-Fa-f:.]+\])$")
LOCAL_NAMES = frozenset({"localhost", "127.0.0.1", "::1", "[::1]"})


class HostSpecError(ValueError):
    """A host list, hostfile or Slurm variable that cannot be understood."""


@dataclasses.dataclass(frozen=True)
class HostSlots:
    """A host and how many ranks (slots) it takes."""

    name: str
    slots: int

    def __str__(self) -> str:
        return f"{self.name}:{self.slots}"


def _check_name(name: str, where: str) -> str:
    if not name:
        raise HostSpecError(f"{where}: missing host name (write host:slots, e.g. node1:4)")
    if not _NAME.match(name):
        raise HostSpecError(f"{where}: {name!r} is not a valid host name")
    return name


def _check_slots(text: str, where: str) -> int:
    if not text:
        raise HostSpecError(f"{where}: missing slot count (write e.g. node1:4)")
    if not text.isdigit():
        raise HostSpecError(f"{where}: slot count {text!r} is not a whole number")
    slots = int(text)
    if slots < 1:
        raise HostSpecError(f"{where}: slot count must be at least 1")
    return slots


def _no_duplicates(hosts: Sequence[HostSlots], where: str) -> list[HostSlots]:
    seen: set[str] = set()
    for host in hosts:
        if host.name in seen:
            raise HostSpecError(f"{where}: host {host.name!r} is listed twice "
                                "(give it once with the total slot count)")
        seen.add(host.name)
    return list(hosts)


def parse_host_list(text: str) -> list[HostSlots]:
    """Parse `-H host1:4,host2:4` (a host without `:N` has one slot)."""
    if not text.strip():
        raise HostSpecError("-H: empty host list (write e.g. -H node1:4,node2:4)")
    hosts = []
    for item in text.split(","):
        item = item.strip()
        where = f"-H {item!r}"
        if not item:
            raise HostSpecError("-H: empty entry between commas")
        if item.startswith("["):  # [IPv6]:slots
            close = item.find("]")
            name, rest = item[: close + 1], item[close + 1:]
            slots = _check_slots(rest[1:], where) if rest.startswith(":") else 1
            if rest and not rest.startswith(":"):
                raise HostSpecError(f"{where}: expected ':' after ']'")
        elif ":" in item:
            name, _, count = item.rpartition(":")
            slots = _check_slots(count, where)
        else:
            name, slots = item, 1
        hosts.append(HostSlots(_check_name(name, where), slots))
    return _no_duplicates(hosts, "-H")


def parse_hostfile_text(text: str, source: str = "hostfile") -> list[HostSlots]:
    """Parse hostfile lines `host slots=N` (`#` comments, blank lines; `host` alone = 1 slot)."""
    hosts = []
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        where = f"{source}:{number}"
        words = line.split()
        slots = 1
        for word in words[1:]:
            key, eq, value = word.partition("=")
            if key in ("slots", "max_slots", "max-slots") and eq:
                if key == "slots":
                    slots = _check_slots(value, where)
            else:
                raise HostSpecError(f"{where}: cannot read {word!r} (write `host slots=N`)")
        if ":" in words[0] and not words[0].startswith("["):
            raise HostSpecError(f"{where}: write `{words[0].split(':')[0]} slots=N`, not host:N")
        hosts.append(HostSlots(_check_name(words[0], where), slots))
    if not hosts:
        raise HostSpecError(f"{source}: no hosts in the file (write one `host slots=N` per line)")
    return _no_duplicates(hosts, source)


def read_hostfile(path: str) -> list[HostSlots]:
    """Read and parse a hostfile; an unreadable file is a HostSpecError too."""
    try:
        with open(path, encoding="utf-8") as handle:
            text = handle.read()
    except (OSError, UnicodeDecodeError) as error:
        reason = getattr(error, "strerror", None) or str(error)
        raise HostSpecError(f"--hostfile {path}: cannot read it ({reason})") from None
    return parse_hostfile_text(text, source=path)


def expand_slurm_nodelist(text: str) -> list[str]:
    """Expand Slurm's compressed node list: `gpu[01-03,07],login1` -> gpu01 gpu02 gpu03 gpu07 login1."""
    names: list[str] = []
    for item in re.findall(r"[^,\[]+(?:\[[^\]]*\][^,\[]*)*", text):
        match = re.fullmatch(r"([^\[]*)\[([^\]]*)\](.*)", item)
        if not match:
            names.append(item)
            continue
        prefix, ranges, suffix = match.groups()
        for part in ranges.split(","):
            low, dash, high = part.partition("-")
            if not low.isdigit() or (dash and not high.isdigit()):
                raise HostSpecError(f"SLURM_JOB_NODELIST: cannot read range {part!r}")
            for number in range(int(low), int(high if dash else low) + 1):
                names.append(f"{prefix}{str(number).zfill(len(low))}{suffix}")
    return names


def expand_slurm_counts(text: str) -> list[int]:
    """Expand Slurm's `4(x2),2` task counts to [4, 4, 2]."""
    counts: list[int] = []
    for item in text.split(","):
        match = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", item.strip())
        if not match:
            raise HostSpecError(f"SLURM_TASKS_PER_NODE: cannot read {item!r}")
        counts += [int(match.group(1))] * int(match.group(2) or 1)
    return counts


def slurm_hosts(env: Mapping[str, str]) -> list[HostSlots] | None:
    """Hosts of the enclosing Slurm allocation, or None outside Slurm."""
    nodelist = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
    if not env.get("SLURM_JOB_ID") or not nodelist:
        return None
    names = expand_slurm_nodelist(nodelist)
    counts_text = env.get("SLURM_TASKS_PER_NODE") or env.get("SLURM_JOB_CPUS_PER_NODE") or ""
    counts = expand_slurm_counts(counts_text) if counts_text else [1] * len(names)
    if len(counts) != len(names):
        raise HostSpecError(f"Slurm gives {len(names)} nodes but {len(counts)} task counts")
    return _no_duplicates([HostSlots(n, c) for n, c in zip(names, counts) if c > 0], "Slurm")


def pbs_hosts(env: Mapping[str, str]) -> list[HostSlots] | None:
    """Hosts of the enclosing PBS / Torque job, or None outside one.

    $PBS_NODEFILE lists one line per slot (a host with 4 slots appears 4 times), as PRRTE's
    `ras pbs` reads it; hosts keep the order of their first line."""
    path = env.get("PBS_NODEFILE")
    if not env.get("PBS_JOBID") or not path:
        return None
    try:
        with open(path, encoding="utf-8") as handle:
            lines = handle.read().splitlines()
    except (OSError, UnicodeDecodeError) as error:
        reason = getattr(error, "strerror", None) or str(error)
        raise HostSpecError(f"PBS_NODEFILE {path}: cannot read it ({reason})") from None
    slots: dict[str, int] = {}
    for number, line in enumerate(lines, start=1):
        name = line.split("#", 1)[0].strip()
        if name:
            slots[_check_name(name, f"PBS_NODEFILE {path}:{number}")] = slots.get(name, 0) + 1
    if not slots:
        raise HostSpecError(f"PBS_NODEFILE {path}: no hosts in the file")
    return [HostSlots(name, count) for name, count in slots.items()]


@dataclasses.dataclass(frozen=True)
class Allocation:
    """The hosts a batch scheduler gave the job mtrain runs in."""

    scheduler: str                    # "Slurm" or "PBS"
    job_id: str
    hosts: tuple[HostSlots, ...]

    @property
    def slots(self) -> int:
        return sum(host.slots for host in self.hosts)

    def describe(self) -> str:
        return f"{self.scheduler} job {self.job_id} ({','.join(map(str, self.hosts))})"


def scheduler_allocation(env: Mapping[str, str]) -> Allocation | None:
    """The Slurm or PBS allocation this process runs in (Slurm first), or None."""
    hosts = slurm_hosts(env)
    if hosts is not None:
        return Allocation("Slurm", env["SLURM_JOB_ID"], tuple(hosts))
    hosts = pbs_hosts(env)
    if hosts is not None:
        return Allocation("PBS", env["PBS_JOBID"], tuple(hosts))
    return None


def assign_slots(hosts: Sequence[HostSlots], num_proc: int) -> list[HostSlots]:
    """Fill slots host by host in order; return the hosts used with the ranks each gets."""
    total = sum(h.slots for h in hosts)
    if num_proc < 1:
        raise HostSpecError(f"-np {num_proc}: need at least one process")
    if num_proc > total:
        raise HostSpecError(f"-np {num_proc} is more than the {total} slots of the hosts "
                            f"({','.join(map(str, hosts))}); lower -np or add slots")
    plan, left = [], num_proc
    for host in hosts:
        if left == 0:
            break
        take = min(host.slots, left)
        plan.append(HostSlots(host.name, take))
        left -= take
    return plan


def rank_hosts(plan: Sequence[HostSlots]) -> list[str]:
    """Host of each rank, indexed by rank."""
    return [host.name for host in plan for _ in range(host.slots)]


def local_names() -> frozenset[str]:
    """Names under which this machine may appear in a host list."""
    hostname = socket.gethostname()
    return LOCAL_NAMES | {hostname, hostname.split(".")[0]}


def is_local(name: str, names: frozenset[str] | None = None) -> bool:
    """True when `name` denotes the machine mtrain runs on (no SSH needed)."""
    return name in (names if names is not None else local_names())
