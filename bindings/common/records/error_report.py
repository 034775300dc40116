"""ErrorReport: a rank's own account of why it is failing, in the file $MTRAIN_ERROR_FILE.

Written by the runtime in a rank (``report_error``), read by the rank wrapper (launcher/rank.py),
which carries it into the rank's ExitRecord.  The variable's presence is also how a rank knows
that it runs under ``mtrain run``'s rank wrapper (``supervised``).
"""
import enum
import json
import os
import time

from mtrain.common.records.base import DECODE_ERRORS, Record

ENV_ERROR_FILE = "MTRAIN_ERROR_FILE"
_ERROR_FILE_LIMIT = 65536
MESSAGE_LIMIT = 500   # the longest reason a record carries


class FailureCause(enum.Enum):
    OWN = "own"    # the failure began in this rank
    PEER = "peer"  # this rank failed only because another one left or failed


class ErrorReport(Record):
    """Why a rank is failing, in the runtime's own words (one line)."""

    message: str
    cause: FailureCause
    time: float

    def write(self, path: str) -> bool:
        """Write the report unless one is there already (the first account wins)."""
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except OSError:
            return False
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            json.dump(self.to_json(), handle)
        return True

    @staticmethod
    def read(path: str) -> "ErrorReport | None":
        """The report at `path`, or None when there is none or it is not one of ours."""
        try:
            with open(path, "rb") as handle:
                report = ErrorReport.from_json(json.loads(handle.read(_ERROR_FILE_LIMIT)))
        except (OSError, *DECODE_ERRORS):
            return None
        return report.replace(message=one_line(report.message))


def supervised() -> bool:
    """Whether this rank runs under `mtrain run`'s rank wrapper, which reports how it ends."""
    return ENV_ERROR_FILE in os.environ


def report_error(message: str, cause: FailureCause) -> None:
    """Tell the launcher (if one is listening through $MTRAIN_ERROR_FILE) why this rank fails."""
    path = os.environ.get(ENV_ERROR_FILE)
    if not path:
        return
    try:
        ErrorReport(one_line(message), cause, time.time()).write(path)
    except OSError:
        pass  # the report is a courtesy; it must never mask the failure itself


def one_line(text: str) -> str:
    """The first line of `text`, at most MESSAGE_LIMIT characters."""
    lines = text.splitlines()
    return lines[0][:MESSAGE_LIMIT] if lines else ""
