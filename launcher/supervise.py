"""Run one job under the MPI launcher: relay output, watch, stop, and explain the outcome.

The launcher process (mpirun) runs in its own session so a Ctrl-C at the
terminal reaches only mtrain, which then stops the job in order: SIGTERM to
mpirun (it stops every rank on every host), and if the job is still there
after STOP_GRACE seconds, SIGKILL to everything left in the session; the
agents' deaths close their SSH sessions, whose remote guards kill what
remains on the hosts.  Every wait is bounded.

Outcome, in priority order: interrupted (130/143) · a host lost or
unreachable (255, naming it) · the *first* rank that failed on its own
(its exit code, or 128+N for signal N) · mpirun's own failure.
"""
from __future__ import annotations

import dataclasses
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import IO, Callable, Sequence

from mtrain.launcher.events import EventReader
from mtrain.launcher.process_tools import die_with_parent, exit_code, live_processes, signal_name, signal_process
from mtrain.launcher.rank import EXIT_MARKER
from mtrain.launcher.ssh_agent import GATE_CLOSED, GATE_OPEN

STOP_GRACE = 5.0           # SIGTERM → SIGKILL for the whole session
LOST_HOST_GRACE = 2.0      # mpirun cannot stop a job cleanly through a dead daemon: shorter wait
FAILURE_GRACE = 2.0        # mpirun normally stops the job itself after a rank fails
SESSION_DRAIN = 3.0        # time for agents to finish after mpirun has exited
CAUSE_WINDOW = 1.0         # failures closer than this are ordered by evidence, not by clock
_PREFIX = re.compile(rb"^\[(\d+)\]<(stdout|stderr)>:")


@dataclasses.dataclass(frozen=True)
class RankExit:
    """How one rank ended, as its wrapper reported it."""

    rank: int
    host: str
    returncode: int
    stopped: bool          # it had been told to stop (a consequence, not a cause)
    time: float
    stderr_tail: tuple[str, ...]
    message: str = ""
    mpi_abort: bool = False  # it ended inside MPI_Abort (a fatal MPI error or an explicit abort)

    @property
    def failed(self) -> bool:
        return self.returncode != 0

    def describe(self) -> str:
        if self.returncode < 0:
            how = f"killed by {signal_name(-self.returncode)}"
        else:
            how = f"exit code {self.returncode}"
        detail = f" ({self.message})" if self.message else ""
        return f"rank {self.rank} on {self.host}: {how}{detail}"


def _evidence(record: RankExit) -> int:
    """How surely this failure began in this rank: 0 sure, 1 plain exit status, 2 doubtful."""
    if record.message or record.returncode < 0:
        return 0   # the runtime's own account, or a signal nobody in the job sent (kill -9, OOM, SEGV)
    if record.mpi_abort:
        return 2   # MPI aborted it; a peer's death or a lost link is the usual reason
    return 1


def first_failure(records: Sequence[RankExit]) -> RankExit | None:
    """The root cause: of the ranks that failed on their own, the first, else the earliest failure.

    Clocks cannot order failures that happen within a few milliseconds of each other
    (a rank's death and its neighbours' MPI errors): inside CAUSE_WINDOW the stronger
    evidence wins, then the earlier time.
    """
    failed = [r for r in records if r.failed]
    own = [r for r in failed if not r.stopped]
    if own:
        start = min(r.time for r in own)
        close = [r for r in own if r.time <= start + CAUSE_WINDOW]
        return min(close, key=lambda r: (_evidence(r), r.time, r.rank))
    return min(failed, key=lambda r: (r.time, r.rank)) if failed else None


class _OutputSink:
    """Writes rank lines to our streams and, optionally, to DIR/rank.N/{stdout,stderr}."""

    def __init__(self, output_dir: Path | None) -> None:
        self.output_dir = output_dir
        self.files: dict[tuple[int, str], IO[bytes]] = {}
        self.lock = threading.Lock()

    def write(self, line: bytes, stream: IO[bytes]) -> None:
        with self.lock:
            stream.write(line)
            stream.flush()
            if self.output_dir is None:
                return
            match = _PREFIX.match(line)
            if not match:
                return
            key = (int(match.group(1)), match.group(2).decode())
            handle = self.files.get(key)
            if handle is None:
                directory = self.output_dir / f"rank.{key[0]}"
                directory.mkdir(parents=True, exist_ok=True)
                handle = self.files[key] = open(directory / key[1], "ab")
            handle.write(line[match.end():])
            handle.flush()

    def close(self) -> None:
        with self.lock:
            for handle in self.files.values():
                handle.close()


