"""The flight recorder's records: what each rank's collectives were doing.

ringreduce/observe/recorder.py writes them, the supervisor reads them (launcher/supervise/hang_report.py).  Marker
lines on the rank's stderr, removed by the supervisor; the line's prefix names the rank.  A rank
dumps on SIGUSR1 (mtrain run forwards its own SIGUSR1 to mpirun, which forwards it to every
rank); a rank whose coordinator sees a stall asks the supervisor to signal every rank
(DumpRequest).
"""
import enum

from mtrain.common.records.base import Record
from mtrain.common.records.marker import MarkerRecord

DUMP_MARKER = b"@@mtrain-flight-recorder@@ "
DUMP_REQUEST_MARKER = b"@@mtrain-flight-request@@ "
ENV_FLIGHT_RECORDER_SIZE = "MTRAIN_FLIGHT_RECORDER_SIZE"  # ops kept per process set; 0: off


class OpState(enum.Enum):
    WAITING = "waiting"   # submitted; waiting for the other ranks to submit it (negotiation)
    RUNNING = "running"   # every rank agreed: in the ring / collective now
    DONE = "done"
    FAILED = "failed"


class OpRecord(Record):
    """One collective a rank submitted (a flight-recorder entry); times are seconds before the dump."""

    seq: int            # this rank's submit counter for the process set (1 = its first op)
    name: str
    kind: str           # allreduce, allgather, broadcast, ...
    what: str           # dtype and shape, e.g. "float32[1024]"
    state: OpState
    submitted_ago: float
    started_ago: float = -1.0   # -1: not started
    ended_ago: float = -1.0     # -1: not ended


class SetRecord(Record):
    """One process set's recorder on one rank."""

    set_id: int
    members: tuple[int, ...]      # the job's ranks in the set
    ops: tuple[OpRecord, ...]     # oldest first
    blocked: int                  # user threads blocked on this set's handles now
    idle_s: float = -1.0          # since this set's last submit or finished wait (-1: never)


class RecorderDump(MarkerRecord):
    """One rank's flight recorder at one moment."""

    marker = DUMP_MARKER
    json_optional = ("user_frame",)

    rank: int
    host: str
    reason: str                   # what made it dump (the rank's view: "SIGUSR1", "stall", ...)
    time: float                   # wall clock of the dump
    sets: tuple[SetRecord, ...]   # by set id
    user_frame: str = ""          # where the main thread is in the program's own code (``frames.frame_line``)


class DumpRequest(MarkerRecord):
    """A rank asks the supervisor to have every rank dump its recorder (a stall it coordinates)."""

    marker = DUMP_REQUEST_MARKER

    reason: str
