"""Pure pieces of the agent and the supervisor."""
import os
import shlex
import subprocess
import sys
import threading

import pytest

from mtrain.launcher.cli.config import SshOptions
from mtrain.launcher.rank import child_environment, exit_record
from mtrain.launcher.ssh.agent import (
    read_config,
    remote_command,
    split_arguments,
    wait_for_gate,
    write_config,
)
from mtrain.launcher.supervise.outcome import first_failure, print_failure_report
from mtrain.launcher.supervise.supervisor import Job
from mtrain.common.records.agent_events import AgentEvent, AgentEventKind, AgentEventReader
from mtrain.common.records.error_report import ErrorReport, FailureCause, report_error
from mtrain.common.records.exit_record import EXIT_MARKER, ExitRecord, exception_line
from mtrain.common.records.gate import Gate
from mtrain.common.records.phase import Phase, PhaseNote


def test_agent_parses_ssh_style_arguments():
    assert split_arguments(["-x", "node1", "echo", "hi"]) == ("node1", ["echo", "hi"], None)
    assert split_arguments(["-p", "2222", "-o", "BatchMode=yes", "n", "c"]) == ("n", ["c"], 2222)
    with pytest.raises(ValueError):
        split_arguments(["-x"])
    with pytest.raises(ValueError, match="unsupported"):
        split_arguments(["-Z", "n", "c"])


def test_agent_command_drops_daemonize_and_quotes_for_the_guard():
    words = ["PATH=/p:$PATH;export", "PATH;/p/prted", "--daemonize", "--x", '"a b"']
    command = remote_command(words, "/my env/python")
    parsed = shlex.split(command)
    assert parsed[:4] == ["exec", "/my env/python", "-m", "mtrain.launcher.remote_guard"]
    # The guard gets exactly what OpenSSH would have sent, minus --daemonize.
    assert parsed[4] == 'PATH=/p:$PATH;export PATH;/p/prted --x "a b"'


def test_agent_config_round_trip(tmp_path):
    path = str(tmp_path / "agent.json")
    write_config(path, SshOptions(2222, "/k/id", True, 5.0), "/env/python", "/tmp/events", "/tmp/gate",
                 "/tmp/job-{host}.json", "/tmp/updates")
    assert read_config(path) == (SshOptions(2222, "/k/id", True, 5.0), "/env/python", "/tmp/events", "/tmp/gate",
                                 "/tmp/job-{host}.json", "/tmp/updates")
    assert read_config(None)[2:] == (None, None, None, None)


def test_gate_opens_closes_and_times_out(tmp_path):
    stop = threading.Event()
    gate = str(tmp_path / "gate")
    assert wait_for_gate(None, 0.1, stop)
    assert not wait_for_gate(gate, 0.2, stop)  # never opened: bounded wait, then no
    Gate(gate).close()
    assert not wait_for_gate(gate, 5, stop)
    other = str(tmp_path / "other")
    threading.Timer(0.1, Gate(other).open).start()
    assert wait_for_gate(other, 5, stop)
    stop.set()
    assert not wait_for_gate(str(tmp_path / "third"), 5, stop)  # a stopping agent does not wait


def test_rank_environment_yields_only_when_oversubscribed():
    cores = os.cpu_count() or 1
    busy = child_environment({"OMPI_COMM_WORLD_LOCAL_SIZE": str(cores + 1)}, "/e")
    assert busy["OMPI_MCA_mpi_yield_when_idle"] == "1" and busy["MTRAIN_ERROR_FILE"] == "/e"
    calm = child_environment({"OMPI_COMM_WORLD_LOCAL_SIZE": str(cores)}, "/e")
    assert "OMPI_MCA_mpi_yield_when_idle" not in calm
    kept = child_environment({"OMPI_COMM_WORLD_LOCAL_SIZE": "999", "OMPI_MCA_mpi_yield_when_idle": "0"}, "/e")
    assert kept["OMPI_MCA_mpi_yield_when_idle"] == "0"  # the user's choice wins
    assert calm["OMPI_MCA_mpi_abort_delay"] == "1"
    assert child_environment({"OMPI_MCA_mpi_abort_delay": "0"}, "/e")["OMPI_MCA_mpi_abort_delay"] == "0"


