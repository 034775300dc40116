"""What mtrain leaves in shared places is private, and what another user planted there is refused.

The other user is simulated by chown (these tests run as root in CI; as an ordinary user
the chown tests skip): a planted folder, file or symlink is refused with one line naming
the path, its owner and mode, and is never read.
"""
from __future__ import annotations

import os
import pickle
import stat
import subprocess
import sys

import pytest

from mtrain.elastic import snapshot
from mtrain.common.private import (
    PrivatePathError,
    private_folder,
    read_private,
    remove_private,
    write_private,
)
from mtrain.common.records.elastic import HostUpdates
from mtrain.common.records.job_layout import JobLayout

OTHER_UID = 65534  # nobody
KEY = b"k" * 64  # the job's key
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="giving a path to another user needs root (CI runs as root)")


def mode(path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def test_folders_and_files_are_made_private_whatever_the_umask(tmp_path):
    old = os.umask(0)
    try:
        folder = private_folder(str(tmp_path / "job"))
        write_private(os.path.join(folder, "layout.json"), b"{}")
    finally:
        os.umask(old)
    assert mode(folder) == 0o700
    assert mode(os.path.join(folder, "layout.json")) == 0o600
    assert os.listdir(folder) == ["layout.json"]  # no temporary left behind
    assert private_folder(folder) == folder  # ours already: reused


def test_an_open_folder_of_our_own_is_refused(tmp_path):
    folder = tmp_path / "open"
    folder.mkdir()
    folder.chmod(0o755)
    with pytest.raises(PrivatePathError) as caught:
        private_folder(str(folder))
    text = str(caught.value)
    assert str(folder) in text and "other users may use it" in text and "drwxr-xr-x" in text
    assert "\n" not in text


def test_a_symlink_is_never_followed(tmp_path):
    target = tmp_path / "elsewhere"
    target.mkdir(mode=0o700)
    link = tmp_path / "link"
    link.symlink_to(target)
    with pytest.raises(PrivatePathError, match="it is a symlink"):
        private_folder(str(link))
    (target / "state").write_bytes(b"x")
    file_link = tmp_path / "file-link"
    file_link.symlink_to(target / "state")
    with pytest.raises(OSError):  # O_NOFOLLOW: ELOOP, never the target's bytes
        read_private(str(file_link))


@needs_root
def test_a_folder_planted_by_another_user_is_refused(tmp_path):
    planted = tmp_path / "mtrain-elastic-job"
    planted.mkdir(mode=0o700)
    os.chown(planted, OTHER_UID, OTHER_UID)
    with pytest.raises(PrivatePathError) as caught:
        private_folder(str(planted))
    assert "it belongs to another user" in str(caught.value) and "nobody" in str(caught.value)


@needs_root
def test_a_planted_snapshot_is_refused_not_unpickled(tmp_path):
    folder = str(tmp_path / "host")
    snapshot.write(folder, snapshot.new_header(3, 2), {"step": 3}, KEY)
    assert mode(folder) == 0o700 and mode(snapshot.path_in(folder)) == 0o600
    assert snapshot.read(folder, KEY)[1] == {"step": 3}

    class Boom:
        def __reduce__(self):
            return (os.system, ("touch " + str(tmp_path / "ran"),))

    planted = snapshot.MAGIC + b'{"commit": 9, "size": 2, "time": 0}\n' + pickle.dumps(Boom())
    path = snapshot.path_in(folder)
    os.unlink(path)
    with open(path, "wb") as handle:
        handle.write(planted)
    os.chown(path, OTHER_UID, OTHER_UID)
    with pytest.raises(PrivatePathError, match="belongs to another user"):
        snapshot.read(folder, KEY)
    with pytest.raises(PrivatePathError):
        snapshot.read_header(folder, KEY)
    assert not (tmp_path / "ran").exists()
    os.chown(folder, OTHER_UID, OTHER_UID)  # a foreign folder: refused before any file in it is opened
    with pytest.raises(PrivatePathError, match="belongs to another user"):
        snapshot.read(folder, KEY)


@needs_root
def test_a_planted_job_layout_or_host_version_is_refused(tmp_path):
    job_folder = private_folder(str(tmp_path / "mtrain-job-x"))
    layout_path = os.path.join(job_folder, "host.json")
    with open(layout_path, "w") as handle:
        handle.write("{}")
    os.chown(layout_path, OTHER_UID, OTHER_UID)
    with pytest.raises(PrivatePathError):
        JobLayout.read(layout_path)
    updates = os.path.join(job_folder, "host.updates")
    HostUpdates(4).write(updates)
    assert mode(updates) == 0o600 and HostUpdates.read(updates) == 4
    os.chown(updates, OTHER_UID, OTHER_UID)
    with pytest.raises(PrivatePathError):
        HostUpdates.read(updates)
    assert HostUpdates.read(str(tmp_path / "none")) == 0


def test_a_planted_temporary_name_fails_the_write_instead_of_being_written_through(tmp_path):
    target = tmp_path / "layout.json"
    decoy = tmp_path / "decoy"
    (tmp_path / f"layout.json.{os.getpid()}.tmp").symlink_to(decoy)
    with pytest.raises(FileExistsError):
        write_private(str(target), b"secret")
    assert not decoy.exists() and not target.exists()


def test_a_snapshot_not_signed_with_the_jobs_key_is_refused_not_unpickled(tmp_path):
    folder = str(tmp_path / "job" / "host")
    ran = tmp_path / "ran"

    class Boom:
        def __reduce__(self):
            return (os.system, ("touch " + str(ran),))

    snapshot.write(folder, snapshot.new_header(4, 2), Boom(), b"another job's key")
    with pytest.raises(snapshot.SnapshotRejected, match="not signed with this job's key") as caught:
        snapshot.read(folder, KEY)
    assert snapshot.path_in(folder) in str(caught.value) and "\n" not in str(caught.value)
    with pytest.raises(snapshot.SnapshotRejected):
        snapshot.read_header(folder, KEY)
    # Signed by this job, then changed (the payload swapped under a header that was right).
    snapshot.write(folder, snapshot.new_header(5, 2), {"step": 5}, KEY)
    with open(snapshot.path_in(folder), "rb") as handle:
        header = handle.readline()
    with open(snapshot.path_in(folder), "wb") as handle:
        handle.write(header + pickle.dumps(Boom()))
    assert snapshot.read_header(folder, KEY).commit == 5  # the header itself is still right
    with pytest.raises(snapshot.SnapshotRejected, match="do not match its signed header"):
        snapshot.read(folder, KEY)
    # A header edited to claim a newer commit breaks its MAC.
    with open(snapshot.path_in(folder), "wb") as handle:
        handle.write(header.replace(b'"commit": 5', b'"commit": 9') + pickle.dumps({"step": 5}))
    with pytest.raises(snapshot.SnapshotRejected):
        snapshot.read_header(folder, KEY)
    assert not ran.exists()


def test_files_are_read_only_from_a_folder_of_ours(tmp_path):
    open_folder = tmp_path / "open"
    open_folder.mkdir()
    (open_folder / "layout.json").write_text("{}")
    open_folder.chmod(0o777)
    with pytest.raises(PrivatePathError, match="other users may use it"):
        read_private(str(open_folder / "layout.json"))


def test_removing_a_file_removes_its_folder_once_empty(tmp_path):
    folder = private_folder(str(tmp_path / "mtrain-job-y"))
    for host in ("a", "b"):
        write_private(os.path.join(folder, f"{host}.json"), b"{}")
    remove_private(os.path.join(folder, "a.json"))
    assert os.listdir(folder) == ["b.json"]  # another host's file: the folder stays
    remove_private(os.path.join(folder, "b.json"))
    assert not os.path.exists(folder)
    remove_private(os.path.join(folder, "b.json"))  # gone already: nothing to do


def test_a_hosts_job_files_go_by_generation(tmp_path, monkeypatch):
    # The guard of a generation that ended may still be stopping its daemon while the next
    # generation starts on the same host: each removes only its own generation's entries, and a
    # new generation what earlier ones left (a killed host's).
    from mtrain.launcher.job import job_files
    monkeypatch.setattr(job_files, "JOB_FOLDER_PARENT", str(tmp_path / "tmp"))
    monkeypatch.setattr(job_files, "SHARED_MEMORY_PARENT", str(tmp_path / "shm"))
    os.makedirs(tmp_path / "tmp", mode=0o700)
    os.makedirs(tmp_path / "shm", mode=0o700)
    first, second = job_files.template("j", 1), job_files.template("j", 2)
    for template in (first, second):
        for host in ("a", "b"):
            write_private(job_files.layout(template, host), b"{}")
            job_files.daemon_session(template, host)
            job_files.rank_scratch(template, host, 0)
            job_files.shared_memory_folder(template, host)
    folder = tmp_path / "tmp" / "mtrain-job-j"
    job_files.remove_host(second, "a", earlier=True)  # generation 2 starts on a: 1's entries there go
    assert sorted(os.listdir(folder)) == sorted(["a.g2.json", "a.g2.prted", "a.g2.rank0", "b.g1.json", "b.g1.prted",
                                                 "b.g1.rank0", "b.g2.json", "b.g2.prted", "b.g2.rank0"])
    assert sorted(os.listdir(tmp_path / "shm" / "mtrain-job-j")) == ["a.g2", "b.g1", "b.g2"]
    job_files.remove_host(first, "b")  # generation 1's guard on b finishes late: its own only
    job_files.remove_host(second, "b")
    job_files.remove_host(second, "a")
    assert not folder.exists() and not (tmp_path / "shm" / "mtrain-job-j").exists()


def test_a_job_folder_another_hosts_cleanup_removes_as_it_is_made_is_made_again(tmp_path, monkeypatch):
    # Hosts that share /tmp share the job's folder: one host's guard removes it once it is empty
    # (what its earlier generations left is gone) just as another host has made it and is about
    # to put its layout, daemon folder or rank folder in it.  The second host makes it again.
    from mtrain.launcher.job import job_files
    monkeypatch.setattr(job_files, "JOB_FOLDER_PARENT", str(tmp_path / "tmp"))
    monkeypatch.setattr(job_files, "SHARED_MEMORY_PARENT", str(tmp_path / "shm"))
    os.makedirs(tmp_path / "tmp", mode=0o700)
    os.makedirs(tmp_path / "shm", mode=0o700)
    template = job_files.template("race")
    job_folders = (os.path.dirname(template), os.path.dirname(job_files.shared_memory_path(template, "a")))
    real_open, real_mkdir = os.open, os.mkdir
    removed = []

    def other_host_cleans_up(parent):
        if parent in job_folders and not os.listdir(parent) and not removed:
            removed.append(parent)
            job_files.remove_host(template, "b", earlier=True)  # what the other host does as it starts
            assert not os.path.exists(parent)

    def racing_open(path, *args, **kwargs):
        other_host_cleans_up(os.path.dirname(str(path)))
        return real_open(path, *args, **kwargs)

    def racing_mkdir(path, *args, **kwargs):
        other_host_cleans_up(os.path.dirname(str(path)))
        return real_mkdir(path, *args, **kwargs)

    for make in (lambda: write_private(job_files.layout(template, "a"), b"{}"),
                 lambda: job_files.daemon_session(template, "a"),
                 lambda: job_files.rank_scratch(template, "a", 0),
                 lambda: job_files.shared_memory_folder(template, "a")):
        removed.clear()
        with monkeypatch.context() as racing:
            racing.setattr(os, "open", racing_open)
            racing.setattr(os, "mkdir", racing_mkdir)
            make()
        assert len(removed) == 1  # removed once, empty, and made again
        (entry,) = [os.path.join(parent, name) for parent in job_folders if os.path.isdir(parent)
                    for name in os.listdir(parent)]
        assert entry.startswith(removed[0]) and mode(removed[0]) == 0o700 and mode(entry) in (0o600, 0o700)
        job_files.remove_host(template, "a")
        assert not any(os.path.exists(parent) for parent in job_folders)


def test_a_program_run_without_a_launcher_leaves_nothing_in_dev_shm(tmp_path):
    # `python train.py` is an MPI singleton; Open MPI 5's leaves its shared-memory segment (16 MiB,
    # sm_segment.<host>.<uid>.<job>.0) in /dev/shm however it ends, unless mtrain keeps it off.
    if not os.path.isdir("/dev/shm"):
        pytest.skip("no /dev/shm here")
    code = ("import numpy as np, mtrain.ringreduce as rr\n"
            "rr.init()\n"
            "print(rr.size(), rr.allreduce(np.arange(3.0), op=rr.Sum).tolist())\n"
            "import os; print(os.environ.get('OMPI_MCA_btl'))\n")  # (not for the jobs it starts)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMPI_", "PMIX_", "PMI_"))}
    before = set(os.listdir("/dev/shm"))
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=tmp_path,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split("\n")[:2] == ["1 [0.0, 1.0, 2.0]", "None"]
    assert not [name for name in set(os.listdir("/dev/shm")) - before if name.startswith("sm_segment.")]
