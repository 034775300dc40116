"""Elastic jobs (`--min-np`, `--max-np`, `--host-discovery-script`): generations of mpirun.

An MPI world cannot shrink or grow, so an elastic job runs as a series of
generations, one mpirun each, over the host set of the moment:

    discover hosts ─▶ plan (≥ --min-np, ≤ --max-np, no blacklisted host) ─▶ run a generation
         ▲                                                                        │
         └── a host was lost (its ranks were killed, its link died): blacklist it ┤
         └── the discovery script shows new or vanished hosts: the ranks are told ┘
             (hvd.elastic raises HostsUpdatedInterrupt at their next commit and
             every rank exits with RESET_EXIT_STATUS)

The ranks keep each `state.commit()` in memory and in a snapshot on their host
(MTRAIN_ELASTIC_STATE_DIR), so a new generation restores the newest commit any
surviving rank holds and no committed work is lost.  A program error (an
exception, a plain non-zero exit) is not a host problem: it ends the job with
the usual report.  Every reset is logged in one line, once the new generation
has said from which commit it resumed.
"""
from __future__ import annotations

import dataclasses
import math
import os
import shlex
import socket
import subprocess
import sys
import threading
import time
import uuid
from typing import Callable

from mtrain.common.records.agent_events import AgentEventKind
from mtrain.common.records.elastic import (
    ENV_ELASTIC,
    ENV_ELASTIC_STATE_DIR,
    RESET_EXIT_STATUS,
    ElasticResume,
    new_job_secret,
)
from mtrain.common.records.exit_record import ExitRecord
from mtrain.launcher.cli.config import LaunchConfig, Launcher
from mtrain.launcher.job import job_files, slurm
from mtrain.launcher.job.hosts import HostSlots, is_local, local_names
from mtrain.launcher.supervise.outcome import first_failure, print_failure_report

DISCOVERY_INTERVAL = 1.0      # seconds between runs of the discovery script while a generation runs
DISCOVERY_TIMEOUT = 30.0      # one run of the script
STATE_DIRECTORY = "/dev/shm" if os.path.isdir("/dev/shm") else "/tmp"
INTERRUPTED_WAIT = 2.0       # for the discovery script a Ctrl-C'd job's watcher is running
CLEANUP_TIMEOUT = 5.0         # connecting to a host, and removing its snapshots, at the job's end


class DiscoveryError(Exception):
    """The discovery script failed or printed something that is not a host list."""


def parse_discovery_output(text: str, slots_per_host: int | None) -> list[HostSlots]:
    """Hosts in the order printed: lines `host` or `host:slots` (blank lines are skipped)."""
    hosts: list[HostSlots] = []
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line:
            continue
        name, colon, slots_text = line.partition(":")
        if not name or any(c.isspace() for c in line) or (colon and not slots_text.isdigit()):
            raise DiscoveryError(f"line {number}: {line[:60]!r} is not `host` or `host:slots`")
        if colon:
            slots = int(slots_text)
        elif slots_per_host is not None:
            slots = slots_per_host
        else:
            raise DiscoveryError(f"line {number}: host {name} has no slot count; print `{name}:N` "
                                 "or give --slots-per-host")
        if slots < 1:
            raise DiscoveryError(f"line {number}: host {name} has {slots} slots; need at least 1")
        if any(h.name == name for h in hosts):
            raise DiscoveryError(f"line {number}: host {name} is listed twice")
        hosts.append(HostSlots(name, slots))
    return hosts


def run_discovery(script: str, slots_per_host: int | None) -> list[HostSlots]:
    """The hosts the script prints now; DiscoveryError says what went wrong, in one line."""
    try:
        done = subprocess.run([os.path.abspath(script) if os.path.exists(script) else script],
                              capture_output=True, text=True, timeout=DISCOVERY_TIMEOUT)
    except subprocess.TimeoutExpired:
        raise DiscoveryError(f"--host-discovery-script {script} did not finish within "
                             f"{DISCOVERY_TIMEOUT:g} s") from None
    except OSError as error:
        raise DiscoveryError(f"--host-discovery-script {script}: cannot run it ({error.strerror}); "
                             "it must be an executable file") from None
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["no message"])[-1]
        raise DiscoveryError(f"--host-discovery-script {script} exited with status {done.returncode}: {last}")
    try:
        return parse_discovery_output(done.stdout, slots_per_host)
    except DiscoveryError as error:
        raise DiscoveryError(f"--host-discovery-script {script} printed garbage: {error}") from None


