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
from mtrain.records import HostUpdates, JobLayout, host_path, updates_file

HEARTBEAT_TIMEOUT = 8.0
TERM_GRACE = 3.0


def _login_shell() -> str:
    try:
        return pwd.getpwuid(os.getuid()).pw_shell or "/bin/sh"
    except KeyError:
        return "/bin/sh"


def _watch_stdin(stopped: threading.Event, updates_path: str | None = None) -> str:
    """Until the session ends or goes silent (then: why); heartbeats are lines, and a line
    `update N` carries an elastic job's host-set version, left in `updates_path` for the ranks."""
    last = time.monotonic()
    pending = b""
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
            *lines, pending = (pending + data).split(b"\n")
            for line in lines:
                if line.startswith(b"update ") and updates_path and line[7:].strip().isdigit():
                    HostUpdates(int(line[7:])).write(updates_path)
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
    job_file, layout, updates_path = None, None, None
    if argv[:1] == ["--job-file"] and len(argv) >= 4 and argv[2] == "--layout":
        template = argv[1]
        job_file, layout, argv = host_path(template), JobLayout.decode(argv[3]), argv[4:]
        updates_path = host_path(updates_file(template))
    if len(argv) != 1:
        print("usage: python -m mtrain.launcher.remote_guard [--job-file PATH --layout JSON] 'COMMAND'",
              file=sys.stderr)
        return 2
    if job_file and layout:
        layout.write(job_file)
    try:
        return _guard(argv[0], updates_path)
    finally:
        for path in (job_file, updates_path):
            if path:
                with contextlib.suppress(OSError):
                    os.unlink(path)


def _guard(command: str, updates_path: str | None) -> int:
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
        reason = _watch_stdin(done, updates_path)
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
