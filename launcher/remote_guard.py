"""`python -m mtrain.launcher.remote_guard [--job-file T --layout JSON] 'SHELL COMMAND'`: runs on a
remote host, inside the SSH session.

It runs MPI's daemon command in the login shell and ends the whole process
tree under it (daemons and ranks) when the session ends or goes silent: the
agent on the launcher host writes a heartbeat line every second to our stdin.
End of stdin means the agent or its connection is gone; silence for
HEARTBEAT_TIMEOUT seconds means the link is cut.

PRRTE's daemon forks and calls setsid(), so killing a process group is not
enough: the guard makes itself a child subreaper, so every descendant stays
under it even when its parent exits, and signals the whole tree.

With `--job-file`, the guard first writes the job's layout (mtrain.records.
JobLayout) to that path template, "{host}" replaced by this host's name, for
the rank wrappers here, and removes it when the job ends.
"""
from __future__ import annotations

import contextlib
import os
import pwd
import select
import signal
import socket
import subprocess
import sys
import threading
import time

from mtrain.launcher.process_tools import become_subreaper, descendants, exit_code, signal_process
from mtrain.records import JobLayout

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


def end_tree(grace: float = TERM_GRACE) -> None:
    """SIGTERM every descendant, then SIGKILL whatever is left after `grace` seconds."""
    me = os.getpid()
    for pid in descendants(me):
        signal_process(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while descendants(me) and time.monotonic() < deadline:
        time.sleep(0.05)
    for pid in descendants(me):
        signal_process(pid, signal.SIGKILL)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    job_file, layout = None, None
    if argv[:1] == ["--job-file"] and len(argv) >= 4 and argv[2] == "--layout":
        job_file, layout, argv = argv[1].format(host=socket.gethostname()), JobLayout.decode(argv[3]), argv[4:]
    if len(argv) != 1:
        print("usage: python -m mtrain.launcher.remote_guard [--job-file PATH --layout JSON] 'COMMAND'",
              file=sys.stderr)
        return 2
    if job_file and layout:
        layout.write(job_file)
    try:
        return _guard(argv[0])
    finally:
        if job_file:
            with contextlib.suppress(OSError):
                os.unlink(job_file)


def _guard(command: str) -> int:
    become_subreaper()
    child = subprocess.Popen([_login_shell(), "-c", command], stdin=subprocess.DEVNULL)
    done = threading.Event()
    ending = threading.Lock()

    def end_once(reason: str) -> None:
        if ending.acquire(blocking=False):
            # Reaches mpirun's stderr through the agent: shown with --verbose and in DIR/mpirun.log.
            print(f"mtrain-guard: {socket.gethostname()}: ending the job's processes here: {reason}",
                  file=sys.stderr, flush=True)
            end_tree()

    def watchdog() -> None:
        reason = _watch_stdin(done)
        if reason:
            end_once(reason)

    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
        signal.signal(sig, lambda number, frame: threading.Thread(
            target=end_once, args=(f"received {signal.Signals(number).name}",), daemon=True).start())
    threading.Thread(target=watchdog, daemon=True).start()
    status = None
    # Reap the direct child and every orphan handed to us; leave when no child is left.
    while True:
        try:
            pid, raw = os.waitpid(-1, 0)
        except ChildProcessError:
            break
        except InterruptedError:
            continue
        if pid == child.pid:
            status = os.waitstatus_to_exitcode(raw)
            child.returncode = status
    done.set()
    return exit_code(status if status is not None else 255)


if __name__ == "__main__":
    sys.exit(main())
