"""The rank side of a pooled job: run test bodies one after another in one MPI process.

    mpirun -np N python -m tests.mpi.rank_server SOCKET

Each rank connects to the pytest process's socket, says its rank, then waits for bodies. For
each body it runs ``rr.init(); body(); rr.shutdown()`` (what a one-off job's rank runs), with
its stdout and stderr in files of that body's own, and answers whether the body passed and, if
not, its traceback. A rank waits for the next body in a socket read, not in MPI: Open MPI
busy-polls while it waits, and idle ranks would take the cores from the test that runs.

The pytest side (``pool.py``) ends the whole job after a body that failed on any rank: the other
ranks may be waiting in a collective the failed one never joins.
"""
from __future__ import annotations

import ctypes
import importlib
import json
import os
import socket
import sys
import threading
import traceback
from typing import Any, BinaryIO


def _send(conn: socket.socket, message: "dict[str, Any]") -> None:
    conn.sendall(json.dumps(message).encode() + b"\n")


def _flush_all() -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    ctypes.CDLL(None).fflush(None)  # C code's buffered prints (NULL: every stream)


class _Redirected:
    """fd 1 and 2 (and so Python's and C's prints, and child processes') into two files."""

    def __init__(self, out: str, err: str) -> None:
        self.paths = (out, err)

    def __enter__(self) -> None:
        _flush_all()
        self.saved = [os.dup(1), os.dup(2)]
        for fd, path in zip((1, 2), self.paths):
            target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            os.dup2(target, fd)
            os.close(target)

    def __exit__(self, *exc: object) -> None:
        _flush_all()
        for fd, saved in zip((1, 2), self.saved):
            os.dup2(saved, fd)
            os.close(saved)


def run_body(module_name: str, function_name: str, env: "dict[str, str]") -> "str | None":
    """Run one body as a one-off job's rank would; its traceback if it failed, else None.

    The body's changes to the environment, the working directory, the standard streams and the
    exception hooks are undone after it, so that the next body starts as in a job of its own
    (a body that changes other process-wide state runs with ``fresh=True``)."""
    import mtrain.ringreduce as rr

    saved_env, saved_cwd = dict(os.environ), os.getcwd()
    saved_hooks = (sys.stdout, sys.stderr, sys.excepthook, threading.excepthook)
    os.environ.update(env)
    try:
        rr.init()
        # As init() leaves them (its first call in a process installs the abort hook).
        saved_hooks = (sys.stdout, sys.stderr, sys.excepthook, threading.excepthook)
        getattr(importlib.import_module(module_name), function_name).rank_body()
        rr.shutdown()
        return None
    except SystemExit as leaving:
        # A one-off job's rank that leaves with status 0 passes; any other status fails.
        if leaving.code in (None, 0):
            rr.shutdown()
            return None
        text = traceback.format_exc()
    except BaseException:  # noqa: BLE001 - a KeyboardInterrupt in a body fails that body too
        text = traceback.format_exc()
    finally:
        os.environ.clear()
        os.environ.update(saved_env)
        os.chdir(saved_cwd)
        sys.stdout, sys.stderr, sys.excepthook, threading.excepthook = saved_hooks
    sys.stderr.write(text)  # where a one-off job's abort hook would print it
    return text


def serve(address: str) -> None:
    """Connect to ``address`` and run the bodies it sends, until the job is killed (or the
    pytest side goes away)."""
    from mpi4py import MPI

    import mtrain.ringreduce  # noqa: F401  (imported once for every body: that is the point)

    rank = MPI.COMM_WORLD.Get_rank()
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    conn.connect(address)
    _send(conn, {"rank": rank, "pid": os.getpid()})
    lines: BinaryIO = conn.makefile("rb")
    for line in lines:
        order = json.loads(line)
        with _Redirected(f"{order['output']}.rank{rank}.out", f"{order['output']}.rank{rank}.err"):
            failure = run_body(order["module"], order["function"], order.get("env", {}))
        _send(conn, {"rank": rank, "ok": failure is None, "traceback": failure or ""})
    conn.close()


if __name__ == "__main__":
    serve(sys.argv[1])
