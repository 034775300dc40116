"""TaskService, task agent and run_through_tasks (launcher/task_*.py) on this machine: real
services, real agents, a real mpirun whose second "host" is reached only through a service."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
import uuid

import pytest

from mtrain.launcher.tasks import agent as task_agent
from mtrain.launcher.process_tools import descendants
from mtrain.launcher.tasks.service import TaskService
from tests.jobs import run_job

pytestmark = pytest.mark.timeout(120)
PYTHON = sys.executable


@pytest.fixture
def service():
    key = os.urandom(32)
    running = TaskService(key)
    address, port = running.start()
    yield running, key, address, port
    running.stop()


def agent_argv(folder: str, key: bytes, host: str, address: str, port: int, *words: str) -> list[str]:
    path = os.path.join(folder, "agent.json")
    task_agent.write_config(path, key, {host: (address, port)}, PYTHON, None)
    return [PYTHON, "-m", "mtrain.launcher.tasks.agent", "--config", path, "-x", host, *words]


def test_agent_runs_a_command_and_returns_its_output_and_status(service, tmp_path):
    running, key, address, port = service
    argv = agent_argv(str(tmp_path), key, "node-1", address, port, "echo", "out-$((6*7));", "echo", "err", ">&2;",
                      "exit", "7")
    done = run_job(argv, 30)
    assert (done.returncode, done.stdout, done.stderr) == (7, "out-42\n", "err\n")
    assert oct(os.stat(tmp_path / "agent.json").st_mode & 0o777) == "0o600"


def test_a_wrong_key_is_refused_and_nothing_runs(service, tmp_path):
    running, key, address, port = service
    marker = tmp_path / "ran"
    argv = agent_argv(str(tmp_path), os.urandom(32), "node-1", address, port, "touch", str(marker))
    done = run_job(argv, 30)
    assert done.returncode == 255
    assert "node-1" in done.stderr and len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert running.refused == 1 and not marker.exists()


def test_unknown_host_and_unreachable_service_are_one_line_each(tmp_path):
    argv = agent_argv(str(tmp_path), b"k" * 32, "node-1", "127.0.0.1", 9, "true")
    done = run_job(argv[:-2] + ["node-2", "true"], 30)
    assert done.returncode == 255 and "no task service for host node-2" in done.stderr
    done = run_job(argv, 30)
    assert done.returncode == 255 and "127.0.0.1:9" in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr


def test_a_dropped_connection_ends_the_whole_tree(service, tmp_path):
    """A grandchild in a session of its own (as Open MPI's daemon puts its ranks) goes too."""
    running, key, address, port = service
    pid_file = tmp_path / "pid"
    script = f"import os,time; open({str(pid_file)!r},'w').write(str(os.getpid())); time.sleep(300)"
    argv = agent_argv(str(tmp_path), key, "node-1", address, port, "setsid", PYTHON, "-c", f'"{script}"')
    agent = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 30
    while not (pid_file.exists() and pid_file.read_text()):
        assert time.monotonic() < deadline and agent.poll() is None, agent.stderr.read() if agent.poll() else ""
        time.sleep(0.05)
    grandchild = int(pid_file.read_text())
    assert running.running() == 1
    agent.kill()  # no goodbye: the service sees the connection drop
    agent.wait(timeout=10)
    deadline = time.monotonic() + 15
    while os.path.exists(f"/proc/{grandchild}") and _state(grandchild) != "Z":
        assert time.monotonic() < deadline, f"{grandchild} outlived its connection"
        time.sleep(0.05)
    while running.running():  # the guard above it reaps its tree and goes
        assert time.monotonic() < deadline, "the command outlived its connection"
        time.sleep(0.05)


def test_stop_ends_what_runs(service, tmp_path):
    running, key, address, port = service
    pid_file = tmp_path / "pid"
    # The command says it started (its pid, which `exec sleep` keeps) once it runs under the guard.
    argv = agent_argv(str(tmp_path), key, "node-1", address, port, "echo", "$$", ">", f"{pid_file}.part", "&&",
                      "mv", f"{pid_file}.part", str(pid_file), "&&", "exec", "sleep", "300")
    before = set(descendants(os.getpid()))  # (other fixtures' processes, a test cluster's sshd say)
    agent = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 30
    while not pid_file.exists():
        assert time.monotonic() < deadline and agent.poll() is None, agent.stderr.read() if agent.poll() else ""
        time.sleep(0.05)
    command = int(pid_file.read_text())
    assert running.running() == 1
    started = [p for p in descendants(os.getpid()) if p != agent.pid and p not in before]
    # The command itself and the guard above it, under the service in this process.
    assert command in started and len(started) >= 2, (command, started)
    running.stop()
    assert running.running() == 0
    assert agent.wait(timeout=15) != 0  # its command was ended, not finished
    deadline = time.monotonic() + 10  # (a SIGKILLed child of another parent may take a moment to be reaped)
    while alive := [p for p in started if _state(p) not in ("Z", "gone")]:
        assert time.monotonic() < deadline, f"left running after stop: {alive} (the command: {command})"
        time.sleep(0.05)


def _state(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/stat", "rb") as handle:
            return handle.read().rsplit(b")", 1)[1].split()[0].decode()
    except OSError:
        return "gone"


def _driver(rank_code: str, token: str) -> str:
    # The second "host" is a name that is not this machine's: mpirun starts its daemon through
    # the agent, which reaches the service started here.
    return textwrap.dedent(f"""
        import os, socket, sys
        from mtrain.launcher.tasks.service import TaskService
        from mtrain.launcher.tasks.launch import run_through_tasks
        key = os.urandom(32)
        service = TaskService(key)
        address, port = service.start()
        code = {rank_code!r}
        status = run_through_tasks([sys.executable, "-c", code, {token!r}], {{"other-node": (address, port)}},
                                   {{socket.gethostname(): 1, "other-node": 2}}, key,
                                   env={{"TEST_WORD_FOR_RANKS": "w1"}})
        # The service ends what the job's agents left there as their connections drop: wait for it.
        import time
        deadline = time.monotonic() + 15
        while service.running() and time.monotonic() < deadline:
            time.sleep(0.05)
        print("served", service.running(), "status", status, flush=True)
        service.stop()
        sys.exit(status)
    """)


def test_run_through_tasks_runs_ranks_on_the_service_host(tmp_path):
    token = f"mtrtok{uuid.uuid4().hex[:8]}"
    # Whether a remote guard is among the rank's ancestors: only a daemon started through the service has one.
    code = textwrap.dedent("""
        import os
        def guarded(pid):
            while pid > 1:
                with open(f"/proc/{pid}/cmdline", "rb") as handle:
                    if b"mtrain.launcher.remote_guard" in handle.read():
                        return True
                with open(f"/proc/{pid}/stat", "rb") as handle:
                    pid = int(handle.read().rsplit(b")", 1)[1].split()[1])
            return False
        print("rank", os.environ["OMPI_COMM_WORLD_RANK"], os.environ["TEST_WORD_FOR_RANKS"], guarded(os.getpid()))
    """)
    done = run_job([PYTHON, "-c", _driver(code, token)], 90, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    lines = sorted(line for line in done.stdout.splitlines() if "rank " in line)
    # (Both "hosts" are this machine, whose name the daemon reports: PRRTE may place rank 0 there
    # too. tests/cluster/test_ray.py checks the split on two hosts.)
    assert [line.rsplit(" ", 1)[0] for line in lines] == [f"[{r}]<stdout>:rank {r} w1" for r in range(3)], done.stdout
    assert lines[1:] == ["[1]<stdout>:rank 1 w1 True", "[2]<stdout>:rank 2 w1 True"], done.stdout
    assert _processes_with(token) == []


def test_run_through_tasks_names_the_failing_rank(tmp_path):
    token = f"mtrtok{uuid.uuid4().hex[:8]}"
    code = ("import os, sys\nif os.environ['OMPI_COMM_WORLD_RANK'] == '2': sys.exit('rank two gives up')\n"
            "import time; time.sleep(60)")
    done = run_job([PYTHON, "-c", _driver(code, token)], 90, cwd=tmp_path)
    assert done.returncode != 0
    assert "rank 2" in done.stderr and "rank two gives up" in done.stderr, done.stderr
    assert "served 0" in done.stdout
    assert _processes_with(token) == []


def _processes_with(token: str) -> list[str]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) != os.getpid():
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as handle:
                    line = handle.read().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if token in line and _state(int(entry)) != "Z":
                found.append(f"{entry}: {line[:120]}")
    return found
