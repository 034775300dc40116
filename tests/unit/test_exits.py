"""The exit status a rank is leaving with, noted for the exit handler (no MPI)."""
import subprocess
import sys

import pytest

from mtrain.ringreduce.exits import status_of


@pytest.mark.parametrize("code, status", [(None, 0), (0, 0), (7, 7), (256 + 3, 3), (True, 1), (False, 0),
                                          ("message", 1)])
def test_status_as_the_interpreter_computes_it(code, status):
    assert status_of(code) == status
    done = subprocess.run([sys.executable, "-c", f"import sys; sys.exit({code!r})"], capture_output=True)
    assert done.returncode == status


def test_sys_exit_and_builtins_note_the_status_and_still_exit():
    # What the exit handler will see, for each way of asking to exit; the handler is replaced
    # by one that prints it, so no MPI is needed.
    code = ("import builtins, sys\n"
            "from mtrain.ringreduce import exits\n"
            "exits.install(lambda: None)\n"
            "import atexit\n"
            "atexit.unregister(exits.leave)  # the real handler would start MPI to abort\n"
            "atexit.register(lambda: print('noted', exits.noted_status(), flush=True))\n"
            "{call}\n")
    for call, status in (("sys.exit(7)", 7), ("exit(3)", 3), ("quit('bye')", 1), ("sys.exit()", 0), ("pass", None)):
        done = subprocess.run([sys.executable, "-c", code.format(call=call)], capture_output=True, text=True)
        assert f"noted {status}" in done.stdout, (call, done.stdout, done.stderr)
        assert done.returncode == (status or 0), call


def test_only_the_main_threads_exit_and_not_a_caught_one_is_noted():
    code = ("import threading, sys\n"
            "from mtrain.ringreduce import exits\n"
            "exits.install(lambda: None)\n"
            "import atexit\n"
            "atexit.unregister(exits.leave)\n"
            "worker = threading.Thread(target=sys.exit, args=(5,)); worker.start(); worker.join()\n"
            "print('after thread', exits.noted_status())\n"
            "try:\n    sys.exit(2)\nexcept SystemExit:\n    pass\n"
            "print('caught', exits.noted_status())\n"
            "exits.forget_status()  # what init() and every submit do: the program went on\n"
            "print('going on', exits.noted_status())\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split("\n")[:3] == ["after thread None", "caught 2", "going on None"]
