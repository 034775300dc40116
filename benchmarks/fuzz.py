"""The API fuzzer's long run: thousands of random submissions, errors on every rank or none, never a hang.

Run as ``mtrain run -np 2 python benchmarks/fuzz.py`` and again with ``-np 3`` (or
``mpirun -np N --oversubscribe python benchmarks/fuzz.py``). The cases are those of the CI
test (``tests/mpi/fuzzing.py``, loaded from its file, and its docstring says what a case is and
when it passes), here many more of them (``--cases``, default 10,000), and the run does not stop
at a failing case: it counts it, prints its report and goes on. At the end rank 0 prints a table:

    cases        run, and how many every rank of the set got through
    errors       the cases that ended with an error on every rank, by error class (of the set's
                 lowest rank), and how many of them raised different classes on different ranks,
                 which only ranks refused at submission for different reasons may
                 (docs/failure-semantics.md)
    inconsistent cases that broke the rule (different classes, a wrong result, ...): must be 0
    hangs        cases that outlived the stall limit by fuzzing.HANG_MARGIN_S: must be 0. A hang
                 ends the job (the runtime is stuck); the table is printed first, with the hang
    rss, fds     resident memory and open file descriptors of every rank, after start-up
                 (the runtime, the fuzzer's process sets) and after the last case

``--seed``/``--first`` (or MTRAIN_FUZZ_SEED/MTRAIN_FUZZ_FIRST) replay a run or a part of it.
The stall limit (MTRAIN_STALL_SHUTDOWN_SECONDS) is 1 s unless set: cases whose ranks submit
different names stall by design, and each costs that long.
"""
from __future__ import annotations

import argparse
import os
import time
from types import ModuleType
from typing import Any

from mtrain.launcher.cli.module_files import load_module_file
from repo_helpers import ROOT  # a sibling (repo_helpers.py says why so)

STALL_VARIABLE = "MTRAIN_STALL_SHUTDOWN_SECONDS"


def load_fuzzing() -> ModuleType:
    """tests/mpi/fuzzing.py, from its file (the repository root stays off sys.path)."""
    return load_module_file("mtrain_benchmarks_fuzzing", ROOT / "tests" / "mpi" / "fuzzing.py")


def table(runner: Any, seed: int, first: int, run: int, inconsistent: int, hangs: int,
          seconds: float, resources: "list[tuple[tuple[int, int], tuple[int, int] | None]]") -> str:
    rows = [f"fuzz: seed {seed}, np {runner.size}, cases {first}..{first + run - 1}, stall limit "
            f"{runner.stall_s:g}s, process sets {runner.lists}",
            f"  {'cases':<28}{run:>8}",
            f"  {'  every rank succeeded':<28}{runner.succeeded:>8}",
            f"  {'  every rank raised':<28}{sum(runner.classes.values()):>8}"]
    for name, count in sorted(runner.classes.items(), key=lambda item: -item[1]):
        rows.append(f"  {'    ' + name:<28}{count:>8}")
    rows += [f"  {'distinct error classes':<28}{len(runner.classes):>8}",
             f"  {'  classes differed (allowed)':<28}{runner.mixed:>8}",
             f"  {'inconsistent':<28}{inconsistent:>8}",
             f"  {'hangs':<28}{hangs:>8}",
             f"  {'cases by mode':<28}{'  '.join(f'{m} {c}' for m, c in sorted(runner.modes.items()))}",
             f"  {'wall time':<28}{seconds:>7.0f}s  (slowest case {runner.slowest[1]}: {runner.slowest[0]:.2f}s)",
             "",
             f"  {'rank':<6}{'rss start':>12}{'rss end':>12}{'fds start':>11}{'fds end':>9}"]
    for rank, (start, end) in enumerate(resources):
        rss_end, fds_end = (f"{end[0] / 1024:.1f} MiB", str(end[1])) if end is not None else ("-", "-")
        rows.append(f"  {rank:<6}{start[0] / 1024:>8.1f} MiB{rss_end:>12}{start[1]:>11}{fds_end:>9}")
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", type=int, default=None, help="how many cases (default 10000)")
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--first", type=int, default=None, help="the first case's number")
    parser.add_argument("--show", type=int, default=5, help="print the reports of this many failing cases")
    args = parser.parse_args()
    os.environ.setdefault(STALL_VARIABLE, "1")  # read by init()
    fuzzing = load_fuzzing()
    import mtrain.ringreduce as rr
    rr.init()
    seed, first, cases = fuzzing.settings(10_000)
    seed = args.seed if args.seed is not None else seed
    first = args.first if args.first is not None else first
    cases = args.cases if args.cases is not None else cases
    runner = fuzzing.Runner(seed, float(os.environ[STALL_VARIABLE]))
    start = runner.comm.allgather(fuzzing.resources())
    state = {"run": 0, "inconsistent": 0}
    began = time.monotonic()

    def on_hang() -> None:  # the watchdog's thread, before it ends the job: this rank's view only
        view = [(mine, None) for mine in start]
        print(table(runner, seed, first, state["run"] + 1, state["inconsistent"], 1,
                    time.monotonic() - began, view), flush=True)
    runner.on_hang(on_hang)
    shown = 0
    for number in range(first, first + cases):
        case, outcomes, failure = runner.run_case(number)
        state["run"] += 1
        if failure is not None:
            state["inconsistent"] += 1
            if runner.rank == 0 and shown < args.show:
                shown += 1
                print(fuzzing.report(seed, case, outcomes, failure), flush=True)
        if runner.rank == 0 and state["run"] % 1000 == 0:
            rss, fds = fuzzing.resources()
            print(f"fuzz: {state['run']} cases, {time.monotonic() - began:.0f}s, rank 0: rss {rss / 1024:.1f} MiB, "
                  f"{fds} fds", flush=True)
    seconds = time.monotonic() - began
    end = runner.comm.allgather(fuzzing.resources())
    if runner.rank == 0:
        print(table(runner, seed, first, state["run"], state["inconsistent"], 0, seconds,
                    list(zip(start, end))), flush=True)
    rr.shutdown()


if __name__ == "__main__":
    main()
