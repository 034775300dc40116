"""Check every remote host before any rank starts: all hosts in parallel, one bounded wait.

Per host: connect (host key verified), then run a probe with the launcher's
own Python path that reports mtrain's version, the host's GPU count, its
addresses and as many free TCP ports as the job needs there (for
torch.distributed's MASTER_PORT and tf.distribute's workers).  Every
failing host yields one line; the job starts only if there are none.

With `keep` (launcher/ssh/master.py), a host that passed keeps its
connection, and its probe keeps running: it waits for a go line and then
becomes that host's remote guard, so the job reuses the preflight's SSH
connection, session and Python instead of opening its own.
"""
from __future__ import annotations

import dataclasses
import ipaddress
import json
import shlex
import threading
import time
from typing import Any, Callable, Mapping, Sequence

from mtrain.launcher.cli.config import SshOptions

# Runs on the remote host; must work with nothing but mtrain installed.
PROBE = r"""
import json, os, sys
try:
    import mtrain
    from mtrain.launcher.cli.capabilities import gpu_count
    from mtrain.launcher.job.netif import free_ports, interface_addresses
except Exception:
    found = {"version": None}
else:
    try:
        found = {"version": mtrain.__version__, "gpus": gpu_count(), "addresses": interface_addresses(),
                 "ports": free_ports(int(sys.argv[1]))}
    except Exception as error:
        found = {"version": mtrain.__version__, "error": f"{type(error).__name__}: {error}"}
found["node"] = os.environ.get("SLURMD_NODENAME", "")  # which node answered, through srun (launcher/job/slurm.py)
print(json.dumps(found), flush=True)
if len(sys.argv) > 3 and found.get("version") == sys.argv[2] and "error" not in found:
    # The launcher keeps this session: wait for its go line, then guard the job's daemon here.
    from mtrain.launcher.process_tools import exit_now
    from mtrain.launcher.remote_guard import after_probe
    exit_now(after_probe(float(sys.argv[3])))
"""


@dataclasses.dataclass(frozen=True)
class HostReport:
    """What the preflight learned about one host (error set when it failed)."""

    host: str
    error: str | None = None
    gpus: int = 0
    addresses: Mapping[str, str] = dataclasses.field(default_factory=dict)  # interface -> "ip/len"
    ports: tuple[int, ...] = ()  # free TCP ports there, as many as asked for
    address: str = ""  # the host's IPv4 address as the preflight reached it ("" if not IPv4)
    source: str = ""   # this machine's IPv4 address on that connection ("" if not IPv4)


# keep(host, client, probe channel) -> True if it took both (they then stay open)
Keeper = Callable[[str, Any, Any], bool]
# How long a kept probe waits for its go line beyond the preflight's own timeout.
GO_WAIT_MARGIN = 30.0


def probe_host(host: str, options: SshOptions, python: str, version: str, timeout: float,
               ports: int = 0, keep: Keeper | None = None) -> HostReport:
    """Connect to `host` and run the probe (asking for `ports` free ports); never raises.

    With `keep`, a host that passes hands its connection and its probe (now waiting for a
    go line) to `keep` instead of closing them.
    """
    from mtrain.launcher.ssh import client as ssh  # keeps paramiko out of local-only jobs
    try:
        client = ssh.connect(host, options, timeout=timeout)
    except ssh.SshError as error:
        return HostReport(host, str(error))
    except Exception as error:  # a report line, never a traceback from a worker thread
        return HostReport(host, f"host {host}: cannot connect: {type(error).__name__}: {error}")
    kept = False
    try:
        address, source = _addresses(client)
        command = f"{shlex.quote(python)} -c {shlex.quote(PROBE)} {int(ports)}"
        if keep is None:
            status, out, err = ssh.run_command(client, command, timeout)
            found = _parse(out)
        else:
            command += f" {shlex.quote(version)} {timeout + GO_WAIT_MARGIN:g}"
            channel, status, out, err = ssh.start_command(client, command, timeout, _answered)
            found = _parse(out)
        report = judge(host, python, version, status, found, err, address, source)
        if keep is not None:
            if report.error is None:
                kept = keep(host, client, channel)
            if not kept:
                channel.close()
        return report
    except Exception as error:
        return HostReport(host, f"host {host}: probe failed: {error}")
    finally:
        if not kept:
            client.close()


def _addresses(client: Any) -> tuple[str, str]:
    """(the host's, ours) IPv4 addresses on the client's connection; "" where not IPv4."""
    try:
        sock = client.get_transport().sock
        peer, own = sock.getpeername()[0], sock.getsockname()[0]
    except (OSError, AttributeError, IndexError, TypeError):
        return "", ""
    return (peer if _is_ipv4(peer) else ""), (own if _is_ipv4(own) else "")


def _is_ipv4(text: str) -> bool:
    try:
        return isinstance(ipaddress.ip_address(text), ipaddress.IPv4Address)
    except ValueError:
        return False


def _parse(out: str) -> dict | None:
    """The probe's answer: the JSON object on the last line of its output, if there is one."""
    try:
        found = json.loads(out.strip().splitlines()[-1])
    except (ValueError, IndexError):
        return None
    return found if isinstance(found, dict) else None


def _answered(out: str) -> bool:
    """Whether a running probe has given its answer (a complete JSON line with a version)."""
    complete, newline, _ = out.rpartition("\n")
    found = _parse(complete) if newline else None
    return found is not None and "version" in found


def judge(host: str, python: str, version: str, status: int | None, found: dict | None, err: str,
           address: str, source: str) -> HostReport:
    """The report for what the probe said (`status` None: it answered and is still running)."""
    if status == 127:
        return HostReport(host, f"host {host}: no Python at {python} (mtrain needs the same "
                          "environment at the same path on every host)")
    if found is None:
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
                      tuple(int(port) for port in found.get("ports", ())), address, source)


def run_preflight(hosts: Sequence[str], options: SshOptions, python: str, version: str,
                  timeout: float, ports: Mapping[str, int] | None = None,
                  keep: Keeper | None = None, stopped: Callable[[], bool] | None = None) -> dict[str, HostReport]:
    """Probe all hosts in parallel; a host without an answer by `timeout` is reported as such.
    When `stopped()` turns true (mtrain is being stopped) it returns at once.

    `ports` says how many free ports to find on each host (none by default); `keep`: see
    probe_host (a host that answers after the deadline is offered too: `keep` decides).
    """
    results: dict[str, HostReport] = {}
    lock = threading.Lock()

    def work(host: str) -> None:
        report = probe_host(host, options, python, version, timeout, (ports or {}).get(host, 0), keep)
        with lock:
            results[host] = report

    # Daemon threads: a host stuck in a TCP handshake must not keep mtrain alive past the deadline.
    threads = [threading.Thread(target=work, args=(host,), daemon=True) for host in hosts]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + timeout
    for thread in threads:
        while thread.is_alive() and time.monotonic() < deadline and not (stopped and stopped()):
            thread.join(min(0.1, max(0.0, deadline - time.monotonic())))
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