class Blacklist:
    """Hosts that failed; with a cooldown range (lo, hi) a host returns after lo·n seconds (capped
    at hi) for its n-th failure, as Horovod's --blacklist-cooldown-range; without one, never."""

    def __init__(self, cooldown: tuple[float, float] | None) -> None:
        self.cooldown = cooldown
        self.failures: dict[str, int] = {}
        self.until: dict[str, float] = {}

    def add(self, host: str, now: float) -> None:
        count = self.failures[host] = self.failures.get(host, 0) + 1
        if self.cooldown is None:
            self.until[host] = math.inf
        else:
            low, high = self.cooldown
            self.until[host] = now + min(low * count, high)

    def allows(self, host: str, now: float) -> bool:
        return self.until.get(host, -math.inf) <= now

    def listed(self, now: float) -> list[str]:
        return sorted(h for h in self.until if not self.allows(h, now))


def plan_hosts(available: list[HostSlots], blacklist: Blacklist, now: float, limit: int | None) -> list[HostSlots]:
    """Usable hosts in discovery order, slots trimmed so the total stays within `limit`."""
    plan: list[HostSlots] = []
    total = 0
    for host in available:
        if not blacklist.allows(host.name, now):
            continue
        slots = host.slots if limit is None else min(host.slots, limit - total)
        if slots <= 0:
            break
        plan.append(HostSlots(host.name, slots))
        total += slots
    return plan


@dataclasses.dataclass
class _Reset:
    """What ended a generation, for the one line logged once the next one has resumed."""

    number: int
    kind: str        # "failure" or "change": what the time in the log line is counted from
    why: str
    started: float   # wall-clock time the trouble began (a failure's own time, or the change seen)


