"""Folders in Open MPI's way, for the tests that a job starts anyway.

Open MPI's launcher names its folder in the temporary folder after its own pid alone
(`ompi.<pid>`) and will not start when that folder holds PMIx's rendezvous files already,
as one left by a killed launcher (or planted by another user) does.  `plant` makes such a
folder for each of the next pids the kernel will hand out, so whatever the next mpirun's
pid is, its folder is taken.

    python tests/stale_mpi_folders.py COUNT    # plants in /tmp; prints the pids planted
"""
from __future__ import annotations

import contextlib
import os
import shutil
import socket
import sys
from typing import Iterator

RESERVED_PIDS = 300   # where the kernel starts again once it reaches pid_max


def next_pids(count: int) -> "list[int]":
    with open("/proc/sys/kernel/pid_max") as handle:
        pid_max = int(handle.read())
    with open("/proc/sys/kernel/ns_last_pid") as handle:
        last = int(handle.read())
    span = pid_max - RESERVED_PIDS
    return [RESERVED_PIDS + (last + 1 + i - RESERVED_PIDS) % span for i in range(count)]


def plant(base: str, count: int) -> "list[int]":
    """A folder as a killed launcher leaves it for each of the next `count` pids (but those
    whose folder is there already): the pids planted."""
    host = socket.gethostname()
    planted = []
    for pid in next_pids(count):
        folder = os.path.join(base, f"ompi.{pid}")
        try:
            os.mkdir(folder, 0o700)
        except FileExistsError:
            continue
        with open(os.path.join(folder, f"pmix.{host}.tool.{pid}"), "w") as handle:
            handle.write(f"pmix-server.{pid};tcp4://127.0.0.1:1\n")
        planted.append(pid)
    return planted


def remove(base: str, pids: "list[int]") -> None:
    for pid in pids:
        shutil.rmtree(os.path.join(base, f"ompi.{pid}"), ignore_errors=True)


@contextlib.contextmanager
def planted(base: str, count: int = 3000) -> "Iterator[list[int]]":
    """``plant``, and what was planted removed afterwards."""
    pids = plant(base, count)
    try:
        yield pids
    finally:
        remove(base, pids)


# A rank program for these tests: it prints its pid.
PRINT_PID = "import os; print('pid', os.getpid())"


def assert_mpirun_met_them(stdout: str, nprocs: int, base: str, pids: "list[int]") -> None:
    """`stdout` of a job of `nprocs` PRINT_PID ranks that started where `pids` were planted:
    the ranks started after mpirun, so their pids among those planted mean mpirun's was too;
    and the job left the planted folders alone (they are not its own)."""
    ranks = [int(line.split()[-1]) for line in stdout.splitlines() if "pid " in line]
    assert len(ranks) == nprocs and set(ranks) <= set(pids), (ranks, pids[0], pids[-1])
    assert all(os.path.isdir(os.path.join(base, f"ompi.{pid}")) for pid in pids)


if __name__ == "__main__":
    print(" ".join(map(str, plant("/tmp", int(sys.argv[1])))))
