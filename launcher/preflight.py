"""Check every remote host before any rank starts: all hosts in parallel, one bounded wait.

Per host: connect (host key verified), then run a probe with the launcher's
own Python path that reports mtrain's version, the host's GPU count, its
addresses and as many free TCP ports as the job needs there (for
torch.distributed's MASTER_PORT and tf.distribute's workers).  Every
failing host yields one line; the job starts only if there are none.
"""
from __future__ import annotations

import dataclasses
import json
import shlex
import threading
import time
from typing import Mapping, Sequence

from mtrain.launcher.config import SshOptions

# Runs on the remote host; must work with nothing but mtrain installed.
PROBE = r"""
import json, sys
try:
    import mtrain
    from mtrain.launcher.capabilities import gpu_count
    from mtrain.launcher.netif import free_ports, interface_addresses
except Exception:
    found = {"version": None}
else:
    try:
        found = {"version": mtrain.__version__, "gpus": gpu_count(), "addresses": interface_addresses(),
                 "ports": free_ports(int(sys.argv[1]))}
    except Exception as error:
        found = {"version": mtrain.__version__, "error": f"{type(error).__name__}: {error}"}
print(json.dumps(found))
"""


@dataclasses.dataclass(frozen=True)
class HostReport:
    """What the preflight learned about one host (error set when it failed)."""

    host: str
    error: str | None = None
    gpus: int = 0
    addresses: Mapping[str, str] = dataclasses.field(default_factory=dict)  # interface -> "ip/len"
    ports: tuple[int, ...] = ()  # free TCP ports there, as many as asked for


def probe_host(host: str, options: SshOptions, python: str, version: str, timeout: float,
               ports: int = 0) -> HostReport:
    """Connect to `host` and run the probe (asking for `ports` free ports); never raises."""
    from mtrain.launcher import ssh  # keeps paramiko out of local-only jobs
    try:
        client = ssh.connect(host, options, timeout=timeout)
    except ssh.SshError as error:
        return HostReport(host, str(error))
    except Exception as error:  # a report line, never a traceback from a worker thread
        return HostReport(host, f"host {host}: cannot connect: {type(error).__name__}: {error}")
    try:
        status, out, err = ssh.run_command(client, f"{shlex.quote(python)} -c {shlex.quote(PROBE)} {int(ports)}",
                                           timeout)
    except Exception as error:
        return HostReport(host, f"host {host}: probe failed: {error}")
    finally:
        client.close()
    if status == 127:
        return HostReport(host, f"host {host}: no Python at {python} (mtrain needs the same "
                          "environment at the same path on every host)")
    try:
        found = json.loads(out.strip().splitlines()[-1])
    except (ValueError, IndexError):
        last = (err.strip().splitlines() or ["no output"])[-1]
        return HostReport(host, f"host {host}: probe with {python} failed: {last}")
    if found.get("error"):
        return HostReport(host, f"host {host}: the probe failed there: {found['error']}")
    if found.get("version") is None:
        return HostReport(host, f"host {host}: mtrain is not installed for {python} there")
    if found["version"] != version:
        return HostReport(host, f"host {host}: mtrain {found['version']} there but {version} here; "
                          "install the same version on every host")
    return HostReport(host, None, int(found.get("gpus", 0)), dict(found.get("addresses", {})),
                      tuple(int(port) for port in found.get("ports", ())))


def run_preflight(hosts: Sequence[str], options: SshOptions, python: str, version: str,
                  timeout: float, ports: Mapping[str, int] | None = None) -> dict[str, HostReport]:
    """Probe all hosts in parallel; a host without an answer by `timeout` is reported as such.

    `ports` says how many free ports to find on each host (none by default).
    """
    results: dict[str, HostReport] = {}
    lock = threading.Lock()

    def work(host: str) -> None:
        report = probe_host(host, options, python, version, timeout, (ports or {}).get(host, 0))
        with lock:
            results[host] = report

    # Daemon threads: a host stuck in a TCP handshake must not keep mtrain alive past the deadline.
    threads = [threading.Thread(target=work, args=(host,), daemon=True) for host in hosts]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + timeout
    for thread in threads:
        thread.join(max(0.0, deadline - time.monotonic()))
    with lock:
        for host in hosts:
            if host not in results:
                results[host] = HostReport(host, f"host {host}: no answer within --start-timeout "
                                           f"{timeout:g} s (check the network or raise --start-timeout)")
        return dict(results)


def slot_warnings(reports: Mapping[str, HostReport], slots: Mapping[str, int]) -> list[str]:
    """One line per host that has GPUs but fewer than the ranks it will run."""
    lines = []
    for host, report in reports.items():
        if report.error is None and 0 < report.gpus < slots.get(host, 0):
            lines.append(f"host {host}: {slots[host]} ranks but only {report.gpus} GPUs; "
                         "ranks will share GPUs")
    return lines
