"""Run one job under the MPI launcher: relay output, watch, stop, and explain the outcome.

The launcher process (mpirun) runs in its own session so a Ctrl-C at the
terminal reaches only mtrain, which then stops the job in order: SIGTERM to
mpirun (it stops every rank on every host), and if the job is still there
after STOP_GRACE seconds, SIGKILL to everything left in the session; the
agents' deaths close their SSH sessions, whose remote guards kill what
remains on the hosts.  Every wait is bounded.

The outcome and the failure report are outcome.py's; the lines the user
reads go through output.py's sink.

What the user reads is mtrain's report.  The MPI launcher's own lines (the
banners Open MPI prints around every failure) are kept out of the default
output: `--verbose` shows them as they come, `--output-filename DIR` keeps
them in DIR/mpirun.log, and they are shown after all when mpirun fails before
any rank could report why.
"""
from __future__ import annotations

import enum
import os
import select
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import IO, Callable, Sequence

from mtrain.common.records.agent_events import EVENT_MARKER, AgentEvent, AgentEventReader
from mtrain.common.records.daemon_env import DAEMON_UMASK
from mtrain.common.records.elastic import RESUME_MARKER, ElasticResume
from mtrain.common.records.exit_record import EXIT_MARKER, ExitRecord, signal_name
from mtrain.common.records.flight_recorder import DUMP_MARKER, DUMP_REQUEST_MARKER, DumpRequest, RecorderDump
from mtrain.common.records.gate import Gate
from mtrain.common.records.phase import PHASE_MARKER, Phase, PhaseNote
from mtrain.common.records.steps import STEP_MARKER, StepReport
from mtrain.launcher.cli.config import StepSettings
from mtrain.launcher.process_tools import die_with_parent, live_processes, signal_process
from mtrain.launcher.supervise.hang_report import FAILURE_QUIET_SECONDS, Collector, HangReport
from mtrain.launcher.supervise.outcome import LOST_HOST_KINDS, JobEnd, exit_status
from mtrain.launcher.supervise.output import RANK_PREFIX, OutputSink, log
from mtrain.launcher.supervise.progress import ProgressDisplay, describe
from mtrain.launcher.supervise.stragglers import MIN_STEPS, StepBoard, format_table, title_for

STOP_GRACE = 5.0           # SIGTERM → SIGKILL for the whole session
LOST_HOST_GRACE = 2.0      # mpirun cannot stop a job cleanly through a dead daemon: shorter wait
FAILURE_GRACE = 2.0        # mpirun normally stops the job itself after a rank fails
SESSION_DRAIN = 3.0        # time for agents to finish after mpirun has exited
LATE_EVENT_GRACE = 3.0     # a host's news after mpirun's exit (ssh_master.DRAIN_SECONDS, and a moment)
STUCK_GRACE = 3.0          # a job that can never go on (stuck_in_init) is stopped after this
LAUNCHER_TAIL = 40         # MPI launcher lines kept to explain a failure no rank reported


class StopReason(enum.Enum):
    """Why the supervisor stopped a job itself (logged, and it picks the grace period)."""

    INTERRUPTED = "interrupted"                 # Ctrl-C or SIGTERM reached mtrain
    HOST_LOST = "a host was lost"               # an agent reported a dead connection
    RANK_FAILED = "a rank failed and mpirun did not stop the job"
    STUCK = "the job could never go on"         # ranks wait in init() for one whose program ended


def stuck_in_init(waiting: "dict[int, tuple]", ended: "dict[int, int]") -> "str | None":
    """Why the job can never go on, when ranks wait in init() for a rank whose program has ended
    (with status 0: an error status ends the job by itself); None when it may.  ``waiting``: the
    ranks each rank waits for in init() (records.phase.PhaseNote), ``ended``: programs' statuses."""
    stuck = {rank: [r for r in ranks if ended.get(r) == 0] for rank, ranks in waiting.items()}
    stuck = {rank: gone for rank, gone in stuck.items() if gone}
    if not stuck:
        return None
    gone = sorted({r for ranks in stuck.values() for r in ranks})
    who = f"rank {gone[0]}" if len(gone) == 1 else f"ranks {', '.join(map(str, gone))}"
    waiters = sorted(stuck)
    them = f"rank {waiters[0]} waits" if len(waiters) == 1 else f"ranks {', '.join(map(str, waiters))} wait"
    return (f"{who} ended (exit code 0) without calling init(), while {them} for it in init(); every rank must "
            "call init() (or give init(comm=[...]) only the ranks that do)")