class Job:
    """One running mpirun and what we learn about it."""

    def __init__(self, argv: Sequence[str], env: dict[str, str], output_dir: Path | None,
                 verbose: bool, events_path: str | None, preflight: Callable[[], bool] | None = None,
                 gate: str | None = None) -> None:
        self.argv, self.env, self.verbose = list(argv), env, verbose
        self.events_path, self.preflight, self.gate = events_path, preflight, gate
        self.quiet = False
        self.sink = _OutputSink(output_dir)
        self.records: list[RankExit] = []
        self.launcher_tail: list[str] = []
        self.lock = threading.Lock()
        self.interrupted: int | None = None

    def log(self, message: str) -> None:
        if self.verbose:
            print(f"mtrain: [{_stamp()}] {message}", file=sys.stderr, flush=True)

    def _read(self, pipe: IO[bytes], stream: IO[bytes], is_stderr: bool) -> None:
        for line in iter(pipe.readline, b""):
            if is_stderr and EXIT_MARKER in line:
                # mpirun may glue a record to an unterminated line of its own: split it off.
                before, _, payload = line.partition(EXIT_MARKER)
                self._record(payload)
                if not before.strip():
                    continue
                line = before + b"\n"
            if self.quiet:
                continue
            if not _PREFIX.match(line):
                with self.lock:
                    self.launcher_tail = (self.launcher_tail + [line.decode(errors="replace").rstrip()])[-20:]
            self.sink.write(line, stream)

    def _record(self, payload: bytes) -> None:
        try:
            data = json.loads(payload)
            record = RankExit(int(data["rank"]), str(data["host"]), int(data["returncode"]),
                              bool(data["stopped"]), float(data["time"]), tuple(data["stderr_tail"]),
                              str(data.get("message", "")), bool(data.get("mpi_abort", False)))
        except (ValueError, KeyError, TypeError):
            return
        with self.lock:
            self.records.append(record)
        if record.failed:
            self.log(f"{record.describe()}{' (after being stopped)' if record.stopped else ''}")

    def run(self) -> int:
        """Run to completion; print the outcome; return mtrain's exit status."""
        previous = {sig: signal.signal(sig, self._on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            return self._run(self.env, EventReader(self.events_path) if self.events_path else None)
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            self.sink.close()

    def _on_signal(self, number: int, frame) -> None:
        if self.interrupted is None:
            self.interrupted = number

    def _run(self, env: dict[str, str], reader: EventReader | None) -> int:
        self.log("starting: " + " ".join(self.argv))
        try:
            process = subprocess.Popen(self.argv, env=env, stdin=subprocess.DEVNULL,
                                       stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                       start_new_session=True, preexec_fn=_mpirun_dies_with_us)
        except OSError as error:
            print(f"mtrain: cannot start {self.argv[0]}: {error.strerror}", file=sys.stderr)
            return 1
        readers = [threading.Thread(target=self._read, args=(process.stdout, sys.stdout.buffer, False), daemon=True),
                   threading.Thread(target=self._read, args=(process.stderr, sys.stderr.buffer, True), daemon=True)]
        for thread in readers:
            thread.start()
        if self.preflight is not None and not self._pass_gate(process):
            return 1
        host_problems: list[dict] = []
        stop_reason: str | None = None
        stop_sent_at: float | None = None
        failure_seen_at: float | None = None
        while True:
            try:
                process.wait(timeout=0.1)
                break
            except subprocess.TimeoutExpired:
                pass
            now = time.monotonic()
            for event in (reader.poll() if reader else []):
                host_problems.append(event)
                self.log(f"{event['event']}: {event['detail']}")
            if failure_seen_at is None and any(r.failed and not r.stopped for r in self.records):
                failure_seen_at = now
            if stop_reason is None:
                if self.interrupted is not None:
                    stop_reason = f"interrupted by {signal_name(self.interrupted)}"
                elif any(e["event"] == "host-lost" for e in host_problems):
                    stop_reason = "a host was lost"
                elif failure_seen_at is not None and now - failure_seen_at > FAILURE_GRACE:
                    stop_reason = "a rank failed and mpirun did not stop the job"
                if stop_reason is not None:
                    self.log(f"stopping the job: {stop_reason}")
                    signal_process(process.pid, signal.SIGTERM)
                    stop_sent_at = now
            elif stop_sent_at is not None and now - stop_sent_at > (
                    LOST_HOST_GRACE if stop_reason == "a host was lost" else STOP_GRACE):
                self.log("job still running; killing everything it started")
                kill_session(process.pid, signal.SIGKILL)
                stop_sent_at = None
        self.log(f"{os.path.basename(self.argv[0])} exited with status {process.returncode}")
        # Agents may outlive mpirun by a moment; they end on their own when their session does.
        if not wait_session_empty(process.pid, SESSION_DRAIN):
            kill_session(process.pid, signal.SIGKILL)
            wait_session_empty(process.pid, 1.0)
        for thread in readers:
            thread.join(timeout=2.0)
        self.log("all processes of the job have ended")
        host_problems += reader.poll() if reader else []
        return self._outcome(process.returncode, host_problems)

    def _pass_gate(self, process: subprocess.Popen) -> bool:
        """Run the preflight while mpirun's agents connect; open or close their gate."""
        passed = self.preflight()
        if passed:
            open(self.gate + GATE_OPEN, "w").close()
            return True
        # Nothing ran anywhere: the agents only connected.  Silence mpirun's complaints.
        self.quiet = True
        kill_session(process.pid, signal.SIGKILL)
        open(self.gate + GATE_CLOSED, "w").close()
        try:
            process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass
        wait_session_empty(process.pid, 2.0)
        return False

    def _outcome(self, mpirun_status: int, host_problems: list[dict]) -> int:
        records = list(self.records)
        if self.interrupted is not None:
            print(f"mtrain: {signal_name(self.interrupted)} received; all ranks were stopped",
                  file=sys.stderr)
            return 128 + self.interrupted
        failure = first_failure(records)
        lost = [e for e in host_problems if e["event"] == "host-lost"]
        if lost and (failure is None or failure.stopped or lost[0]["time"] <= failure.time):
            for event in lost:
                print(f"mtrain: {event['detail']}; the job was stopped", file=sys.stderr)
            return 255
        if failure is not None:
            self._report(failure, len(records))
            return exit_code(failure.returncode)
        unreachable = [e for e in host_problems if e["event"] == "connect-failed"]
        if unreachable:
            for event in unreachable:
                print(f"mtrain: {event['detail']}", file=sys.stderr)
            return 255
        if mpirun_status != 0:
            print(f"mtrain: {os.path.basename(self.argv[0])} failed with exit status "
                  f"{exit_code(mpirun_status)} before any rank reported a failure "
                  "(its messages are above)", file=sys.stderr)
            return exit_code(mpirun_status) or 1
        return 0

    def _report(self, failure: RankExit, reported: int) -> None:
        print(f"mtrain: job failed; first failure: {failure.describe()}", file=sys.stderr)
        if failure.stderr_tail:
            print(f"mtrain: last stderr lines of rank {failure.rank}:", file=sys.stderr)
            for line in failure.stderr_tail:
                print(f"    {line}", file=sys.stderr)
        others = sorted(r.rank for r in self.records if r.failed and r is not failure)
        if others:
            print(f"mtrain: ranks {', '.join(map(str, others))} were stopped or failed after it",
                  file=sys.stderr)
        sys.stderr.flush()


def _mpirun_dies_with_us() -> None:
    # Runs in the child before exec: even `kill -9 mtrain` makes mpirun stop the job.
    die_with_parent(signal.SIGTERM)


def session_members(session: int) -> list[int]:
    """Live processes whose session id is `session` (mpirun's, which we created)."""
    return [pid for pid, fields in live_processes() if int(fields[3]) == session]


def kill_session(session: int, sig: int) -> None:
    for pid in session_members(session):
        signal_process(pid, sig)


def wait_session_empty(session: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while session_members(session):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def run_job(argv: Sequence[str], env: dict[str, str], output_dir: Path | None = None,
            verbose: bool = False, events_path: str | None = None,
            preflight: Callable[[], bool] | None = None, gate: str | None = None) -> int:
    """Run the launcher argv as one supervised job; return mtrain's exit status.

    `events_path` is the file the SSH agents report connection problems to;
    `preflight` runs once mpirun has started and opens the agents' `gate` when it passes.
    """
    return Job(argv, env, output_dir, verbose, events_path, preflight, gate).run()


def _stamp() -> str:
    now = time.time()
    return time.strftime("%H:%M:%S", time.localtime(now)) + f".{int(now % 1 * 1000):03d}"
