"""Test-suite-wide hooks: pooled MPI jobs (tests/mpi/pool.py) end when pytest leaves their file,
and Open MPI's OFI transport stays out of the tests' jobs."""
from __future__ import annotations

import os
import sys

import pytest

# Open MPI 5's btl/ofi sleeps one second when it is closed (its component-close function calls
# sleep(1)), and MPI_Init closes it wherever libfabric finds no fabric to use, as on the test
# machines: a second of every job's start, in every rank.  The tests' jobs (mpirun, mtrain run,
# Slurm, through the environment they inherit) leave it out; a btl choice made before wins.
os.environ.setdefault("OMPI_MCA_btl", "^ofi")


def _close_pools() -> None:
    pool = sys.modules.get("tests.mpi.pool")  # never imported: no job was pooled
    if pool is not None:
        pool.close_all()


def pytest_runtest_teardown(item: pytest.Item, nextitem: "pytest.Item | None") -> None:
    # A file's jobs hold its modules (and torch, TF) in every rank: end them before the next file.
    if nextitem is None or getattr(nextitem, "module", None) is not getattr(item, "module", None):
        _close_pools()


def pytest_sessionfinish(session: pytest.Session) -> None:
    _close_pools()