def _wrapped(code: str) -> tuple[str, dict]:
    done = subprocess.run([sys.executable, "-m", "mtrain.launcher.rank", "--", sys.executable, "-c", code],
                          capture_output=True, timeout=60, env={**os.environ, "OMPI_COMM_WORLD_RANK": "5"})
    lines = done.stderr.splitlines(keepends=True)
    records = [ExitRecord.decode(l[len(EXIT_MARKER):]) for l in lines if l.startswith(EXIT_MARKER)]
    assert len(records) == 1 and records[0] is not None, done.stderr
    return b"".join(l for l in lines if not l.startswith(EXIT_MARKER)).decode(), records[0]


def test_wrapper_hides_open_mpi_abort_delay_line_and_records_it():
    shown, record = _wrapped("import sys, os\n"
                             "print('before', file=sys.stderr)\n"
                             "print(f'[node-1:{os.getpid()}] Delaying for 1 seconds before aborting', file=sys.stderr)\n"
                             "sys.exit(14)")
    # The program's runner adds its note for the supervisor (which takes it out): never in the tail.
    # It says where the program left, and the record keeps it for the report.
    ended = PhaseNote(Phase.ENDED, status=14, where="<string>:4 in <module>")
    assert shown == "[5]<stderr>:before\n" + "[5]<stderr>:" + ended.encode().decode()
    assert (record.rank, record.returncode, record.mpi_abort) == (5, 14, True)
    assert record.where == "<string>:4 in <module>"
    assert record.stderr_tail == ("before",)
    shown, record = _wrapped("import sys; print('Delaying for 1 seconds before aborting', file=sys.stderr); sys.exit(3)")
    assert shown.startswith("[5]<stderr>:Delaying for 1 seconds before aborting\n") and record.mpi_abort is False


def test_wrapper_carries_the_runtimes_own_account_into_the_record():
    code = ("from mtrain.common.records.error_report import FailureCause, report_error\n"
            "report_error('ShutdownError: rank 2 left\\nmore', FailureCause.PEER)\n"
            "report_error('second account, ignored', FailureCause.OWN)\n"
            "raise SystemExit(9)")
    shown, record = _wrapped(code)
    assert (record.returncode, record.report, record.stopped) == (9, "ShutdownError: rank 2 left", True)


def test_error_report_is_read_defensively_and_written_once(tmp_path, monkeypatch):
    path = tmp_path / "e.json"
    assert ErrorReport.read(str(path)) is None
    path.write_text("not json")
    assert ErrorReport.read(str(path)) is None
    path.write_text('{"time": 5, "cause": "elsewhere", "message": "x"}')
    assert ErrorReport.read(str(path)) is None
    path.write_text('{"time": 5, "cause": "peer", "message": "line one\\nline two", "x": 1}')
    assert ErrorReport.read(str(path)) == ErrorReport("line one", FailureCause.PEER, 5.0)
    fresh = tmp_path / "f.json"
    monkeypatch.setenv("MTRAIN_ERROR_FILE", str(fresh))
    report_error("ValueError: first", FailureCause.OWN)
    report_error("ValueError: second", FailureCause.PEER)
    assert (ErrorReport.read(str(fresh)).message, ErrorReport.read(str(fresh)).cause) == ("ValueError: first", FailureCause.OWN)


def test_exit_record_round_trip_and_the_runtime_account_wins():
    record = ExitRecord(3, "b", -9, False, 12.5, ("x", "y"), "RuntimeError: z", True, where="t.py:3 in f")
    assert ExitRecord.decode(record.encode()[len(EXIT_MARKER):]) == record
    assert ExitRecord.decode(b'{"rank": 1}') is None and ExitRecord.decode(b"garbage") is None
    peer = exit_record(1, "a", 1, False, (), 20.0, ErrorReport("ShutdownError: rank 0 left", FailureCause.PEER, 19.0), False)
    assert peer.stopped and peer.time == 19.0 and peer.report == "ShutdownError: rank 0 left"
    plain = exit_record(1, "a", 1, True, ("t",), 20.0, None, False)
    assert plain.stopped and plain.time == 20.0 and plain.report == ""


