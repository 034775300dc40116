"""Test-suite-wide hooks: pooled MPI jobs (tests/mpi/pool.py) end when pytest leaves their file
(a shared pool's, their folder), Open MPI's OFI transport stays out of the tests' jobs, and
their ranks yield the cores they share."""
from __future__ import annotations

import os
import signal
import sys

import pytest

# Open MPI 5's btl/ofi sleeps one second when it is closed (its component-close function calls
# sleep(1)), and MPI_Init closes it wherever libfabric finds no fabric to use, as on the test
# machines: a second of every job's start, in every rank.  The tests' jobs (mpirun, mtrain run,
# Slurm, through the environment they inherit) leave it out; a btl choice made before wins.
os.environ.setdefault("OMPI_MCA_btl", "^ofi")
# The test cluster's hosts (network namespaces) and every job's ranks share this machine's two
# cores: four ranks of a two-host job on two cores, where a rank that waits in MPI busy-polls
# the core another rank needs to start or compute (a 4-rank job: 2.4 s and 4.2 CPU-seconds
# with busy polling, 1.4 s and 2.0 with yielding). mtrain run itself asks Open MPI to yield only
# where one host has more ranks than cores, and a namespace host cannot see that its cores are
# shared, so the tests say it for every job; a choice made before wins.
os.environ.setdefault("OMPI_MCA_mpi_yield_when_idle", "1")
# A shell without job control starts a background command (`pytest ... &`, `nohup bash .ci/run &`)
# with SIGINT ignored, and an ignored signal stays ignored in every child: mtrain run then rightly
# ignores the Ctrl-C the tests send it (as a user's background job would), and the tests of what
# Ctrl-C does wait for nothing. The tests' jobs start as from a terminal: with Python's own handler
# here, their SIGINT is back at its default after exec.
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


def _close_pools(file_only: bool = False) -> None:
    pool = sys.modules.get("tests.mpi.pool")  # never imported: no job was pooled
    if pool is not None:
        pool.close_file_jobs() if file_only else pool.close_all()


def pytest_runtest_teardown(item: pytest.Item, nextitem: "pytest.Item | None") -> None:
    # A file's jobs hold its modules (and torch, TF) in every rank: end them before the next file;
    # the jobs of a shared pool (the TensorFlow files') before the next folder.
    if nextitem is None or nextitem.path.parent != item.path.parent:
        _close_pools()
    elif getattr(nextitem, "module", None) is not getattr(item, "module", None):
        _close_pools(file_only=True)


def pytest_sessionfinish(session: pytest.Session) -> None:
    _close_pools()