def _take_marker(line: bytes, marker: bytes, take: Callable[[int, bytes], None]) -> bytes:
    """Hand the record after ``marker`` in a rank's line to ``take``, with the rank the line's
    prefix names; what remains of the line (b"" when nothing does)."""
    before, _, payload = line.partition(marker)
    prefix = RANK_PREFIX.match(before)
    if prefix is not None:  # the rank wrapper's prefix names the rank
        take(int(prefix.group(1)), payload)
        before = before[prefix.end():]
    if not before.strip():
        return b""
    return (prefix.group(0) if prefix else b"") + before + b"\n"


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
        self.sink = OutputSink(output_dir, ranks, verbose, prefix_timestamp)
        self.records: list[ExitRecord] = []
        self.launcher_tail: list[str] = []
        self.lock = threading.Lock()
        self.interrupted: int | None = None
        # Where each rank's program is (records.phase.PhaseNote): in init() for whom, or ended how.
        self.in_init: dict[int, tuple] = {}
        self.ended: dict[int, int] = {}
        self.stuck: str | None = None  # why the job was stopped as one that could never go on
        # Every rank's measured steps (records.steps.StepReport): the straggler table and --progress.
        self.steps, self.board = steps, StepBoard(ranks)
        self.up: set[int] = set()  # ranks out of init(), whose program has not ended
        self._next_table = steps.every  # --straggler-report N: the step of the next table
        # The flight recorder's hang reports (hang_report.py): SIGUSR1 to mpirun asks every rank.
        self.mpirun_pid: int | None = None
        self.collector = Collector(ranks, self._signal_ranks, output_dir)
        self.usr1 = False  # mtrain run got SIGUSR1 (the handler only sets this: no locks in handlers)

    def log(self, message: str) -> None:
        log(self.verbose, message)

    def read_stream(self, pipe: IO[bytes], stream: IO[bytes], is_stderr: bool) -> None:
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
            if not RANK_PREFIX.match(line):
                with self.lock:
                    self.launcher_tail = (self.launcher_tail + [line.decode(errors="replace").rstrip()])[-LAUNCHER_TAIL:]
            self.sink.write(line, stream)

    def _take_event(self, line: bytes) -> bytes:
        """A daemon's guard's event (records.agent_events.EVENT_MARKER) in mpirun's own output: kept for the loop."""
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

    def stuck_now(self) -> str | None:
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
            # umask: what Open MPI leaves in /tmp is private (see records.daemon_env.ENV_USER_UMASK).
            process = subprocess.Popen(self.argv, env=env, stdin=subprocess.DEVNULL,
                                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, umask=DAEMON_UMASK,
                                       start_new_session=True, preexec_fn=_mpirun_dies_with_us)
        except OSError as error:
            print(f"mtrain: cannot start {self.argv[0]}: {error.strerror}", file=sys.stderr)
            return 1
        self.mpirun_pid = process.pid
        readers = [threading.Thread(target=self.read_stream, args=(process.stdout, sys.stdout.buffer, False), daemon=True),
                   threading.Thread(target=self.read_stream, args=(process.stderr, sys.stderr.buffer, True), daemon=True)]
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
            stuck = self.stuck_now()
            stuck_since = (stuck_since or now) if stuck else None
            if stop_reason is None:
                if self.interrupted is not None:
                    stop_reason = StopReason.INTERRUPTED
                elif stuck and now - stuck_since > STUCK_GRACE:
                    stop_reason, self.stuck = StopReason.STUCK, stuck
                elif any(e.kind in LOST_HOST_KINDS for e in host_problems):
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
        while ((reader or self.events_on_stderr) and not any(e.kind in LOST_HOST_KINDS for e in host_problems)
               and time.monotonic() < deadline
               and len({r.rank for r in self.records}) < self.ranks and self.interrupted is None):
            time.sleep(0.1)
            host_problems += self._events(reader)
        self.host_problems = host_problems
        self._print_report(self.collector.finish(set()))  # a collection the job's end cut short
        self._stop_progress()
        self.print_straggler_table()
        return self.outcome(process.returncode, host_problems)

    def outcome(self, mpirun_status: int, host_problems: list[AgentEvent]) -> int:
        """Print the outcome (outcome.py) and return mtrain's exit status."""
        interrupted_line = (self.interrupted_line(self.interrupted)
                            if self.interrupted is not None and self.interrupted_line else None)
        return exit_status(JobEnd(
            launcher=os.path.basename(self.argv[0]), launcher_status=mpirun_status, ranks=self.ranks,
            records=tuple(self.records), host_problems=tuple(host_problems),
            launcher_tail=tuple(self.launcher_tail), interrupted=self.interrupted,
            interrupted_line=interrupted_line, stuck=self.stuck, verbose=self.verbose,
            report_failures=self.report_failures))

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
