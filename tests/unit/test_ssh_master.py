"""The SSH connection master (launcher/ssh/master.py) with stand-ins for paramiko's objects:
what the agent gets relayed, what the host gets sent, and when nothing may run at all.
The real thing over sshd: tests/cluster/test_shared_connection.py."""
from __future__ import annotations

import json
import os
import queue
import signal
import socket
import stat
import subprocess
import sys
import threading
import time

import pytest

from mtrain.launcher import remote_guard
from mtrain.launcher.ssh import agent as ssh_agent, master as ssh_master
from mtrain.launcher.cli.config import SshOptions
from mtrain.launcher.ssh.master import (
    ConnectionMaster,
    FrameKind,
    MasterSession,
    Outcome,
    ProtocolError,
    decode_request,
    encode_request,
    receive_frame,
    send_frame,
)
from mtrain.common.records.agent_events import AgentEventKind, AgentEventReader

WORDS = ["PATH=/p;export PATH;", "prted", "--daemonize", "--x", '"a b"']


class WatchedEvent(threading.Event):
    """A channel's status event that tells when the master waits out its drain on it."""

    def __init__(self) -> None:
        super().__init__()
        self.draining = threading.Event()

    def wait(self, timeout=None) -> bool:
        if timeout == ssh_master.DRAIN_SECONDS:  # the agent went: the master drains the session
            self.draining.set()
        return super().wait(timeout)


class FakeChannel:
    """A paramiko Channel as the master uses it; `behave(channel, first_line)` plays the host."""

    def __init__(self, behave=None) -> None:
        self.behave = behave
        self.sent: list[bytes] = []
        self.command: str | None = None
        self.closed = False
        self.status_event = WatchedEvent()
        self.exit_status = -1
        self.out: queue.Queue = queue.Queue()
        self.err: queue.Queue = queue.Queue()
        self.started = threading.Event()
        self.reading = {"out": threading.Event(), "err": threading.Event()}

    def relayed(self, timeout: float = 10) -> bool:
        """Whether the master's relay reads both of the session's streams (within ``timeout``)."""
        return all(event.wait(timeout) for event in self.reading.values())

    def _start(self, first: str) -> None:
        self.started.set()
        if self.behave:
            threading.Thread(target=self.behave, args=(self, first), daemon=True).start()

    def exec_command(self, command: str) -> None:
        self.command = command
        self._start(command)

    def sendall(self, data: bytes) -> None:
        if self.closed:
            raise OSError("channel closed")
        self.sent.append(data)
        if len(self.sent) == 1 and self.command is None:
            self._start(data.decode())

    def recv(self, size: int) -> bytes:
        self.reading["out"].set()
        return self.out.get()

    def recv_stderr(self, size: int) -> bytes:
        self.reading["err"].set()
        return self.err.get()

    def exit_status_ready(self) -> bool:
        return self.status_event.is_set()

    def finish(self, status: int) -> None:
        self.out.put(b"")
        self.err.put(b"")
        self.exit_status = status
        self.status_event.set()

    def close(self) -> None:
        self.closed = True
        self.status_event.set()  # as paramiko's Channel.close() does (the status stays -1)
        self.out.put(b"")
        self.err.put(b"")


class FakeTransport:
    def __init__(self, behave=None) -> None:
        self.active = True
        self.behave = behave
        self.sessions: list[FakeChannel] = []
        self.sock = None

    def is_active(self) -> bool:
        return self.active

    def open_session(self, timeout=None) -> FakeChannel:
        if not self.active:
            raise EOFError("transport closed")
        channel = FakeChannel(self.behave)
        self.sessions.append(channel)
        return channel


class FakeClient:
    def __init__(self, transport: FakeTransport) -> None:
        self.transport = transport
        self.closed = False

    def get_transport(self) -> FakeTransport:
        return self.transport

    def close(self) -> None:
        self.closed = True