def test_agent_events_round_trip_through_the_file(tmp_path):
    path = str(tmp_path / "events")
    reader = AgentEventReader(path)
    assert reader.poll() == []
    lost = AgentEvent(AgentEventKind.HOST_LOST, "b", "host b: lost", 7.0)
    lost.emit(path)
    AgentEvent(AgentEventKind.CONNECT_FAILED, "c", "host c: refused", 8.0).emit(None)  # nobody listens
    with open(path, "a") as handle:
        handle.write('{"kind": "unknown"}\n{"kind": "connect-fa')  # garbage, then half a line
    assert reader.poll() == [lost]
    with open(path, "a") as handle:
        handle.write('iled", "host": "c", "detail": "host c: refused", "time": 8}\n')
    assert reader.poll() == [AgentEvent(AgentEventKind.CONNECT_FAILED, "c", "host c: refused", 8.0)]


def _exit(rank, code, stopped, time, message="", mpi_abort=False, tail=()):
    return ExitRecord(rank, "h", code, stopped, time, tuple(tail), message, mpi_abort)


def test_mpirun_status_0_is_no_success_while_ranks_never_reported_an_end(capsys):
    # Open MPI 5's launcher exits 0 when a remote host's daemon is killed with its ranks (and their
    # wrappers, which never write a record); only every rank's record makes a job a success.
    job = Job(["mpirun"], {}, 4, None, False, None)
    job.records = [_exit(0, 0, False, 1.0), _exit(1, 0, False, 1.0)]
    assert job.outcome(0, []) == 1
    assert "mpirun exited with status 0, but ranks 2, 3 of 4 never reported an end" in capsys.readouterr().err
    job.records.append(_exit(2, 0, False, 1.0))
    assert job.outcome(0, []) == 1
    assert "but rank 3 of 4 never reported" in capsys.readouterr().err
    job.records.append(_exit(3, 0, False, 1.0))
    assert job.outcome(0, []) == 0
    assert capsys.readouterr().err == ""


def test_first_failure_prefers_own_failures_over_stopped_ranks():
    records = [_exit(0, -15, True, 1.0), _exit(2, 3, False, 2.0), _exit(1, 1, False, 3.0), _exit(3, 0, False, 0.5)]
    assert first_failure(records).rank == 2


def test_first_failure_falls_back_to_stopped_and_none_when_all_ok():
    assert first_failure([_exit(1, -15, True, 2.0), _exit(0, -9, True, 1.0)]).rank == 0
    assert first_failure([_exit(0, 0, False, 1.0)]) is None


def test_failure_report_names_ranks_stopped_before_they_could_report(capsys):
    # Open MPI SIGKILLs a stopped rank's process group milliseconds after SIGTERM: on a busy
    # host the wrapper of rank 2 dies before writing its record, yet it was stopped all the same.
    failure, finished = _exit(1, 3, False, 1.0, "boom"), _exit(3, 0, False, 0.5)
    print_failure_report(failure, [failure, _exit(0, -15, True, 1.2), finished], verbose=False, size=5)
    err = capsys.readouterr().err.splitlines()
    assert err[0] == "mtrain: job failed; first failure: rank 1 on h: exit code 3 (boom)"
    assert err[-1] == "mtrain: ranks 0, 2, 4 were stopped or failed after it"
    print_failure_report(failure, [failure], verbose=False, size=2)
    assert capsys.readouterr().err.splitlines()[-1] == "mtrain: rank 0 was stopped or failed after it"
    print_failure_report(failure, [failure, finished], verbose=False)  # size unknown: records only
    assert "after it" not in capsys.readouterr().err


