"""`.ci/run`'s permission step (`.ci/grant_traversal.sh`) lets the test users through the folders
above a checkout without narrowing what they have, and puts every ACL back afterwards.

A named-user ACL entry wins over the "other" bits: the step once gave `u:mtrain-job:--x` to
/tmp (mode 1777) for a checkout under /tmp, and from then on neither test user could create
anything in /tmp.  Here the checkout lies under a world-writable sticky folder of the test's
own, below a folder closed to others, as a clone under /tmp lies below /tmp.
"""
from __future__ import annotations

import os
import subprocess
import tempfile
from pathlib import Path

import pytest

from tests.security import local_users
from tests.security.local_users import JOB_USER, OTHER_USER, as_user

STEP = Path(__file__).resolve().parents[2] / ".ci" / "grant_traversal.sh"
pytestmark = pytest.mark.timeout(60)
users = local_users.users_fixture()


def acl(path: Path) -> str:
    return subprocess.run(["getfacl", "--absolute-names", str(path)], capture_output=True, text=True,
                          check=True).stdout


def step(*args: str) -> None:
    done = subprocess.run(["bash", str(STEP), *args], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def test_a_checkout_under_a_sticky_folder_leaves_it_writable_and_every_acl_as_found():
    top = Path(tempfile.mkdtemp(prefix="mtrain-acl-", dir="/tmp"))  # 0700, root's: the users cannot pass
    try:
        shared = top / "shared"
        shared.mkdir()
        os.chmod(shared, 0o1777)  # like /tmp
        checkout = shared / "clone" / "repo"
        checkout.mkdir(parents=True)
        os.chmod(checkout.parent, 0o700)  # a clone of root's inside it
        folders = [Path("/"), *reversed(checkout.parents[:-1]), checkout]
        before = {folder: acl(folder) for folder in folders}
        state = top / "state"

        step("grant", str(state), JOB_USER, OTHER_USER, "--", str(checkout))

        for user in (JOB_USER, OTHER_USER):
            assert as_user(user, ["test", "-x", str(checkout)]).returncode == 0, f"{user} cannot reach the checkout"
            made = as_user(user, ["touch", str(shared / f"made-by-{user}")], capture_output=True, text=True)
            assert made.returncode == 0, f"{user} can no longer create files in the sticky folder: {made.stderr}"
        assert acl(shared) == before[shared], "the world-writable sticky folder's ACL was changed"
        assert acl(Path("/tmp")) == before[Path("/tmp")]
        assert f"user:{JOB_USER}:--x" in acl(top) and f"user:{OTHER_USER}:--x" in acl(checkout.parent)

        step("undo", str(state))

        assert {folder: acl(folder) for folder in folders} == before
        assert not state.exists()
    finally:
        subprocess.run(["rm", "-rf", str(top)], check=True)


def test_a_user_entry_that_allows_more_keeps_it():
    top = Path(tempfile.mkdtemp(prefix="mtrain-acl-", dir="/tmp"))
    try:
        subprocess.run(["setfacl", "-m", f"u:{JOB_USER}:rw-", str(top)], check=True)
        before = acl(top)
        state = top.parent / f"{top.name}.state"
        step("grant", str(state), JOB_USER, "--", str(top))
        assert f"user:{JOB_USER}:rwx" in acl(top)
        step("undo", str(state))
        assert acl(top) == before
    finally:
        subprocess.run(["rm", "-rf", str(top)], check=True)
