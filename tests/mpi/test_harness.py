"""The harness's own promise: a job it starts is not stopped by what earlier mpiruns left."""
from __future__ import annotations

import os
import sys
import tempfile

from tests import stale_mpi_folders
from tests.mpi.harness import launch


def test_a_job_starts_where_killed_mpiruns_left_their_folders():
    # A whole-suite run kills mpiruns and goes through the pids more than once: the folder a
    # killed one left (named after its pid alone) stops the next mpirun with that pid.
    base = tempfile.gettempdir()
    planted = stale_mpi_folders.plant(base, 3000)
    try:
        done = launch(2, [sys.executable, "-c", "import os; print(os.getpid())"], timeout=60)
        assert done.returncode == 0, done.stderr
        ranks = [int(line) for line in done.stdout.split()]
        # The ranks started after mpirun: their pids among those planted mean mpirun's was too.
        assert len(ranks) == 2 and set(ranks) <= set(planted), (ranks, planted[0], planted[-1])
        assert all(os.path.isdir(os.path.join(base, f"ompi.{pid}")) for pid in planted)
    finally:
        stale_mpi_folders.remove(base, planted)
