"""ExitRecord: how one rank ended, as its wrapper saw it.

The rank wrapper (launcher/rank.py) writes it as a marker line on the rank's stderr; the
supervisor takes it out and names the job's first failure from them.  A rank that no launcher
of ours watches (started by srun directly, say) says its own line (``own_failure_line``).
"""
import enum
import re
import signal

from mtrain.common.records.error_report import MESSAGE_LIMIT
from mtrain.common.records.marker import MarkerRecord

EXIT_MARKER = b"@@mtrain-rank-exit@@ "
# The line Python ends a traceback with, `package.module.ValueError: …` (torch.distributed adds
# `[rank3]: ` in front); shown as `ValueError: …`, as the runtime's own account shows it.
_EXCEPTION_LINE = re.compile(r"^(?:\[rank\d+\]:\s*)?(?:[A-Za-z_]\w*\.)*"
                             r"([A-Za-z_]\w*(?:Error|Exception|Exit|Interrupt|Fault)(?::.*)?)$")


def exception_line(line: str) -> str:
    """The exception named by a traceback's last line (without its module path), else ""."""
    match = _EXCEPTION_LINE.match(line.rstrip())
    return match.group(1)[:MESSAGE_LIMIT] if match else ""


class Evidence(enum.IntEnum):
    """How surely a failure began in the rank that reports it (lower is surer)."""

    SURE = 0       # the runtime's own account, or a signal nobody in the job sent (kill -9, OOM, SEGV)
    EXIT = 1       # a plain non-zero exit status, or an abort() of the rank's own
    DOUBTFUL = 2   # it aborted inside MPI: a peer's death or a lost link is the usual reason


class ExitRecord(MarkerRecord):
    """How one rank ended, as its wrapper saw it."""

    marker = EXIT_MARKER
    json_optional = ("where",)

    rank: int
    host: str
    returncode: int                 # negative: killed by that signal
    stopped: bool                   # told to stop before it ended, or failed because of a peer
    time: float                     # when the failure began (the runtime's time if it said so)
    stderr_tail: tuple[str, ...] = ()
    report: str = ""                # the runtime's own one-line account, if it gave one
    mpi_abort: bool = False         # it ended inside MPI_Abort
    exception: str = ""             # the last exception line the rank printed to stderr, if any
    where: str = ""                 # the program's own line it failed at (``frames.user_line``), if known

    @property
    def failed(self) -> bool:
        # A rank that ended with status 0 still failed if the runtime says it left the job
        # while other ranks needed it.
        return self.returncode != 0 or bool(self.report and not self.stopped)

    @property
    def evidence(self) -> Evidence:
        # SIGABRT is a process aborting itself, often a library reacting to a peer's death
        # (gloo's "Connection closed by peer", then std::terminate): no surer than an exit status.
        if self.report or (self.returncode < 0 and self.returncode != -signal.SIGABRT):
            return Evidence.SURE
        return Evidence.DOUBTFUL if self.mpi_abort else Evidence.EXIT

    @property
    def reason(self) -> str:
        """One line saying why: the runtime's own account; else, for a rank that exited with an
        error status, the last exception it printed, else its last line on stderr (so a
        failure before `init()` reads like one after it).  A signal is its own reason."""
        if self.report:
            return self.report
        if self.returncode <= 0:
            return ""
        if self.exception:
            return self.exception
        for line in reversed(self.stderr_tail):
            if line.strip() and not line[:1].isspace():  # not a traceback frame
                return (exception_line(line) or line.strip())[:MESSAGE_LIMIT]
        return ""

    def describe(self) -> str:
        how = f"killed by {signal_name(-self.returncode)}" if self.returncode < 0 else f"exit code {self.returncode}"
        reason = self.reason
        where = f" at {self.where}" if self.where and self.returncode > 0 else ""
        return f"rank {self.rank} on {self.host}: {how}" + (f" ({reason})" if reason else "") + where


def signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def own_failure_line(record: ExitRecord) -> str:
    """The job's failure report as a rank with no launcher of ours says it of itself (ranks that
    srun started directly, say): the line `mtrain run` would print for it."""
    return f"mtrain: job failed; first failure: {record.describe()}\n"