def test_first_failure_weighs_evidence_when_failures_are_too_close_for_clocks():
    # A rank killed by SIGKILL vs. a neighbour whose MPI error exit got stamped a moment earlier.
    assert first_failure([_exit(0, 14, False, 10.0), _exit(3, -9, False, 10.004)]).rank == 3
    # A plain exit status beats a rank that ended inside MPI_Abort.
    assert first_failure([_exit(0, 14, False, 10.0, mpi_abort=True), _exit(2, 7, False, 10.3)]).rank == 2
    # The runtime's own account (an exception) beats a plain exit status.
    assert first_failure([_exit(1, 7, False, 10.0), _exit(2, 1, False, 10.2, "RuntimeError: x")]).rank == 2
    # A rank that aborts itself (gloo's std::terminate after its peer died) does not outrank the peer.
    assert first_failure([_exit(1, 1, False, 10.0), _exit(2, -6, False, 10.05)]).rank == 1
    assert first_failure([_exit(1, 1, False, 10.0), _exit(2, -11, False, 10.05)]).rank == 2
    # Far apart in time, the clock decides whatever the evidence.
    assert first_failure([_exit(0, 14, False, 10.0, mpi_abort=True), _exit(3, -9, False, 12.0)]).rank == 0
    # Equal evidence: earlier first, then lower rank.
    assert first_failure([_exit(2, 7, False, 10.1), _exit(1, 7, False, 10.1), _exit(0, 5, False, 10.2)]).rank == 1


def test_describe_names_signal_and_reason():
    assert _exit(4, -9, False, 0).describe() == "rank 4 on h: killed by SIGKILL"
    assert _exit(4, 2, False, 0).describe() == "rank 4 on h: exit code 2"
    # Without the runtime's account, the exception line of a traceback (or the last line) says why,
    # so a failure before init() reads like one after it.
    traceback = ["Traceback (most recent call last):", '  File "x.py", line 1, in <module>',
                 "mtrain.ringreduce.runtime.NotInitializedError: call init() first", ""]
    assert _exit(0, 1, False, 0, tail=traceback).describe() == \
        "rank 0 on h: exit code 1 (NotInitializedError: call init() first)"
    assert _exit(0, 2, False, 0, tail=["python: can't open file 'x.py'"]).reason == "python: can't open file 'x.py'"
    assert _exit(0, 1, False, 0, "MismatchError: m", tail=traceback).reason == "MismatchError: m"
    assert _exit(0, -11, False, 0, tail=["last words"]).reason == ""  # a signal is its own reason
    # A message of many lines pushes the exception's own line out of the tail: the wrapper keeps it.
    long = ExitRecord(0, "h", 1, False, 0, ("  0: <tf.Tensor ...>", "}) with an unsupported type"),
                      exception="ValueError: Attempt to convert a value (PerReplica:{")
    assert long.reason == "ValueError: Attempt to convert a value (PerReplica:{"


def test_exception_lines_are_recognised_and_shortened():
    assert exception_line("mtrain.ringreduce.core.errors.MismatchError: ranks differ") == "MismatchError: ranks differ"
    assert exception_line("[rank1]: RuntimeError: simulated") == "RuntimeError: simulated"
    assert exception_line("KeyboardInterrupt") == "KeyboardInterrupt"
    for other in ("  File \"x.py\", line 3", "WARNING: All log messages", "/a/b.py:74: UserWarning: x",
                  "python: can't open file 'x.py'", "Traceback (most recent call last):"):
        assert exception_line(other) == "", other


def test_wrapper_keeps_the_exception_line_a_long_message_pushes_out_of_the_tail():
    code = "raise ValueError('first line of a long message' + chr(10) * 40 + 'last line')"
    shown, record = _wrapped(code)
    assert record.exception == "ValueError: first line of a long message"
    assert record.describe() == ("rank 5 on " + record.host
                                 + ": exit code 1 (ValueError: first line of a long message) at <string>:1 in <module>")


