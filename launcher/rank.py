"""`python -m mtrain.launcher.rank -- COMMAND…`: the wrapper MPI starts as each rank.

It runs the user's command as a child and
* prefixes every output line with the rank, `[3]<stdout>:` / `[3]<stderr>:`,
  keeping stdout and stderr apart (mpirun forwards them separately);
* when the child ends, writes one exit record (a marker line on stderr, read
  and removed by the supervisor) with rank, host, exit status, whether we had
  been told to stop, the time, and the last lines of the child's stderr; the
  supervisor uses the records to name the *first* failing rank;
* stops the child (its whole process group) when MPI stops us, and dies with
  its parent, so a killed mpirun/prted never leaves a rank running;
* passes SIGUSR1 (mpirun forwards `mtrain run`'s) on to the child when the child
  catches it: the runtime's flight recorder dumps on it (ringreduce/observe/recorder.py),
  and a program that has not called `init()` would be killed by it;
* starts a command that runs this environment's Python through
  ``mtrain.launcher.pymain``, which learns the status the program ends with;
* hands the child its stderr pipe a second time ($MTRAIN_MARKER_FD), so the
  runtime's marker lines reach us even when the program points fd 2 elsewhere
  (pytest's capture does: see records/marker.py).

Ranks that fail only because another one died are the usual noise around a
root cause: with Open MPI, a peer's death closes sockets and the survivors
abort inside MPI within milliseconds, racing the dead rank's own record.  So
the child gets Open MPI's `mpi_abort_delay` of one second: a rank aborting in
MPI first waits, the launcher meanwhile stops it as a consequence of the real
failure, and the wrapper hides Open MPI's "Delaying for…" line and marks the
record `mpi_abort` (evidence the supervisor weighs; see outcome.first_failure).

The runtime sharpens the report through $MTRAIN_ERROR_FILE (the idea of
torchelastic's error file): an `ErrorReport` (mtrain.common.records.error_report) written there
before the rank exits says why it fails and whether the failure began here or
in a peer.  Without one, the last line the rank printed to stderr stands in as
its reason, so a failure before `init()` reads the same as one after.
"""
from __future__ import annotations

import collections
import os
import re
import signal
import subprocess
import sys
import threading
import time

from mtrain.common.private import PrivatePathError
from mtrain.common.records.daemon_env import ENV_USER_UMASK, restore_user_tmpdir
from mtrain.common.records.elastic import RESUME_MARKER
from mtrain.common.records.error_report import ENV_ERROR_FILE, ErrorReport, FailureCause
from mtrain.common.records.exit_record import ExitRecord, exception_line
from mtrain.common.records.flight_recorder import DUMP_MARKER, DUMP_REQUEST_MARKER
from mtrain.common.records.job_layout import ENV_JOB_FILE, JobLayout
from mtrain.common.records.marker import ENV_MARKER_FD, marker_channel
from mtrain.common.records.phase import PHASE_MARKER, Phase, PhaseNote
from mtrain.common.records.steps import STEP_MARKER
from mtrain.launcher import pymain
from mtrain.launcher.job import job_files
from mtrain.launcher.process_tools import die_with_parent, exit_code, exit_now, kill_group

TAIL_LINES = 15
TERM_GRACE = 3.0
# What the runtime writes on a rank's stderr for the supervisor: never the rank's own words.
RUNTIME_MARKERS = (PHASE_MARKER, RESUME_MARKER, STEP_MARKER, DUMP_MARKER, DUMP_REQUEST_MARKER)
_RANK_VARIABLES = ("OMPI_COMM_WORLD_RANK", "PMIX_RANK", "PMI_RANK")
ABORT_DELAY_SECONDS = "1"
# Open MPI's line when a process enters MPI_Abort (or a fatal MPI error) with mpi_abort_delay set.
_ABORT_DELAY_LINE = re.compile(rb"^\[[^\]\s]+:\d+\] Delaying for \d+ seconds? before aborting\s*$")


def rank_from_env(env: dict[str, str] | os._Environ) -> int:
    for name in _RANK_VARIABLES:
        if env.get(name, "").isdigit():
            return int(env[name])
    return 0


class _Relay(threading.Thread):
    """Copies one pipe to one of our streams, a prefixed line at a time."""

    def __init__(self, source: int, target, prefix: bytes, lock: threading.Lock,
                 tail: collections.deque | None) -> None:
        super().__init__(daemon=True)
        self.source, self.target, self.prefix, self.lock, self.tail = source, target, prefix, lock, tail
        self.saw_mpi_abort = False
        self.last_exception = ""
        self.where = ""  # the program's own line it failed at, as its runner noted it

    def _emit(self, line: bytes) -> None:
        if self.tail is not None and _ABORT_DELAY_LINE.match(line):
            self.saw_mpi_abort = True  # evidence for the record, not news for the user
            return
        with self.lock:
            self.target.write(self.prefix + line)
            self.target.flush()
        if self.tail is not None and PHASE_MARKER in line:  # the supervisor's, not the rank's words
            note = PhaseNote.decode(line.partition(PHASE_MARKER)[2])
            if note is not None and note.phase is Phase.ENDED:
                self.where = note.where
        elif self.tail is not None and not any(marker in line for marker in RUNTIME_MARKERS):
            text = line.rstrip(b"\n").decode(errors="replace")
            self.tail.append(text)
            # Kept apart from the tail: a long exception message can push its first line out.
            self.last_exception = exception_line(text) or self.last_exception

    def run(self) -> None:
        pending = b""
        while True:
            try:
                data = os.read(self.source, 65536)
            except OSError:
                data = b""
            if not data:
                break
            pending += data
            *lines, pending = pending.split(b"\n")
            for line in lines:
                self._emit(line + b"\n")
        if pending:  # a last line without newline still gets one, so prefixes stay aligned
            self._emit(pending + b"\n")
        os.close(self.source)


