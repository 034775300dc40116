"""How a job ended, in mtrain's words: the first failure, the failure report, the exit status.

Outcome, in priority order: interrupted (130/143) · a job that could never go on (1) · a host lost
(255, naming it) · the *first* rank that failed on its own (its exit code, or 128+N for signal
N) · a host unreachable (255) · mpirun's own failure, or ranks that never reported an end.
"""
from __future__ import annotations

import dataclasses
import signal
import sys
from typing import Sequence

from mtrain.common.records.agent_events import AgentEvent, AgentEventKind
from mtrain.common.records.exit_record import ExitRecord, signal_name
from mtrain.launcher.process_tools import exit_code

CAUSE_WINDOW = 1.0         # failures closer than this are ordered by evidence, not by clock
# A host whose connection or whose MPI daemon died: the job there is gone.
LOST_HOST_KINDS = (AgentEventKind.HOST_LOST, AgentEventKind.DAEMON_DIED)


@dataclasses.dataclass(frozen=True, eq=False, repr=False)  # none needed: cheaper to make, on every job's start
class JobEnd:
    """What the supervisor learned about a job that has ended."""

    launcher: str                        # the MPI launcher's name, as the user reads it (mpirun)
    launcher_status: int                 # its exit status
    ranks: int
    records: tuple[ExitRecord, ...]      # one per rank whose wrapper reported its end
    host_problems: tuple[AgentEvent, ...]
    launcher_tail: tuple[str, ...]       # the launcher's own last lines
    interrupted: int | None = None       # the signal that stopped us
    interrupted_line: str | None = None  # what to say of it instead of the default line
    stuck: str | None = None             # why the job was stopped as one that could never go on
    verbose: bool = False
    report_failures: bool = True         # False: an elastic driver reports failures itself


def exit_status(end: JobEnd) -> int:
    """Print the outcome (on stderr) and return mtrain's exit status."""
    records = list(end.records)
    if end.interrupted is not None:
        print(end.interrupted_line or f"mtrain: {signal_name(end.interrupted)} received; all ranks were stopped",
              file=sys.stderr)
        return 128 + end.interrupted
    if end.stuck is not None:
        print(f"mtrain: job stopped: it could never go on: {end.stuck}", file=sys.stderr)
        return 1
    failure = first_failure(records)
    lost = [e for e in end.host_problems if e.kind in LOST_HOST_KINDS]
    say = end.report_failures
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
            print_failure_report(failure, records, end.verbose, end.ranks)
        return exit_code(failure.returncode) or 1
    unreachable = [e for e in end.host_problems if e.kind is AgentEventKind.CONNECT_FAILED]
    if unreachable:
        for event in unreachable if say else ():
            print(f"mtrain: {event.detail}", file=sys.stderr)
        return 255
    # Every rank's wrapper writes a record however its rank ends, so a rank without one was
    # killed with its wrapper: Open MPI 5's launcher exits 0 when a host's daemon dies
    # (killed, with its ranks), and 0 must mean that every rank finished.
    silent = sorted(set(range(end.ranks)) - {r.rank for r in records})
    if end.launcher_status != 0 or silent:
        launcher = end.launcher
        if end.launcher_tail and not end.verbose:
            print(f"mtrain: {launcher} said:", file=sys.stderr)
            for line in end.launcher_tail:
                print(f"    {line}", file=sys.stderr)
        if end.launcher_status != 0:
            print(f"mtrain: {launcher} failed with exit status {exit_code(end.launcher_status)} "
                  "before any rank reported a failure", file=sys.stderr)
        else:
            which = f"rank {silent[0]}" if len(silent) == 1 else f"ranks {', '.join(map(str, silent))}"
            print(f"mtrain: {launcher} exited with status 0, but {which} of {end.ranks} never reported "
                  "an end (killed with the rank wrapper, or the host's MPI daemon died): the job did not "
                  "finish", file=sys.stderr)
        return exit_code(end.launcher_status) or 1
    return 0


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
