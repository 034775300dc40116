"""Pooled MPI jobs: one ``mpirun`` per job size (and environment) for a test file, many bodies in it.

A job started for each test pays for mpirun's start and for importing Python, torch and
TensorFlow in every rank, over and over; the bodies themselves mostly take a fraction of that.
So the pytest process keeps a job per (size, environment) while the tests of one file run, and
sends it body after body (``rank_server.py`` is the rank side). Files whose bodies name the same
shared pool (``PoolKey.shared``: the TensorFlow files, whose ranks take 5 s and more to import
it) keep their jobs from one file to the next, until pytest leaves their folder.

One body's failure stays its own: when a body fails on any rank, outlives its time, or the job
dies under it, that test fails with every rank's output, the whole job is killed (its ranks may
be out of step: waiting in a collective that a failed rank never joins), and the next body
starts a fresh job. ``close_file_jobs`` (called by tests/conftest.py when pytest leaves a test
file) ends the jobs of no shared pool, and ``close_all`` (when it leaves a folder, and at exit)
every job, leaving no process behind.

Jobs of one rank are pooled too, not run in the pytest process: a body would initialize MPI and
the runtime (an engine thread, signal handlers, exit hooks) in pytest itself, where the launcher
tests start and fork processes that must not inherit them, and a failing or hanging body would
take pytest down with it.
"""
from __future__ import annotations

import atexit
import contextlib
import itertools
import json
import selectors
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import pytest

from tests.jobs import kill_session
from tests.mpi.mpirun import REPO, job_environment, mpirun_command

_TAIL = 6000  # characters of each stream a failure shows, as a one-off job's failure does


class PoolKey(NamedTuple):
    """What makes two bodies able to share a job: its size, its environment, and the shared pool
    its file's bodies name ("": none, the job ends with the file)."""
    nprocs: int
    env: "tuple[tuple[str, str], ...]"
    shared: str = ""


class Body(NamedTuple):
    """A test body, named as a rank imports it."""
    module: str
    function: str


class _JobFailed(Exception):
    """The job can no longer be trusted with another body (the message says why)."""


@dataclass
class _Job:
    """One running pooled ``mpirun`` and the sockets of its ranks (index: rank)."""
    key: PoolKey
    folder: Path
    proc: subprocess.Popen
    environment: contextlib.ExitStack
    ranks: "list[socket.socket]" = field(default_factory=list)
    readers: "list[Any]" = field(default_factory=list)
    bodies: "itertools.count[int]" = field(default_factory=itertools.count)

    def log(self, stream: str) -> str:
        return _read(self.folder / f"mpirun.{stream}")

    def kill(self) -> None:
        """The whole job, at once: mpirun, its daemon and every rank share its session."""
        kill_session(self.proc.pid)
        self.proc.wait()
        self._release()

    def _release(self) -> None:
        for conn in self.ranks:
            conn.close()
        self.ranks.clear()
        self.environment.close()
        shutil.rmtree(self.folder, ignore_errors=True)


_jobs: "dict[PoolKey, _Job]" = {}


def _read(path: Path) -> str:
    try:
        return path.read_text(errors="replace")
    except FileNotFoundError:
        return ""


def _start(key: PoolKey, deadline: float) -> _Job:
    # A folder of this user's alone (mkdtemp makes it 0700): the socket in it takes orders to
    # import and run code, and no one else may connect to it.
    command = mpirun_command(key.nprocs)  # (no mpirun: the test fails here, before anything is made)
    folder = Path(tempfile.mkdtemp(prefix="mtrain-test-pool-"))
    address = str(folder / "s")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stack = contextlib.ExitStack()
    try:
        listener.bind(address)
        listener.listen(key.nprocs)
        env = stack.enter_context(job_environment(dict(key.env)))
        with open(folder / "mpirun.out", "wb") as out, open(folder / "mpirun.err", "wb") as err:
            proc = subprocess.Popen(command + [sys.executable, "-m", "tests.mpi.rank_server", address],
                                    stdout=out, stderr=err, stdin=subprocess.DEVNULL, start_new_session=True,
                                    env=env, cwd=REPO)
    except BaseException:
        listener.close()
        stack.close()
        shutil.rmtree(folder, ignore_errors=True)
        raise
    job = _Job(key, folder, proc, stack)
    try:
        connected: "dict[int, socket.socket]" = {}
        while len(connected) < key.nprocs:
            if proc.poll() is not None:
                raise _JobFailed(f"exited with {proc.returncode} before its ranks were ready")
            listener.settimeout(max(0.0, min(0.5, deadline - time.monotonic())))
            try:
                conn, _ = listener.accept()
            except socket.timeout:
                if time.monotonic() >= deadline:
                    raise _JobFailed("did not start within its time (hang?)") from None
                continue
            # A rank that connected says which it is at once; one that stalls or dies first fails the start.
            conn.settimeout(max(0.1, deadline - time.monotonic()))
            reader = conn.makefile("rb")
            try:
                rank = json.loads(reader.readline())["rank"]
            except (OSError, ValueError, KeyError, TypeError):
                raise _JobFailed("lost a rank that connected before it said which it was") from None
            connected[rank] = conn
            job.readers.append((rank, reader))
        job.ranks = [connected[rank] for rank in range(key.nprocs)]
        job.readers = [reader for _, reader in sorted(job.readers, key=lambda pair: pair[0])]
    except BaseException:
        job.kill()
        raise
    finally:
        listener.close()
    return job