def child_environment(env, error_file: str, rank: int = 0) -> dict[str, str]:
    """The rank's environment: ours, plus the error-file path, Open MPI's abort delay
    (see the module docstring), on a host with more ranks than cores Open MPI's yield
    setting (busy-polling ranks starve each other), and the job's layout: the variables
    torchrun sets (RANK, LOCAL_RANK, MASTER_ADDR, …) and TF_CONFIG, so plain
    torch.distributed and tf.distribute programs run unchanged.  Settings the user made win."""
    child = dict(env)
    child[ENV_ERROR_FILE] = error_file
    restore_user_tmpdir(child)  # where mpirun was given another (records.daemon_env.ENV_MPIRUN_TMPDIR)
    template = child.get(ENV_JOB_FILE, "")
    host = os.uname().nodename
    layout = JobLayout.read(job_files.layout(template, host)) if "{host}" in template else None
    if layout is not None and rank < sum(layout.slots):
        for name, value in layout.rank_environment(rank).items():
            child.setdefault(name, value)
    if "{host}" in template:
        # Open MPI's segments in a private folder of the job's, removed with the job's part on
        # this host, even when a killed rank leaves them behind.
        child.setdefault("OMPI_MCA_btl_sm_backing_directory", job_files.shared_memory_folder(template, host))
    child.setdefault("OMPI_MCA_mpi_abort_delay", ABORT_DELAY_SECONDS)
    local = child.get("OMPI_COMM_WORLD_LOCAL_SIZE", "")
    if local.isdigit() and int(local) > (os.cpu_count() or 1):
        child.setdefault("OMPI_MCA_mpi_yield_when_idle", "1")
    return child


def _scratch_directory(rank: int) -> str:
    """A new private directory for the rank's error file: in the job's folder (job_files.py)
    under mtrain run, else tempfile.mkdtemp's job, without importing tempfile (with random and
    hashlib, ~5 ms of every wrapper's start)."""
    template = os.environ.get(ENV_JOB_FILE, "")
    if "{host}" in template:
        return job_files.rank_scratch(template, os.uname().nodename, rank)
    base = os.environ.get("TMPDIR") or "/tmp"
    for _ in range(16):
        path = os.path.join(base, f"mtrain-rank-{os.urandom(6).hex()}")
        try:
            os.mkdir(path, 0o700)
            return path
        except FileExistsError:
            continue
        except OSError:
            break  # an unusable $TMPDIR: tempfile knows the fallbacks
    import tempfile
    return tempfile.mkdtemp(prefix="mtrain-rank-")


def _remove_scratch(scratch: str, error_file: str) -> None:
    for remove, path in ((os.unlink, error_file), (os.rmdir, scratch)):
        try:
            remove(path)
        except FileNotFoundError:
            pass
        except OSError:  # something else was left there
            import shutil
            shutil.rmtree(scratch, ignore_errors=True)
            return


def _user_umask(env: "dict[str, str]") -> int:
    """The umask of the user who launched the job: the program gets it back from Open MPI's
    daemons, which run with a private one (records.daemon_env.ENV_USER_UMASK); -1 (leave it) without one."""
    text = env.get(ENV_USER_UMASK, "")
    try:
        return int(text, 8) & 0o777 if text else -1
    except ValueError:
        return -1


