"""A thread that waits on a handle runs the engine's cycle itself (Engine.assist).

A lone op's wait runs its own cycle when the engine thread is between cycles; the results,
the step meter and the errors are what the engine thread gives. An interrupt that lands in
the middle of such a cycle stops this rank's engine (its ops fail naming why) and goes on
to the program; the next init() starts afresh. Work too big for a waiting thread is left to
the engine thread. Data differ per rank and per element.
"""
import time

import numpy as np
import pytest

import mtrain.ringreduce as rr
from mtrain.ringreduce import runtime
from mtrain.ringreduce.engine.cycle import ASSIST_MAX_OPS
from tests.mpi.data import values
from tests.mpi.harness import mpi_test


@mpi_test(nps=(1, 2, 3))
def test_lone_ops_run_in_the_waiting_thread_with_the_same_results():
    n, me = rr.size(), rr.rank()
    before = rr.engine_stats().assisted_cycles
    for step in range(40):
        for dtype, count in ((np.float32, 1 + step), (np.int64, 4099), (np.float64, 3)):
            inputs = [values(r, (count,), dtype) + step for r in range(n)]
            got = rr.allreduce(inputs[me], op=rr.Sum, name=f"assist.{np.dtype(dtype).name}")
            want = inputs[0].astype(np.float64)
            for other in inputs[1:]:
                want = want + other
            assert np.array_equal(got, want.astype(dtype)), (step, dtype, got[:3], want[:3])
        # Out of place, in place, and through async + synchronize: one path each.
        mine = values(me, (13,), np.float32) * (step + 1)
        handle = rr.allreduce_async_(mine, op=rr.Max, name="assist.max")
        assert rr.synchronize(handle) is mine
        assert np.array_equal(mine, np.max([values(r, (13,), np.float32) * (step + 1) for r in range(n)], axis=0))
    assisted = rr.engine_stats().assisted_cycles - before
    # The engine thread may be in a tick now and then; most waits find it between cycles.
    assert assisted > 10, f"only {assisted} of 160 waits ran their cycle themselves"


# A long cycle time: the engine thread finds the step only when a thread waits (no tick comes
# in the middle of the submissions to take part of them).
@mpi_test(nps=(2, 3), env={"MTRAIN_CYCLE_TIME_MS": "1000"})
def test_a_step_of_many_ops_is_left_to_the_engine_thread():
    """More ops than a waiting thread takes on: the engine thread runs them (and the results are right)."""
    n, me = rr.size(), rr.rank()
    count = ASSIST_MAX_OPS * 3
    for step in range(3):
        arrays = [values(me, (7 + i,), np.float32) + step for i in range(count)]
        before = rr.engine_stats().assisted_cycles
        handles = [rr.allreduce_async_(a, op=rr.Sum, name=f"many.{i}") for i, a in enumerate(arrays)]
        for i, handle in enumerate(handles):
            got = rr.synchronize(handle)
            want = sum(values(r, (7 + i,), np.float32).astype(np.float64) + step for r in range(n))
            assert np.array_equal(got, want.astype(np.float32)), (step, i)
        # The first wait found every op pending or submitted: too many to run itself.
        assert rr.engine_stats().assisted_cycles == before


# A long cycle time: the engine thread sleeps through the test, so the wait runs the cycle.
@mpi_test(nps=(1,), fresh=True, env={"MTRAIN_CYCLE_TIME_MS": "1000"})
def test_an_interrupt_inside_a_waiting_threads_cycle_stops_the_engine_and_goes_on():
    executor = runtime.current().engine.executor

    def interrupted(*args, **kwargs):  # an interrupt that arrives while the op runs
        raise KeyboardInterrupt
    executor.allreduce_flat = interrupted
    with pytest.raises(KeyboardInterrupt):
        rr.allreduce(np.arange(5, dtype=np.float32), op=rr.Sum, name="interrupted")
    del executor.allreduce_flat
    with pytest.raises(rr.EngineError, match="KeyboardInterrupt"):
        rr.allreduce(np.arange(5, dtype=np.float32), op=rr.Sum, name="after")
    rr.shutdown()
    rr.init()
    got = rr.allreduce(np.arange(5, dtype=np.float32), op=rr.Sum, name="afresh")
    assert np.array_equal(got, np.arange(5, dtype=np.float32))


@mpi_test(nps=(1,), fresh=True)
def test_an_engine_that_fails_in_the_middle_of_an_op_fails_that_op_too():
    """The op being run when the engine fails is out of the pending ops already: it fails with
    the engine's error, in a waiting thread's cycle and in the engine thread's, and never hangs."""
    def broken(*args, **kwargs):
        raise RuntimeError("the all-reduce path broke")
    runtime.current().engine.executor.allreduce_flat = broken
    with pytest.raises(rr.EngineError, match="the all-reduce path broke"):
        rr.allreduce(np.arange(5, dtype=np.float32), op=rr.Sum, name="in.a.waiting.thread")
    rr.shutdown()
    rr.init()
    runtime.current().engine.executor.allreduce_flat = broken
    handle = rr.allreduce_async(np.arange(5, dtype=np.float32), op=rr.Sum, name="in.the.engine.thread")
    deadline = time.monotonic() + 30
    while not handle.done():  # nobody waits on it (polling runs no cycle): the engine thread's tick runs it
        assert time.monotonic() < deadline, "the engine thread never ran the op"
        time.sleep(0.001)
    with pytest.raises(rr.EngineError, match="the all-reduce path broke"):
        rr.synchronize(handle)
    rr.shutdown()