class ElasticDriver:
    def __init__(self, config: LaunchConfig) -> None:
        assert config.elastic is not None
        self.config, self.settings = config, config.elastic
        self.blacklist = Blacklist(self.settings.cooldown)
        self.job_id = uuid.uuid4().hex
        self.secret = new_job_secret()  # signs every generation's snapshots (bindings/elastic/snapshot.py)
        self.state_dir = os.path.join(STATE_DIRECTORY, f"mtrain-elastic-{self.job_id}")
        self.remote_hosts_used: set[str] = set()  # their snapshots are removed at the end
        self.generations = 0  # started so far
        self.resets = 0
        self.pending: _Reset | None = None
        self.discovery_problem = ""

    # -- hosts ------------------------------------------------------------------------------
    def discover(self) -> list[HostSlots]:
        if self.settings.discovery_script is None:
            return list(self.settings.fixed_hosts)
        return run_discovery(self.settings.discovery_script, self.settings.slots_per_host)

    def wait_for_plan(self, limit: int | None) -> tuple[list[HostSlots], set[str]] | None:
        """A plan with at least --min-np slots, waiting up to --elastic-timeout for one, and the
        names of the hosts usable then (a host not among them joins later as an added host)."""
        deadline = time.monotonic() + self.settings.timeout
        while True:
            now = time.monotonic()
            try:
                available = self.discover()
                problem = ""
            except DiscoveryError as error:
                available, problem = [], str(error)
            plan = plan_hosts(available, self.blacklist, now, limit)
            if sum(h.slots for h in plan) >= self.settings.min_np:
                return plan, {h.name for h in available if self.blacklist.allows(h.name, now)}
            if now >= deadline:
                listed = self.blacklist.listed(now)
                detail = problem or (f"{sum(h.slots for h in plan)} slots on "
                                     f"{', '.join(f'{h.name}:{h.slots}' for h in plan) or 'no host'}")
                print(f"mtrain: elastic: below --min-np {self.settings.min_np} for --elastic-timeout "
                      f"{self.settings.timeout:g} s ({detail}"
                      + (f"; blacklisted: {', '.join(listed)}" if listed else "") + "); giving up",
                      file=sys.stderr, flush=True)
                return None
            time.sleep(DISCOVERY_INTERVAL)

    def watch(self, plan: list[HostSlots], known: set[str], generation, stop: threading.Event) -> None:
        """While a generation runs: tell its ranks when a running host vanishes from discovery, or
        when hosts appear that were not there when it started and there is room to grow."""
        running = {h.name: h.slots for h in plan}
        limit = self.settings.max_np
        while not stop.wait(DISCOVERY_INTERVAL):
            try:
                available = self.discover()
                if stop.is_set():
                    return  # the generation ended while the script ran: _after() decides now
            except DiscoveryError as error:
                if str(error) != self.discovery_problem:  # say it once; the job goes on
                    print(f"mtrain: warning: {error}; the job goes on with its hosts", file=sys.stderr, flush=True)
                self.discovery_problem = str(error)
                continue
            self.discovery_problem = ""
            wanted = plan_hosts(available, self.blacklist, time.monotonic(), limit)
            gone = [name for name in running if name not in {h.name for h in available}]
            grown = [h.name for h in wanted if h.name not in running and h.name not in known]
            if gone or (grown and sum(h.slots for h in wanted) > sum(running.values())):
                why = "; ".join(part for part in (f"{', '.join(grown)} added" if grown else "",
                                                   f"{', '.join(gone)} gone" if gone else "") if part)
                self.pending = _Reset(self.resets + 1, "change", f"host set changed ({why})", time.time())
                generation.notify(1)
                return

    # -- generations ------------------------------------------------------------------------
    def run(self) -> int:
        from mtrain.launcher.job.launch import Generation, launch
        limit = self.settings.initial_np
        try:
            while True:
                found = self.wait_for_plan(limit)
                if found is None:
                    return 1
                plan, known = found
                limit = self.settings.max_np  # after the first generation, grow to what is there
                names = local_names()
                config = dataclasses.replace(self.config, plan=tuple(plan), remote_hosts=tuple(
                    h.name for h in plan if not is_local(h.name, names)))
                self.remote_hosts_used.update(config.remote_hosts)
                self.generations += 1
                generation = Generation(env={ENV_ELASTIC: "1", ENV_ELASTIC_STATE_DIR: f"{self.state_dir}/{{host}}"},
                                        job_id=self.job_id, secret=self.secret, number=self.generations,
                                        on_resume=self._resumed(plan))
                stop = threading.Event()
                watcher = threading.Thread(target=self.watch, args=(plan, known, generation, stop), daemon=True)
                watcher.start()
                try:
                    status = launch(config, generation=generation)
                finally:
                    stop.set()
                # What the watcher saw before `stop` counts in _after(); a script it is running ends
                # before mtrain does. On Ctrl-C or SIGTERM the wait is short: the user asked to stop.
                watcher.join(timeout=INTERRUPTED_WAIT if generation.interrupted else DISCOVERY_TIMEOUT + 2)
                if status == 0 or generation.interrupted:
                    return status
                decision = self._after(generation, status, plan)
                if decision is not None:
                    return decision
        finally:
            self._remove_snapshots()

    def _remove_snapshots(self) -> None:
        """At the job's end, remove the snapshots every host holds: this one's here, the others'
        over SSH, in parallel and bounded (a host that is gone keeps its own, in its /dev/shm)."""
        template = os.path.join(self.state_dir, "{host}")
        job_files.remove_folder(template, socket.gethostname())
        if self.config.launcher is Launcher.SLURM:
            if self.remote_hosts_used:  # one step on all those nodes (a node that is gone keeps its own)
                slurm.run_step(sorted(self.remote_hosts_used), [sys.executable, "-m", "mtrain.launcher.job.job_files",
                                                                "remove-folder", template],
                               2 * CLEANUP_TIMEOUT, "mtrain-cleanup")
            return
        command = f"{shlex.quote(sys.executable)} -m mtrain.launcher.job.job_files remove-folder {shlex.quote(template)}"

        def remove_on(host: str) -> None:
            from mtrain.launcher.ssh import client as ssh  # paramiko only for jobs with remote hosts
            try:
                client = ssh.connect(host, self.config.ssh, timeout=CLEANUP_TIMEOUT)
            except Exception:  # noqa: BLE001 - a host that is gone or refuses: nothing to do there
                return
            try:
                ssh.run_command(client, command, CLEANUP_TIMEOUT)
            except Exception:  # noqa: BLE001
                pass
            finally:
                client.close()

        started = time.monotonic()
        left = on_hosts_within(sorted(self.remote_hosts_used), remove_on, 2 * CLEANUP_TIMEOUT)
        if self.config.verbose:
            done = len(self.remote_hosts_used) - len(left)
            print(f"mtrain: elastic: snapshot cleanup: {done} of {len(self.remote_hosts_used)} hosts answered in "
                  f"{time.monotonic() - started:.1f} s" + (f" (no answer in time from {', '.join(left)})" if left else ""),
                  file=sys.stderr, flush=True)

    def _after(self, generation, status: int, plan: "list[HostSlots]") -> int | None:
        """None to go on with the next generation, else mtrain's exit status."""
        now, wall = time.monotonic(), time.time()
        records = generation.records
        failure = first_failure(records)
        lost = sorted({e.host for e in generation.host_problems if e.kind in (
            AgentEventKind.HOST_LOST, AgentEventKind.DAEMON_DIED, AgentEventKind.CONNECT_FAILED)})
        # A host none of whose ranks reported an end lost them with their wrappers: the whole host
        # died, or its MPI daemon did (then Open MPI's launcher kills every rank and exits 0, and
        # the event above names the host). Lost as surely as a dead link. (No record and no event:
        # nothing started, and the preflight said why.)
        silent = silent_hosts(plan, records) if records else []
        if silent and not lost:
            lost = silent
        if reset_asked(records) and not lost:
            if self.pending is None:
                self.pending = _Reset(self.resets + 1, "change", "the ranks asked for a new host set", wall)
        elif lost:
            for host in lost:
                self.blacklist.add(host, now)
            began = min((e.time for e in generation.host_problems), default=wall)
            self.pending = _Reset(self.resets + 1, "failure", f"host {', '.join(lost)} lost", began)
        elif failure is not None and _host_failure(failure):
            self.blacklist.add(failure.host, now)
            self.pending = _Reset(self.resets + 1, "failure", f"host {failure.host} failed ({failure.describe()})",
                                  failure.time)
        else:
            if failure is not None:  # the program's own error: not something a new host fixes
                print_failure_report(failure, records, self.config.verbose, generation.size)
            return status or 1
        self.resets += 1
        limit = self.settings.reset_limit
        if limit is not None and self.resets > limit:
            print(f"mtrain: elastic: {self.pending.why}, but the job was already reset {limit} times "
                  f"(--reset-limit {limit}); giving up", file=sys.stderr, flush=True)
            return 1
        return None

    def _resumed(self, plan: list[HostSlots]):
        def say(resumed: ElasticResume) -> None:
            reset, self.pending = self.pending, None
            if reset is None:
                return  # the first generation: nothing was reset
            where = ", ".join(f"{h.name}:{h.slots}" for h in plan)
            commit = f"commit {resumed.commit}" if resumed.commit >= 0 else "the start (no commit yet)"
            print(f"mtrain: elastic reset {reset.number}: {reset.why}; now {resumed.size} ranks on {where}; "
                  f"resumed from {commit} {time.time() - reset.started:.1f} s after the {reset.kind}",
                  file=sys.stderr, flush=True)
        return say


