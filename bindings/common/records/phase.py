"""PhaseNote: where a rank's program is, so that the supervisor can tell a job that can never go
on (a rank that ended while others wait for it in init()) from one that is merely slow.

A marker line on the rank's stderr, written by the runtime and the Python main wrapper
(launcher/pymain.py), removed by the supervisor; the line's prefix names the rank.
"""
import enum
import sys

from mtrain.common.records.error_report import supervised
from mtrain.common.records.marker import MarkerRecord

PHASE_MARKER = b"@@mtrain-rank-phase@@ "


class Phase(enum.Enum):
    INIT_WAITING = "init-waiting"   # in init(), whose collectives need every rank of `ranks`
    INIT_DONE = "init-done"         # out of init() again
    ENDED = "ended"                 # the program ended with `status` (the process may wait in MPI_Finalize)


class PhaseNote(MarkerRecord):
    marker = PHASE_MARKER
    json_optional = ("where",)

    phase: Phase
    ranks: tuple[int, ...] = ()  # INIT_WAITING: the job's ranks that init() waits for
    status: int = 0              # ENDED: the program's exit status
    where: str = ""              # ENDED through an exception or SystemExit: the program's own line it left from

    def emit(self) -> None:
        """Tell the supervisor, when there is one, on a line after what the program already said."""
        if not supervised():
            return
        try:
            sys.stderr.flush()
        except (OSError, ValueError):
            pass
        super().emit()
