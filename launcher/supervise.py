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

What the user reads is mtrain's report.  The MPI launcher's own lines (the
banners Open MPI prints around every failure) are kept out of the default
output: `--verbose` shows them as they come, `--output-filename DIR` keeps
them in DIR/mpirun.log, and they are shown after all when mpirun fails before
any rank could report why.
"""
from __future__ import annotations

import os
import re
import select
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import IO, Callable, Sequence

from mtrain.launcher.config import StepSettings
from mtrain.launcher.hang_report import FAILURE_QUIET_SECONDS, Collector, HangReport
from mtrain.launcher.process_tools import die_with_parent, exit_code, live_processes, signal_process
from mtrain.launcher.progress import ProgressDisplay, describe
from mtrain.launcher.records import (DAEMON_UMASK, DUMP_MARKER, DUMP_REQUEST_MARKER, EVENT_MARKER, EXIT_MARKER,
                                     PHASE_MARKER,
                                     RESUME_MARKER, STEP_MARKER, AgentEvent, AgentEventKind, AgentEventReader,
                                     DumpRequest, ElasticResume, ExitRecord, Gate, Phase, PhaseNote, RecorderDump,
                                     StepReport, StopReason, signal_name, stuck_in_init)
from mtrain.launcher.stragglers import MIN_STEPS, StepBoard, format_table, title_for

STOP_GRACE = 5.0           # SIGTERM → SIGKILL for the whole session
LOST_HOST_GRACE = 2.0      # mpirun cannot stop a job cleanly through a dead daemon: shorter wait
FAILURE_GRACE = 2.0        # mpirun normally stops the job itself after a rank fails
SESSION_DRAIN = 3.0        # time for agents to finish after mpirun has exited
LATE_EVENT_GRACE = 3.0     # a host's news after mpirun's exit (ssh_master.DRAIN_SECONDS, and a moment)
CAUSE_WINDOW = 1.0         # failures closer than this are ordered by evidence, not by clock
STUCK_GRACE = 3.0          # a job that can never go on (records.stuck_in_init) is stopped after this
LAUNCHER_TAIL = 40         # MPI launcher lines kept to explain a failure no rank reported
_PREFIX = re.compile(rb"^\[(\d+)\]<(stdout|stderr)>:")
# A host whose connection or whose MPI daemon died: the job there is gone.
_LOST = (AgentEventKind.HOST_LOST, AgentEventKind.DAEMON_DIED)


def _take_marker(line: bytes, marker: bytes, take: Callable[[int, bytes], None]) -> bytes:
    """Hand the record after ``marker`` in a rank's line to ``take``, with the rank the line's
    prefix names; what remains of the line (b"" when nothing does)."""
    before, _, payload = line.partition(marker)
    prefix = _PREFIX.match(before)
    if prefix is not None:  # the rank wrapper's prefix names the rank
        take(int(prefix.group(1)), payload)
        before = before[prefix.end():]
    if not before.strip():
        return b""
    return (prefix.group(0) if prefix else b"") + before + b"\n"


def first_failure(records: Sequence[ExitRecord]) -> ExitRecord | None:
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
        return min(close, key=lambda r: (r.evidence, r.time, r.rank))
    return min(failed, key=lambda r: (r.time, r.rank)) if failed else None


class _OutputSink:
    """Writes rank lines to our streams and, optionally, to DIR/rank.N/{stdout,stderr};
    the MPI launcher's own lines go to DIR/mpirun.log (and to our stderr with `verbose`)."""

    def __init__(self, output_dir: Path | None, ranks: int, verbose: bool, timestamp: bool = False) -> None:
        self.output_dir, self.verbose = output_dir, verbose
        self.timestamp = timestamp  # --prefix-output-with-timestamp: Horovod's `{asctime}[rank]<stream>:`
        self.files: dict[tuple[int, str], IO[bytes]] = {}
        self.launcher_log: IO[bytes] | None = None
        self.lock = threading.Lock()
        self.display: ProgressDisplay | None = None  # --progress: the ranks' lines scroll above its line
        if output_dir is not None:
            # Every rank gets both files, even one that never prints: scripts can rely on them.
            for rank in range(ranks):
                for stream in ("stdout", "stderr"):
                    self._file(rank, stream)
            self.launcher_log = open(output_dir / "mpirun.log", "ab")

    def _file(self, rank: int, stream: str) -> IO[bytes]:
        handle = self.files.get((rank, stream))
        if handle is None:
            directory = self.output_dir / f"rank.{rank}"
            directory.mkdir(parents=True, exist_ok=True)
            handle = self.files[(rank, stream)] = open(directory / stream, "ab")
        return handle

    def write(self, line: bytes, stream: IO[bytes]) -> None:
        match = _PREFIX.match(line)
        with self.lock:
            if match is None:
                self._launcher_line(line)
                return
            shown = time.asctime().encode() + line if self.timestamp else line
            if self.display is None or not self.display.write(shown, stream):
                stream.write(shown)
                stream.flush()
            if self.output_dir is not None:
                handle = self._file(int(match.group(1)), match.group(2).decode())
                handle.write(line[match.end():])
                handle.flush()

    def say(self, lines: Sequence[str]) -> None:
        """mtrain's own lines on stderr, together, between the ranks' lines."""
        with self.lock:
            for line in lines:
                if self.display is None or not self.display.write(f"{line}\n".encode()):
                    sys.stderr.write(f"{line}\n")
            sys.stderr.flush()

    def _launcher_line(self, line: bytes) -> None:
        if self.verbose:
            sys.stderr.buffer.write(line)
            sys.stderr.flush()
        if self.launcher_log is not None:
            self.launcher_log.write(line)
            self.launcher_log.flush()

    def close(self) -> None:
        with self.lock:
            for handle in [*self.files.values(), *([self.launcher_log] if self.launcher_log else [])]:
                handle.close()


