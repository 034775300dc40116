"""On a host other people log in to: a job run by one local user keeps everything it leaves in
/tmp and /dev/shm private, and a second local user can neither read it nor plant anything the
job would use.

The job runs as the ordinary user `mtrain-job` (root ignores file modes); `mtrain-other`
reads and plants.  `.ci/run` makes both users; elsewhere these tests skip, in CI they fail
when they cannot run.
"""
from __future__ import annotations

import os
import pickle
import pwd
import shutil
import stat
import subprocess
import threading
import time
from pathlib import Path

import pytest

from mtrain.elastic import snapshot
from tests import stale_mpi_folders
from tests.security import local_users
from tests.security.local_users import JOB_USER, OTHER_USER, PYTHON, as_user, user_argv
from tests.shared_places import shared_entries

HERE = Path(__file__).resolve().parent
pytestmark = pytest.mark.timeout(180)
users = local_users.users_fixture()


def owned_entries(uid: int, besides: Path) -> "dict[str, int]":
    """Every path under /tmp and /dev/shm that belongs to `uid` (and what is inside it), but the
    test's own folder `besides`: its mode."""
    return shared_entries(lambda top, info: info.st_uid == uid and top != str(besides))


class Job:
    """`mtrain run` of tests/security/shared_host_job.py as JOB_USER, its output read by threads."""

    def __init__(self, work: Path, commits: int = 3) -> None:
        self.work = work
        self.go = work / "go"
        argv = [PYTHON, "-m", "mtrain.launcher.cli.main", "run", "-np", "2", "--min-np", "2", "-H", "localhost:2",
                PYTHON, str(HERE / "shared_host_job.py"), str(self.go), str(commits)]
        self.proc = subprocess.Popen(user_argv(JOB_USER, argv), cwd=work, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True)
        self.out: "list[str]" = []
        self.err: "list[str]" = []
        self.threads = [threading.Thread(target=lambda: self.out.extend(self.proc.stdout), daemon=True),
                        threading.Thread(target=lambda: self.err.extend(self.proc.stderr), daemon=True)]
        for thread in self.threads:
            thread.start()

    def wait_for(self, word: str, count: int, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while sum(word in line for line in list(self.out)) < count:
            assert self.proc.poll() is None or time.monotonic() < deadline, self.report()
            assert time.monotonic() < deadline, f"no {count} {word!r} lines: " + self.report()
            time.sleep(0.05)

    def rank_environment(self) -> "dict[str, str]":
        """A rank's environment, read as root from /proc (what the job user alone may read)."""
        uid = pwd.getpwnam(JOB_USER).pw_uid
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                if os.stat(f"/proc/{entry}").st_uid != uid:
                    continue
                with open(f"/proc/{entry}/environ", "rb") as handle:
                    pairs = [item.split(b"=", 1) for item in handle.read().split(b"\0") if b"=" in item]
            except OSError:
                continue
            env = {k.decode(): v.decode(errors="replace") for k, v in pairs}
            if "OMPI_COMM_WORLD_RANK" in env and "MTRAIN_ELASTIC_STATE_DIR" in env:
                return env
        raise AssertionError("no rank of the job found in /proc: " + self.report())

    def finish(self, timeout: float = 90) -> int:
        try:
            status = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise AssertionError("the job did not end: " + self.report())
        for thread in self.threads:
            thread.join(timeout=5)
        return status

    def report(self) -> str:
        return f"\n--- stdout ---\n{''.join(self.out)[-3000:]}\n--- stderr ---\n{''.join(self.err)[-3000:]}"


@pytest.fixture
def work():
    """The job's working folder: the job user's own (pytest's tmp_path is closed to other users)."""
    import tempfile
    folder = Path(tempfile.mkdtemp(prefix="shared-host-test-"))
    user = pwd.getpwnam(JOB_USER)
    os.chown(folder, user.pw_uid, user.pw_gid)
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


def test_an_ordinary_users_job_keeps_what_it_leaves_private_and_leaves_nothing(work):
    uid = pwd.getpwnam(JOB_USER).pw_uid
    before = set(owned_entries(uid, work))
    (work / "go.hold").touch()  # the ranks hold after their first commit, while the files are listed
    job = Job(work)
    job.wait_for("ready", 2)
    job.go.touch()
    job.wait_for("committed", 2)
    env = job.rank_environment()
    host = os.uname().nodename
    layout = env["MTRAIN_JOB_FILE"].format(host=host)
    snapshot_file = snapshot.path_in(env["MTRAIN_ELASTIC_STATE_DIR"].format(host=host))
    made = {path: mode for path, mode in owned_entries(uid, work).items() if path not in before}
    try:
        for path in (layout, os.path.dirname(layout), snapshot_file, os.path.dirname(snapshot_file),
                     os.path.dirname(os.path.dirname(snapshot_file))):
            assert path in made, (path, sorted(made))
        # Every file and folder the job has in a shared place, mtrain's and Open MPI's alike.
        open_to_others = {path: stat.filemode(mode) for path, mode in made.items() if mode & 0o077}
        assert not open_to_others, open_to_others
        for path in (layout, snapshot_file):
            peek = as_user(OTHER_USER, ["cat", path], capture_output=True, text=True)
            assert peek.returncode != 0 and "Permission denied" in peek.stderr, (path, peek)
        listing = as_user(OTHER_USER, ["ls", os.path.dirname(snapshot_file)], capture_output=True, text=True)
        assert listing.returncode != 0 and "Permission denied" in listing.stderr, listing
    finally:
        (work / "go.hold").unlink()
    assert job.finish() == 0, job.report()
    assert sum("done" in line for line in job.out) == 2, job.report()
    left = sorted(set(owned_entries(uid, work)) - before)
    assert not left, left


def _plant(kind: str, path: str, host: str, decoy: Path) -> "list[str]":
    """As OTHER_USER, make `path` (the job's snapshot folder-to-be) a folder of theirs holding a
    snapshot, a symlink to such a folder, or a plain file; the paths made."""
    made = [path]
    if kind == "folder":
        commands = [["mkdir", "-m", "0777", path], ["mkdir", "-m", "0777", os.path.join(path, host)],
                    ["cp", str(decoy), os.path.join(path, host, snapshot.FILE_NAME)]]
    elif kind == "symlink":
        target = f"/tmp/mtrain-other-{os.getpid()}-{time.monotonic_ns()}"
        made.append(target)
        commands = [["mkdir", "-m", "0777", "-p", os.path.join(target, host)],
                    ["cp", str(decoy), os.path.join(target, host, snapshot.FILE_NAME)], ["ln", "-s", target, path]]
    else:
        commands = [["cp", str(decoy), path]]
    for command in commands:
        done = as_user(OTHER_USER, command, capture_output=True, text=True)
        assert done.returncode == 0, (command, done.stderr)
    return made


@pytest.mark.parametrize("kind", ["folder", "symlink", "file"])
def test_a_snapshot_folder_planted_by_another_user_is_refused_and_never_read(work, kind):
    ran = work / "planted-code-ran"

    class Planted:
        def __reduce__(self):
            return (os.system, (f"touch {ran}",))

    decoy = Path(f"/tmp/mtrain-decoy-{os.getpid()}.snapshot")  # what the other user hopes the job unpickles
    decoy.write_bytes(snapshot.MAGIC + b"0" * 64 + b' {"commit": 99, "size": 2, "time": 0, "sha256": ""}\n'
                      + pickle.dumps(Planted()))
    decoy.chmod(0o644)
    job = Job(work)
    job.wait_for("ready", 2)  # the ranks have not made the snapshot folder yet
    env = job.rank_environment()
    host = os.uname().nodename
    planted = os.path.dirname(env["MTRAIN_ELASTIC_STATE_DIR"].format(host=host))
    made = [planted]
    try:
        made = _plant(kind, planted, host, decoy)
        job.go.touch()
        status = job.finish()
        stderr = "".join(job.err)
        assert status == 1, job.report()
        refusal = f"mtrain: refusing {planted}: "
        assert refusal in stderr and f"owner {OTHER_USER}" in stderr, job.report()
        lines = [line for line in stderr.splitlines() if refusal in line]
        assert all(line.count("mtrain: refusing") == 1 for line in lines), lines
        assert "Traceback" not in stderr, job.report()
        assert not ran.exists()
    finally:
        subprocess.run(["rm", "-rf", *made, str(decoy)], check=False)


def test_the_job_folders_planted_by_another_user_are_refused_with_one_line():
    # Every call the launcher, the remote guard and the rank wrapper make in the job's folders
    # (launcher/job/job_files.py), run as the job's user, at paths the other user made first: folders
    # of theirs open to all in /tmp and /dev/shm, and symlinks to them.
    name = f"mtrain-job-planted{os.getpid()}"
    planted = [f"{base}/{name}{suffix}" for base in ("/tmp", "/dev/shm") for suffix in ("", "-link")]
    for base in ("/tmp", "/dev/shm"):
        for command in (["mkdir", "-m", "0777", f"{base}/{name}"], ["ln", "-s", f"{base}/{name}", f"{base}/{name}-link"]):
            assert as_user(OTHER_USER, command).returncode == 0
    code = ("import sys\n"
            "from mtrain.launcher.job import job_files\n"
            "from mtrain.common.private import PrivatePathError\n"
            "from mtrain.common.records.elastic import HostUpdates, updates_file\n"
            "from mtrain.common.records.job_layout import JobLayout\n"
            "template = sys.argv[1] + '/{host}.g0.json'\n"
            "layout = JobLayout(slots=(1,), master_addr='10.0.0.1', master_port=1, workers=('10.0.0.1:1',))\n"
            "for call in (lambda: layout.write(job_files.layout(template, 'h')),\n"
            "             lambda: JobLayout.read(job_files.layout(template, 'h')),\n"
            "             lambda: HostUpdates(2).write(updates_file(template).format(host='h')),\n"
            "             lambda: job_files.daemon_session(template, 'h'), lambda: job_files.rank_scratch(template, 'h', 0),\n"
            "             lambda: job_files.shared_memory_folder(template, 'h')):\n"
            "    try:\n        call()\n        print('accepted')\n"
            "    except PrivatePathError as error:\n        print(error)\n")
    try:
        for suffix, problem in (("", "it belongs to another user"), ("-link", "it is a symlink")):
            folder = f"/tmp/{name}{suffix}"
            done = as_user(JOB_USER, [PYTHON, "-c", code, folder], capture_output=True, text=True, cwd="/")
            lines = done.stdout.splitlines()
            assert done.returncode == 0 and len(lines) == 6, (done.stdout, done.stderr)
            for line in lines[:5]:
                assert line.startswith(f"mtrain: refusing {folder}: {problem} (owner {OTHER_USER}, mode "), line
            shm = f"/dev/shm/{name}{suffix}"
            assert lines[5].startswith(f"mtrain: refusing {shm}: {problem} (owner {OTHER_USER}, mode "), lines[5]
            for base in ("/tmp", "/dev/shm"):
                assert os.listdir(f"{base}/{name}") == []  # nothing of the job went into a planted folder
    finally:
        subprocess.run(["rm", "-rf", *planted], check=False)


def test_open_mpi_folders_another_user_planted_do_not_stop_a_job(work):
    # Open MPI names its launcher's folder in /tmp after the launcher's pid alone and will not
    # start where that folder is another user's: planting one for each of the next pids would
    # stop every job of the host's other users.  The launch gives mpirun a folder of its own.
    planting = as_user(OTHER_USER, [PYTHON, str(HERE.parent / "stale_mpi_folders.py"), "3000"],
                       capture_output=True, text=True, cwd="/")
    planted = [int(word) for word in planting.stdout.split()]
    try:
        assert planting.returncode == 0 and planted, planting.stderr
        argv = [PYTHON, "-m", "mtrain.launcher.cli.main", "run", "-np", "2", "-H", "localhost:2",
                PYTHON, "-c", stale_mpi_folders.PRINT_PID]
        done = as_user(JOB_USER, argv, capture_output=True, text=True, cwd=work, timeout=90)
        assert done.returncode == 0, done.stderr
        stale_mpi_folders.assert_mpirun_met_them(done.stdout, 2, "/tmp", planted)
        assert "Traceback" not in done.stderr, done.stderr
    finally:
        stale_mpi_folders.remove("/tmp", planted)
