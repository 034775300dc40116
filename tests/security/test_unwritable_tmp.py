"""A user who may not create anything in /tmp (or in any temporary folder) gets one line that
names the folder and what to do, exit status 1, and no "internal error".

Each case runs `mtrain run` as the job user in a mount namespace of its own, where /tmp (and
/var/tmp) is a fresh tmpfs of root's, mode 0755: the host's own folders are never touched.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from tests.security import local_users
from tests.security.local_users import JOB_USER, PYTHON, user_argv

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.timeout(90)
users = local_users.users_fixture()


def _mount_namespace_problem() -> "str | None":
    """Why a mount namespace of this test's own cannot be had here, or None."""
    if shutil.which("unshare") is None:
        return "no unshare (util-linux, which `.ci/run` installs)"
    done = subprocess.run(["unshare", "--mount", "--propagation", "private", "true"], capture_output=True,
                          text=True, timeout=30)
    if done.returncode != 0:
        return f"cannot make a mount namespace (needs root): {done.stderr.strip()[-200:]}"
    return None


@pytest.fixture(scope="module", autouse=True)
def mount_namespaces():
    """Skip where mount namespaces cannot be had; in CI (CI=true, root, util-linux) that is a failure,
    as for the cluster tests (tests/cluster/conftest.py)."""
    problem = _mount_namespace_problem()
    if problem:
        if os.environ.get("CI"):
            pytest.fail(f"the unwritable-/tmp tests must run in CI but cannot: {problem}")
        pytest.skip(problem)


def run_with_closed(folders: "list[str]", env: "list[str]", hold: Path) -> subprocess.CompletedProcess:
    """`mtrain run` as the job user where each of `folders` is a fresh tmpfs of root's, mode 0755.

    What this test runs from (the checkout, the virtualenv) may itself lie in such a folder,
    as a clone under /tmp does: it is bound back into the new tmpfs at its own path, from a
    bind of the old folder kept at `hold/N` (all of it in this mount namespace only)."""
    needed = sorted({str(REPO), sys.prefix})
    steps = []
    for number, folder in enumerate(folders):
        kept = hold / str(number)
        kept.mkdir()
        steps += [f"mount --bind {folder} {kept}", f"mount -t tmpfs -o mode=0755 mtrain-test {folder}"]
        for path in needed:
            if path.startswith(folder.rstrip("/") + "/"):
                inside = os.path.relpath(path, folder)
                steps += [f"mkdir -p {folder}/{inside}", f"mount --bind {kept}/{inside} {folder}/{inside}"]
    argv = user_argv(JOB_USER, [PYTHON, "-m", "mtrain.launcher.cli.main", "run", "-np", "1", "-H", "localhost:1",
                                PYTHON, "-c", "print('ran')"])
    argv[argv.index("env") + 2:argv.index("env") + 2] = env  # after "env -i"
    script = " && ".join(steps + ["cd /", 'exec "$@"'])
    return subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c", script, "sh", *argv],
                          capture_output=True, text=True, timeout=60)


@pytest.fixture
def hold():
    """A folder of root's outside /tmp and /var/tmp for the binds that keep the masked folders."""
    folder = Path(tempfile.mkdtemp(prefix="mtrain-test-hold-", dir="/dev/shm" if os.path.isdir("/dev/shm") else "/run"))
    yield folder
    shutil.rmtree(folder)


def assert_one_line_refusal(done: subprocess.CompletedProcess, *words: str) -> None:
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 1, done.stderr
    assert "ran" not in done.stdout, done.stdout
    assert len(lines) == 1 and "internal error" not in done.stderr and "Traceback" not in done.stderr, done.stderr
    for word in words:
        assert word in lines[0], lines[0]


def test_tmp_closed_to_the_user_names_the_job_folder_and_what_to_do(hold):
    done = run_with_closed(["/tmp"], [], hold)
    assert_one_line_refusal(done, "mtrain: cannot make /tmp/mtrain-job-", f"this user ({JOB_USER}) may not create",
                            "in /tmp (owner root, mode drwxr-xr-x)", "make /tmp writable for this user")


def test_no_writable_temporary_folder_names_tmpdir(hold):
    done = run_with_closed(["/tmp", "/var/tmp"], ["TMPDIR=/proc"], hold)
    assert_one_line_refusal(done, "mtrain: no folder for temporary files is writable", "not TMPDIR=/proc",
                            "set TMPDIR to a folder this user can write to")
