"""StepReport: a rank's measured training steps (ringreduce/observe/steps.py sends them;
launcher/supervise/stragglers.py reads them: the straggler report and --progress).

A marker line on the rank's stderr, removed by the supervisor; the line's prefix names the rank.
Sent every few steps or seconds (MTRAIN_STRAGGLER_EVERY, MTRAIN_STEP_REPORT_SECONDS) and when the
rank's runtime shuts down.
"""
from mtrain.common.records.base import Record
from mtrain.common.records.marker import MarkerRecord

STEP_MARKER = b"@@mtrain-steps@@ "
ENV_STRAGGLER_EVERY = "MTRAIN_STRAGGLER_EVERY"          # a table every N steps (0: at exit only)
ENV_STEP_REPORT_SECONDS = "MTRAIN_STEP_REPORT_SECONDS"  # send what was measured at least this often
ENV_STRAGGLER_OFF = "MTRAIN_STRAGGLER_REPORT_DISABLE"   # 1: measure no steps (the engine has no StepMeter)


class StepSample(Record):
    """One training step of one rank (times in seconds; ``end`` on the rank's own monotonic clock)."""

    step: int       # this rank's step number, from 1
    cycle: int      # the engine cycle that ran the step's last ops: the same on every rank for the same step
    end: float      # when the step's last op completed
    compute: float  # from the previous step's last completion to this step's first submit
    wait: float     # the longest any op of this step waited from its submit to running (the others' lateness)
    nbytes: int     # bytes of the step's collectives

    # On the wire a sample is a row, [step, cycle, end, compute, wait, nbytes], times to the
    # microsecond: a report carries many of them, every few seconds.
    json_row = True
    json_float_digits = 6


class StepReport(MarkerRecord):
    marker = STEP_MARKER
    json_separators = (",", ":")

    host: str
    samples: tuple[StepSample, ...] = ()  # oldest first
