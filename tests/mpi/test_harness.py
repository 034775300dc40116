"""The harness's own promise: a job it starts is not stopped by what earlier mpiruns left."""
from __future__ import annotations

import sys
import tempfile

from tests import stale_mpi_folders
from tests.mpi.harness import launch


def test_a_job_starts_where_killed_mpiruns_left_their_folders():
    # A whole-suite run kills mpiruns and goes through the pids more than once: the folder a
    # killed one left (named after its pid alone) stops the next mpirun with that pid.
    base = tempfile.gettempdir()
    with stale_mpi_folders.planted(base) as planted:
        done = launch(2, [sys.executable, "-c", stale_mpi_folders.PRINT_PID], timeout=60)
        assert done.returncode == 0, done.stderr
        stale_mpi_folders.assert_mpirun_met_them(done.stdout, 2, base, planted)
