"""The records that cross a process boundary, each with its writer and reader side by side.

Both halves of mtrain import this module: the runtime inside every rank
(``mtrain.ringreduce``) and the launcher (``mtrain.launcher``).  It depends on
the standard library only, because it runs in ranks, SSH agents and remote
guards alike. It lives with the launcher, its owner: the launcher reads what
the ranks and agents write (as torchrun's error-file format belongs to
``torch.distributed.elastic.multiprocessing.errors``, which workers import).

    record          written by                       read by
    ErrorReport     the runtime, in a rank           the rank wrapper
    ExitRecord      the rank wrapper                 the supervisor
    AgentEvent      the SSH agents                   the supervisor
    Gate            the supervisor                   the SSH agents
    JobLayout       the launcher (through the gate)  the rank wrapper on every host
    HostUpdates     the launcher (through the agents) hvd.elastic in the ranks (host-set version)
    ElasticResume   rank 0 of an elastic generation  the supervisor (the reset's log line)
    StopReason      the supervisor (why it stopped a job; logged and used for its grace period)
    RecorderDump    the runtime's flight recorder        the supervisor's hang report
    DumpRequest     the runtime (a stall it coordinates) the supervisor (signals every rank to dump)
"""
from __future__ import annotations

import enum
import json
import os
import re
import signal
import threading
import time
import typing

from mtrain.launcher.private import PrivatePathError, read_private, write_private

# --------------------------------------------------------------------------------------------
# The records are plain frozen classes: ``_record`` gives them what dataclass(frozen=True)
# would, without importing dataclasses (and inspect with it), ~10 ms of CPU at the start of
# every rank wrapper and remote guard, on a launch's critical path.


def _record(cls: type) -> type:
    """Make ``cls`` a frozen record of its annotated fields, in order (a value in the class
    body is that field's default, and must be immutable): ``__init__`` by position or
    keyword, ``==`` and ``hash`` over the fields, ``repr``, ``_asdict()`` and
    ``replace(**changes)``; assigning to a field raises AttributeError."""
    names = tuple(cls.__dict__.get("__annotations__", {}))
    defaults = {name: cls.__dict__[name] for name in names if name in cls.__dict__}

    def __init__(self, *args, **kwargs) -> None:
        if len(args) > len(names):
            raise TypeError(f"{cls.__name__}() takes {len(names)} fields, {len(args)} given")
        values = dict(zip(names, args))
        for name, value in kwargs.items():
            if name not in names or name in values:
                raise TypeError(f"{cls.__name__}() got an unexpected or repeated field {name!r}")
            values[name] = value
        for name in names:
            if name not in values:
                if name not in defaults:
                    raise TypeError(f"{cls.__name__}() is missing field {name!r}")
                values[name] = defaults[name]
            object.__setattr__(self, name, values[name])

    def _values(self) -> tuple:
        return tuple(getattr(self, name) for name in names)

    def __eq__(self, other: object) -> bool:
        if other.__class__ is not self.__class__:
            return NotImplemented
        return _values(self) == _values(other)

    def __hash__(self) -> int:
        return hash(_values(self))

    def __repr__(self) -> str:
        return f"{cls.__name__}({', '.join(f'{name}={getattr(self, name)!r}' for name in names)})"

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError(f"cannot assign to field {name!r} of a frozen {cls.__name__}")

    def __delattr__(self, name: str) -> None:
        raise AttributeError(f"cannot delete field {name!r} of a frozen {cls.__name__}")

    def _asdict(self) -> dict:
        return {name: getattr(self, name) for name in names}

    def replace(self, **changes) -> object:
        return cls(**{**_asdict(self), **changes})

    for function in (__init__, __eq__, __hash__, __repr__, __setattr__, __delattr__, _asdict, replace):
        function.__qualname__ = f"{cls.__qualname__}.{function.__name__}"
        setattr(cls, function.__name__, function)
    cls._fields = names  # type: ignore[attr-defined]
    return cls


# --------------------------------------------------------------------------------------------
# ErrorReport: a rank's own account of why it is failing ($MTRAIN_ERROR_FILE)

ENV_ERROR_FILE = "MTRAIN_ERROR_FILE"
_ERROR_FILE_LIMIT = 65536
_MESSAGE_LIMIT = 500


class FailureCause(enum.Enum):
    OWN = "own"    # the failure began in this rank
    PEER = "peer"  # this rank failed only because another one left or failed