def answer(status: int):
    """A host that prints one line on each stream, then exits with `status`."""
    def behave(channel: FakeChannel, first: str) -> None:
        channel.out.put(b"daemon out\n")
        channel.err.put(b"daemon err\n")
        time.sleep(0.05)
        channel.finish(status)
    return behave


def run_forever(channel: FakeChannel, first: str) -> None:
    pass  # a daemon that keeps running until its session is closed


class GateWatch(threading.Condition):
    """The master's gate condition, telling the test when a request is held at the gate.

    The master waits on this condition only while the preflight has given no verdict and a
    request is in: `held` is set then, and `server` is the thread serving that request."""

    def __init__(self, lock) -> None:
        super().__init__(lock)
        self.held = threading.Event()
        self.server: threading.Thread | None = None

    def wait(self, timeout=None) -> bool:
        self.server = threading.current_thread()
        self.held.set()
        return super().wait(timeout)


def watch_gate(master: ConnectionMaster) -> GateWatch:
    """Install a GateWatch in `master` (before any agent connects)."""
    assert isinstance(master.gate_changed, threading.Condition), "the master's gate is no longer a Condition"
    watch = GateWatch(master.lock)
    master.gate_changed = watch
    return watch


def held_at_gate(watch: GateWatch, proc: subprocess.Popen) -> None:
    """Wait until the agent's request is held at the master's gate (or fail saying why not)."""
    if not watch.held.wait(20):
        proc.kill()
        out, err = proc.communicate(timeout=10)
        pytest.fail(f"the agent's request never reached the master's gate (agent exit {proc.returncode}, "
                    f"stdout {out!r}, stderr {err!r})")


@pytest.fixture
def scratch(tmp_path):
    directory = tmp_path / "scratch"
    directory.mkdir(mode=0o700)
    return directory


def make_master(scratch, hosts=("hosta", "hostb"), timeout=20.0, events=None) -> ConnectionMaster:
    master = ConnectionMaster(
        str(scratch), hosts,
        remote_command=lambda words, layout: ssh_agent.remote_command(words, "/py", "/tmp/job-{host}.json", layout),
        go_line=lambda words, layout: remote_guard.go_line(ssh_agent.daemon_command(words), "/tmp/job-{host}.json",
                                                           layout),
        session_timeout=timeout, events=events)
    master.start()
    return master


def agent(master: ConnectionMaster | None, tmp_path, host: str, *words: str, master_path: str | None = None,
          **popen) -> subprocess.Popen:
    config = str(tmp_path / "agent.json")
    ssh_agent.write_config(config, SshOptions(connect_timeout=5), sys.executable, str(tmp_path / "events"),
                           master=master_path or (master.path if master else None))
    env = {**os.environ, "HOME": str(tmp_path)}
    env.pop("SSH_AUTH_SOCK", None)
    return subprocess.Popen([sys.executable, "-m", "mtrain.launcher.ssh.agent", "--config", config, host, *words],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, **popen)


def test_frames_round_trip_and_garbage_is_an_error():
    left, right = socket.socketpair()
    with left, right:
        send_frame(left, FrameKind.STDOUT, b"x" * 100000)
        send_frame(left, FrameKind.EXIT, b"3")
        assert receive_frame(right) == (FrameKind.STDOUT, b"x" * 100000)
        assert receive_frame(right) == (FrameKind.EXIT, b"3")
        left.sendall(b"Z\0\0\0\0")
        with pytest.raises(ProtocolError, match="unknown frame kind"):
            receive_frame(right)
        left.sendall(b"R\x7f\xff\xff\xff")
        with pytest.raises(ProtocolError, match="too large"):
            receive_frame(right)
    assert decode_request(encode_request("h", ["a", "b c"])) == ("h", ["a", "b c"])
    for bad in (b"", b"[]", b'{"host": 1, "words": []}', b'{"host": "h", "words": [1]}', b'{"host": ""}'):
        with pytest.raises(ProtocolError):
            decode_request(bad)


