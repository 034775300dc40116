"""Run one test body on every rank of a real ``mpirun`` job, at several job sizes.

    @mpi_test(nps=(1, 2, 3))
    def test_something():
        ...  # runs inside every rank; a failing assert fails the test

pytest sees one test per job size. The bodies of one test file share a job per job size (and
per ``env``): each rank runs ``rr.init(); body(); rr.shutdown()`` for one body after another
(pool.py, rank_server.py), so Python, torch and MPI start once per job, not once per test. A
body that fails on any rank, or outlives its time, fails alone with every rank's output, and
the next body starts on a fresh job.

``fresh=True`` runs a body in a job of its own, as every body once ran: the rank exits through
ringreduce's abort-on-exception hook when it raises, so one failing rank ends the job at once.
Use it only for a body that a shared process would change the meaning of, and say why there.
"""
from __future__ import annotations

import importlib
import subprocess
import sys
from typing import Callable, Iterable

import pytest

from tests.jobs import run_job
from tests.mpi.mpirun import REPO, job_environment, mpirun_command, mpirun_path  # noqa: F401  (the API)
from tests.mpi.pool import Body, PoolKey, run_pooled


def launch(nprocs: int, argv: "list[str]", timeout: float = 120,
           env: "dict[str, str] | None" = None) -> subprocess.CompletedProcess:
    """Run ``argv`` as ``nprocs`` ranks of a job of its own; kill the whole job if it outlives ``timeout``."""
    with job_environment(env) as full_env:
        return run_job(mpirun_command(nprocs) + argv, timeout, f"{nprocs}-rank job", env=full_env, cwd=REPO)


def mpi_test(nps: Iterable[int] = (1, 2, 3), timeout: float = 120,
             env: "dict[str, str] | None" = None, fresh: bool = False,
             body_env: "Callable[[], dict[str, str]] | None" = None, pool: str = "") -> Callable:
    """Turn a rank body into a pytest test run under mpirun once per job size.

    ``env``: the job's environment (bodies with different ones run in different jobs).
    ``body_env``: made anew for each run of the body and set on every rank for it alone (a
    rendezvous port, say). ``fresh``: a job of the body's own (see the module's note).
    ``pool``: a pool shared with other files' bodies that name it (pool.py), whose jobs outlive
    the file; every such body must leave its ranks as the next file's bodies expect them."""
    def wrap(body: Callable[[], None]) -> Callable:
        @pytest.mark.parametrize("nprocs", list(nps), ids=lambda n: f"np{n}")
        def test(nprocs: int) -> None:
            extra = body_env() if body_env is not None else {}
            if not fresh:
                key = PoolKey(nprocs, tuple(sorted((env or {}).items())), pool)
                run_pooled(key, Body(body.__module__, body.__name__), timeout, extra)
                return
            result = launch(nprocs, [sys.executable, "-m", "tests.mpi.harness", body.__module__, body.__name__],
                            timeout, {**(env or {}), **extra})
            if result.returncode != 0:
                pytest.fail(f"{nprocs}-rank job exited with {result.returncode}\n"
                            f"--- stdout ---\n{result.stdout[-6000:]}\n--- stderr ---\n{result.stderr[-6000:]}")
        test.rank_body = body  # type: ignore[attr-defined]
        test.__doc__ = body.__doc__
        return test
    return wrap


def _main(module_name: str, function_name: str) -> None:
    import mtrain.ringreduce as rr
    rr.init()
    getattr(importlib.import_module(module_name), function_name).rank_body()
    rr.shutdown()


if __name__ == "__main__":
    _main(sys.argv[1], sys.argv[2])
