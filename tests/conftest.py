"""Test-suite-wide hooks: pooled MPI jobs (tests/mpi/pool.py) end when pytest leaves their file."""
from __future__ import annotations

import sys

import pytest


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
