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

Under Slurm (`--slurm PRTED ARGS…`, launcher/job/slurm.py) srun starts the guard on each node, the
layout comes in the environment, and Slurm, not a heartbeat, ends the step.

With `--job-file`, the guard first writes the job's layout (mtrain.common.records.
job_layout.JobLayout) to that path template, "{host}" replaced by this host's name, for
the rank wrappers here, and removes it when the job ends.

The preflight's probe becomes the guard when the launcher shares its SSH
connection (launcher/ssh/master.py): after its answer the probe calls
`after_probe()`, which waits for one "go" line on stdin (`go_line()`: the
daemon command, the job-file template and the layout) and then guards that
command exactly as above; the end of stdin instead means the job is not
starting here, and it leaves without running anything.
"""
from __future__ import annotations

import json
import os
import pwd
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

from mtrain.common.private import PrivatePathError
from mtrain.common.records.agent_events import AgentEvent, AgentEventKind, event_line
from mtrain.common.records.daemon_env import DAEMON_UMASK, ENV_OPENMPI_SESSION_BASE, restore_user_tmpdir
from mtrain.common.records.elastic import HostUpdates, host_path, updates_file
from mtrain.common.records.exit_record import signal_name
from mtrain.common.records.job_layout import ENV_JOB_FILE, ENV_JOB_LAYOUT, JobLayout
from mtrain.launcher.job import job_files
from mtrain.launcher.process_tools import become_subreaper, descendants, exit_code, exit_now, signal_process

HEARTBEAT_TIMEOUT = 8.0
TERM_GRACE = 3.0


def _login_shell() -> str:
    try:
        return pwd.getpwuid(os.getuid()).pw_shell or "/bin/sh"
    except KeyError:
        return "/bin/sh"


def _daemon_environment() -> dict[str, str]:
    """Our environment for the daemon's shell, marked as a nested shell.

    The session's own shell has already read the user's rc file (what it exports is our
    environment), as OpenSSH's single shell per command does.  Bash reads ~/.bashrc again
    in any shell that looks started by sshd (SSH_CLIENT set, SHLVL below 2 -- and bash
    lowers SHLVL when it execs our Python), which costs every launch another rc run on
    every host (a pyenv or conda init takes a noticeable time); SHLVL 1 here makes that
    shell level 2."""
    env = dict(os.environ)
    try:
        level = int(env.get("SHLVL") or 0)
    except ValueError:
        level = 0
    env["SHLVL"] = str(max(level, 1))
    return env


def _watch_stdin(stopped: threading.Event, updates_path: str | None = None, pending: bytes = b"") -> str:
    """Until the session ends or goes silent (then: why); heartbeats are lines, and a line
    `update N` carries an elastic job's host-set version, left in `updates_path` for the ranks.
    `pending`: what was already read from stdin past the go line."""
    last = time.monotonic()
    data = b""
    while not stopped.is_set():
        if pending or data:
            *lines, pending = (pending + data).split(b"\n")
            data = b""
            for line in lines:
                if line.startswith(b"update ") and updates_path and line[7:].strip().isdigit():
                    HostUpdates(int(line[7:])).write(updates_path)
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


def go_line(command: str, job_file: str | None, layout: str) -> bytes:
    """What the launcher sends a waiting probe to make it guard `command` (one line)."""
    return json.dumps({"command": command, "job_file": job_file, "layout": layout}).encode() + b"\n"


def _read_go_line(wait: float) -> tuple[bytes | None, bytes]:
    """(the go line, what came after it) from stdin; (None, b"") at its end or after `wait` s."""
    received = b""
    deadline = time.monotonic() + wait
    while b"\n" not in received:
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([0], [], [], left)[0]:
            return None, b""
        try:
            data = os.read(0, 65536)
        except OSError:
            return None, b""
        if not data:
            return None, b""
        received += data
    line, _, rest = received.partition(b"\n")
    return line, rest


def after_probe(wait: float) -> int:
    """Wait (at most `wait` s) for the launcher's go line, then guard the daemon it names."""
    line, rest = _read_go_line(wait)
    if line is None:
        return 0  # the job is not starting here: nothing was run
    try:
        order = json.loads(line)
        command, template, layout_text = order["command"], order.get("job_file"), order.get("layout") or ""
        if not isinstance(command, str) or not command:
            raise ValueError("no command")
        layout = JobLayout.decode(layout_text) if template and layout_text else None
    except (ValueError, KeyError, TypeError, AttributeError) as error:
        print(f"mtrain-guard: {socket.gethostname()}: bad go line from the launcher: {error}",
              file=sys.stderr, flush=True)
        return 2
    return _run_guarded(command, template if layout else None, layout, rest)


def _tell(data: bytes) -> None:
    """Write `data` to our stderr (the session's), if it is still there.  The session may have
    ended already: sshd closes our stderr as it goes, and a guard that died of the broken pipe
    would leave the job's processes here running (the notice is news, ending them is the job)."""
    try:
        os.write(2, data)
    except OSError:
        pass


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
    if argv[:1] == ["--slurm"] and len(argv) > 1:
        return slurm_main(argv[1:])
    template, layout = None, None
    if argv[:1] == ["--job-file"] and len(argv) >= 4 and argv[2] == "--layout":
        template, layout, argv = argv[1], JobLayout.decode(argv[3]), argv[4:]
    if len(argv) != 1:
        print("usage: python -m mtrain.launcher.remote_guard [--job-file PATH --layout JSON] 'COMMAND'",
              file=sys.stderr)
        return 2
    return _run_guarded(argv[0], template if layout else None, layout)