def on_hosts_within(hosts: "list[str]", action: "Callable[[str], None]", seconds: float) -> "list[str]":
    """Run `action(host)` for every host at once, waiting at most `seconds` in all (not per host:
    a job that ends, on Ctrl-C too, waits no longer for many slow hosts than for one); the hosts
    whose action had not finished by then (their threads are left to end by themselves)."""
    workers = [threading.Thread(target=action, args=(host,), daemon=True) for host in hosts]
    deadline = time.monotonic() + seconds
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(timeout=max(0.0, deadline - time.monotonic()))
    return [host for host, worker in zip(hosts, workers) if worker.is_alive()]


def silent_hosts(plan: "list[HostSlots]", records: "list[ExitRecord]") -> "list[str]":
    """The hosts of the plan (in plan order) none of whose ranks wrote an exit record: lost
    whole, unless a rank elsewhere failed on its own (then that is the cause, and what those
    hosts' ranks said as the job was stopped was lost on its way: a record is a line of output)."""
    reported = {r.rank for r in records}
    hosts, first = [], 0
    for host in plan:
        if not any(rank in reported for rank in range(first, first + host.slots)):
            hosts.append(host.name)
        first += host.slots
    if any(r.failed and not r.stopped and r.host not in hosts for r in records):
        return []
    return hosts


def reset_asked(records: "list[ExitRecord]") -> bool:
    """Whether the generation ended because its ranks asked for the next one: each rank exited
    with RESET_EXIT_STATUS, or was killed by the job's stop after one had (Open MPI stops the
    others the moment a rank exits with a status other than 0; one still on its way out of
    MPI_Finalize then dies by that signal instead of exiting with its own 75)."""
    asked = [r for r in records if r.returncode == RESET_EXIT_STATUS and not r.stopped]
    return bool(asked) and all(r.returncode == RESET_EXIT_STATUS or (r.stopped and r.returncode < 0)
                               for r in records)


def _host_failure(record: ExitRecord) -> bool:
    """Killed by a signal, with no exception of its own: the host's doing, not the program's."""
    return record.returncode < 0 and not record.report


def run_elastic(config: LaunchConfig) -> int:
    return ElasticDriver(config).run()