def test_paramiko_starts_without_importing_invoke_until_ssh_config_needs_it():
    code = ("import sys, mtrain.launcher.ssh.client, paramiko.config as c\n"
            "assert 'invoke.context' not in sys.modules, 'invoke imported at start-up'\n"
            "assert c.invoke.Context.__module__ == 'invoke.context'\n"
            "assert sys.modules['invoke'].Context is c.invoke.Context\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr


def test_paramiko_gets_its_version_without_importlib_metadata_which_still_works_after():
    code = ("import sys, importlib, mtrain.launcher.ssh.client, paramiko\n"
            "assert 'importlib.metadata' not in sys.modules, 'the stand-in was left behind'\n"
            "assert not hasattr(importlib, 'metadata'), 'the stand-in was left on importlib'\n"
            "from importlib import metadata\n"
            "assert type(metadata).__name__ == 'module' and metadata.version('paramiko') == paramiko.__version__\n"
            "assert metadata.distribution('paramiko').metadata['Name'].lower() == 'paramiko'\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr


def test_wrapper_leaves_its_scratch_directory_behind_in_no_case(tmp_path):
    env = {**os.environ, "TMPDIR": str(tmp_path), "OMPI_COMM_WORLD_RANK": "0"}
    code = ("from mtrain.common.records.error_report import FailureCause, report_error\n"
            "report_error('it failed', FailureCause.OWN)\n"
            "raise SystemExit(4)")
    for argv in ([sys.executable, "-c", code], [sys.executable, "-c", "pass"], ["/nonexistent/program"]):
        done = subprocess.run([sys.executable, "-m", "mtrain.launcher.rank", "--", *argv], capture_output=True,
                              timeout=60, env=env)
        assert done.returncode in (4, 0, 127), done.stderr
        assert list(tmp_path.iterdir()) == [], f"{argv}: left {list(tmp_path.iterdir())}"
    # An unusable $TMPDIR: the wrapper still runs the rank (tempfile's own fallbacks).
    done = subprocess.run([sys.executable, "-m", "mtrain.launcher.rank", "--", sys.executable, "-c", "print(7)"],
                          capture_output=True, timeout=60, env={**env, "TMPDIR": str(tmp_path / "missing")})
    assert done.returncode == 0 and b"[0]<stdout>:7" in done.stdout, done.stderr


def test_records_are_frozen_compare_by_value_and_take_defaults():
    record = ExitRecord(3, "h", 1, False, 2.5)
    assert record == ExitRecord(rank=3, host="h", returncode=1, stopped=False, time=2.5)
    assert hash(record) == hash(ExitRecord(3, "h", 1, False, 2.5)) and record != ExitRecord(3, "h", 2, False, 2.5)
    assert (record.stderr_tail, record.report, record.mpi_abort) == ((), "", False)
    assert record.replace(returncode=9).returncode == 9 and record.returncode == 1
    assert repr(record).startswith("ExitRecord(rank=3, host='h', returncode=1,")
    with pytest.raises(AttributeError):
        record.rank = 4
    with pytest.raises(AttributeError):
        del record.host
    with pytest.raises(TypeError, match="missing field 'time'"):
        ExitRecord(3, "h", 1, False)
    with pytest.raises(TypeError, match="unexpected or repeated field 'rank'"):
        ExitRecord(3, "h", 1, False, 2.5, rank=4)
    assert ExitRecord.decode(record.encode()[len(EXIT_MARKER):]) == record


def test_phase_notes_round_trip_and_tell_a_job_stuck_in_init():
    from mtrain.launcher.supervise.supervisor import stuck_in_init
    for note in (PhaseNote(Phase.INIT_WAITING, (0, 1, 3)), PhaseNote(Phase.INIT_DONE), PhaseNote(Phase.ENDED, status=4),
                 PhaseNote(Phase.ENDED, status=1, where="train.py:7 in step")):
        marker, _, payload = note.encode().partition(b" ")
        assert PhaseNote.decode(payload) == note
    assert PhaseNote.decode(b"{not json") is None
    # Rank 3 ended with 0 while ranks 0 and 1 wait for it: stuck. An error status ends the job
    # by itself, init(comm=[0, 1]) needs no rank 3, and a rank already out of init() waits for nobody.
    assert stuck_in_init({0: (0, 1, 2, 3), 1: (0, 1, 2, 3)}, {3: 0, 2: 5}) == (
        "rank 3 ended (exit code 0) without calling init(), while ranks 0, 1 wait for it in init(); every rank "
        "must call init() (or give init(comm=[...]) only the ranks that do)")
    assert stuck_in_init({0: (0, 1, 2, 3)}, {3: 7}) is None
    assert stuck_in_init({0: (0, 1)}, {3: 0}) is None
    assert stuck_in_init({}, {3: 0}) is None
    assert "ranks 2, 3 ended" in stuck_in_init({0: (0, 1, 2, 3)}, {2: 0, 3: 0})


def test_the_supervisor_takes_phase_notes_out_of_the_ranks_output():
    import io
    job = Job(["mpirun"], {}, 2, None, False, None)
    text = (b"[0]<stderr>:" + PhaseNote(Phase.INIT_WAITING, (0, 1)).encode()
            + b"[1]<stderr>:half a line" + PhaseNote(Phase.ENDED, status=0).encode()
            + b"[1]<stderr>:still talking\n")
    shown = io.BytesIO()
    job.read_stream(io.BytesIO(text), shown, True)
    assert job.in_init == {0: (0, 1)} and job.ended == {1: 0}
    assert job.stuck_now().startswith("rank 1 ended (exit code 0) without calling init(), while rank 0 waits")
    assert shown.getvalue() == b"[1]<stderr>:half a line\n[1]<stderr>:still talking\n"
    job.read_stream(io.BytesIO(b"[0]<stderr>:" + PhaseNote(Phase.INIT_DONE).encode()), io.BytesIO(), True)
    assert job.in_init == {} and job.stuck_now() is None


def test_lines_that_mpirun_starts_with_nul_bytes_keep_their_rank():
    # Seen on the test cluster after a rank's abort: "\x00[0]<stderr>:@@mtrain-flight-recorder@@ ...".
    import io
    from mtrain.common.records.flight_recorder import RecorderDump
    job = Job(["mpirun"], {}, 2, None, False, None)
    dump = RecorderDump(1, "h1", "SIGUSR1", 5.0, ())
    text = (b"\0[0]<stderr>:" + PhaseNote(Phase.INIT_DONE).encode() + b"\0\0[1]<stderr>:" + dump.encode()
            + b"\0[1]<stdout>:step 7\n")
    shown = io.BytesIO()
    job.read_stream(io.BytesIO(text), shown, True)
    assert job.up == {0}
    assert [d.rank for d in job.collector.dumps.values()] == [1]
    assert shown.getvalue() == b"[1]<stdout>:step 7\n"


def test_event_lines_are_taken_out_of_a_guards_stderr_and_appended(tmp_path):
    from mtrain.common.records.agent_events import event_line, take_events
    events = str(tmp_path / "events")
    died = AgentEvent(AgentEventKind.DAEMON_DIED, "h2", "host h2: the MPI daemon there died (killed by SIGKILL)", 5.0)
    chunk = b"mtrain-guard: one\n" + event_line(died) + b"two, unterminated"
    assert take_events(chunk, events) == b"mtrain-guard: one\ntwo, unterminated"
    assert AgentEventReader(events).poll() == [died]
    assert take_events(b"plain\n", events) == b"plain\n"
    assert take_events(b"@@mtrain-agent-event@@ not json\n", events) == b"@@mtrain-agent-event@@ not json\n"


def test_a_hosts_news_that_comes_after_mpiruns_exit_still_counts(tmp_path, capsys):
    # Open MPI's launcher exits 0 as soon as it loses a remote daemon and has stopped its agents;
    # the connection master, which outlives them, may pass on the guard's word of its daemon's
    # death a moment later. Ranks that never reported: the supervisor waits for that word.
    events = str(tmp_path / "events")
    died = AgentEvent(AgentEventKind.DAEMON_DIED, "h2", "host h2: the MPI daemon there died (killed by SIGKILL)", 5.0)
    job = Job([sys.executable, "-c", "pass"], dict(os.environ), 2, None, False, events)
    late = threading.Timer(1.0, died.emit, args=(events,))
    late.start()
    try:
        assert job.run() == 255
    finally:
        late.cancel()
    assert "mtrain: host h2: the MPI daemon there died (killed by SIGKILL); the job was stopped" in capsys.readouterr().err


def _raised(fn) -> "object":
    try:
        fn()
    except BaseException as error:  # noqa: B036 - SystemExit too
        return error.__traceback__
    raise AssertionError("did not raise")


def _bad_json() -> None:
    import json
    json.loads("{not json")  # the stdlib raises further in


def _frozen_record() -> None:
    note = PhaseNote(Phase.INIT_DONE)
    note.status = 3  # mtrain's record refuses it, in records.py


def test_user_line_is_the_innermost_frame_of_the_programs_own_code(monkeypatch):
    from mtrain.common.records.user_frames import user_line
    here = os.path.dirname(os.path.abspath(__file__))
    name = os.path.basename(__file__)
    line = _bad_json.__code__.co_firstlineno + 2
    monkeypatch.chdir(here)  # under the current folder: relative
    assert user_line(_raised(_bad_json)) == f"{name}:{line} in _bad_json"
    assert user_line(_raised(_frozen_record)) == f"{name}:{_frozen_record.__code__.co_firstlineno + 2} in _frozen_record"
    assert user_line(_raised(lambda: sys.exit(3))) == f"{name}:{sys._getframe().f_lineno} in <lambda>"
    monkeypatch.chdir("/")  # elsewhere: the path as the code object has it
    assert user_line(_raised(_bad_json)) == f"{os.path.abspath(__file__)}:{line} in _bad_json"
    # Only library frames (the test's own frame cut off): nothing to name.
    assert user_line(_raised(_bad_json).tb_next.tb_next) == ""
    assert user_line(None) == ""
    # Code given with -c (or typed in) is the user's.
    scope: dict = {}
    exec(compile("def f():\n    raise KeyError(1)\n", "<string>", "exec"), scope)
    assert user_line(_raised(scope["f"])) == "<string>:2 in f"


def test_the_failure_report_says_where_a_failing_rank_left(capsys):
    failed = ExitRecord(1, "b", 1, False, 3.0, exception="ValueError: x", where="train.py:7 in step")
    assert failed.describe() == "rank 1 on b: exit code 1 (ValueError: x) at train.py:7 in step"
    killed = ExitRecord(1, "b", -9, False, 3.0, where="train.py:7 in step")
    assert killed.describe() == "rank 1 on b: killed by SIGKILL"  # a signal has no line of its own
    # The first failure's status replaced (see Job.outcome) is still that rank, not one after it.
    other = ExitRecord(0, "a", 1, True, 3.5)
    print_failure_report(failed.replace(returncode=3), [failed, other], False, 2)
    err = capsys.readouterr().err
    assert "first failure: rank 1 on b: exit code 3 (ValueError: x) at train.py:7 in step" in err
    assert "mtrain: rank 0 was stopped or failed after it" in err and "ranks 0, 1" not in err


def test_the_runtimes_records_on_stderr_are_never_a_ranks_last_words():
    # Seen under Slurm: a rank's last stderr line was its step meter's record, which then stood in
    # as the reason of its failure ("exit code 75 (@@mtrain-steps@@ {...})").
    from mtrain.common.records.steps import StepReport, StepSample
    report = StepReport("node-1", (StepSample(1, 7, 1.0, 0.5, 0.25, 64),)).encode()
    code = ("import os, sys\n"
            "print('the last words', file=sys.stderr)\n"
            f"sys.stderr.flush(); os.write(2, {report!r})\n"
            "sys.exit(75)")
    shown, record = _wrapped(code)
    assert record.returncode == 75 and record.stderr_tail == ("the last words",), record
    assert record.reason == "the last words"