def slurm_main(command: list[str]) -> int:
    """`--slurm PRTED ARGS…`: what PRRTE's plm slurm starts on each node through srun
    (launcher/job/slurm.py).  The job's layout comes in $MTRAIN_JOB_LAYOUT (Slurm passes mpirun's
    environment on), there is no session to watch (Slurm ends the step when mpirun goes, and
    signals it on scancel), and the daemon runs as given, without a shell."""
    template = os.environ.get(ENV_JOB_FILE, "")
    text = os.environ.pop(ENV_JOB_LAYOUT, "")
    restore_user_tmpdir(os.environ)  # mpirun's own is on its host only
    try:
        layout = JobLayout.decode(text) if "{host}" in template and text else None
    except (ValueError, KeyError, TypeError) as error:
        print(f"mtrain-guard: {socket.gethostname()}: bad job layout from the launcher: {error}",
              file=sys.stderr, flush=True)
        return 2
    return _run_guarded(command, template if layout else None, layout, watch=False)


def _run_guarded(command: "str | list[str]", template: str | None, layout: JobLayout | None,
                 pending: bytes = b"", watch: bool = True) -> int:
    """Guard `command` (Open MPI's daemon), leaving the job's `layout` for the ranks on this host
    at `template`'s path (job_files.py) and removing what the job keeps here when it ends."""
    host = os.uname().nodename
    job_file = job_files.layout(template, host) if template else None
    updates_path = host_path(updates_file(template), host) if template else None
    if template:
        job_files.remove_host(template, host, earlier=True)  # what a killed generation of this job left here
    if job_file and layout:
        try:
            layout.write(job_file)
        except PrivatePathError as error:  # another user's folder (or file) at the job's path
            sys.stderr.write(f"{error} (on {host})\n")
            return 1
        except OSError as error:
            sys.stderr.write(f"mtrain: cannot write the job layout {job_file} on {host}: "
                             f"{error.strerror or error}\n")
            return 1
    try:
        return _guard(command, template, updates_path, pending, watch)
    finally:
        if template:
            job_files.remove_host(template, host)  # this generation's, and the folders once empty


def _guard(command: "str | list[str]", template: str | None, updates_path: str | None, pending: bytes = b"",
           watch: bool = True) -> int:
    become_subreaper()
    # Open MPI's daemon makes its session folder (open to all, whatever the umask) in a new 0700
    # folder of the job's (job_files.py), and runs with a private umask (the rank wrapper gives the
    # user's program the user's umask back: records.daemon_env.ENV_USER_UMASK).
    session = (job_files.daemon_session(template, os.uname().nodename) if template
               else tempfile.mkdtemp(prefix="mtrain-prted-"))
    env = _daemon_environment()
    env[ENV_OPENMPI_SESSION_BASE] = session
    try:
        return _run_daemon(command, env, updates_path, pending, watch)
    finally:
        shutil.rmtree(session, ignore_errors=True)


def _run_daemon(command: "str | list[str]", env: "dict[str, str]", updates_path: str | None, pending: bytes,
                watch: bool = True) -> int:
    """Run the daemon (a shell command, or an argv as given) and reap its tree; with `watch`, end
    it when our session's stdin ends or goes silent."""
    argv = [_login_shell(), "-c", command] if isinstance(command, str) else command
    child = subprocess.Popen(argv, stdin=subprocess.DEVNULL, env=env, umask=DAEMON_UMASK)
    done = threading.Event()
    ending = threading.Lock()

    def end_once(reason: str) -> None:
        if ending.acquire(blocking=False):
            # Reaches mpirun's stderr through the agent: shown with --verbose and in DIR/mpirun.log.
            _tell(f"mtrain-guard: {socket.gethostname()}: ending the job's processes here: {reason}\n".encode())
            end_tree()

    def watchdog() -> None:
        reason = _watch_stdin(done, updates_path, pending)
        if reason:
            end_once(reason)

    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
        signal.signal(sig, lambda number, frame: threading.Thread(
            target=end_once, args=(f"received {signal.Signals(number).name}",), daemon=True).start())
    if watch:
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
            # Killed (or its shell says it was: 128+N), and not by the job's own end: tell the launcher
            # now (records.agent_events.EVENT_MARKER); its ranks, reparented to us, may take seconds more to go.
            killer = -status if status < 0 else status - 128 if status > 128 else 0
            if killer and killer not in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT) and not ending.locked():
                host = socket.gethostname()
                _tell(event_line(AgentEvent(AgentEventKind.DAEMON_DIED, host, f"host {host}: the MPI daemon "
                                            f"there died (killed by {signal_name(killer)})", time.time())))
    done.set()
    return exit_code(status if status is not None else 255)


if __name__ == "__main__":
    exit_now(main())
