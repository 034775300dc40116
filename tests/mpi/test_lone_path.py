"""A steady batch of one host all-reduce runs in the op's own memory (``Dispatcher.execute_lone``).

A training step that reduces one tensor at a time (or a benchmark of one op) repeats a batch of
one op. Once that batch is steady, it is reduced in the user's array (or in the fresh copy an
out-of-place op returns), with no plan and no fusion buffer. These tests check that the path is
taken, and that what it returns is what the general path returns: every dtype the paths reduce,
every op, scaling, odd and one-element sizes, 2-D arrays, and strided in-place views. Data
differ per rank and per element.
"""
import numpy as np

import mtrain.ringreduce as rr
from mtrain.ringreduce import runtime
from tests.mpi.data import OPS, assert_matches, reference, values
from tests.mpi.harness import mpi_test

STEPS = 5  # the first two runs of a name go through the coordinator, then learn the steady batch


def _lone_runs() -> int:
    return rr.engine_stats().lone_runs


@mpi_test(nps=(1, 2, 3))
def test_a_lone_steady_op_gives_the_general_paths_results():
    n, me = rr.size(), rr.rank()
    before = _lone_runs()
    cases = 0
    for dtype in (np.float32, np.float64, np.int32, np.int64, np.float16, np.uint8):
        for op in OPS:
            for shape in ((1,), (4099,), (3, 5)):
                inputs = [values(r, shape, dtype, op) for r in range(n)]
                want = reference(inputs, op)
                name = f"lone.{np.dtype(dtype).name}.{op.name}.{len(shape)}.{shape[0]}"
                for step in range(STEPS):
                    mine = inputs[me].copy()
                    got = rr.allreduce(mine, op=op, name=name)
                    assert got is not mine and np.array_equal(mine, inputs[me]), "the input must stay as it was"
                    assert_matches(got, want, f"{name} step {step}")
                    again = inputs[me].copy()
                    assert rr.allreduce_(again, op=op, name=name + ".in") is again
                    assert_matches(again, want, f"{name} in place, step {step}")
                cases += 1
    lone = _lone_runs() - before
    # Two names per case, STEPS runs each: all but the first two of each are steady when the ranks
    # submit in step (a rank that is ahead falls back to the general path for that op).
    steady = cases * 2 * (STEPS - 2)
    assert lone >= steady // 2, f"only {lone} of {steady} steady ops ran alone"


@mpi_test(nps=(2, 3))
def test_scaling_and_strided_views_on_the_lone_path():
    n, me = rr.size(), rr.rank()
    before = _lone_runs()
    base = [values(r, (6, 7), np.float64) for r in range(n)]
    for step in range(STEPS):
        # Average with both scalings: Horovod's rule, prescale before the sum and postscale / N after.
        got = rr.allreduce(base[me], op=rr.Average, name="lone.scaled", prescale_factor=0.5, postscale_factor=3.0)
        assert_matches(got, reference(base, rr.Sum) * 0.5 * 3.0 / n, f"scaled, step {step}")
        # In place into every other column of a bigger array: the rest of it must not change.
        holder = np.full((6, 14), -7.0)
        holder[:, ::2] = base[me]
        view = holder[:, ::2]
        assert not view.flags.c_contiguous
        assert rr.allreduce_(view, op=rr.Sum, name="lone.strided") is view
        assert_matches(holder[:, ::2], reference(base, rr.Sum), f"strided, step {step}")
        assert (holder[:, 1::2] == -7.0).all(), "the columns between were written"
        # A transposed (Fortran-ordered) array, out of place.
        transposed = base[me].T
        got = rr.allreduce(transposed, op=rr.Max, name="lone.transposed")
        assert_matches(got, reference([b.T for b in base], rr.Max), f"transposed, step {step}")
    assert _lone_runs() - before >= 3 * (STEPS - 2) // 2


@mpi_test(nps=(2, 3))
def test_a_lone_steady_op_of_another_kind_runs_its_own_collective():
    """Only all-reduces run alone: a steady batch of one broadcast, all-gather or reduce-scatter
    runs that collective (run as an all-reduce, it would meet the other ranks' call, or fail)."""
    n, me = rr.size(), rr.rank()
    before = _lone_runs()
    rows = 2 * n + 1  # rows that do not split evenly: the first ``rows % n`` ranks get one more
    base, extra = divmod(rows, n)
    start, share = me * base + min(me, extra), base + (1 if me < extra else 0)
    for step in range(STEPS):
        mine = [values(r, (5, 3), np.float32) + step for r in range(n)]
        got = rr.broadcast(mine[me], root_rank=n - 1, name="lone.broadcast")
        assert np.array_equal(got, mine[n - 1]), step
        got = rr.allgather(mine[me], name="lone.allgather")
        assert np.array_equal(got, np.concatenate(mine)), step
        tall = [values(r, (rows, 3), np.float64) + step for r in range(n)]
        got = rr.reducescatter(tall[me], op=rr.Sum, name="lone.reducescatter")
        assert_matches(got, reference(tall, rr.Sum)[start:start + share], f"reduce-scatter, step {step}")
    assert _lone_runs() == before, "an op of another kind was run as a lone all-reduce"


@mpi_test(nps=(2,))
def test_an_op_that_differs_on_one_rank_leaves_the_lone_path_and_still_agrees():
    """After the lone op is steady, the ranks submit it and another op in opposite orders: the
    batches differ between ranks (a steady cycle on one rank meets another vector), both ops
    still complete with the right values, and the lone path resumes after."""
    n, me = rr.size(), rr.rank()
    x = [values(r, (9,), np.float32) for r in range(n)]
    for _ in range(STEPS):
        assert_matches(rr.allreduce(x[me], op=rr.Sum, name="lone.a"), reference(x, rr.Sum), "warm-up")
    order = ["lone.a", "lone.b"] if me == 0 else ["lone.b", "lone.a"]
    handles = [rr.allreduce_async(x[me] * (2 if name == "lone.b" else 1), op=rr.Sum, name=name) for name in order]
    results = dict(zip(order, map(rr.synchronize, handles)))
    assert_matches(results["lone.a"], reference(x, rr.Sum), "lone.a")
    assert_matches(results["lone.b"], reference(x, rr.Sum) * 2, "lone.b")
    before = rr.engine_stats()
    for _ in range(STEPS):  # and lone again
        assert_matches(rr.allreduce(x[me], op=rr.Sum, name="lone.a"), reference(x, rr.Sum), "after")
    assert rr.engine_stats().lone_runs > before.lone_runs


@mpi_test(nps=(1,), fresh=True)
def test_a_timeline_or_a_zero_size_op_takes_the_general_path():
    """What ``execute_lone`` leaves to ``execute``: an empty array, and any batch while a timeline
    records (its spans come from the general path)."""
    empty = np.zeros((0, 3), np.float32)
    for _ in range(STEPS):
        assert rr.allreduce(empty, op=rr.Sum, name="lone.empty").shape == (0, 3)
    assert _lone_runs() == 0
    x = np.arange(5, dtype=np.float32)
    for _ in range(STEPS):
        rr.allreduce(x, op=rr.Sum, name="lone.x")
    assert _lone_runs() > 0
    engine = runtime.current().engine

    class Recording:  # stands in for a running timeline: the dispatcher only asks whether one runs
        def __getattr__(self, name):
            return lambda *args, **kwargs: None
    engine.timelines.current = Recording()
    try:
        before = _lone_runs()
        for _ in range(STEPS):
            assert np.array_equal(rr.allreduce(x, op=rr.Sum, name="lone.x"), x)
        assert _lone_runs() == before
    finally:
        engine.timelines.current = None
