"""`python -m launcher.remote_guard 'SHELL COMMAND'`: runs on a remote host, inside the SSH session.

It runs MPI's daemon command in the login shell and kills it (and through it
the ranks) when the session ends or goes silent: the agent on the launcher
host writes a heartbeat line every second to our stdin.  End of stdin means
the agent or its connection is gone; silence for HEARTBEAT_TIMEOUT seconds
means the link is cut.  Either way no process of the job survives here.
"""
from __future__ import annotations

import os
import pwd
import select
import signal
import subprocess
import sys
import threading
import time

from launcher.process_tools import exit_code, kill_group

HEARTBEAT_TIMEOUT = 8.0
TERM_GRACE = 3.0


def _login_shell() -> str:
    try:
        return pwd.getpwuid(os.getuid()).pw_shell or "/bin/sh"
    except KeyError:
        return "/bin/sh"


def _watch_stdin(stopped: threading.Event) -> str:
    last = time.monotonic()
    while not stopped.is_set():
        readable, _, _ = select.select([0], [], [], 1.0)
        if readable:
            try:
                data = os.read(0, 4096)
            except OSError:
                return "stdin error"
            if not data:
                return "session closed"
            last = time.monotonic()
        elif time.monotonic() - last > HEARTBEAT_TIMEOUT:
            return "no heartbeat"
    return ""


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python -m launcher.remote_guard 'COMMAND'", file=sys.stderr)
        return 2
    child = subprocess.Popen([_login_shell(), "-c", argv[0]], stdin=subprocess.DEVNULL,
                             start_new_session=True)
    done = threading.Event()

    def end_child(reason: str) -> None:
        if child.poll() is not None:
            return
        kill_group(child.pid, signal.SIGTERM)
        deadline = time.monotonic() + TERM_GRACE
        while child.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        kill_group(child.pid, signal.SIGKILL)

    def watchdog() -> None:
        reason = _watch_stdin(done)
        if reason:
            end_child(reason)

    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
        signal.signal(sig, lambda number, frame: threading.Thread(
            target=end_child, args=("signal",), daemon=True).start())
    threading.Thread(target=watchdog, daemon=True).start()
    while True:
        try:
            returncode = child.wait()
            break
        except InterruptedError:
            continue
    done.set()
    return exit_code(returncode)


if __name__ == "__main__":
    sys.exit(main())
