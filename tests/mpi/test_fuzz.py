"""The API fuzzer (``tests/mpi/fuzzing.py``) in CI: a bounded run at np 2 and 3.

Every case gives each rank a random submission, the same on every rank or differing on one, or
with a value a user can get wrong; every case must succeed with the reference result on every rank,
or fail with the same error class on every rank within the stall limit, and the job goes on to the
next case. The seed is fixed (``fuzzing.DEFAULT_SEED``); a failure prints it with the case and
every rank's submission. Replay it with

    MTRAIN_FUZZ_SEED=<seed> MTRAIN_FUZZ_FIRST=<case> MTRAIN_FUZZ_CASES=1 python -m pytest -q tests/mpi/test_fuzz.py

(``MTRAIN_FUZZ_FIRST=0 MTRAIN_FUZZ_CASES=<case + 1>`` replays the whole run up to it, for a failure
that needs the runtime's state from earlier cases). The long run is ``benchmarks/fuzz.py``.
"""
import numpy as np

import mtrain.ringreduce as rr
from tests.mpi import fuzzing
from tests.mpi.harness import mpi_test

CASES = 300  # about 10-25 s per job size on the 2-core VM, most of it in the cases that stall
STALL_S = 1.0


@mpi_test(nps=(2, 3), timeout=240, env={"MTRAIN_STALL_SHUTDOWN_SECONDS": str(STALL_S)})
def test_random_submissions_end_alike_on_every_rank():
    seed, first, count = fuzzing.settings(CASES)
    runner = fuzzing.Runner(seed, STALL_S)
    if runner.rank == 0:
        print(f"fuzz: seed {seed}, cases {first}..{first + count - 1}, np {runner.size}", flush=True)
    for number in range(first, first + count):
        case, outcomes, failure = runner.run_case(number)
        if failure is not None:
            if runner.rank == 0:
                print(fuzzing.report(seed, case, outcomes, failure), flush=True)
            runner.comm.Barrier()  # rank 0 has printed the report before any rank ends the job
            raise AssertionError(f"fuzz seed {seed} case {number}: {failure}")
    # Nothing was lost on the way: every set still runs an op, with the right result.
    for ranks, process_set in zip([list(range(runner.size))] + runner.lists, runner.sets):
        if runner.rank in ranks:
            got = rr.allreduce(np.full(3, runner.rank, np.int64), op=rr.Sum, name="fuzz.after",
                               process_set=process_set)
            assert got.tolist() == [sum(ranks)] * 3, f"set {ranks} after the run: {got}"
    # A full run exercises both outcomes (a generator that made every case fail, or pass, would not).
    if count == CASES:
        assert runner.succeeded > count // 5 and len(runner.classes) >= 4, (
            f"seed {seed}: {runner.succeeded} of {count} cases succeeded, error classes {dict(runner.classes)}")
    if runner.rank == 0:
        print(f"fuzz: {count} cases passed; {runner.succeeded} succeeded everywhere, errors "
              f"{dict(runner.classes)}; slowest case {runner.slowest[1]} ({runner.slowest[0]:.2f}s)", flush=True)
