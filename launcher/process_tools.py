"""Small Linux process helpers shared by the rank wrapper, the agent and the remote guard."""
from __future__ import annotations

import ctypes
import os
import signal

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


def kill_group(pid: int, sig: int) -> None:
    """Signal the process group led by `pid`, ignoring one that is already gone."""
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def exit_code(returncode: int) -> int:
    """Shell-style status: a death by signal N becomes 128+N."""
    return 128 - returncode if returncode < 0 else returncode


def signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"