def _collect(job: _Job, deadline: float) -> "dict[int, dict[str, Any]]":
    """Every rank's answer; stop at the first failure, since the rest may never answer."""
    answers: "dict[int, dict[str, Any]]" = {}
    with selectors.DefaultSelector() as selector:
        for rank, conn in enumerate(job.ranks):
            selector.register(conn, selectors.EVENT_READ, rank)
        while len(answers) < len(job.ranks):
            left = deadline - time.monotonic()
            if left <= 0:
                raise _JobFailed("did not finish within its time (hang?)")
            for event, _ in selector.select(timeout=min(left, 1.0)):
                rank = event.data
                # Bounded too: a rank that wrote part of its answer and stopped must not hold us.
                job.ranks[rank].settimeout(max(0.1, deadline - time.monotonic()))
                try:
                    line = job.readers[rank].readline()
                    answer = json.loads(line) if line else None
                except (OSError, ValueError):
                    answer = None
                if answer is None:
                    job.proc.poll()
                    raise _JobFailed(f"lost rank {rank} (the job died; mpirun: {job.proc.returncode})")
                answers[rank] = answer
                selector.unregister(job.ranks[rank])
                if not answers[rank]["ok"]:
                    return answers
            if job.proc.poll() is not None:
                raise _JobFailed(f"exited with {job.proc.returncode} during the body")
    return answers


def _report(job: _Job, output: str, what: str, answers: "dict[int, dict[str, Any]]") -> str:
    """A failure message shaped as a one-off job's: a header, then stdout and stderr tails, every
    rank's own, then the failing ranks' tracebacks last, where a tail never cuts them."""
    nprocs = job.key.nprocs
    outs, errs = [], []
    for rank in range(nprocs):
        outs.append(f"[rank {rank}]\n{_read(Path(f'{output}.rank{rank}.out'))[-_TAIL // nprocs:]}")
        errs.append(f"[rank {rank}]\n{_read(Path(f'{output}.rank{rank}.err'))[-_TAIL // nprocs:]}")
    errs.append(f"[mpirun]\n{job.log('err')[-2000:]}")
    outs.append(f"[mpirun]\n{job.log('out')[-2000:]}")
    failed = "".join(f"--- rank {rank}'s traceback ---\n{answer['traceback']}"
                     for rank, answer in sorted(answers.items()) if not answer["ok"])
    return (f"{nprocs}-rank pooled job {what}\n--- stdout ---\n" + "\n".join(outs)
            + "\n--- stderr ---\n" + "\n".join(errs) + ("\n" + failed if failed else ""))


def run_pooled(key: PoolKey, body: Body, timeout: float, env: "dict[str, str] | None" = None) -> None:
    """Run ``body`` on every rank of the pool's job for ``key`` (starting one if there is none);
    fail the test, and end the job, unless every rank finished it without an error.

    ``timeout`` covers the body, and the job's start when it starts one. ``env`` is set on every
    rank for this body alone."""
    deadline = time.monotonic() + timeout
    job = _jobs.get(key)
    if job is not None and job.proc.poll() is not None:  # it died between bodies: start afresh
        _drop(key)
        job = None
    if job is None:
        try:
            job = _start(key, deadline)
        except _JobFailed as failed:
            pytest.fail(f"{key.nprocs}-rank pooled job {failed}")
        _jobs[key] = job
    output = str(job.folder / f"body{next(job.bodies)}")
    order = {"module": body.module, "function": body.function, "output": output, "env": env or {}}
    answers: "dict[int, dict[str, Any]]" = {}
    try:
        for rank, conn in enumerate(job.ranks):
            try:
                conn.sendall(json.dumps(order).encode() + b"\n")
            except OSError:
                raise _JobFailed(f"lost rank {rank} before the body reached it") from None
        answers = _collect(job, deadline)
        what = "" if all(answer["ok"] for answer in answers.values()) else (
            f"failed on rank(s) {sorted(rank for rank, answer in answers.items() if not answer['ok'])} "
            f"running {body.function}")
    except _JobFailed as failed:
        what = f"{failed} running {body.function} ({timeout}s allowed)"
    except BaseException:  # pytest-timeout, ^C: the job is out of step with us
        _drop(key)
        raise
    if what:
        message = _report(job, output, what, answers)
        _drop(key)
        pytest.fail(message)
    for path in job.folder.glob(f"{Path(output).name}.rank*"):
        path.unlink()


def job_pid(key: PoolKey) -> "int | None":
    """The pid of the pool's ``mpirun`` for ``key`` (None: no job is running for it)."""
    job = _jobs.get(key)
    return job.proc.pid if job is not None else None


def _drop(key: PoolKey) -> None:
    job = _jobs.pop(key, None)
    if job is not None:
        job.kill()


def close_all() -> None:
    """End every pooled job. Killed, not asked to leave: a clean MPI_Finalize took seconds a job
    on this 2-core machine, and what Open MPI leaves is in the job's folders, which go with it."""
    while _jobs:
        _, job = _jobs.popitem()
        job.kill()


def close_file_jobs() -> None:
    """End the jobs of no shared pool: a file's jobs hold its modules in every rank."""
    for key in [key for key in _jobs if not key.shared]:
        _drop(key)


atexit.register(close_all)
