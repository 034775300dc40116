"""`python -m mtrain.launcher.pymain (FILE | -m MODULE | -c COMMAND) [ARGS…]`: run a Python
program as ``__main__`` and learn the status it ends with, however it spells its exit.

Why: Open MPI 5's ``MPI_Finalize`` waits for every rank.  A rank that ends with an error
status must end MPI with ``MPI_Abort(status)`` instead, or it waits (for as long as the
others train) and the job never hears why.  The interpreter does not tell exit handlers
its status: ``raise SystemExit(3)``, a ``SystemExit`` a worker thread raised and
``Future.result()`` raised again in the main thread, or an exception a thread's hook
turned into an exit all leave through the same C code, which keeps the status to itself.
What every one of them does is leave the main module with an exception, so this runner
(as ``python -m mpi4py`` does) runs the program inside ``try`` and notes the status of
whatever leaves it, before the interpreter's exit handlers run.

The rank wrapper (``launcher/rank.py``) starts a rank's command through this runner when
the command runs this environment's Python (``command_through_runner``); the program sees
the ``sys.argv``, ``sys.path[0]``, ``__main__`` and tracebacks it would have seen without it.

The status it learns goes to ``mtrain.common.exit_status``, where the runtime's exit handler
(``mtrain.ringreduce.exits``) reads it.  This module must stay stdlib-only and must not start MPI: it only looks at an ``mpi4py.MPI``
(and a ``torch.distributed``, see ``close_torch_process_groups``) the program itself imported.
"""
from __future__ import annotations

import gc
import os
import shutil
import sys
from typing import Any, Mapping, Sequence

from mtrain.common import exit_status
from mtrain.common.records.phase import Phase, PhaseNote
from mtrain.common.records.user_frames import user_line

MODULE = "mtrain.launcher.pymain"
# Options of the interpreter (before the program): these take no value...
_FLAGS = frozenset("bBdEIOPqRsSuvx")
# ...these take one (the rest of the word, or the next word)...
_VALUED = frozenset("WX")
# ...and with these the interpreter does something else than run a program to its end.
_NOT_A_PROGRAM = frozenset("hiV")
_LONG_VALUED = ("--check-hash-based-pycs",)

def _ended(status: int, leaving: "BaseException | None" = None) -> None:
    if status == 0:
        close_torch_process_groups()
    exit_status.set_final(status)
    # The supervisor learns that this rank will call nothing more: others waiting for it in
    # init() never would get out (see supervise.stuck_in_init); and the program's own line it
    # left from, for the job's failure report (a status 0 fails the job too if the rank left
    # while others still needed it).
    where = user_line(leaving.__traceback__) if leaving is not None else ""
    PhaseNote(Phase.ENDED, status=status, where=where).emit()
    # Whether or not the runtime was initialized: a rank that fails before init() must not
    # keep the others waiting in theirs (its exit handler, when it has one, says the same).
    exit_status.abort_mpi_at_exit(status)


def close_torch_process_groups() -> None:
    """Destroy the torch.distributed process groups a program that ended well left open, and
    collect the garbage that may still hold one, while the interpreter is whole.

    A gloo group left to the interpreter's finalization keeps worker threads that may still
    have work in flight: one that then needs the GIL (a future's callback, a tensor whose
    memory Python owns) is ended by the finalizing interpreter inside C++ code that cannot
    unwind, and the process dies with "terminate called without an active exception"
    (SIGABRT), its status 134 instead of 0. Destroying the groups waits for their work; a
    group that outlives that in a reference cycle (a DDP model's reducer) goes with the
    collection. Only after a status 0: a failing rank's peers may never finish the work its
    groups wait for. Only a torch.distributed the program imported itself is looked at.
    """
    dist = sys.modules.get("torch.distributed")
    if dist is None:
        return
    try:
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
    except Exception as error:  # noqa: BLE001 - the program has ended: say it, and leave as it would have
        sys.stderr.write(f"mtrain: closing torch.distributed's process groups at exit failed: {error}\n")
    gc.collect()


def command_through_runner(argv: Sequence[str], env: "Mapping[str, str] | None" = None) -> "list[str] | None":
    """``argv`` (a rank's command) run through this runner, or None when it does not run a program
    of this environment's Python (another interpreter may not have mtrain; a shell script, ``-i``,
    ``-`` or ``--version`` are left as they are)."""
    if not argv or not _is_this_python(argv[0], env):
        return None
    index = 1
    while index < len(argv):
        word = argv[index]
        if word in _LONG_VALUED:
            index += 2
            continue
        if word.startswith("--") or word == "-":
            return None  # --help, --version, `--` and stdin: not a program file of ours to run
        if not word.startswith("-"):  # the program file: the runner goes before it
            return [*argv[:index], "-m", MODULE, *argv[index:]]
        for position, letter in enumerate(word[1:], start=1):
            if letter in _FLAGS:
                continue
            if letter in _VALUED:
                index += 1 if position + 1 < len(word) else 2
                break
            if letter in "cm":  # the rest of the word, or the next word, is the command or module
                flags = word[1:position]
                value = word[position + 1:]
                rest = argv[index + 1:] if value else argv[index + 2:]
                if not value:
                    if index + 1 >= len(argv):
                        return None  # the interpreter will say what is missing
                    value = argv[index + 1]
                head = [*argv[:index], *([f"-{flags}"] if flags else [])]
                return [*head, "-m", MODULE, f"-{letter}", value, *rest]
            return None  # -h, -i, -V, or an option this runner does not know: leave the command alone
        else:
            index += 1
    return None  # options only: the interactive interpreter