@_record
class ErrorReport:
    """Why a rank is failing, in the runtime's own words (one line)."""

    message: str
    cause: FailureCause
    time: float

    def write(self, path: str) -> bool:
        """Write the report unless one is there already (the first account wins)."""
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except OSError:
            return False
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            json.dump({"message": self.message, "cause": self.cause.value, "time": self.time}, handle)
        return True

    @staticmethod
    def read(path: str) -> "ErrorReport | None":
        """The report at `path`, or None when there is none or it is not one of ours."""
        try:
            with open(path, "rb") as handle:
                data = json.loads(handle.read(_ERROR_FILE_LIMIT))
            return ErrorReport(message=_one_line(str(data["message"])),
                               cause=FailureCause(data["cause"]), time=float(data["time"]))
        except (OSError, ValueError, KeyError, TypeError):
            return None


def supervised() -> bool:
    """Whether this rank runs under `mtrain run`'s rank wrapper, which reports how it ends."""
    return ENV_ERROR_FILE in os.environ


def own_failure_line(record: "ExitRecord") -> str:
    """The job's failure report as a rank with no launcher of ours says it of itself (ranks that
    srun started directly, say): the line `mtrain run` would print for it."""
    return f"mtrain: job failed; first failure: {record.describe()}\n"


def report_error(message: str, cause: FailureCause) -> None:
    """Tell the launcher (if one is listening through $MTRAIN_ERROR_FILE) why this rank fails."""
    path = os.environ.get(ENV_ERROR_FILE)
    if not path:
        return
    try:
        ErrorReport(_one_line(message), cause, time.time()).write(path)
    except OSError:
        pass  # the report is a courtesy; it must never mask the failure itself


def _one_line(text: str) -> str:
    lines = text.splitlines()
    return lines[0][:_MESSAGE_LIMIT] if lines else ""


# --------------------------------------------------------------------------------------------
# ExitRecord: how one rank ended (a marker line on the rank's stderr, removed by the supervisor)

EXIT_MARKER = b"@@mtrain-rank-exit@@ "
# The line Python ends a traceback with, `package.module.ValueError: …` (torch.distributed adds
# `[rank3]: ` in front); shown as `ValueError: …`, as the runtime's own account shows it.
_EXCEPTION_LINE = re.compile(r"^(?:\[rank\d+\]:\s*)?(?:[A-Za-z_]\w*\.)*"
                             r"([A-Za-z_]\w*(?:Error|Exception|Exit|Interrupt|Fault)(?::.*)?)$")


def exception_line(line: str) -> str:
    """The exception named by a traceback's last line (without its module path), else ""."""
    match = _EXCEPTION_LINE.match(line.rstrip())
    return match.group(1)[:_MESSAGE_LIMIT] if match else ""


def user_line(traceback: object) -> str:
    """Where the program's own code was when ``traceback``'s exception left it: the innermost
    frame outside mtrain, the installed libraries and the standard library, as
    ``file:line in function`` (``file`` relative to the current folder when under it), else ""."""
    frame = None
    roots = _library_roots()
    while traceback is not None:
        filename = traceback.tb_frame.f_code.co_filename  # type: ignore[attr-defined]
        if not _library_file(filename, roots):
            frame = traceback
        traceback = traceback.tb_next  # type: ignore[attr-defined]
    if frame is None:
        return ""
    code = frame.tb_frame.f_code
    return f"{_shown_path(code.co_filename)}:{frame.tb_lineno} in {code.co_name}"


def _shown_path(path: str) -> str:
    """``path`` relative to the current folder when under it."""
    try:
        here = os.getcwd()
    except OSError:  # the current folder was removed
        here = os.sep
    if not path.startswith("<") and here != os.sep:
        relative = os.path.relpath(path, here)
        path = relative if not relative.startswith(os.pardir) else path
    return path


def _library_file(filename: str, roots: "list[str]") -> bool:
    if filename.startswith("<"):
        return filename.startswith("<frozen ")  # <string> (python -c) and <stdin> are the user's
    path = os.path.realpath(filename)
    if f"{os.sep}site-packages{os.sep}" in path or f"{os.sep}dist-packages{os.sep}" in path:
        return True
    return any(path == root or path.startswith(root + os.sep) for root in roots)


def _library_roots() -> "list[str]":
    import sys
    import sysconfig
    roots = [sysconfig.get_paths().get(key) for key in ("stdlib", "platstdlib", "purelib", "platlib")]
    roots.append(os.path.dirname(os.path.abspath(__file__)))  # mtrain.launcher
    for name in ("mtrain", "mtrain.ringreduce"):  # mtrain (its bindings, mtrain.torch, ...) and the runtime
        roots.extend(getattr(sys.modules.get(name), "__path__", None) or ())
    return [os.path.realpath(root) for root in roots if root]