class Job:
    """One running mpirun and what we learn about it."""

    def __init__(self, argv: Sequence[str], env: dict[str, str], ranks: int, output_dir: Path | None,
                 verbose: bool, events_path: str | None, preflight: Callable[[], str | None] | None = None,
                 gate: Gate | None = None, on_resume: Callable[[ElasticResume], None] | None = None,
                 report_failures: bool = True, prefix_timestamp: bool = False,
                 steps: StepSettings = StepSettings(),
                 interrupted_line: "Callable[[int], str | None] | None" = None,
                 events_on_stderr: bool = False) -> None:
        self.argv, self.env, self.verbose = list(argv), env, verbose
        # What to say when a signal stopped us, where a scheduler knows why it sent one (None: the signal).
        self.interrupted_line = interrupted_line
        self.events_path, self.preflight, self.gate = events_path, preflight, gate
        # Through Slurm the guards' srun writes to mpirun's stderr, and their events come with it.
        self.events_on_stderr = events_on_stderr
        self.stderr_events: list[AgentEvent] = []
        # An elastic driver hears when a generation has resumed, and reports failures itself.
        self.on_resume, self.report_failures = on_resume, report_failures
        self.host_problems: list[AgentEvent] = []
        self.quiet = False
        self.ranks = ranks
        self.sink = _OutputSink(output_dir, ranks, verbose, prefix_timestamp)
        self.records: list[ExitRecord] = []
        self.launcher_tail: list[str] = []
        self.lock = threading.Lock()
        self.interrupted: int | None = None
        # Where each rank's program is (records.PhaseNote): in init() for whom, or ended how.
        self.in_init: dict[int, tuple] = {}
        self.ended: dict[int, int] = {}
        self.stuck: str | None = None  # why the job was stopped as one that could never go on
        # Every rank's measured steps (records.StepReport): the straggler table and --progress.
        self.steps, self.board = steps, StepBoard(ranks)
        self.up: set[int] = set()  # ranks out of init(), whose program has not ended
        self._next_table = steps.every  # --straggler-report N: the step of the next table
        # The flight recorder's hang reports (hang_report.py): SIGUSR1 to mpirun asks every rank.
        self.mpirun_pid: int | None = None
        self.collector = Collector(ranks, self._signal_ranks, output_dir)
        self.usr1 = False  # mtrain run got SIGUSR1 (the handler only sets this: no locks in handlers)

    def log(self, message: str) -> None:
        if self.verbose:
            print(f"mtrain: [{_stamp()}] {message}", file=sys.stderr, flush=True)

    def _read(self, pipe: IO[bytes], stream: IO[bytes], is_stderr: bool) -> None:
        for line in iter(pipe.readline, b""):
            # mpirun's forwarding sometimes starts a line with NUL bytes (seen on the test cluster
            # once a rank has aborted): without them the rank's prefix is found again, so its
            # line is neither taken for mpirun's own nor its record lost.
            line = line.lstrip(b"\0")
            if is_stderr and EXIT_MARKER in line:
                # mpirun may glue a record to an unterminated line of its own: split it off.
                before, _, payload = line.partition(EXIT_MARKER)
                self._record(payload)
                if not before.strip():
                    continue
                line = before + b"\n"
            if is_stderr and self.events_on_stderr and EVENT_MARKER in line:
                line = self._take_event(line)
                if not line:
                    continue
            for marker, take in ((PHASE_MARKER, self._phase), (STEP_MARKER, self._steps),
                                 (DUMP_MARKER, self._dump), (DUMP_REQUEST_MARKER, self._dump_request)):
                if is_stderr and marker in line:
                    line = _take_marker(line, marker, take)
            if not line:
                continue
            if is_stderr and RESUME_MARKER in line:
                resumed = ElasticResume.decode(line.partition(RESUME_MARKER)[2])
                if resumed is not None and self.on_resume is not None:
                    self.on_resume(resumed)
                continue
            if self.quiet:
                continue
            if not _PREFIX.match(line):
                with self.lock:
                    self.launcher_tail = (self.launcher_tail + [line.decode(errors="replace").rstrip()])[-LAUNCHER_TAIL:]
            self.sink.write(line, stream)

    def _take_event(self, line: bytes) -> bytes:
        """A daemon's guard's event (records.EVENT_MARKER) in mpirun's own output: kept for the loop."""
        before, _, payload = line.partition(EVENT_MARKER)
        event = AgentEvent.decode(payload)
        if event is not None:
            with self.lock:
                self.stderr_events.append(event)
        return before + b"\n" if before.strip() else b""

    def _events(self, reader: "AgentEventReader | None") -> list[AgentEvent]:
        """The guards' events since the last call: from the agents' file, and from mpirun's stderr."""
        with self.lock:
            events, self.stderr_events = self.stderr_events, []
        return (reader.poll() if reader else []) + events

    def _record(self, payload: bytes) -> None:
        record = ExitRecord.decode(payload)
        if record is None:
            return
        with self.lock:
            self.records.append(record)
        if record.failed:
            self.log(f"{record.describe()}{' (after being stopped)' if record.stopped else ''}")

    # -- flight recorder ---------------------------------------------------------------------
    def _dump(self, rank: int, payload: bytes) -> None:
        """A rank's flight-recorder dump (the dump names its rank itself)."""
        dump = RecorderDump.decode(payload)
        if dump is not None:
            self.collector.add(dump)

    def _dump_request(self, rank: int, payload: bytes) -> None:
        """A rank's coordinator asks for every rank's dump (a stall)."""
        request = DumpRequest.decode(payload)
        if request is not None:
            self.collector.request(request.reason)

    def _signal_ranks(self) -> None:
        if self.mpirun_pid is not None:
            signal_process(self.mpirun_pid, signal.SIGUSR1)  # mpirun forwards it to every rank

    def _live_ranks(self) -> set[int]:
        with self.lock:
            return set(range(self.ranks)) - set(self.ended) - {r.rank for r in self.records}

    def _failed_rank(self) -> int | None:
        """A rank whose program ended with an error status, or that failed on its own; else None."""
        with self.lock:
            ended = sorted(rank for rank, status in self.ended.items() if status != 0)
            failed = sorted(r.rank for r in self.records if r.failed and not r.stopped)
        return (ended or failed or [None])[0]

    def _print_report(self, hang: HangReport | None) -> None:
        if hang is not None:
            self.sink.say(hang.lines)  # whole lines, between the ranks' lines

    def _on_usr1(self, number: int, frame) -> None:
        self.usr1 = True

    def _phase(self, rank: int, payload: bytes) -> None:
        note = PhaseNote.decode(payload)
        if note is None:
            return
        with self.lock:
            if note.phase is Phase.INIT_WAITING:
                self.in_init[rank] = note.ranks
            elif note.phase is Phase.INIT_DONE:
                self.in_init.pop(rank, None)
                self.up.add(rank)
            else:
                self.ended[rank] = note.status
                self.up.discard(rank)

    def _steps(self, rank: int, payload: bytes) -> None:
        report = StepReport.decode(payload)
        if report is None:
            return
        self.board.add(rank, report)
        every = self.steps.every
        if every and self.report_failures:
            done = self.board.steps_everywhere()
            if done >= self._next_table:
                last = done - done % every
                self._next_table = last + every
                self.sink.say(format_table(self.board.table(last - every + 1, last),
                                           title_for(f"steps {last - every + 1}-{last}")))

    def _say_one(self, line: str) -> None:
        self.sink.say([line])

    def _stop_progress(self) -> None:
        with self.sink.lock:  # no line goes to the display once it is stopping
            display, self.sink.display = self.sink.display, None
        if display is not None:
            display.stop()

    def _progress_line(self) -> str:
        with self.lock:
            up = len(self.up)
        return describe(self.board.progress(), up, self.ranks)

    def print_straggler_table(self) -> None:
        """The table over the whole job, at its end (when it measured enough steps on 2+ ranks)."""
        if not (self.steps.report and self.report_failures):
            return
        if self.board.reporting_ranks() < 2 or self.board.measured_steps() < MIN_STEPS:
            return
        rows = self.board.table()
        if rows:
            self.sink.say(format_table(rows, title_for("the whole job")))

    def _stuck_now(self) -> str | None:
        with self.lock:
            return stuck_in_init(dict(self.in_init), dict(self.ended))

    def run(self) -> int:
        """Run to completion; print the outcome; return mtrain's exit status."""
        previous = {sig: signal.signal(sig, self._on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
        previous[signal.SIGUSR1] = signal.signal(signal.SIGUSR1, self._on_usr1)
        try:
            return self._run(self.env, AgentEventReader(self.events_path) if self.events_path else None)
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            self._stop_progress()
            self.sink.close()

    def _on_signal(self, number: int, frame) -> None:
        if self.interrupted is None:
            self.interrupted = number

    def _run(self, env: dict[str, str], reader: AgentEventReader | None) -> int:
        self.log("starting: " + " ".join(self.argv))
        try:
            # umask: what Open MPI leaves in /tmp is private (see records.ENV_USER_UMASK).
            process = subprocess.Popen(self.argv, env=env, stdin=subprocess.DEVNULL,
                                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, umask=DAEMON_UMASK,
                                       start_new_session=True, preexec_fn=_mpirun_dies_with_us)
        except OSError as error:
            print(f"mtrain: cannot start {self.argv[0]}: {error.strerror}", file=sys.stderr)
            return 1
        self.mpirun_pid = process.pid
        readers = [threading.Thread(target=self._read, args=(process.stdout, sys.stdout.buffer, False), daemon=True),
                   threading.Thread(target=self._read, args=(process.stderr, sys.stderr.buffer, True), daemon=True)]
        for thread in readers:
            thread.start()
        if self.steps.progress:
            self.sink.display = ProgressDisplay(self._progress_line, self.steps.progress_interval, self._say_one)
            self.sink.display.start()
        if self.preflight is not None and not self._pass_gate(process):
            if self.interrupted is not None:
                print(f"mtrain: {signal_name(self.interrupted)} received; nothing was started", file=sys.stderr)
                return 128 + self.interrupted
            return 1
        host_problems: list[AgentEvent] = []
        stop_reason: StopReason | None = None
        stop_sent_at: float | None = None
        failure_seen_at: float | None = None
        stuck_since: float | None = None
        failure_asked = False
        ended = _EndWatch(process)
        while True:
            if ended.wait(0.1):
                break
            now = time.monotonic()
            for event in self._events(reader):
                host_problems.append(event)
                self.log(f"{event.kind.value}: {event.detail}")
            if failure_seen_at is None and any(r.failed and not r.stopped for r in self.records):
                failure_seen_at = now
            failed = self._failed_rank()
            if failed is not None and not failure_asked:
                # What the others were doing, asked while they still run (a failing rank's program
                # says it ended about a second before its MPI_Abort stops the job); printed
                # before the failure report.
                failure_asked = True
                self.collector.request(f"rank {failed} failed", FAILURE_QUIET_SECONDS)
            if self.usr1:
                self.usr1 = False
                self.collector.request("SIGUSR1 to mtrain run")
            self._print_report(self.collector.poll(self._live_ranks()))
            # Held for a moment first: a rank's note that it left init() may come a little
            # after a peer's note that its program ended, through another pipe.
            stuck = self._stuck_now()
            stuck_since = (stuck_since or now) if stuck else None
            if stop_reason is None:
                if self.interrupted is not None:
                    stop_reason = StopReason.INTERRUPTED
                elif stuck and now - stuck_since > STUCK_GRACE:
                    stop_reason, self.stuck = StopReason.STUCK, stuck
                elif any(e.kind in _LOST for e in host_problems):
                    stop_reason = StopReason.HOST_LOST
                elif failure_seen_at is not None and now - failure_seen_at > FAILURE_GRACE:
                    stop_reason = StopReason.RANK_FAILED
                if stop_reason is not None:
                    self.log(f"stopping the job: {stop_reason.value}")
                    signal_process(process.pid, signal.SIGTERM)
                    stop_sent_at = now
            elif stop_sent_at is not None and now - stop_sent_at > (
                    LOST_HOST_GRACE if stop_reason is StopReason.HOST_LOST else STOP_GRACE):
                self.log("job still running; killing everything it started")
                kill_session(process.pid, signal.SIGKILL)
                stop_sent_at = None
        ended.close()
        self.mpirun_pid = None  # nothing to signal any more
        self.log(f"{os.path.basename(self.argv[0])} exited with status {process.returncode}")
        # Agents may outlive mpirun by a moment; they end on their own when their session does.
        if not wait_session_empty(process.pid, SESSION_DRAIN):
            kill_session(process.pid, signal.SIGKILL)
            wait_session_empty(process.pid, 1.0)
        for thread in readers:
            thread.join(timeout=2.0)
        self.log("all processes of the job have ended")
        host_problems += self._events(reader)
        # Ranks that never reported an end, and no word of a host: their host's relay may still
        # be passing on what its guard said (the connection master outlives mpirun's agents).
        deadline = time.monotonic() + LATE_EVENT_GRACE
        while ((reader or self.events_on_stderr) and not any(e.kind in _LOST for e in host_problems)
               and time.monotonic() < deadline
               and len({r.rank for r in self.records}) < self.ranks and self.interrupted is None):
            time.sleep(0.1)
            host_problems += self._events(reader)
        self.host_problems = host_problems
        self._print_report(self.collector.finish(set()))  # a collection the job's end cut short
        self._stop_progress()
        self.print_straggler_table()
        return self._outcome(process.returncode, host_problems)

    def _pass_gate(self, process: subprocess.Popen) -> bool:
        """Run the preflight while mpirun's agents connect; open or close their gate."""
        message = self.preflight()
        if message is not None:
            self.gate.open(message)
            return True
        # Nothing ran anywhere: the agents only connected.  Silence mpirun's complaints.
        self.quiet = True
        kill_session(process.pid, signal.SIGKILL)
        self.gate.close()
        try:
            process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass
        wait_session_empty(process.pid, 2.0)
        return False

    def _outcome(self, mpirun_status: int, host_problems: list[AgentEvent]) -> int:
        records = list(self.records)
        if self.interrupted is not None:
            said = self.interrupted_line(self.interrupted) if self.interrupted_line else None
            print(said or f"mtrain: {signal_name(self.interrupted)} received; all ranks were stopped", file=sys.stderr)
            return 128 + self.interrupted
        if self.stuck is not None:
            print(f"mtrain: job stopped: it could never go on: {self.stuck}", file=sys.stderr)
            return 1
        failure = first_failure(records)
        lost = [e for e in host_problems if e.kind in _LOST]
        say = self.report_failures
        if lost and (failure is None or failure.stopped or lost[0].time <= failure.time):
            for event in lost if say else ():
                print(f"mtrain: {event.detail}; the job was stopped", file=sys.stderr)
            return 255
        if failure is not None:
            if failure.report and failure.returncode in (-signal.SIGTERM, -signal.SIGKILL):
                # It raised, told the runtime so, and was aborting with status 1 when a peer's
                # abort stopped it first (two ranks raising at once): its own status is 1.
                failure = failure.replace(returncode=1)
            if say:
                print_failure_report(failure, records, self.verbose, self.ranks)
            return exit_code(failure.returncode) or 1
        unreachable = [e for e in host_problems if e.kind is AgentEventKind.CONNECT_FAILED]
        if unreachable:
            for event in unreachable if say else ():
                print(f"mtrain: {event.detail}", file=sys.stderr)
            return 255
        # Every rank's wrapper writes a record however its rank ends, so a rank without one was
        # killed with its wrapper: Open MPI 5's launcher exits 0 when a host's daemon dies
        # (killed, with its ranks), and 0 must mean that every rank finished.
        silent = sorted(set(range(self.ranks)) - {r.rank for r in records})
        if mpirun_status != 0 or silent:
            launcher = os.path.basename(self.argv[0])
            if self.launcher_tail and not self.verbose:
                print(f"mtrain: {launcher} said:", file=sys.stderr)
                for line in self.launcher_tail:
                    print(f"    {line}", file=sys.stderr)
            if mpirun_status != 0:
                print(f"mtrain: {launcher} failed with exit status {exit_code(mpirun_status)} "
                      "before any rank reported a failure", file=sys.stderr)
            else:
                which = f"rank {silent[0]}" if len(silent) == 1 else f"ranks {', '.join(map(str, silent))}"
                print(f"mtrain: {launcher} exited with status 0, but {which} of {self.ranks} never reported "
                      "an end (killed with the rank wrapper, or the host's MPI daemon died): the job did not "
                      "finish", file=sys.stderr)
            return exit_code(mpirun_status) or 1
        return 0

def print_failure_report(failure: ExitRecord, records: Sequence[ExitRecord], verbose: bool,
                         size: int = 0) -> None:
    """mtrain's report of a failed job: the first failure in one line, then what followed.

    Of a job of `size` ranks, a rank with no record was stopped before its wrapper could
    write one: Open MPI's launcher sends SIGKILL to a rank's process group a moment after
    SIGTERM (within milliseconds), so on a busy host a stopped wrapper often dies first.
    """
    print(f"mtrain: job failed; first failure: {failure.describe()}", file=sys.stderr)
    # A reason in one line is enough (the full traceback is above, prefixed with the rank);
    # without one, the rank's last words are the best clue (a signal, a silent exit).
    if failure.stderr_tail and (verbose or not failure.reason):
        print(f"mtrain: last stderr lines of rank {failure.rank}:", file=sys.stderr)
        for line in failure.stderr_tail:
            print(f"    {line}", file=sys.stderr)
    reported = {r.rank for r in records}
    silent = {rank for rank in range(size) if rank not in reported}
    others = sorted({r.rank for r in records if r.failed and r.rank != failure.rank} | silent)
    if len(others) == 1:
        print(f"mtrain: rank {others[0]} was stopped or failed after it", file=sys.stderr)
    elif others:
        print(f"mtrain: ranks {', '.join(map(str, others))} were stopped or failed after it", file=sys.stderr)
    sys.stderr.flush()


class _EndWatch:
    """Waits for a child to end and wakes the moment it does (a pidfd where Linux has them;
    Popen.wait polls, up to 50 ms late, and this wait is on every job's way out)."""

    def __init__(self, process: subprocess.Popen) -> None:
        self.process = process
        try:
            self.pidfd: int | None = os.pidfd_open(process.pid)
        except (AttributeError, OSError):
            self.pidfd = None

    def wait(self, timeout: float) -> bool:
        """True once the process has ended (reaped), after at most `timeout` seconds."""
        if self.pidfd is None:
            try:
                self.process.wait(timeout=timeout)
                return True
            except subprocess.TimeoutExpired:
                return False
        select.select([self.pidfd], [], [], timeout)
        return self.process.poll() is not None

    def close(self) -> None:
        if self.pidfd is not None:
            os.close(self.pidfd)
            self.pidfd = None


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
        time.sleep(0.02)  # the agents usually end a moment after mpirun: look again soon
    return True


def _stamp() -> str:
    now = time.time()
    return time.strftime("%H:%M:%S", time.localtime(now)) + f".{int(now % 1 * 1000):03d}"
