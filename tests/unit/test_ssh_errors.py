"""SSH failures that need no server: each is one line naming the host (no network used)."""
import socket

import pytest

from mtrain.launcher.ssh import client as ssh
from mtrain.launcher.cli.config import SshOptions
from mtrain.launcher.job.preflight import HostReport, slot_warnings


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / ".ssh").mkdir()
    return tmp_path


def test_unknown_hostname(home, monkeypatch):
    def no_such_name(*args, **kwargs):
        raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
    monkeypatch.setattr(socket, "getaddrinfo", no_such_name)
    with pytest.raises(ssh.SshError) as caught:
        ssh.connect("nodex", SshOptions(), timeout=1)
    assert str(caught.value).startswith("host nodex: unknown host name 'nodex'")
    assert caught.value.host == "nodex"


def test_missing_identity_file(home):
    with pytest.raises(ssh.SshError, match="identity file .* does not exist"):
        ssh.connect("nodex", SshOptions(identity_file=str(home / "nope")), timeout=1)


def test_ssh_config_alias_and_flags(home):
    (home / ".ssh" / "config").write_text(
        "Host gpu1\n  HostName 10.1.2.3\n  Port 2200\n  User alice\n  IdentityFile ~/.ssh/gpu_key\n")
    target = ssh.resolve("gpu1", SshOptions())
    assert (target.hostname, target.port, target.user) == ("10.1.2.3", 2200, "alice")
    assert target.identity_files == (str(home / ".ssh" / "gpu_key"),)
    assert ssh.known_hosts_name(target) == "[10.1.2.3]:2200"
    flagged = ssh.resolve("gpu1", SshOptions(port=22, identity_file="~/other"))
    assert flagged.port == 22 and flagged.identity_files == (str(home / "other"),) and flagged.identities_only
    assert ssh.known_hosts_name(flagged) == "10.1.2.3"
    plain = ssh.resolve("plainhost", SshOptions())
    assert (plain.hostname, plain.port) == ("plainhost", 22)


def test_bad_ssh_config_is_one_line(home):
    (home / ".ssh" / "config").write_text("Host x\n  Port notanumber\n")
    with pytest.raises(ssh.SshError, match="Port 'notanumber' is not a number"):
        ssh.connect("x", SshOptions(), timeout=1)


def test_gpu_warning_only_for_hosts_with_too_few_gpus():
    reports = {"a": HostReport("a", gpus=2), "b": HostReport("b", gpus=0), "c": HostReport("c", gpus=8)}
    assert slot_warnings(reports, {"a": 4, "b": 4, "c": 4}) == [
        "host a: 4 ranks but only 2 GPUs; ranks will share GPUs"]