def test_socket_is_private_and_removed_at_close(scratch):
    master = make_master(scratch)
    mode = os.stat(master.path).st_mode
    assert stat.S_ISSOCK(mode) and stat.S_IMODE(mode) == 0o600
    assert stat.S_IMODE(os.stat(scratch).st_mode) == 0o700
    transport = FakeTransport(run_forever)
    master.adopt("hosta", FakeClient(transport), FakeChannel(run_forever))
    master.close()
    master.close()  # idempotent
    assert not os.path.exists(master.path)
    assert master.hosts["hosta"].client.closed


def test_master_refuses_a_directory_others_can_enter(tmp_path):
    shared = tmp_path / "open"
    shared.mkdir(mode=0o755)
    os.chmod(shared, 0o755)
    with pytest.raises(RuntimeError, match="must be private"):
        make_master(shared)


def test_long_directory_gets_its_own_private_directory_removed_at_close(tmp_path):
    deep = tmp_path / ("d" * 60) / ("e" * 60)
    deep.mkdir(parents=True, mode=0o700)
    master = make_master(deep)
    assert len(master.path) <= 107 and not master.path.startswith(str(deep))
    assert stat.S_IMODE(os.stat(os.path.dirname(master.path)).st_mode) == 0o700
    master.close()
    assert not os.path.exists(os.path.dirname(master.path))


def test_waiting_probe_runs_the_daemon_after_the_gate_and_output_and_status_come_back(scratch, tmp_path):
    master = make_master(scratch)
    gate = watch_gate(master)
    probe = FakeChannel(answer(3))
    master.adopt("hosta", FakeClient(FakeTransport()), probe)
    proc = agent(master, tmp_path, "hosta", *WORDS)
    try:
        held_at_gate(gate, proc)
        assert proc.poll() is None and probe.sent == []  # held at the gate: nothing sent to the host
        master.open_gate('{"layout": 1}')
        out, err = proc.communicate(timeout=20)
    finally:
        master.close()
    assert proc.returncode == 3, err
    assert out == b"daemon out\n" and err == b"daemon err\n"
    go = json.loads(probe.sent[0])
    assert go == {"command": 'PATH=/p;export PATH; prted --x "a b"', "job_file": "/tmp/job-{host}.json",
                  "layout": '{"layout": 1}'}
    assert master.counters.probe_sessions == 1 and master.counters.new_sessions == 0


def test_without_a_waiting_probe_a_new_session_runs_the_guard_command(scratch, tmp_path):
    master = make_master(scratch)
    transport = FakeTransport(answer(0))
    master.adopt("hosta", FakeClient(transport))
    master.open_gate("")
    proc = agent(master, tmp_path, "hosta", *WORDS)
    out, err = proc.communicate(timeout=20)
    master.close()
    assert proc.returncode == 0 and out == b"daemon out\n", err
    assert transport.sessions[0].command == ssh_agent.remote_command(WORDS, "/py", "/tmp/job-{host}.json", "")
    assert master.counters.new_sessions == 1


def test_heartbeats_follow_the_go_line(scratch, tmp_path):
    master = make_master(scratch)
    probe = FakeChannel(run_forever)
    master.adopt("hosta", FakeClient(FakeTransport()), probe)
    master.open_gate("")
    proc = agent(master, tmp_path, "hosta", "prted")
    try:
        deadline = time.monotonic() + 10
        while len(probe.sent) < 3 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert probe.sent[1:3] == [b"\n", b"\n"]
    finally:
        proc.kill()
        proc.wait(timeout=10)
        master.close()


def test_closed_gate_runs_nothing_and_the_agent_leaves_quietly(scratch, tmp_path):
    master = make_master(scratch)
    gate = watch_gate(master)
    probe = FakeChannel(answer(0))
    master.adopt("hosta", FakeClient(FakeTransport()), probe)
    proc = agent(master, tmp_path, "hosta", *WORDS)
    held_at_gate(gate, proc)
    master.close_gate()
    out, err = proc.communicate(timeout=20)
    master.close()
    assert proc.returncode == 255 and out == b"" and err == b""
    assert probe.sent == [] and probe.closed  # the probe is told to leave: its stdin closes


