"""Pure pieces of the agent and the supervisor."""
import shlex

import pytest

from launcher.config import SshOptions
from launcher.ssh_agent import read_config, remote_command, split_arguments, write_config
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
    write_config(path, SshOptions(2222, "/k/id", True, 5.0), "/env/python", "/tmp/events")
    assert read_config(path) == (SshOptions(2222, "/k/id", True, 5.0), "/env/python", "/tmp/events")


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
