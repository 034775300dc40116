"""Pure pieces of the agent and the supervisor."""
import os
import shlex
import threading

import pytest

from launcher.config import SshOptions
from launcher.rank import child_environment, read_error_file
from launcher.ssh_agent import read_config, remote_command, split_arguments, wait_for_gate, write_config
from launcher.supervise import RankExit, first_failure


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
    assert parsed[:4] == ["exec", "/my env/python", "-m", "launcher.remote_guard"]
    # The guard gets exactly what OpenSSH would have sent, minus --daemonize.
    assert parsed[4] == 'PATH=/p:$PATH;export PATH;/p/prted --x "a b"'


def test_agent_config_round_trip(tmp_path):
    path = str(tmp_path / "agent.json")
    write_config(path, SshOptions(2222, "/k/id", True, 5.0), "/env/python", "/tmp/events", "/tmp/gate")
    assert read_config(path) == (SshOptions(2222, "/k/id", True, 5.0), "/env/python", "/tmp/events", "/tmp/gate")
    assert read_config(None)[2:] == (None, None)


def test_gate_opens_closes_and_times_out(tmp_path):
    stop = threading.Event()
    gate = str(tmp_path / "gate")
    assert wait_for_gate(None, 0.1, stop)
    assert not wait_for_gate(gate, 0.2, stop)  # never opened: bounded wait, then no
    open(gate + ".abort", "w").close()
    assert not wait_for_gate(gate, 5, stop)
    other = str(tmp_path / "other")
    threading.Timer(0.1, lambda: open(other + ".go", "w").close()).start()
    assert wait_for_gate(other, 5, stop)


def test_rank_environment_yields_only_when_oversubscribed():
    cores = os.cpu_count() or 1
    busy = child_environment({"OMPI_COMM_WORLD_LOCAL_SIZE": str(cores + 1)}, "/e")
    assert busy["OMPI_MCA_mpi_yield_when_idle"] == "1" and busy["MTRAIN_ERROR_FILE"] == "/e"
    calm = child_environment({"OMPI_COMM_WORLD_LOCAL_SIZE": str(cores)}, "/e")
    assert "OMPI_MCA_mpi_yield_when_idle" not in calm
    kept = child_environment({"OMPI_COMM_WORLD_LOCAL_SIZE": "999", "OMPI_MCA_mpi_yield_when_idle": "0"}, "/e")
    assert kept["OMPI_MCA_mpi_yield_when_idle"] == "0"  # the user's choice wins


def test_error_file_is_read_defensively(tmp_path):
    path = tmp_path / "e.json"
    assert read_error_file(str(path)) == {}
    path.write_text("not json")
    assert read_error_file(str(path)) == {}
    path.write_text('{"time": 5, "cause": "peer", "message": "line one\\nline two", "x": 1}')
    assert read_error_file(str(path)) == {"time": 5.0, "cause": "peer", "message": "line one"}


def _exit(rank, code, stopped, time):
    return RankExit(rank, "h", code, stopped, time, ())


def test_first_failure_prefers_own_failures_over_stopped_ranks():
    records = [_exit(0, -15, True, 1.0), _exit(2, 3, False, 2.0), _exit(1, 1, False, 3.0), _exit(3, 0, False, 0.5)]
    assert first_failure(records).rank == 2


def test_first_failure_falls_back_to_stopped_and_none_when_all_ok():
    assert first_failure([_exit(1, -15, True, 2.0), _exit(0, -9, True, 1.0)]).rank == 0
    assert first_failure([_exit(0, 0, False, 1.0)]) is None


def test_describe_names_signal():
    assert _exit(4, -9, False, 0).describe() == "rank 4 on h: killed by SIGKILL"
    assert _exit(4, 2, False, 0).describe() == "rank 4 on h: exit code 2"