class Evidence(enum.IntEnum):
    """How surely a failure began in the rank that reports it (lower is surer)."""

    SURE = 0       # the runtime's own account, or a signal nobody in the job sent (kill -9, OOM, SEGV)
    EXIT = 1       # a plain non-zero exit status, or an abort() of the rank's own
    DOUBTFUL = 2   # it aborted inside MPI: a peer's death or a lost link is the usual reason


@_record
class ExitRecord:
    """How one rank ended, as its wrapper saw it."""

    rank: int
    host: str
    returncode: int                 # negative: killed by that signal
    stopped: bool                   # told to stop before it ended, or failed because of a peer
    time: float                     # when the failure began (the runtime's time if it said so)
    stderr_tail: tuple[str, ...] = ()
    report: str = ""                # the runtime's own one-line account, if it gave one
    mpi_abort: bool = False         # it ended inside MPI_Abort
    exception: str = ""             # the last exception line the rank printed to stderr, if any
    where: str = ""                 # the program's own line it failed at (``user_line``), if known

    @property
    def failed(self) -> bool:
        # A rank that ended with status 0 still failed if the runtime says it left the job
        # while other ranks needed it.
        return self.returncode != 0 or bool(self.report and not self.stopped)

    @property
    def evidence(self) -> Evidence:
        # SIGABRT is a process aborting itself, often a library reacting to a peer's death
        # (gloo's "Connection closed by peer", then std::terminate): no surer than an exit status.
        if self.report or (self.returncode < 0 and self.returncode != -signal.SIGABRT):
            return Evidence.SURE
        return Evidence.DOUBTFUL if self.mpi_abort else Evidence.EXIT

    @property
    def reason(self) -> str:
        """One line saying why: the runtime's own account; else, for a rank that exited with an
        error status, the last exception it printed, else its last line on stderr (so a
        failure before `init()` reads like one after it).  A signal is its own reason."""
        if self.report:
            return self.report
        if self.returncode <= 0:
            return ""
        if self.exception:
            return self.exception
        for line in reversed(self.stderr_tail):
            if line.strip() and not line[:1].isspace():  # not a traceback frame
                return (exception_line(line) or line.strip())[:_MESSAGE_LIMIT]
        return ""

    def describe(self) -> str:
        how = f"killed by {signal_name(-self.returncode)}" if self.returncode < 0 else f"exit code {self.returncode}"
        reason = self.reason
        where = f" at {self.where}" if self.where and self.returncode > 0 else ""
        return f"rank {self.rank} on {self.host}: {how}" + (f" ({reason})" if reason else "") + where

    def encode(self) -> bytes:
        fields = self._asdict()
        fields["stderr_tail"] = list(self.stderr_tail)
        return EXIT_MARKER + json.dumps(fields).encode() + b"\n"

    @staticmethod
    def decode(payload: bytes) -> "ExitRecord | None":
        """The record after EXIT_MARKER, or None for anything else."""
        try:
            data = json.loads(payload)
            return ExitRecord(rank=int(data["rank"]), host=str(data["host"]),
                              returncode=int(data["returncode"]), stopped=bool(data["stopped"]),
                              time=float(data["time"]),
                              stderr_tail=tuple(str(line) for line in data["stderr_tail"]),
                              report=str(data["report"]), mpi_abort=bool(data["mpi_abort"]),
                              exception=str(data["exception"]), where=str(data.get("where", "")))
        except (ValueError, KeyError, TypeError):
            return None


def signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


# --------------------------------------------------------------------------------------------
# AgentEvent: what the SSH agents (children of mpirun, whose own reports may hide them) tell
# the supervisor, as JSON lines appended to a file the supervisor polls.

class AgentEventKind(enum.Enum):
    CONNECT_FAILED = "connect-failed"  # the host could not be reached or refused a session
    HOST_LOST = "host-lost"            # the connection died while the job ran
    DAEMON_DIED = "daemon-died"        # the host's MPI daemon was killed (by a signal) while the job ran


@_record
class AgentEvent:
    kind: AgentEventKind
    host: str
    detail: str   # one line for the user, naming the host
    time: float

    def _json(self) -> str:
        return json.dumps({"kind": self.kind.value, "host": self.host, "detail": self.detail, "time": self.time})

    def emit(self, path: "str | None") -> None:
        """Append the event to `path` if a supervisor listens (None: nothing)."""
        if not path:
            return
        line = self._json() + "\n"
        # One write() on an O_APPEND file: lines from several agents never interleave.
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        try:
            os.write(fd, line.encode())
        finally:
            os.close(fd)

    @staticmethod
    def decode(line: bytes) -> "AgentEvent | None":
        try:
            data = json.loads(line)
            return AgentEvent(AgentEventKind(data["kind"]), str(data["host"]), str(data["detail"]),
                              float(data["time"]))
        except (ValueError, KeyError, TypeError):
            return None


