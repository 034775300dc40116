"""The runner a rank's Python program starts through: it sees the program's exit status however
the program spells its exit, and the program sees what it would have seen without it."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from mtrain.launcher.pymain import MODULE, command_through_runner

PYTHON = sys.executable
HERE = os.path.dirname(PYTHON)
# What the exit handler will read, printed by an exit handler of the program's own (no MPI).
REPORT = ("import atexit\nfrom mtrain.common import exit_status\n"
          "atexit.register(lambda: print('final', exit_status.final_status(), flush=True))\n")


@pytest.mark.parametrize("argv, expected", [
    ([PYTHON, "train.py", "--lr", "1"], [PYTHON, "-m", MODULE, "train.py", "--lr", "1"]),
    ([PYTHON, "-u", "-W", "ignore", "-X", "dev", "t.py"], [PYTHON, "-u", "-W", "ignore", "-X", "dev", "-m", MODULE, "t.py"]),
    ([PYTHON, "-Wignore", "-OO", "t.py"], [PYTHON, "-Wignore", "-OO", "-m", MODULE, "t.py"]),
    ([PYTHON, "-m", "pkg.train", "-m", "x"], [PYTHON, "-m", MODULE, "-m", "pkg.train", "-m", "x"]),
    ([PYTHON, "-um", "pkg"], [PYTHON, "-u", "-m", MODULE, "-m", "pkg"]),
    ([PYTHON, "-c", "print(1)", "a"], [PYTHON, "-m", MODULE, "-c", "print(1)", "a"]),
    ([PYTHON, "-Bcprint(1)"], [PYTHON, "-B", "-m", MODULE, "-c", "print(1)"]),
    ([PYTHON, "--check-hash-based-pycs", "never", "t.py"],
     [PYTHON, "--check-hash-based-pycs", "never", "-m", MODULE, "t.py"]),
    # Left alone: not a program of this environment's Python run to its end.
    ([PYTHON, "-i", "t.py"], None), ([PYTHON, "-"], None), ([PYTHON, "--version"], None), ([PYTHON], None),
    ([PYTHON, "-u"], None), ([PYTHON, "-c"], None), (["bash", "run.sh"], None), (["/no/such/python3", "t.py"], None),
])
def test_which_commands_run_through_the_runner(argv, expected):
    assert command_through_runner(argv) == expected


def test_this_pythons_name_on_path_is_recognized_and_another_python_is_not(tmp_path):
    env = {"PATH": HERE}
    name = os.path.basename(PYTHON)
    assert command_through_runner([name, "t.py"], env) == [name, "-m", MODULE, "t.py"]
    other = tmp_path / name
    other.symlink_to(os.path.realpath(PYTHON))  # the same interpreter, but not this environment
    assert command_through_runner([str(other), "t.py"], env) is None


def run(*args: str, cwd=None) -> subprocess.CompletedProcess:
    return subprocess.run([PYTHON, "-m", MODULE, *args], capture_output=True, text=True, cwd=cwd, timeout=60)


@pytest.mark.parametrize("ending, status", [
    ("raise SystemExit(3)", 3),
    ("raise SystemExit('a message')", 1),
    ("import sys; sys.exit(0)", 0),
    ("pass", 0),
    ("raise ValueError('boom')", 1),
    # A worker thread's SystemExit, raised again in the main thread by Future.result().
    ("from concurrent.futures import ThreadPoolExecutor as P\nimport sys\n"
     "with P(1) as pool:\n    pool.submit(sys.exit, 5).result()", 5),
    # A thread's exception that the program turns into an exit of its own.
    ("import threading\nerrors = []\nthreading.excepthook = errors.append\n"
     "t = threading.Thread(target=lambda: 1 / 0); t.start(); t.join()\n"
     "if errors:\n    raise SystemExit(4)", 4),
    # Caught, then a normal end: no status is left behind.
    ("try:\n    raise SystemExit(6)\nexcept SystemExit:\n    pass", 0),
])
def test_the_final_status_is_known_however_the_program_ends(tmp_path, ending, status):
    script = tmp_path / "prog.py"
    script.write_text(REPORT + ending + "\n")
    done = run(str(script))
    assert done.returncode == status, done.stderr
    assert f"final {status}" in done.stdout, (done.stdout, done.stderr)
    if "boom" in ending:  # the traceback the interpreter would print, without the runner's frames
        assert done.stderr.startswith("Traceback (most recent call last):\n  File \"" + str(script) + "\""), done.stderr
        assert "pymain" not in done.stderr and "runpy" not in done.stderr, done.stderr
    if "message" in ending:
        assert done.stderr == "a message\n"


def test_a_file_sees_what_python_file_shows(tmp_path):
    folder = tmp_path / "code"
    folder.mkdir()
    (folder / "helper.py").write_text("VALUE = 42\n")
    (folder / "prog.py").write_text(textwrap.dedent("""
        import os, pickle, sys
        import __main__, helper
        class Thing: pass
        print(sys.argv, sys.path[0] == os.path.dirname(os.path.abspath(__file__)), __name__, __file__, helper.VALUE)
        print(pickle.loads(pickle.dumps(Thing())).__class__.__module__, __main__.__file__ == __file__)
    """))
    args = ["code/prog.py", "a", "-b"]
    ours = run(*args, cwd=tmp_path)
    plain = subprocess.run([PYTHON, *args], capture_output=True, text=True, cwd=tmp_path)
    assert ours.returncode == plain.returncode == 0, ours.stderr
    assert ours.stdout == plain.stdout
    assert "['code/prog.py', 'a', '-b'] True __main__ " + str(folder / "prog.py") + " 42" in ours.stdout


def test_a_module_a_command_and_a_missing_file_behave_as_with_python(tmp_path):
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "__main__.py").write_text("import sys\nprint(sys.argv[1:], __name__, __spec__.name)\n")
    for args in (["-m", "pkg", "x"], ["-c", "import sys; print(sys.argv, sys.path[0] == '')", "y"], ["missing.py"]):
        ours = run(*args, cwd=tmp_path)
        plain = subprocess.run([PYTHON, *args], capture_output=True, text=True, cwd=tmp_path)
        assert (ours.returncode, ours.stdout, ours.stderr) == (plain.returncode, plain.stdout, plain.stderr), args