def test_agent_stopped_by_sigterm_closes_the_remote_session(scratch, tmp_path):
    master = make_master(scratch)
    probe = FakeChannel(run_forever)
    master.adopt("hosta", FakeClient(FakeTransport()), probe)
    master.open_gate("")
    proc = agent(master, tmp_path, "hosta", "prted")
    try:
        assert probe.started.wait(10)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=10) == 143
        deadline = time.monotonic() + 5
        while not probe.closed and time.monotonic() < deadline:
            time.sleep(0.05)
        assert probe.closed  # the remote guard sees its session end and ends the daemon
    finally:
        proc.kill()
        master.close()


def test_agent_that_dies_while_waiting_starts_nothing(scratch, tmp_path):
    master = make_master(scratch)
    gate = watch_gate(master)
    probe = FakeChannel(answer(0))
    master.adopt("hosta", FakeClient(FakeTransport()), probe)
    proc = agent(master, tmp_path, "hosta", "prted")
    try:
        held_at_gate(gate, proc)
        proc.kill()
        proc.wait(timeout=10)
        master.open_gate("")
        gate.server.join(timeout=20)  # the master is done with the dead agent's request
        assert not gate.server.is_alive(), "the master still serves the agent that died"
        assert probe.sent == [] and not probe.started.is_set()
        assert master.hosts["hosta"].waiting_probe is probe  # still there for a later request
        assert master.counters.probe_sessions == 0 and master.counters.new_sessions == 0
    finally:
        master.close()


def test_connection_lost_mid_job_is_reported_as_host_lost(scratch, tmp_path):
    transport = FakeTransport()

    def die(channel: FakeChannel, first: str) -> None:
        assert channel.relayed()  # mid-job: the master relays the session
        transport.active = False  # what paramiko does when the connection dies: the transport
        channel.close()           # ends, then its channels, with status -1
        channel.status_event.set()

    master = make_master(scratch, events=str(tmp_path / "events"))  # the master tells the supervisor
    master.adopt("hosta", FakeClient(transport), FakeChannel(die))
    master.open_gate("")
    proc = agent(master, tmp_path, "hosta", "prted")
    out, err = proc.communicate(timeout=20)
    master.close()
    assert proc.returncode == 255
    detail = "host hosta: lost the SSH connection mid-job (host down or network cut)"
    assert err.decode().strip() == f"mtrain-agent: {detail}"
    events = AgentEventReader(str(tmp_path / "events")).poll()
    assert [(e.kind, e.host, e.detail) for e in events] == [(AgentEventKind.HOST_LOST, "hosta", detail)]


@pytest.mark.parametrize("agent_stays", [True, False])
def test_a_guard_killed_mid_job_is_a_host_lost_even_when_its_agent_is_gone(scratch, tmp_path, agent_stays):
    # The whole job on a host killed, its guard too: the session ends with a signal (status -1)
    # while the connection lives. mpirun may have stopped the agent already: the master says it.
    stopped, waited = threading.Event(), []

    def killed(channel: FakeChannel, first: str) -> None:
        waited.append(stopped.wait(10) if not agent_stays else channel.relayed())  # mid-job
        channel.status_event.set()

    master = make_master(scratch, events=str(tmp_path / "events"))
    channel = FakeChannel(killed)
    master.adopt("hosta", FakeClient(FakeTransport()), channel)
    master.open_gate("")
    proc = agent(master, tmp_path, "hosta", "prted")
    if not agent_stays:
        assert channel.started.wait(10)  # the daemon runs on the host
        proc.terminate()  # as mpirun stops its agents
        assert channel.status_event.draining.wait(10)  # within the master's drain of the session
        stopped.set()
    out, err = proc.communicate(timeout=20)
    reader, events = AgentEventReader(str(tmp_path / "events")), []
    deadline = time.monotonic() + 10
    while not events and time.monotonic() < deadline:  # as the supervisor polls while mpirun runs
        events = reader.poll()
        time.sleep(0.05)
    master.close()
    assert waited == [True], "the session ended before it was mid-job (its wait timed out)"
    detail = "host hosta: the job's processes there were killed, its remote guard with them"
    assert [(e.kind, e.host, e.detail) for e in events] == [(AgentEventKind.HOST_LOST, "hosta", detail)]
    if agent_stays:
        assert proc.returncode == 255 and err.decode().strip() == f"mtrain-agent: {detail}"


