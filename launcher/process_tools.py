"""Small Linux process helpers shared by the rank wrapper, the agent and the remote guard."""
from __future__ import annotations

import ctypes
import os
import signal
import sys
from collections.abc import Iterator  # (typing costs ~3 ms of every wrapper's start)

_PR_SET_PDEATHSIG = 1


def die_with_parent(sig: int = signal.SIGTERM) -> None:
    """Ask the kernel to send `sig` to this process when its parent dies (Linux only).

    This is what keeps a rank or an agent from outliving a killed mpirun/prted.
    """
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
    except (OSError, AttributeError):
        pass


def signal_process(pid: int, sig: int) -> None:
    """Send ``sig`` to ``pid``; a process that already ended is not an error."""
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def kill_group(pid: int, sig: int) -> None:
    """Signal the process group led by `pid`, ignoring one that is already gone."""
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def exit_now(status: int) -> None:
    """Flush stdout and stderr, then end the process with `status` at once, skipping the
    interpreter's teardown (module cleanup, paramiko's threads: tens of milliseconds that
    every launch waits for, since each of these processes ends a job's critical path)."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe or stream: nothing more to say
            pass
    os._exit(status)


def exit_code(returncode: int) -> int:
    """Shell-style status: a death by signal N becomes 128+N."""
    return 128 - returncode if returncode < 0 else returncode


_PR_SET_CHILD_SUBREAPER = 36


def become_subreaper() -> None:
    """Orphaned descendants are re-parented to us instead of init (Linux only)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    except (OSError, AttributeError):
        pass


def live_processes() -> "Iterator[tuple[int, list[bytes]]]":
    """(pid, stat fields after the command name: state ppid pgrp session …) of every
    live, non-zombie process, read from /proc."""
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as handle:
                stat = handle.read()
        except OSError:
            continue  # it ended while we looked
        fields = stat[stat.rfind(b")") + 2:].split()
        if len(fields) > 3 and fields[0] != b"Z":
            yield int(entry), fields


def _parents() -> dict[int, int]:
    return {pid: int(fields[1]) for pid, fields in live_processes()}


def descendants(root: int) -> list[int]:
    """Live (non-zombie) processes below `root` in the process tree."""
    children: dict[int, list[int]] = {}
    for pid, parent in _parents().items():
        children.setdefault(parent, []).append(pid)
    found, stack = [], list(children.get(root, []))
    while stack:
        pid = stack.pop()
        found.append(pid)
        stack.extend(children.get(pid, []))
    return found