def _is_this_python(program: str, env: "Mapping[str, str] | None") -> bool:
    """Whether ``program`` is the interpreter running this process, started the same way (so that
    it has mtrain): same folder and same file, a venv's ``python`` and ``python3`` alike."""
    path = shutil.which(program, path=(env or os.environ).get("PATH")) if os.sep not in program else program
    if path is None:
        return False
    ours = os.path.abspath(sys.executable)
    path = os.path.abspath(path)
    return (os.path.dirname(path) == os.path.dirname(ours)
            and os.path.realpath(path) == os.path.realpath(ours))


def main(argv: "list[str] | None" = None) -> None:
    """Run the program ``argv`` names (``FILE ARGS…``, ``-m MODULE ARGS…`` or ``-c COMMAND ARGS…``)
    as the interpreter would, noting the status it ends with."""
    argv = sys.argv[1:] if argv is None else argv
    if not argv:
        sys.stderr.write(f"usage: python -m {MODULE} (FILE | -m MODULE | -c COMMAND) [ARGS...]\n")
        raise SystemExit(2)
    try:
        _run(argv)
    except SystemExit as leaving:
        _ended(exit_status.status_of(leaving.code), leaving)
        raise  # the interpreter prints a message code and exits, as it would have
    except BaseException as error:  # noqa: B036 - what the interpreter would do with it, below
        # Printed by the hook the interpreter would call (mtrain's abort hook after init()),
        # without this runner's frames; then status 1, or SIGINT's for Ctrl-C.
        status = 130 if isinstance(error, KeyboardInterrupt) else 1
        _ended(status, error)
        trimmed = _user_frames(error.__traceback__)
        sys.excepthook(type(error), error.with_traceback(trimmed), trimmed)
        raise SystemExit(status) from None
    _ended(0)


def _run(argv: "list[str]") -> None:
    import runpy

    safe_path = sys.flags.isolated or getattr(sys.flags, "safe_path", False)
    if argv[0] == "-m":
        sys.argv = [argv[1], *argv[2:]]  # runpy puts the module's file in sys.argv[0]
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        return
    sys.argv = list(argv) if argv[0] != "-c" else ["-c", *argv[2:]]
    if argv[0] == "-c":
        if not safe_path and sys.path:
            sys.path[0] = ""  # as for `python -c`: the current folder
        _exec_as_main(compile(argv[1], "<string>", "exec"))
        return
    path = os.path.abspath(argv[0])
    if not safe_path and sys.path:
        # As for `python FILE`: the program's own folder first (for -m it was the current one).
        sys.path[0] = os.path.dirname(os.path.realpath(path))
    try:
        with open(path, "rb") as handle:
            source = handle.read()
    except IsADirectoryError:
        source = None
    except OSError as error:  # the interpreter's own words and status
        program = getattr(sys, "orig_argv", [sys.executable])[0]
        sys.stderr.write(f"{program}: can't open file {path!r}: [Errno {error.errno}] {error.strerror}\n")
        raise SystemExit(2) from None
    if source is None or source.startswith(b"PK\x03\x04"):  # a folder or zip file with a __main__.py
        runpy.run_path(path, run_name="__main__")
        return
    from importlib.machinery import SourceFileLoader

    code = compile(source, path, "exec", dont_inherit=True)
    # As the interpreter runs a file: __file__ absolute, sys.argv[0] as it was written.
    _exec_as_main(code, __file__=path, __cached__=None, __loader__=SourceFileLoader("__main__", path))


def _exec_as_main(code: Any, **attributes: Any) -> None:
    """Run ``code`` in a fresh ``__main__`` module (so that pickle finds its classes)."""
    import builtins
    import types

    main_module = types.ModuleType("__main__")
    main_module.__dict__.update(attributes, __builtins__=builtins)
    sys.modules["__main__"] = main_module
    exec(code, main_module.__dict__)


def _user_frames(traceback: Any) -> Any:
    """``traceback`` without the frames of this runner and of runpy above the program's own."""
    import runpy

    ours = {os.path.realpath(__file__), os.path.realpath(runpy.__file__), "<frozen runpy>"}
    while traceback is not None:
        filename = traceback.tb_frame.f_code.co_filename
        if filename not in ours and os.path.realpath(filename) not in ours:
            break
        traceback = traceback.tb_next
    return traceback


if __name__ == "__main__":
    # Run as `-m`, this file is `__main__`: the state that exits.py reads lives in the module
    # imported under its own name.
    from mtrain.launcher import pymain

    pymain.main()
