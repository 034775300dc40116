"""Users' mistakes: one actionable line on stderr, exit status 2, never a traceback."""
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.timeout(60)


def mtrain(*args, env=None, cwd=None):
    return subprocess.run([sys.executable, "-m", "mtrain.launcher.cli.main", *args], capture_output=True,
                          text=True, timeout=30, env=env, cwd=cwd)


def assert_usage_error(done, fragment):
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert "Traceback" not in done.stderr
    assert fragment in lines[0], lines[0]


@pytest.mark.parametrize("args, fragment", [
    (["-H", "h1:", "true"], "missing slot count"),
    (["-H", "h1:0", "true"], "at least 1"),
    (["-H", "h1:x", "true"], "not a whole number"),
    (["-H", ":4", "true"], "missing host name"),
    (["-H", "a:1,a:1", "true"], "listed twice"),
    (["-np", "0", "true"], "at least one process"),
    (["-np", "5", "-H", "a:2,b:2", "true"], "more than the 4 slots"),
    (["-np", "x", "true"], "is not a valid integer"),
    (["-np", "2"], "no command given"),
    (["true"], "-np is required"),
    (["-np", "1", "--bogus", "true"], "unknown option --bogus"),
    (["-np", "1", "-x", "1BAD=2", "true"], "not an environment variable name"),
    (["-np", "1", "-p", "70000", "-H", "a:1", "true"], "70000"),
    (["-np", "1", "-i", "/nonexistent/key", "-H", "a:1", "true"], "does not exist"),
    (["-np", "1", "--network-interface", "eth0;rm", "true"], "not an interface name"),
    (["-np", "1", "--mpirun", "/nonexistent/mpirun", "true"], "no such executable"),
    (["-np", "1", "--mpi-args", "'unterminated", "true"], "--mpi-args"),
])
def test_usage_errors(args, fragment):
    assert_usage_error(mtrain("run", *args), fragment)


def test_hosts_and_hostfile_together(tmp_path):
    hostfile = tmp_path / "hosts"
    hostfile.write_text("a slots=2\n")
    assert_usage_error(mtrain("run", "-H", "a:1", "--hostfile", str(hostfile), "true"), "not both")


def test_missing_and_malformed_hostfile(tmp_path):
    assert_usage_error(mtrain("run", "--hostfile", str(tmp_path / "absent"), "true"), "cannot read it")
    bad = tmp_path / "bad"
    bad.write_text("# header\nnode1 slots=two\n")
    assert_usage_error(mtrain("run", "--hostfile", str(bad), "true"), f"{bad}:2")


def test_mtrain_mpirun_variable_checked():
    env = dict(os.environ, MTRAIN_MPIRUN="/nonexistent/mpirun")
    assert_usage_error(mtrain("run", "-np", "1", "true", env=env), "MTRAIN_MPIRUN")


def test_dry_run_prints_plan_and_argv_without_running(tmp_path):
    marker = tmp_path / "touched"
    done = mtrain("run", "--dry-run", "-np", "3", "-H", "localhost:2,127.0.0.1:2", "touch", str(marker))
    assert done.returncode == 0, done.stderr
    assert "host localhost: ranks 0-1 (local)" in done.stdout
    assert "host 127.0.0.1: rank 2 (local)" in done.stdout
    assert "--bind-to none" in done.stdout and "plm_ssh_agent" not in done.stdout
    assert not marker.exists()


def test_dry_run_remote_hosts_use_the_agent():
    done = mtrain("run", "--dry-run", "-H", "node1:2,node2:2", "-x", "FOO=bar baz", "python", "t.py")
    assert done.returncode == 0, done.stderr
    assert "-np 4" in done.stdout and "mtrain.launcher.ssh.agent" in done.stdout
    assert "'FOO=bar baz'" in done.stdout


def test_a_tmpdir_passed_on_by_name_reaches_the_ranks_by_value(tmp_path):
    # mpirun runs with a TMPDIR of the launch's own: `-x TMPDIR` by name would hand the ranks on
    # other hosts that folder (one of the launch host's) instead of the user's.
    done = mtrain("run", "--dry-run", "-H", "node1:2,node2:2", "-x", "TMPDIR", "python", "t.py",
                  env=dict(os.environ, TMPDIR=str(tmp_path)))
    assert done.returncode == 0, done.stderr
    assert f" -x TMPDIR={tmp_path} " in done.stdout and " -x TMPDIR " not in done.stdout, done.stdout


def test_version_and_help():
    assert mtrain("--version").stdout.startswith("mtrain, version")
    done = mtrain("run", "--help")
    for flag in ("-np", "--hosts", "--hostfile", "--ssh-port", "--ssh-identity-file", "--start-timeout",
                 "--network-interface", "--output-filename", "--output-dir", "--verbose", "--dry-run",
                 "--ssh-accept-new-hosts", "--mpirun"):
        assert flag in done.stdout


@pytest.mark.parametrize("args, expected", [
    (["-np", "2", "python", "x.py"], "-np is an option of `mtrain run`; write `mtrain run -np 2 python x.py`"),
    (["-H", "a:2", "python", "x.py"], "write `mtrain run -H a:2 python x.py`"),
    (["runn", "-np", "2", "true"], "did you mean `mtrain run`?"),
    (["python", "x.py"], "to start a job write `mtrain run -np N python x.py`"),
])
def test_top_level_mistakes_get_the_command_to_write(args, expected):
    assert_usage_error(mtrain(*args), expected)


def test_usage_errors_read_as_one_sentence_with_one_remark():
    done = mtrain("run", "-np", "2")
    assert_usage_error(done, "no command given")
    assert done.stderr.count("(") <= 1, done.stderr  # one parenthesised remark at most


@pytest.mark.parametrize("args, fragment", [
    (["--min-np", "2", "-H", "a:2", "true"], "an elastic job needs -np"),
    (["-np", "2", "--min-np", "3", "-H", "a:4", "true"], "--min-np 3 is more than -np 2"),
    (["-np", "4", "--max-np", "3", "-H", "a:4", "true"], "--max-np 3 is less than -np 4"),
    (["-np", "2", "--min-np", "1", "true"], "needs --host-discovery-script"),
    (["-np", "2", "--host-discovery-script", "/nonexistent/discover.sh", "true"], "not an executable file"),
    (["-np", "2", "--reset-limit", "3", "true"], "--reset-limit applies to elastic jobs only"),
    (["-np", "2", "--min-np", "1", "-H", "a:2", "--blacklist-cooldown-range", "9", "3", "true"], "MIN is more than MAX"),
])
def test_elastic_usage_errors(args, fragment):
    assert_usage_error(mtrain("run", *args), fragment)


def test_elastic_script_and_fixed_hosts_are_exclusive(tmp_path):
    script = tmp_path / "discover.sh"
    script.write_text("#!/bin/sh\necho localhost:2\n")
    script.chmod(0o755)
    assert_usage_error(mtrain("run", "-np", "2", "--host-discovery-script", str(script), "-H", "a:2", "true"),
                       "either --host-discovery-script or -H")
    dry = mtrain("run", "-np", "2", "--min-np", "1", "--host-discovery-script", str(script), "--dry-run", "true")
    assert dry.returncode == 0 and "host localhost: ranks 0-1 (local)" in dry.stdout, dry.stderr
