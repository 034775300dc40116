"""End-to-end `mtrain run` on this machine only (no SSH, no root needed)."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import uuid

import pytest

from tests import stale_mpi_folders
from tests.jobs import run_job
from tests.launcher.report_check import assert_only_mtrain_output

pytestmark = pytest.mark.timeout(120)
PYTHON = sys.executable
RANK = "int(__import__('os').environ['OMPI_COMM_WORLD_RANK'])"


def env() -> dict[str, str]:
    e = dict(os.environ)
    e["PATH"] = os.path.dirname(PYTHON) + os.pathsep + e.get("PATH", "")
    return e


def mtrain(*args: str, timeout: float = 60, extra_env: dict | None = None, cwd=None) -> subprocess.CompletedProcess:
    return run_job([PYTHON, "-m", "mtrain.launcher.cli.main", "run", *args], timeout,
                   env=dict(env(), **(extra_env or {})), cwd=cwd)


def processes_with(token: str) -> list[str]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) != os.getpid():
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as handle:
                    line = handle.read().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if token in line:
                found.append(f"{entry}: {line[:100]}")
    return found


def assert_gone(token: str, within: float) -> None:
    deadline = time.monotonic() + within
    while processes_with(token):
        if time.monotonic() > deadline:
            left = processes_with(token)
            for line in left:
                try:
                    os.kill(int(line.split(":")[0]), signal.SIGKILL)
                except ProcessLookupError:
                    pass
            raise AssertionError(f"left behind: {left}")
        time.sleep(0.1)


def test_output_prefixed_streams_apart_and_arguments_exact():
    tricky = ["a b", "$HOME", "*", ";", "'x'", '"y"', "", "ä"]
    code = (f"import sys; r={RANK}; print('out', r, sys.argv[1:]); "
            "sys.stderr.write(f'err {r}\\nno newline {r}')")
    done = mtrain("-np", "2", PYTHON, "-c", code, *tricky)
    assert done.returncode == 0, done.stderr
    out = sorted(done.stdout.splitlines())
    assert out == [f"[{r}]<stdout>:out {r} {tricky!r}" for r in (0, 1)]
    for r in (0, 1):
        assert f"[{r}]<stderr>:err {r}" in done.stderr.splitlines()
        assert f"[{r}]<stderr>:no newline {r}" in done.stderr.splitlines()
    assert "@@mtrain" not in done.stderr  # exit records never reach the user


def test_first_failure_reported_with_its_code_and_stderr(tmp_path):
    code = (f"import sys,time; r={RANK}\n"
            "if r == 1:\n    print('boom: bad batch 17', file=sys.stderr); sys.exit(3)\n"
            "time.sleep(60)")
    started = time.monotonic()
    done = mtrain("-np", "3", PYTHON, "-c", code)
    assert done.returncode == 3, done.stderr
    assert time.monotonic() - started < 30
    assert "mtrain: job failed; first failure: rank 1 on" in done.stderr
    assert "exit code 3 (boom: bad batch 17)" in done.stderr
    assert "Traceback" not in done.stderr
    assert "rank 0 and" not in done.stderr and "ranks 0, 2 were stopped or failed after it" in done.stderr
    assert_only_mtrain_output(done.stderr)


def test_failure_before_init_reads_like_one_after_it():
    # Raised before the runtime exists: no error file, yet the report names the exception.
    early = mtrain("-np", "2", PYTHON, "-c", "import mtrain.ringreduce as rr; rr.rank()")
    assert early.returncode == 1, early.stderr
    assert "exit code 1 (NotInitializedError: " in early.stderr, early.stderr
    late = mtrain("-np", "2", PYTHON, "-c", "import mtrain.ringreduce as rr; rr.init(); "
                  "raise ValueError(f'bad value on rank {rr.rank()}')")
    assert late.returncode == 1, late.stderr
    assert "exit code 1 (ValueError: bad value on rank " in late.stderr, late.stderr
    missing = mtrain("-np", "2", PYTHON, "no_such_script.py")
    assert missing.returncode == 2, missing.stderr
    assert "exit code 2 (" in missing.stderr and "no_such_script.py" in missing.stderr
    # A bad runtime variable given to `mtrain run` is refused before anything starts; one the
    # program sets itself is refused by init() on the ranks, and reported like any failure.
    refused = mtrain("-np", "2", "-x", "MTRAIN_CYCLE_TIME_MS=soon", PYTHON, "-c",
                     "import mtrain.ringreduce as rr; rr.init()")
    assert refused.returncode == 2 and refused.stderr.count("\n") == 1, refused.stderr
    assert "MTRAIN_CYCLE_TIME_MS='soon' is not a number" in refused.stderr
    bad_setting = mtrain("-np", "2", PYTHON, "-c", "import os; os.environ['MTRAIN_CYCLE_TIME_MS'] = 'soon'; "
                         "import mtrain.ringreduce as rr; rr.init()")
    assert "exit code 1 (ValueError: MTRAIN_CYCLE_TIME_MS='soon' is not a number" in bad_setting.stderr
    for done in (early, late, missing, bad_setting):
        assert_only_mtrain_output(done.stderr)
        # The traceback is shown once, as the rank printed it; the report adds one line, not a copy.
        assert done.stderr.count("Traceback") <= 2, done.stderr


def test_mpi_launcher_lines_kept_out_of_the_way_but_not_lost(tmp_path):
    code = "import mtrain.ringreduce as rr; rr.init(); rr.barrier(); raise SystemExit(5 if rr.rank() == 1 else 0)"
    done = mtrain("-np", "2", "--output-filename", str(tmp_path / "o"), PYTHON, "-c", code)
    assert done.returncode == 5, done.stderr
    assert_only_mtrain_output(done.stderr)
    assert (tmp_path / "o" / "mpirun.log").exists()
    verbose = mtrain("-np", "2", "--verbose", PYTHON, "-c", code)
    assert verbose.returncode == 5 and "mtrain: [" in verbose.stderr


def test_job_runs_from_a_directory_with_hostile_launcher_bindings_ringreduce(tmp_path):
    # A user's project with its own packages of these common names must not change mtrain.
    for name in ("launcher", "bindings", "ringreduce"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "__init__.py").write_text(f"raise ImportError('the user\'s own {name} was imported')\n")
        (tmp_path / name / "rank.py").write_text("raise SystemExit('the user\'s rank module ran')\n")
    (tmp_path / "job.py").write_text(
        "import numpy as np, mtrain.ringreduce as rr\n"
        "rr.init()\n"
        "total = rr.allreduce(np.arange(5, dtype=np.float64) * (rr.rank() + 1), op=rr.Sum)\n"
        "print('sum', total.tolist())\n")
    done = mtrain("-np", "2", PYTHON, "job.py", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert sorted(done.stdout.splitlines()) == [f"[{r}]<stdout>:sum [0.0, 3.0, 6.0, 9.0, 12.0]" for r in (0, 1)]


def test_killed_rank_gives_128_plus_signal():
    code = (f"import os,signal,time; r={RANK}\n"
            "if r == 0: os.kill(os.getpid(), signal.SIGKILL)\n"
            "time.sleep(60)")
    done = mtrain("-np", "2", PYTHON, "-c", code)
    assert done.returncode == 137, done.stderr
    assert "rank 0 on" in done.stderr and "killed by SIGKILL" in done.stderr
    assert_only_mtrain_output(done.stderr)


def test_command_not_found_is_127():
    done = mtrain("-np", "1", "mtrain-no-such-program")
    assert done.returncode == 127
    assert "cannot start 'mtrain-no-such-program'" in done.stderr
    assert_only_mtrain_output(done.stderr)


def test_output_dir_and_environment(tmp_path):
    code = ("import os,sys; print(os.environ.get('MTR_A'), os.environ.get('MTRAIN_B'), "
            "os.environ.get('MTRAIN_AGENT_TIMEOUT')); print('e', file=sys.stderr)")
    done = mtrain("-np", "2", "--output-filename", str(tmp_path / "o"), "-x", "MTR_A=1 2", PYTHON, "-c", code,
                  extra_env={"MTRAIN_B": "fwd"})
    assert done.returncode == 0, done.stderr
    for r in (0, 1):
        assert (tmp_path / "o" / f"rank.{r}" / "stdout").read_text() == "1 2 fwd None\n"
        assert (tmp_path / "o" / f"rank.{r}" / "stderr").read_text() == "e\n"
    # A rank that prints nothing still gets both files.
    silent = mtrain("-np", "2", "--output-filename", str(tmp_path / "s"), PYTHON, "-c",
                    f"print('only rank 0') if {RANK} == 0 else None")
    assert silent.returncode == 0, silent.stderr
    assert (tmp_path / "s" / "rank.0" / "stdout").read_text() == "only rank 0\n"
    for r, stream in ((0, "stderr"), (1, "stdout"), (1, "stderr")):
        assert (tmp_path / "s" / f"rank.{r}" / stream).read_text() == ""


def test_more_ranks_than_cores_with_mpi(tmp_path):
    code = ("from mpi4py import MPI; c=MPI.COMM_WORLD; "
            "assert c.allreduce(c.rank + 1) == c.size * (c.size + 1) // 2; print('ok', c.size)")
    np_ = str(max(3, (os.cpu_count() or 1) + 1))
    # The rank wrapper sees more ranks than cores on this host and makes them yield.
    done = mtrain("-np", np_, PYTHON, "-c", code, timeout=90)
    assert done.returncode == 0, done.stderr
    assert done.stdout.count(f"ok {np_}") == int(np_)


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM, signal.SIGKILL])
def test_stopping_mtrain_leaves_nothing(sig):
    token = f"mtrtok{uuid.uuid4().hex[:8]}"
    proc = subprocess.Popen([PYTHON, "-m", "mtrain.launcher.cli.main", "run", "-np", "2", PYTHON, "-c",
                             "import time; print('ready', flush=True); time.sleep(120)", token],
                            env=env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        seen = 0
        deadline = time.monotonic() + 60
        while seen < 2 and time.monotonic() < deadline:
            line = proc.stdout.readline()
            seen += "ready" in line
        assert seen == 2
        proc.send_signal(sig)
        proc.wait(timeout=15)
    finally:
        if proc.poll() is None:
            proc.kill()
        _, stderr = proc.communicate(timeout=10)
    if sig != signal.SIGKILL:
        assert proc.returncode == 128 + sig
        assert_only_mtrain_output(stderr)
    assert_gone(token, within=10)


def test_check_reports_mpi_and_frameworks():
    done = subprocess.run([PYTHON, "-m", "mtrain.launcher.cli.main", "check"], capture_output=True, text=True,
                          timeout=200, env=env())
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].startswith("openmpi launcher ") or lines[0].startswith("mpich launcher ")
    assert any(l.startswith("mpi4py uses: ") for l in lines)
    assert any(l.startswith("CUDA-aware MPI: ") for l in lines)
    for name in ("numpy", "cupy", "torch", "tensorflow"):
        assert any(l.startswith(f"{name}: ") for l in lines), name
    # A framework's version, not a log line the framework printed while importing.
    versions = dict(l.split(": ", 1) for l in lines if l.split(": ", 1)[0] in ("numpy", "torch", "tensorflow"))
    for name, version in versions.items():
        assert version == "not importable" or re.match(r"^\d+\.\d+", version), (name, version)
    assert lines[-1].startswith("GPUs: ")


@pytest.mark.parametrize("status", [7, 0])
def test_rank_leaving_mid_job_is_named_not_the_ranks_it_strands(status):
    # Rank 1 exits early while rank 0 still waits on an all-reduce.  With an error status the
    # job ends with that status at once; with status 0 rank 0's op fails with ShutdownError,
    # but the report must name rank 1, where the failure began.
    code = ("import sys, numpy as np, mtrain.ringreduce as rr\n"
            "rr.init()\n"
            "for step in range(3):\n    rr.allreduce(np.ones(4), name=f's{step}')\n"
            f"if rr.rank() == 1:\n    sys.exit({status})\n"
            "rr.allreduce(np.ones(4), name='stranded')\n")
    started = time.monotonic()
    done = mtrain("-np", "2", PYTHON, "-c", code)
    assert time.monotonic() - started < 30
    assert "first failure: rank 1 on" in done.stderr, done.stderr
    if status:
        assert done.returncode == status and "exit code 7" in done.stderr, done.stderr
    else:
        assert done.returncode != 0 and "left the job" in done.stderr, done.stderr
        # Rank 0's own traceback says it is a consequence, not the cause.
        assert ("[0]<stderr>:mtrain: rank 0 raised the uncaught exception above because rank(s) [1] left or "
                "failed first") in done.stderr, done.stderr
    # Where rank 1 left: the line of its sys.exit, in the program given with -c.
    assert re.search(r"first failure: rank 1 on .* at <string>:6 in <module>\n", done.stderr), done.stderr
    assert_only_mtrain_output(done.stderr)


_FAILING_PROGRAM = """\
import json, sys
import numpy as np
import mtrain.ringreduce as rr