# The remote guard, which sees its host's MPI daemon die first, says so in a marker line on its
# stderr; the SSH relay that carries it (the connection master, or the agent) takes it out and
# appends the event, before mpirun, which stops its agents as soon as it misses a daemon, can.
EVENT_MARKER = b"@@mtrain-agent-event@@ "


def event_line(event: AgentEvent) -> bytes:
    return EVENT_MARKER + event._json().encode() + b"\n"


def take_events(data: bytes, path: "str | None") -> bytes:
    """`data` (a chunk of a guard's stderr) without its event lines, which go to `path`."""
    if EVENT_MARKER not in data:
        return data
    kept = []
    for line in data.splitlines(keepends=True):
        before, marker, payload = line.partition(EVENT_MARKER)
        event = AgentEvent.decode(payload) if marker else None
        if event is None:
            kept.append(line)
            continue
        event.emit(path)
        if before:
            kept.append(before + b"\n")
    return b"".join(kept)


class AgentEventReader:
    """Reads the events appended to a file since the last poll."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.offset = 0
        self.partial = b""

    def poll(self) -> list[AgentEvent]:
        try:
            with open(self.path, "rb") as handle:
                handle.seek(self.offset)
                data = handle.read()
        except FileNotFoundError:
            return []
        self.offset += len(data)
        *lines, self.partial = (self.partial + data).split(b"\n")
        return [event for event in map(AgentEvent.decode, lines) if event is not None]


# --------------------------------------------------------------------------------------------
# Gate: the agents connect while the preflight runs, and run nothing until it passes.

class GateState(enum.Enum):
    WAITING = "waiting"
    OPEN = "open"      # the preflight passed: go on
    CLOSED = "closed"  # the preflight failed: give up quietly


@_record
class Gate:
    """Two marker files beside `path`: the supervisor creates one, the agents watch for both."""

    path: str

    def _marker(self, state: GateState) -> str:
        return f"{self.path}.{state.value}"

    def open(self, message: str = "") -> None:
        """Let the agents go on, handing them `message` (the job's layout, for the hosts)."""
        write_private(self._marker(GateState.OPEN), message.encode())  # agents never see half a message

    def message(self) -> str:
        """What the supervisor handed over when it opened the gate ("" before)."""
        try:
            with open(self._marker(GateState.OPEN), encoding="utf-8") as handle:
                return handle.read()
        except OSError:
            return ""

    def close(self) -> None:
        write_private(self._marker(GateState.CLOSED), b"")

    def state(self) -> GateState:
        for state in (GateState.OPEN, GateState.CLOSED):
            if os.path.exists(self._marker(state)):
                return state
        return GateState.WAITING

    def wait(self, timeout: float, stop: threading.Event) -> bool:
        """True once the gate opens; False when it closes, `stop` is set or `timeout` passes."""
        deadline = time.monotonic() + timeout
        while not stop.is_set() and time.monotonic() < deadline:
            state = self.state()
            if state is not GateState.WAITING:
                return state is GateState.OPEN
            time.sleep(0.01)
        return False


# --------------------------------------------------------------------------------------------
# StopReason: why the supervisor stopped a job itself.

class StopReason(enum.Enum):
    INTERRUPTED = "interrupted"                 # Ctrl-C or SIGTERM reached mtrain
    HOST_LOST = "a host was lost"               # an agent reported a dead connection
    RANK_FAILED = "a rank failed and mpirun did not stop the job"
    STUCK = "the job could never go on"         # ranks wait in init() for one whose program ended



# --------------------------------------------------------------------------------------------
# PhaseNote: where a rank's program is, so that the supervisor can tell a job that can never go
# on (a rank that ended while others wait for it in init()) from one that is merely slow.  A
# marker line on the rank's stderr, removed by the supervisor; the line's prefix names the rank.

PHASE_MARKER = b"@@mtrain-rank-phase@@ "


class Phase(enum.Enum):
    INIT_WAITING = "init-waiting"   # in init(), whose collectives need every rank of `ranks`
    INIT_DONE = "init-done"         # out of init() again
    ENDED = "ended"                 # the program ended with `status` (the process may wait in MPI_Finalize)


@_record
class PhaseNote:
    phase: Phase
    ranks: tuple = ()  # INIT_WAITING: the job's ranks that init() waits for
    status: int = 0    # ENDED: the program's exit status
    where: str = ""    # ENDED through an exception or SystemExit: the program's own line it left from

    def encode(self) -> bytes:
        return PHASE_MARKER + json.dumps({"phase": self.phase.value, "ranks": list(self.ranks),
                                          "status": self.status, "where": self.where}).encode() + b"\n"

    @staticmethod
    def decode(payload: bytes) -> "PhaseNote | None":
        try:
            data = json.loads(payload)
            return PhaseNote(Phase(data["phase"]), tuple(int(r) for r in data["ranks"]), int(data["status"]),
                             str(data.get("where", "")))
        except (ValueError, KeyError, TypeError):
            return None

    def emit(self) -> None:
        """Tell the supervisor, when there is one (the rank runs under mtrain run's rank wrapper)."""
        if ENV_ERROR_FILE not in os.environ:
            return
        import sys
        try:
            sys.stderr.flush()  # after what the program already said, on a line of its own
        except (OSError, ValueError):
            pass
        try:
            os.write(2, self.encode())
        except OSError:
            pass


def stuck_in_init(waiting: "dict[int, tuple]", ended: "dict[int, int]") -> "str | None":
    """Why the job can never go on, when ranks wait in init() for a rank whose program has ended
    (with status 0: an error status ends the job by itself); None when it may."""
    stuck = {rank: [r for r in ranks if ended.get(r) == 0] for rank, ranks in waiting.items()}
    stuck = {rank: gone for rank, gone in stuck.items() if gone}
    if not stuck:
        return None
    gone = sorted({r for ranks in stuck.values() for r in ranks})
    who = f"rank {gone[0]}" if len(gone) == 1 else f"ranks {', '.join(map(str, gone))}"
    waiters = sorted(stuck)
    them = f"rank {waiters[0]} waits" if len(waiters) == 1 else f"ranks {', '.join(map(str, waiters))} wait"
    return (f"{who} ended (exit code 0) without calling init(), while {them} for it in init(); every rank must "
            "call init() (or give init(comm=[...]) only the ranks that do)")


# --------------------------------------------------------------------------------------------
# JobLayout: what every rank is told about the job, so that plain torch.distributed and
# tf.distribute programs find each other (written by the launcher once the preflight knows
# addresses and free ports; on each host a file the rank wrapper reads).

ENV_JOB_FILE = "MTRAIN_JOB_FILE"  # a path template: "{host}" stands for the host's name (launcher/job_files.py)
# A job started through Slurm: its layout (JobLayout.encode()), which the daemon's guard on each node
# writes at $MTRAIN_JOB_FILE there (launcher/slurm.py); srun passes mpirun's environment on.
ENV_JOB_LAYOUT = "MTRAIN_JOB_LAYOUT"



@_record
class JobLayout:
    slots: tuple[int, ...]            # ranks per host, hosts in rank order
    master_addr: str                  # rank 0's address on the job's network
    master_port: int                  # free on rank 0's host (torch's env:// rendezvous)
    workers: tuple[str, ...]          # "address:port" per rank, ports free on each host (TF_CONFIG)
    gpu_per_rank: tuple[int, ...] = ()  # per host: GPUs to share one per local rank (empty: leave GPUs alone)
    interfaces: tuple[str, ...] = ()    # per host: its interface on the job's network ("" unknown)

    def encode(self) -> str:
        return json.dumps(self._asdict())

    @staticmethod
    def decode(text: str) -> "JobLayout | None":
        try:
            data = json.loads(text)
            return JobLayout(slots=tuple(int(n) for n in data["slots"]), master_addr=str(data["master_addr"]),
                             master_port=int(data["master_port"]),
                             workers=tuple(str(w) for w in data["workers"]),
                             gpu_per_rank=tuple(int(n) for n in data.get("gpu_per_rank", ())),
                             interfaces=tuple(str(name) for name in data.get("interfaces", ())))
        except (ValueError, KeyError, TypeError):
            return None

    def write(self, path: str) -> None:
        # In the job's folder in /tmp (see launcher/private.py): mode 0600, never through a planted path.
        write_private(path, self.encode().encode())

    @staticmethod
    def read(path: str) -> "JobLayout | None":
        """The layout in `path`, None when there is none; PrivatePathError when it is not ours."""
        try:
            return JobLayout.decode(read_private(path).decode("utf-8"))
        except PrivatePathError:
            raise
        except (OSError, UnicodeDecodeError):
            return None

    def rank_environment(self, rank: int) -> dict[str, str]:
        """The variables torchrun gives a rank, plus TF_CONFIG for tf.distribute."""
        host, first = 0, 0
        while rank >= first + self.slots[host]:
            first += self.slots[host]
            host += 1
        local_rank, world = rank - first, sum(self.slots)
        env = {"RANK": str(rank), "WORLD_SIZE": str(world),
               "LOCAL_RANK": str(local_rank), "LOCAL_WORLD_SIZE": str(self.slots[host]),
               "GROUP_RANK": str(host), "GROUP_WORLD_SIZE": str(len(self.slots)),
               "ROLE_RANK": str(rank), "ROLE_WORLD_SIZE": str(world),
               "MASTER_ADDR": self.master_addr, "MASTER_PORT": str(self.master_port),
               "TF_CONFIG": json.dumps({"cluster": {"worker": list(self.workers)},
                                        "task": {"type": "worker", "index": rank}})}
        if self.interfaces and self.interfaces[host]:
            env["GLOO_SOCKET_IFNAME"] = env["NCCL_SOCKET_IFNAME"] = self.interfaces[host]
        if self.gpu_per_rank and self.gpu_per_rank[host] > 0:
            env["CUDA_VISIBLE_DEVICES"] = str(local_rank % self.gpu_per_rank[host])
        return env


# --------------------------------------------------------------------------------------------
# Elastic training: what the launcher's elastic driver and the ranks' `hvd.elastic` share.
#
# An MPI world cannot shrink or grow, so an elastic job runs as generations: the driver
# starts one mpirun per host set.  Ranks keep every `state.commit()` in memory and in a
# snapshot on their host; a new generation restores the newest commit any rank holds.

ENV_ELASTIC = "MTRAIN_ELASTIC"                      # "1" in the ranks of an elastic job
ENV_ELASTIC_STATE_DIR = "MTRAIN_ELASTIC_STATE_DIR"  # template, "{host}": this host's snapshot folder
ENV_ELASTIC_UPDATES = "MTRAIN_ELASTIC_UPDATES"      # template, "{host}": file with the host-set version
ENV_ELASTIC_VERSION = "MTRAIN_ELASTIC_VERSION"      # the host-set version this generation started with
RESET_EXIT_STATUS = 75   # every rank exits with it to ask the driver for the next generation
# A random key per job that signs the snapshots (bindings/elastic/snapshot.py), so that a new
# generation loads only what this job wrote.  It reaches the ranks in their environment (mpirun
# forwards it by name from its own, which only this user can read): never on a command line.
ENV_JOB_SECRET = "MTRAIN_JOB_SECRET"
# Open MPI's daemons run with umask 077, so that what they leave in /tmp is private whatever
# the user's umask; the rank wrapper gives the user's program the user's own umask back.
ENV_USER_UMASK = "MTRAIN_USER_UMASK"   # octal, e.g. "022"
# Open MPI's launcher names its folder in the temporary folder after its pid alone and will not
# start where that folder is already (one a killed launcher left, or another user planted):
# mpirun runs with TMPDIR set to the launch's private scratch folder, and the rank wrapper gives
# the program on that host the user's TMPDIR back.  (TMPDIR is not passed on to Open MPI's daemons
# on other hosts, which use the job's folders there: remote_guard.py; through Slurm the guard
# gives it back before it starts the daemon.)
ENV_MPIRUN_TMPDIR = "MTRAIN_MPIRUN_TMPDIR"   # the TMPDIR mpirun was given
ENV_USER_TMPDIR = "MTRAIN_USER_TMPDIR"       # the user's own; absent when the user had none


def restore_user_tmpdir(env: "typing.MutableMapping[str, str]") -> None:
    """The user's TMPDIR back in `env`, where mpirun's was given instead (and these notes out).
    Through Slurm, srun passes mpirun's environment to the other nodes, where that folder is not."""
    mpirun_tmpdir, user_tmpdir = env.pop(ENV_MPIRUN_TMPDIR, None), env.pop(ENV_USER_TMPDIR, None)
    if mpirun_tmpdir is not None and env.get("TMPDIR") == mpirun_tmpdir:
        if user_tmpdir is None:
            del env["TMPDIR"]
        else:
            env["TMPDIR"] = user_tmpdir
# Where Open MPI's launcher and daemons make their folders (TMPDIR's value, or /tmp, without it).
# PRRTE passes it on to the daemons it starts when mpirun has it, so only a daemon's own is set.
ENV_OPENMPI_SESSION_BASE = "PRTE_MCA_prte_tmpdir_base"
DAEMON_UMASK = 0o077


def new_job_secret() -> str:
    return os.urandom(32).hex()
RESUME_MARKER = b"@@mtrain-elastic-resumed@@ "


def updates_file(job_file: str) -> str:
    """The host-update file template that goes with a job-file template."""
    return job_file[:-len(".json")] + ".updates" if job_file.endswith(".json") else job_file + ".updates"


def host_path(template: str, host: "str | None" = None) -> str:
    """A per-host path from one of the templates above ("{host}": this host's name)."""
    import socket
    return template.format(host=host or socket.gethostname())


@_record
class HostUpdates:
    """The host-set version, kept in a file on each host (written by the launcher's side)."""

    version: int

    def write(self, path: str) -> None:
        write_private(path, str(self.version).encode())

    @staticmethod
    def read(path: str) -> int:
        """The version in `path` (0 when there is none yet); PrivatePathError when it is not ours."""
        try:
            return int(read_private(path).decode().strip() or 0)
        except PrivatePathError:
            raise
        except (OSError, ValueError):
            return 0


@_record
class ElasticResume:
    """Rank 0 of a new generation says, on stderr, from which commit training resumed."""

    commit: int   # the commit number restored (-1: none, training starts afresh)
    size: int     # how many ranks this generation has

    def encode(self) -> bytes:
        return RESUME_MARKER + json.dumps(self._asdict()).encode() + b"\n"

    @staticmethod
    def decode(payload: bytes) -> "ElasticResume | None":
        try:
            data = json.loads(payload)
            return ElasticResume(int(data["commit"]), int(data["size"]))
        except (ValueError, KeyError, TypeError):
            return None


# --------------------------------------------------------------------------------------------
# StepReport: a rank's measured training steps (launcher/stragglers.py reads them: the straggler
# report and --progress). A marker line on the rank's stderr, removed by the supervisor; the
# line's prefix names the rank. Sent every few steps or seconds (MTRAIN_STRAGGLER_EVERY,
# MTRAIN_STEP_REPORT_SECONDS) and when the rank's runtime shuts down.

STEP_MARKER = b"@@mtrain-steps@@ "
ENV_STRAGGLER_EVERY = "MTRAIN_STRAGGLER_EVERY"          # a table every N steps (0: at exit only)
ENV_STEP_REPORT_SECONDS = "MTRAIN_STEP_REPORT_SECONDS"  # send what was measured at least this often
ENV_STRAGGLER_OFF = "MTRAIN_STRAGGLER_REPORT_DISABLE"   # 1: measure no steps (the engine has no StepMeter)


@_record
class StepSample:
    """One training step of one rank (times in seconds; ``end`` on the rank's own monotonic clock)."""

    step: int       # this rank's step number, from 1
    cycle: int      # the engine cycle that ran the step's last ops: the same on every rank for the same step
    end: float      # when the step's last op completed
    compute: float  # from the previous step's last completion to this step's first submit
    wait: float     # the longest any op of this step waited from its submit to running (the others' lateness)
    nbytes: int     # bytes of the step's collectives


@_record
class StepReport:
    host: str
    samples: tuple = ()  # StepSample, oldest first

    def encode(self) -> bytes:
        rows = [[s.step, s.cycle, round(s.end, 6), round(s.compute, 6), round(s.wait, 6), s.nbytes]
                for s in self.samples]
        return STEP_MARKER + json.dumps({"host": self.host, "samples": rows}, separators=(",", ":")).encode() + b"\n"

    @staticmethod
    def decode(payload: bytes) -> "StepReport | None":
        try:
            data = json.loads(payload)
            samples = tuple(StepSample(int(r[0]), int(r[1]), float(r[2]), float(r[3]), float(r[4]), int(r[5]))
                            for r in data["samples"])
            return StepReport(str(data["host"]), samples)
        except (ValueError, KeyError, TypeError, IndexError):
            return None

    def emit(self) -> None:
        """Send to the supervisor, when there is one (the rank runs under mtrain run's rank wrapper)."""
        emit_marker(self.encode())


# --------------------------------------------------------------------------------------------
# Flight recorder: what each rank's collectives were doing (ringreduce/recorder.py writes, the
# supervisor reads: launcher/hang_report.py). Marker lines on the rank's stderr, removed by the
# supervisor; the line's prefix names the rank. A rank dumps on SIGUSR1 (mtrain run forwards its
# own SIGUSR1 to mpirun, which forwards it to every rank); a rank whose coordinator sees a stall
# asks the supervisor to signal every rank (DumpRequest).

DUMP_MARKER = b"@@mtrain-flight-recorder@@ "
DUMP_REQUEST_MARKER = b"@@mtrain-flight-request@@ "
# What the runtime writes on a rank's stderr for the supervisor: never the rank's own words.
RUNTIME_MARKERS = (PHASE_MARKER, RESUME_MARKER, STEP_MARKER, DUMP_MARKER, DUMP_REQUEST_MARKER)
ENV_FLIGHT_RECORDER_SIZE = "MTRAIN_FLIGHT_RECORDER_SIZE"  # ops kept per process set; 0: off


class OpState(enum.Enum):
    WAITING = "waiting"   # submitted; waiting for the other ranks to submit it (negotiation)
    RUNNING = "running"   # every rank agreed: in the ring / collective now
    DONE = "done"
    FAILED = "failed"


@_record
class OpRecord:
    """One collective a rank submitted (a flight-recorder entry); times are seconds before the dump."""

    seq: int            # this rank's submit counter for the process set (1 = its first op)
    name: str
    kind: str           # allreduce, allgather, broadcast, ...
    what: str           # dtype and shape, e.g. "float32[1024]"
    state: OpState
    submitted_ago: float
    started_ago: float = -1.0   # -1: not started
    ended_ago: float = -1.0     # -1: not ended

    def _json(self) -> dict:
        fields = self._asdict()
        fields["state"] = self.state.value
        return fields

    @staticmethod
    def _from(data: dict) -> "OpRecord":
        return OpRecord(int(data["seq"]), str(data["name"]), str(data["kind"]), str(data["what"]),
                        OpState(data["state"]), float(data["submitted_ago"]), float(data["started_ago"]),
                        float(data["ended_ago"]))


@_record
class SetRecord:
    """One process set's recorder on one rank."""

    set_id: int
    members: tuple          # the job's ranks in the set
    ops: tuple              # OpRecord, oldest first
    blocked: int            # user threads blocked on this set's handles now
    idle_s: float = -1.0    # since this set's last submit or finished wait (-1: never)


@_record
class RecorderDump:
    """One rank's flight recorder at one moment."""

    rank: int
    host: str
    reason: str             # what made it dump (the rank's view: "SIGUSR1", "stall", ...)
    time: float             # wall clock of the dump
    sets: tuple             # SetRecord, by set id
    user_frame: str = ""    # where the main thread is in the program's own code (``user_line``)

    def encode(self) -> bytes:
        fields = self._asdict()
        fields["sets"] = [dict(s._asdict(), members=list(s.members), ops=[o._json() for o in s.ops])
                          for s in self.sets]
        return DUMP_MARKER + json.dumps(fields).encode() + b"\n"

    @staticmethod
    def decode(payload: bytes) -> "RecorderDump | None":
        try:
            data = json.loads(payload)
            sets = tuple(SetRecord(int(s["set_id"]), tuple(int(r) for r in s["members"]),
                                   tuple(OpRecord._from(o) for o in s["ops"]), int(s["blocked"]),
                                   float(s["idle_s"])) for s in data["sets"])
            return RecorderDump(int(data["rank"]), str(data["host"]), str(data["reason"]), float(data["time"]),
                                sets, str(data.get("user_frame", "")))
        except (ValueError, KeyError, TypeError):
            return None


@_record
class DumpRequest:
    """A rank asks the supervisor to have every rank dump its recorder (a stall it coordinates)."""

    reason: str

    def encode(self) -> bytes:
        return DUMP_REQUEST_MARKER + json.dumps(self._asdict()).encode() + b"\n"

    @staticmethod
    def decode(payload: bytes) -> "DumpRequest | None":
        try:
            return DumpRequest(str(json.loads(payload)["reason"]))
        except (ValueError, KeyError, TypeError):
            return None


def emit_marker(line: bytes) -> None:
    """Write one marker line to fd 2, whole, when a supervisor reads it (the rank runs under
    mtrain run's rank wrapper); never raises."""
    if ENV_ERROR_FILE not in os.environ:
        return
    try:
        os.write(2, line)
    except OSError:
        pass


def frame_line(frame: object) -> str:
    """``user_line`` for a live stack: the innermost frame of the program's own code from
    ``frame`` outwards (``sys._current_frames()``), as ``file:line in function``, else ""."""
    roots = _library_roots()
    while frame is not None:
        code = frame.f_code  # type: ignore[attr-defined]
        if not _library_file(code.co_filename, roots):
            return f"{_shown_path(code.co_filename)}:{frame.f_lineno} in {code.co_name}"  # type: ignore[attr-defined]
        frame = frame.f_back  # type: ignore[attr-defined]
    return ""
