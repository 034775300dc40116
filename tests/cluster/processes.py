"""What /proc says of a process, for the cluster tests' leftover checks ("" once it is gone)."""
from __future__ import annotations


def cmdline(pid: int) -> str:
    """The process's command line, words joined by spaces."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as handle:
            return handle.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


def comm(pid: int) -> str:
    """The process's name (what `ps -o comm` shows)."""
    try:
        with open(f"/proc/{pid}/comm") as handle:
            return handle.read().strip()
    except OSError:
        return ""