def read_config(text):
    return json.loads(text)  # line 7: the stdlib raises below it


def reduce(x):
    return rr.allreduce(x, process_set="everyone")  # line 11: mtrain raises below it


def give_up():
    sys.exit(4)  # line 15


def main(mode):
    if mode == "before":
        read_config("{not json")  # line 20: before init()
    rr.init()
    if rr.rank() == 1:
        if mode == "stdlib":
            read_config("{not json")
        if mode == "mtrain":
            reduce(np.ones(3))
        if mode == "exit":
            give_up()
        if mode == "return":
            return 3
    rr.barrier()
    return 0


raise SystemExit(main(sys.argv[1]))  # line 35
"""


@pytest.mark.parametrize("mode, line, where, reason", [
    ("stdlib", 7, "read_config", "(JSONDecodeError: Expecting property name"),
    ("mtrain", 11, "reduce", "(InvalidArgumentError: process_set must be an mtrain ProcessSet"),
    ("exit", 15, "give_up", "exit code 4"),
    ("return", 35, "<module>", "exit code 3"),
    ("before", 7, "read_config", "(JSONDecodeError: Expecting property name"),
])
def test_the_report_names_the_users_line_not_mtrains_or_a_librarys(tmp_path, mode, line, where, reason):
    # The innermost frame of the program's own code: not the stdlib's json, not mtrain's
    # runtime, and the SystemExit's line for an exit status. The path is relative to the
    # folder the job runs in.
    (tmp_path / "train.py").write_text(_FAILING_PROGRAM)
    done = mtrain("-np", "2", PYTHON, "train.py", mode, cwd=tmp_path)
    assert done.returncode in (1, 3, 4), done.stderr
    first = next(text for text in done.stderr.splitlines() if "first failure" in text)
    assert first.startswith("mtrain: job failed; first failure: rank ") and reason in first, first
    assert first.endswith(f" at train.py:{line} in {where}"), first
    assert_only_mtrain_output(done.stderr)


@pytest.mark.parametrize("np_", [1, 3])
def test_plain_torch_distributed_program_runs_unchanged(tmp_path, np_):
    pytest.importorskip("torch")
    script = os.path.join(os.path.dirname(__file__), "..", "cluster", "ddp_plain.py")
    before = set(os.listdir("/tmp"))
    done = mtrain("-np", str(np_), PYTHON, script, "gloo", timeout=120)
    assert done.returncode == 0, done.stderr
    ranks = {}
    for line in done.stdout.splitlines():
        data = __import__("json").loads(line.split(">:", 1)[1])
        ranks[data["rank"]] = data
    assert sorted(ranks) == list(range(np_))
    for rank, data in ranks.items():
        assert (data["world"], data["local_rank"], data["local_world_size"]) == (np_, rank, np_)
        assert (data["group_rank"], data["group_world_size"]) == (0, 1)
        assert data["params"] == ranks[0]["params"]
    assert not [name for name in set(os.listdir("/tmp")) - before if name.startswith("mtrain-job-")]


def test_master_port_flag_and_tf_config_on_one_host():
    code = ("import json, os; c = json.loads(os.environ['TF_CONFIG']); "
            "print(os.environ['MASTER_ADDR'], os.environ['MASTER_PORT'], c['task']['index'], len(set(c['cluster']['worker'])))")
    done = mtrain("-np", "2", "--master-port", "29611", PYTHON, "-c", code)
    assert done.returncode == 0, done.stderr
    assert sorted(line.split(">:", 1)[1] for line in done.stdout.splitlines()) == [
        "127.0.0.1 29611 0 2", "127.0.0.1 29611 1 2"]


def test_the_job_layout_left_in_tmp_is_private_and_off_the_command_line_while_the_job_runs():
    # The layout (master address, ports, TF_CONFIG) sits in /tmp: while the job runs it must be
    # ours alone (a 0600 file in a 0700 folder of the job's), and neither its path nor the job's
    # key may be on mpirun's command line, which every user of the host can read.
    code = ("import os, stat; path = os.environ['MTRAIN_JOB_FILE'].format(host=os.uname().nodename); "
            "info, folder = os.lstat(path), os.lstat(os.path.dirname(path)); "
            "print('layout', oct(stat.S_IMODE(info.st_mode)), stat.S_ISREG(info.st_mode), info.st_uid == os.geteuid(), "
            "oct(stat.S_IMODE(folder.st_mode)), stat.S_ISDIR(folder.st_mode), folder.st_uid == os.geteuid(), "
            "os.path.dirname(os.path.dirname(path)), len(os.environ['MTRAIN_JOB_SECRET'])); "
            "lines = [open(f'/proc/{p}/cmdline', 'rb').read() for p in os.listdir('/proc') if p.isdigit() "
            "         and os.path.exists(f'/proc/{p}/cmdline')]; "
            "job = os.path.basename(os.path.dirname(path)).encode(); "  # mtrain-job-<id>
            "print('visible', any(os.environ['MTRAIN_JOB_SECRET'].encode() in l or job in l for l in lines))")
    before = set(os.listdir("/tmp"))
    done = mtrain("-np", "2", PYTHON, "-c", code)
    assert done.returncode == 0, done.stderr
    lines = sorted(line for line in done.stdout.splitlines() if "layout" in line or "visible" in line)
    assert lines == sorted([f"[{r}]<stdout>:layout 0o600 True True 0o700 True True /tmp 64" for r in (0, 1)]
                           + [f"[{r}]<stdout>:visible False" for r in (0, 1)]), done.stdout
    assert not [name for name in set(os.listdir("/tmp")) - before if name.startswith("mtrain-job-")]


@pytest.mark.parametrize("leave", ["sys.exit(0)", "pass  # falls off the end"])
def test_rank_leaving_while_the_others_remove_a_process_set_is_named_not_a_hang(leave):
    # remove_process_set waits for every rank outside the engine thread; rank 2 leaves with
    # status 0 instead of calling it.  The others must end with an error naming rank 2 (their
    # engine hears of the departure on its next tick), never wait for it forever.
    code = ("import sys, time, mtrain.ringreduce as rr\n"
            "rr.init()\n"
            "ps = rr.add_process_set([0, 1])\n"
            f"if rr.rank() == 2:\n    time.sleep(1)\n    {leave}\n"
            "else:\n    rr.remove_process_set(ps)\n    time.sleep(120)\n")
    started = time.monotonic()
    done = mtrain("-np", "3", PYTHON, "-c", code, timeout=90)
    assert time.monotonic() - started < 30, done.stderr
    assert done.returncode != 0, done.stderr
    assert "rank(s) [2] left the job" in done.stderr or "rank 2 left the job" in done.stderr, done.stderr
    assert_only_mtrain_output(done.stderr)


@pytest.mark.parametrize("mask", [0o022, 0o027])
def test_the_program_keeps_the_users_umask_while_open_mpi_runs_with_a_private_one(mask):
    # mpirun runs with umask 077 (what Open MPI leaves in /tmp is private); the user's program
    # gets the launching user's umask back, so its checkpoints come out as they always did (its
    # parent, the rank wrapper, runs with Open MPI's).
    code = ("import os; mask = os.umask(0)\n"
            "daemon = [l for l in open(f'/proc/{os.getppid()}/status') if l.startswith('Umask')][0].split()[1]\n"
            "print('umask', oct(mask), daemon)")
    done = subprocess.run([PYTHON, "-m", "mtrain.launcher.cli.main", "run", "-np", "2", PYTHON, "-c", code],
                          capture_output=True, text=True, timeout=60, env=env(), umask=mask)
    assert done.returncode == 0, done.stderr
    lines = sorted(line.split(">:", 1)[1] for line in done.stdout.splitlines())
    assert lines == [f"umask {oct(mask)} 0077"] * 2, done.stdout


def test_folders_killed_launchers_left_do_not_stop_the_next_job():
    # Open MPI's launcher will not start where a killed one left the folder named after its pid
    # ("The PMIx server's listener thread failed to start", status 213), which happens once pids
    # wrap.  Such a folder waits for each of the next pids; the job must run all the same (and
    # leave them be: they are not the launch's).
    base = tempfile.gettempdir()
    with stale_mpi_folders.planted(base) as planted:
        done = mtrain("-np", "2", PYTHON, "-c", stale_mpi_folders.PRINT_PID)
        assert done.returncode == 0, done.stderr
        stale_mpi_folders.assert_mpirun_met_them(done.stdout, 2, base, planted)


@pytest.mark.parametrize("users", ["unset", "set", "passed on"])
def test_the_program_keeps_the_users_tmpdir_while_mpirun_makes_its_folder_in_a_private_one(tmp_path, users):
    code = ("import os, stat\n"
            "folder = os.path.dirname(os.environ['PMIX_SERVER_TMPDIR'])\n"   # where mpirun made its own
            "mode = stat.S_IMODE(os.stat(folder).st_mode)\n"
            "print('tmpdir', os.environ.get('TMPDIR'), os.path.basename(folder)[:13], oct(mode),\n"
            "      sorted(k for k in os.environ if k.endswith('_TMPDIR') and k.startswith('MTRAIN')))")
    environment = env()
    environment.pop("TMPDIR", None)
    if users != "unset":
        environment["TMPDIR"] = str(tmp_path)
    flags = ["-x", "TMPDIR"] if users == "passed on" else []
    done = subprocess.run([PYTHON, "-m", "mtrain.launcher.cli.main", "run", "-np", "2", *flags, PYTHON, "-c", code],
                          capture_output=True, text=True, timeout=60, env=environment)
    assert done.returncode == 0, done.stderr
    lines = sorted(line.split(">:", 1)[1] for line in done.stdout.splitlines())
    expected = None if users == "unset" else str(tmp_path)
    assert lines == [f"tmpdir {expected} mtrain-agent- 0o700 []"] * 2, done.stdout