def running_daemon(master: ConnectionMaster, tmp_path, host: str) -> subprocess.Popen:
    """Open the gate and start an agent whose daemon runs on `host` through the master."""
    channel = master.hosts[host].waiting_probe  # the session the agent's request will run in
    master.open_gate("")
    proc = agent(master, tmp_path, host, "prted")
    assert channel.relayed()  # the relay's threads start after the daemon's session does
    return proc


def test_a_session_the_master_closes_itself_is_no_host_lost(scratch, tmp_path):
    # The agent goes (the job ends or is stopped): the master closes the session, which sets the
    # channel's status event with -1 too. That is the job's own end, not news.
    master = make_master(scratch, events=str(tmp_path / "events"))
    master.adopt("hosta", FakeClient(FakeTransport()), FakeChannel(lambda channel, first: None))
    proc = running_daemon(master, tmp_path, "hosta")
    proc.terminate()
    proc.communicate(timeout=20)
    master.close()
    assert AgentEventReader(str(tmp_path / "events")).poll() == []


def test_session_that_cannot_start_is_a_connect_failure(scratch, tmp_path):
    transport = FakeTransport()
    transport.active = False
    master = make_master(scratch)
    master.adopt("hosta", FakeClient(transport))
    master.open_gate("")
    proc = agent(master, tmp_path, "hosta", "prted")
    out, err = proc.communicate(timeout=20)
    master.close()
    assert proc.returncode == 255
    assert err.decode().startswith("mtrain-agent: host hosta: cannot start a session: transport closed")
    events = AgentEventReader(str(tmp_path / "events")).poll()
    assert [e.kind for e in events] == [AgentEventKind.CONNECT_FAILED]


def test_agent_connects_itself_without_a_master_or_for_another_host(scratch, tmp_path):
    master = make_master(scratch, hosts=("hosta",))
    try:
        for master_path in (master.path, str(scratch / "no-such.sock")):
            proc = agent(None, tmp_path, "nohost.invalid", "prted", master_path=master_path)
            out, err = proc.communicate(timeout=60)
            # The agent's own connection attempt is what fails: the name does not resolve.
            assert proc.returncode == 255
            assert "host nohost.invalid: unknown host name" in err.decode(), err
    finally:
        master.close()
    assert master.counters.unknown == 1


def test_bad_request_is_refused_and_the_master_serves_on(scratch, tmp_path):
    master = make_master(scratch)
    master.adopt("hosta", FakeClient(FakeTransport()), FakeChannel(answer(5)))
    master.open_gate("")
    try:
        with socket.socket(socket.AF_UNIX) as sock:
            sock.connect(master.path)
            sock.sendall(b"R\0\0\0\x02{}")
            kind, payload = receive_frame(sock)
        assert kind is FrameKind.FAILED and b"malformed request" in payload
        proc = agent(master, tmp_path, "hosta", "prted")
        assert proc.wait(timeout=20) == 5
    finally:
        master.close()