def _set_child_deathsig() -> None:
    # Runs in the child between fork and exec: if this wrapper is SIGKILLed, so is the rank.
    die_with_parent(signal.SIGKILL)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--"]:
        argv = argv[1:]
    if not argv:
        print("usage: python -m mtrain.launcher.rank -- COMMAND…", file=sys.stderr)
        return 2
    die_with_parent(signal.SIGTERM)
    rank = rank_from_env(os.environ)
    host = os.uname().nodename  # socket.gethostname(), without importing socket
    stopping = threading.Event()
    out_read, out_write = os.pipe()
    err_read, err_write = os.pipe()
    try:
        scratch = _scratch_directory(rank)
    except PrivatePathError as error:  # another user's folder at the job's path
        sys.stderr.buffer.write(f"[{rank}]<stderr>:{error}\n".encode())
        _write_record(ExitRecord(rank, host, 1, stopped=False, time=time.time(), stderr_tail=(str(error),)))
        return 1
    error_file = os.path.join(scratch, "error.json")
    try:
        environment = child_environment(os.environ, error_file, rank)
    except PrivatePathError as error:  # a planted job layout: refused, and the rank never starts
        _remove_scratch(scratch, error_file)
        os.close(out_write)
        os.close(err_write)
        message = str(error)
        sys.stderr.buffer.write(f"[{rank}]<stderr>:{message}\n".encode())
        _write_record(ExitRecord(rank, host, 1, stopped=False, time=time.time(), stderr_tail=(message,)))
        return 1
    # A Python program runs through mtrain's runner, so that its exit status is known however
    # it leaves (see launcher/pymain.py).
    command = pymain.command_through_runner(argv, environment) or argv
    # The stderr pipe a second time, for marker lines: a program may point fd 2 elsewhere (pytest's
    # capture does), and a hung rank's dumps must still reach the supervisor (records/marker.py).
    environment[ENV_MARKER_FD] = marker_channel(err_write)
    try:
        child = subprocess.Popen(command, stdout=out_write, stderr=err_write, pass_fds=(err_write,),
                                 env=environment, umask=_user_umask(environment),
                                 start_new_session=True, preexec_fn=_set_child_deathsig)
    except OSError as error:
        _remove_scratch(scratch, error_file)
        os.close(out_write)
        os.close(err_write)
        message = f"cannot start {argv[0]!r}: {error.strerror}"
        sys.stderr.buffer.write(f"[{rank}]<stderr>:{message}\n".encode())
        _write_record(ExitRecord(rank, host, 127, stopped=False, time=time.time(), stderr_tail=(message,)))
        return 127
    os.close(out_write)
    os.close(err_write)

    def on_signal(number, frame) -> None:
        if stopping.is_set():
            return
        stopping.set()
        kill_group(child.pid, signal.SIGTERM)
        threading.Timer(TERM_GRACE, kill_group, args=(child.pid, signal.SIGKILL)).start()

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, on_signal)
    # mpirun forwards mtrain run's SIGUSR1 here: the rank's flight recorder dumps on it.
    signal.signal(signal.SIGUSR1, lambda number, frame: forward_if_caught(child.pid, signal.SIGUSR1))
    if os.getppid() == 1:  # the parent died before die_with_parent took effect
        on_signal(signal.SIGTERM, None)

    lock = threading.Lock()
    tail: collections.deque = collections.deque(maxlen=TAIL_LINES)
    err_relay = _Relay(err_read, sys.stderr.buffer, f"[{rank}]<stderr>:".encode(), lock, tail)
    relays = [_Relay(out_read, sys.stdout.buffer, f"[{rank}]<stdout>:".encode(), lock, None), err_relay]
    for relay in relays:
        relay.start()
    returncode = child.wait()
    end = time.time()
    # Only a stop request that came *before* the child ended makes this rank a consequence;
    # MPI often stops us while we are still flushing a rank that failed on its own.
    stopped = stopping.is_set()
    # Whatever the rank left behind in its group (workers, daemons) ends with it.
    kill_group(child.pid, signal.SIGKILL)
    for relay in relays:
        relay.join(timeout=2.0)
    report = ErrorReport.read(error_file)
    _remove_scratch(scratch, error_file)
    with lock:
        _write_record(exit_record(rank, host, returncode, stopped, tuple(tail), end, report,
                                  err_relay.saw_mpi_abort, err_relay.last_exception, err_relay.where))
    return exit_code(returncode)


def forward_if_caught(pid: int, sig: int) -> bool:
    """Send ``sig`` to ``pid`` only if that process catches it: SIGUSR1's default action ends a
    process, and a program that has not called ``init()`` yet has no handler for it."""
    try:
        with open(f"/proc/{pid}/status", "rb") as handle:
            caught = next((line for line in handle if line.startswith(b"SigCgt:")), b"")
        if not int(caught.split()[1], 16) & (1 << (sig - 1)):
            return False
        os.kill(pid, sig)
        return True
    except (OSError, ValueError, IndexError):  # ended, or no /proc: nothing to tell
        return False


def exit_record(rank: int, host: str, returncode: int, stopped: bool, tail: tuple[str, ...],
                end: float, report: ErrorReport | None, mpi_abort: bool, exception: str = "",
                where: str = "") -> ExitRecord:
    """What the supervisor learns of this rank; the runtime's own account beats our inference."""
    if report is None:
        return ExitRecord(rank, host, returncode, stopped, end, tail, mpi_abort=mpi_abort, exception=exception,
                          where=where)
    return ExitRecord(rank, host, returncode, stopped=report.cause is FailureCause.PEER,
                      time=min(end, report.time), stderr_tail=tail, report=report.message,
                      mpi_abort=mpi_abort, exception=exception, where=where)


def _write_record(record: ExitRecord) -> None:
    sys.stderr.buffer.write(record.encode())
    sys.stderr.flush()


if __name__ == "__main__":
    exit_now(main())
