"""The two ordinary local users of the shared-host tests, and running commands as them.

`mtrain-job` runs jobs (root ignores file modes, so a job must not run as root);
`mtrain-other` tries to read or plant their files.  `.ci/run` makes both users; elsewhere
the tests that need them skip, and in CI they fail when they cannot run.
"""
from __future__ import annotations

import os
import pwd
import shutil
import subprocess
import sys

import pytest

PYTHON = sys.executable
JOB_USER, OTHER_USER = "mtrain-job", "mtrain-other"


def problem() -> "str | None":
    """Why these tests cannot run here, or None."""
    if os.geteuid() != 0:
        return "running a job as another local user needs root"
    for user in (JOB_USER, OTHER_USER):
        try:
            pwd.getpwnam(user)
        except KeyError:
            return f"no local user {user!r} (`.ci/run` makes it with useradd)"
    if shutil.which("runuser") is None:
        return "no runuser (util-linux)"
    done = as_user(JOB_USER, [PYTHON, "-c", "import mtrain.launcher"], capture_output=True, text=True)
    if done.returncode != 0:
        return (f"{JOB_USER} cannot run this environment's Python ({done.stderr.strip()[-200:]}); a folder above it "
                "may be closed to other users (`.ci/run` lets the test users through it with setfacl)")
    return None


def users_fixture():
    """A module's autouse fixture: skip (fail in CI) when the users cannot be had."""
    @pytest.fixture(scope="module", autouse=True)
    def users():
        found = problem()
        if found:
            if os.environ.get("CI"):
                pytest.fail(f"the shared-host tests must run in CI but cannot: {found}")
            pytest.skip(found)
    return users


def as_user(user: str, argv: "list[str]", **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(user_argv(user, argv), **kwargs)


def user_argv(user: str, argv: "list[str]") -> "list[str]":
    """`argv` as `user`, with a clean environment of the user's own (and this Python's bin first)."""
    home = pwd.getpwnam(user).pw_dir
    path = os.path.dirname(PYTHON) + ":/usr/local/bin:/usr/bin:/bin"
    return ["runuser", "-u", user, "--", "env", "-i", f"HOME={home}", f"PATH={path}", "LANG=C.UTF-8",
            f"USER={user}", *argv]