def test_closing_the_master_ends_waiting_and_running_agents(scratch, tmp_path):
    master = make_master(scratch)
    gate = watch_gate(master)
    master.adopt("hosta", FakeClient(FakeTransport()), FakeChannel(run_forever))
    master.adopt("hostb", FakeClient(FakeTransport()), FakeChannel(run_forever))
    waiting = agent(master, tmp_path, "hosta", "prted")
    held_at_gate(gate, waiting)
    master.close()
    assert waiting.wait(timeout=10) == 255
    session = MasterSession(master.path)
    assert not session.connect()  # the socket is gone
    assert session.run("hostb", ["x"]).outcome is Outcome.NO_MASTER


def test_adopt_after_close_is_refused(scratch):
    master = make_master(scratch)
    master.close()
    assert not master.adopt("hosta", FakeClient(FakeTransport()), FakeChannel())


def _after_probe(stdin: bytes, wait: float = 10) -> subprocess.CompletedProcess:
    code = f"import sys; from mtrain.launcher.remote_guard import after_probe; sys.exit(after_probe({wait}))"
    return subprocess.run([sys.executable, "-c", code], input=stdin, capture_output=True, timeout=60)


def test_probe_becomes_the_guard_on_its_go_line(tmp_path):
    template = str(tmp_path / "mtrain-job-x" / "{host}.g0.json")
    layout = json.dumps({"slots": [1], "master_addr": "10.0.0.1", "master_port": 1234, "workers": ["10.0.0.1:1"]})
    command = f"test -f {tmp_path}/mtrain-job-x/$(hostname).g0.json && echo ran; exit 4"
    code = "import sys; from mtrain.launcher.remote_guard import after_probe; sys.exit(after_probe(10))"
    # stdin stays open (the session lives) while the daemon runs: its end would stop the guard.
    proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    proc.stdin.write(remote_guard.go_line(command, template, layout) + b"\n")
    proc.stdin.flush()
    try:
        assert proc.wait(timeout=30) == 4, proc.stderr.read()
    finally:
        proc.kill()
        proc.stdin.close()
    assert proc.stdout.read() == b"ran\n"
    assert list(tmp_path.iterdir()) == []  # the layout file and its folder are removed when the job ends


def test_probe_without_go_line_runs_nothing(tmp_path):
    marker = tmp_path / "ran"
    done = _after_probe(b"")
    assert done.returncode == 0 and done.stdout == b"" and done.stderr == b""
    read_end, write_end = os.pipe()  # stdin stays open but silent: the probe gives up after its wait
    try:
        started = time.monotonic()
        done = subprocess.run([sys.executable, "-c", "import sys; from mtrain.launcher.remote_guard import "
                               "after_probe; sys.exit(after_probe(0.5))"], stdin=read_end, capture_output=True,
                              timeout=30)
    finally:
        os.close(read_end)
        os.close(write_end)
    assert done.returncode == 0 and done.stdout == b"" and time.monotonic() - started < 20
    done = _after_probe(b'{"command": ""}\n')
    assert done.returncode == 2 and b"bad go line from the launcher" in done.stderr
    assert done.stderr.count(b"\n") == 1 and not marker.exists()


def test_nothing_is_written_to_the_events_file_once_the_master_is_closed(scratch, tmp_path):
    # The launch removes its scratch folder, the events file's, right after closing the master:
    # the relays that end with it (their connections closed by close()) write nothing there.
    class ClosingClient(FakeClient):
        def close(self) -> None:
            super().close()
            self.transport.active = False  # as paramiko's client does

    events = tmp_path / "events"
    earlier = set(threading.enumerate())
    master = make_master(scratch, events=str(events))
    master.adopt("hosta", ClosingClient(FakeTransport()), FakeChannel(run_forever))
    proc = running_daemon(master, tmp_path, "hosta")
    relays = [t for t in threading.enumerate() if t.name == "mtrain-ssh-relay" and t not in earlier]
    assert relays
    master.close()
    proc.communicate(timeout=20)
    for relay in relays:  # what a relay does after its session ends, up to its drain
        relay.join(timeout=ssh_master.DRAIN_SECONDS + 10)
        assert not relay.is_alive()
    assert not events.exists(), events.read_text()
