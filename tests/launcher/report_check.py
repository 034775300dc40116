"""What a user reads when a job fails: mtrain's report and the ranks' own lines, nothing else."""
from __future__ import annotations

import re

_RANK_LINE = re.compile(r"^\[\d+\]<std(out|err)>:")


def assert_only_mtrain_output(stderr: str) -> None:
    """Every line is a rank's (prefixed), mtrain's own, or part of mtrain's report (indented):
    no banner of the MPI launcher (`prterun detected…`, `MPI_ABORT was invoked…`)."""
    foreign = [line for line in stderr.splitlines()
               if line and not _RANK_LINE.match(line) and not line.startswith(("mtrain: ", "    "))]
    assert not foreign, "lines that are not mtrain's report:\n" + "\n".join(foreign)
    for banner in ("prterun", "MPI_ABORT was invoked", "mpirun detected", "PID 0"):
        assert banner not in stderr, stderr
