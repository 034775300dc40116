"""A steady batch of one host all-reduce runs in the op's own memory (``Dispatcher.execute_lone``).

A training step that reduces one tensor at a time (or a benchmark of one op) repeats a batch of
one op. Once that batch is steady, it is reduced in the user's array (or in the fresh copy an
out-of-place op returns), with no plan and no fusion buffer. These tests check that the path is
taken for every steady op it is meant for, and that what it returns is what the general path
returns: every dtype the paths reduce, every op, scaling, odd and one-element sizes, 2-D arrays,
and strided in-place views; that what ``execute_lone`` leaves to ``execute`` (another kind of
op, device memory, Adasum, an empty array, a running timeline, the autotuner) is steady and
still never runs alone; and that ranks whose batches differ fall back and still agree. Data
differ per rank and per element.

Most bodies run in engines that never tick on their own (``LOCKSTEP``), so that the counts are
exact: every cycle is then run for a thread that waits on an op (``Engine.assist``, or the engine
thread woken by the waiter), and a rank's steady cycle always meets the other ranks' cycle of
the same op. With the default tick (1 ms), a rank that is ahead may meet another rank's empty
tick and fall back to the general path for that op, now and then; the opposite-order test makes
ranks fall back on purpose, and checks that they do.
"""
import json
import os
import shutil
import tempfile
import threading
import time

import numpy as np
from mpi4py import MPI

import mtrain.ringreduce as rr
from mtrain.ringreduce import runtime
from mtrain.ringreduce.core.ops import Kind
from mtrain.ringreduce.core.requests import Handle, make_request
from mtrain.ringreduce.engine.cycle import EngineStats
from mtrain.ringreduce.transport.backend import DeviceBackend
from tests.mpi import adasum_reference
from tests.mpi.data import OPS, assert_matches, reference, values
from tests.mpi.harness import mpi_test

STEPS = 5
# The first two runs of a name go through the coordinator (the first names it, the second runs
# it by its cache bit and teaches the steady batch); every later run is a steady batch.
FIRST = 2
STEADY = STEPS - FIRST
# A cycle time of a minute: the engine thread ticks only when a thread waits (see the module's note).
LOCKSTEP = {"MTRAIN_CYCLE_TIME_MS": "60000"}


def _since(before: EngineStats) -> EngineStats:
    """What this rank's engine did since ``before``."""
    now = rr.engine_stats()
    return EngineStats(*(a - b for a, b in zip(now, before)))


def _assert_lone(counts: EngineStats, lone: int, what: str) -> None:
    """``lone`` steady batches, every one of them run alone, and no fallback."""
    assert counts.lone_runs == lone and counts.steady_cycles == lone and counts.steady_fallbacks == 0, \
        f"{what}: {lone} steady ops should each have run alone, got {counts}"


def _assert_general(counts: EngineStats, steady: int, what: str) -> None:
    """``steady`` steady batches (so the path was open to them), none of them run alone."""
    assert counts.steady_cycles == steady and counts.steady_fallbacks == 0, \
        f"{what}: {steady} steady cycles expected, got {counts}"
    assert counts.lone_runs == 0, f"{what}: {counts.lone_runs} ops ran alone, none should have ({counts})"


@mpi_test(nps=(1, 2, 3), env=LOCKSTEP)
def test_a_lone_steady_op_gives_the_general_paths_results():
    n, me = rr.size(), rr.rank()
    before = rr.engine_stats()
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
    # Two names per case, STEPS runs each: all but the FIRST of each ran alone (the results of the
    # first runs above are the general path's, of the others the lone path's).
    _assert_lone(_since(before), cases * 2 * STEADY, "every dtype, op and shape")


@mpi_test(nps=(2, 3), env=LOCKSTEP)
def test_scaling_and_strided_views_on_the_lone_path():
    n, me = rr.size(), rr.rank()
    before = rr.engine_stats()
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
    _assert_lone(_since(before), 3 * STEADY, "scaled, strided and transposed")


@mpi_test(nps=(2, 3), env=LOCKSTEP)
def test_a_lone_steady_op_of_another_kind_runs_its_own_collective():
    """Only all-reduces run alone: a steady batch of one broadcast, all-gather or reduce-scatter
    runs that collective (run as an all-reduce, it would meet the other ranks' call, or fail)."""
    n, me = rr.size(), rr.rank()
    before = rr.engine_stats()
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
    _assert_general(_since(before), 3 * STEADY, "a broadcast, an all-gather and a reduce-scatter")


def _wait_until(condition, seconds: float = 30.0) -> bool:
    """Whether ``condition()`` came true within ``seconds`` (polled)."""
    deadline = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.001)
    return True


@mpi_test(nps=(2,), env=LOCKSTEP)
def test_ranks_that_submit_in_opposite_orders_fall_back_and_still_agree():
    """Two steady lone ops, a and b. Rank 0 submits a, rank 1 submits b: each rank's steady
    cycle meets the other's vector, so both fall back (once each), and neither op runs alone.
    Rank 0 submits b once it fell back (a still pending there), rank 1 submits a once b is done:
    its steady batch of a now agrees with rank 0's general cycle of its pending a, so a runs
    alone on rank 1 and by the general path on rank 0, with the same result. After that, the
    lone path runs every op again."""
    n, me = rr.size(), rr.rank()
    x = {name: [values(r, (9,), np.float32) * scale for r in range(n)] for name, scale in (("a", 1), ("b", 2))}
    want = {name: reference(inputs, rr.Sum) for name, inputs in x.items()}
    for name in ("a", "b"):
        for step in range(STEPS):
            assert_matches(rr.allreduce(x[name][me], op=rr.Sum, name=f"lone.{name}"), want[name], f"{name} warm-up")
    before = rr.engine_stats()
    if me == 0:
        first = rr.allreduce_async(x["a"][me], op=rr.Sum, name="lone.a")
        got = {}
        # A thread that waits makes this rank's engine run cycles (LOCKSTEP has no ticks).
        waiter = threading.Thread(target=lambda: got.setdefault("a", rr.synchronize(first)))
        waiter.start()
        fell_back = _wait_until(lambda: rr.engine_stats().steady_fallbacks > before.steady_fallbacks)
        # (Submitted either way, so that rank 1 finishes and a failure here is this rank's alone.)
        got["b"] = rr.allreduce(x["b"][me], op=rr.Sum, name="lone.b")
        waiter.join()
        assert fell_back, f"rank 0's steady batch of a met rank 1's b and did not fall back: {_since(before)}"
        lone = 0  # a ran by the general path here: it was pending when rank 1's a came
    else:
        got = {"b": rr.allreduce(x["b"][me], op=rr.Sum, name="lone.b")}
        assert _since(before).steady_fallbacks == 1, f"rank 1's steady batch of b did not fall back: {_since(before)}"
        got["a"] = rr.allreduce(x["a"][me], op=rr.Sum, name="lone.a")
        lone = 1
    for name in ("a", "b"):
        assert_matches(got[name], want[name], f"lone.{name} in opposite orders")
    counts = _since(before)
    assert counts.steady_fallbacks == 1 and counts.lone_runs == lone and counts.steady_cycles == lone, \
        f"rank {me}: one fallback and {lone} lone runs expected, got {counts}"
    before = rr.engine_stats()
    for step in range(STEPS):  # and every run alone again
        assert_matches(rr.allreduce(x["a"][me], op=rr.Sum, name="lone.a"), want["a"], f"after, step {step}")
    _assert_lone(_since(before), STEPS, "lone.a after the fallback")


@mpi_test(nps=(1, 2), env=LOCKSTEP)
def test_a_timeline_or_a_zero_size_op_takes_the_general_path():
    """What ``execute_lone`` leaves to ``execute``: an empty array, and any batch while a timeline
    records (its spans come from the general path): each op under a timeline is on it, on every
    rank's row, and after ``stop_timeline`` the same op runs alone again."""
    n, me = rr.size(), rr.rank()
    before = rr.engine_stats()
    empty = np.zeros((0, 3), np.float32)
    for _ in range(STEPS):
        assert rr.allreduce(empty, op=rr.Sum, name="lone.empty").shape == (0, 3)
    _assert_general(_since(before), STEADY, "an empty array")

    inputs = [values(r, (5,), np.float32) for r in range(n)]
    want = reference(inputs, rr.Sum)
    before = rr.engine_stats()
    for step in range(STEPS):
        assert_matches(rr.allreduce(inputs[me], op=rr.Sum, name="lone.x"), want, f"before the timeline, step {step}")
    _assert_lone(_since(before), STEADY, "lone.x before the timeline")

    folder = MPI.COMM_WORLD.bcast(tempfile.mkdtemp(prefix="mtrain-lone-") if me == 0 else None, root=0)
    path = os.path.join(folder, "timeline.json")  # every rank names rank 0's file: rank 0 writes it
    rr.start_timeline(path)
    try:
        before = rr.engine_stats()
        for step in range(STEPS):
            assert_matches(rr.allreduce(inputs[me], op=rr.Sum, name="lone.x"), want, f"under the timeline, step {step}")
        _assert_general(_since(before), STEPS, "lone.x under a timeline")
    finally:
        rr.stop_timeline()
    before = rr.engine_stats()
    for step in range(STEPS):
        assert_matches(rr.allreduce(inputs[me], op=rr.Sum, name="lone.x"), want, f"after the timeline, step {step}")
    _assert_lone(_since(before), STEPS, "lone.x after stop_timeline")
    MPI.COMM_WORLD.Barrier()  # every rank's timeline is closed (rank 0's waited for the others')
    if me == 0:
        try:
            with open(path) as f:
                events = json.load(f)  # closed: a whole JSON array
        finally:
            shutil.rmtree(folder)
        pids = [e["pid"] for e in events if e.get("name") == "process_name" and e["args"].get("name") == "lone.x"]
        assert len(pids) == 1, f"lone.x is not one op on the timeline: {pids}"
        for rank in range(n):
            mine = [e["name"] for e in events if e.get("pid") == pids[0] and e.get("tid") == rank and e["ph"] == "B"]
            # Each run under the timeline: its op span and its ring; the runs before and after are not there.
            assert mine.count("ALLREDUCE") == STEPS and mine.count("MPI_ALLREDUCE") == STEPS, (rank, mine)


@mpi_test(nps=(2,), env=LOCKSTEP)
def test_a_steady_adasum_all_reduce_takes_the_general_path():
    """Adasum is not elementwise (each tensor's own dot products and norms, ``_run_ring``): a
    steady batch of one Adasum all-reduce runs by the general path, and gives Adasum's result."""
    n, me = rr.size(), rr.rank()
    per_rank = [adasum_reference.rank_tensors(r, [(4099,)], np.float64) for r in range(n)]
    want = adasum_reference.reference(per_rank)[0]
    # Not the sum (nor the average): a path that reduced it elementwise would not give it.
    assert not np.allclose(want, per_rank[0][0] + per_rank[1][0], rtol=1e-3)
    before = rr.engine_stats()
    for step in range(STEPS):
        got = rr.allreduce(per_rank[me][0], op=rr.Adasum, name="lone.adasum")
        adasum_reference.assert_close(got, want, f"Adasum, step {step}")
        mine = per_rank[me][0].copy()
        assert rr.allreduce_(mine, op=rr.Adasum, name="lone.adasum.in") is mine
        adasum_reference.assert_close(mine, want, f"Adasum in place, step {step}")
    _assert_general(_since(before), 2 * STEADY, "an Adasum all-reduce")


@mpi_test(nps=(2,), env=LOCKSTEP)
def test_a_steady_all_reduce_of_device_memory_takes_the_general_path():
    """An op whose memory is a device's (here host arrays behind a stand-in device backend, as in
    test_staging.py) is for its backend's ring, not for ``execute_lone``'s host reduction."""
    from tests.mpi.test_staging import StandInDevice
    n, me = rr.size(), rr.rank()
    engine = runtime.current().engine
    device = DeviceBackend(StandInDevice(), "stand-in")
    inputs = [values(r, (1001,), np.float32) for r in range(n)]
    before = rr.engine_stats()
    for step in range(STEPS):
        handle = Handle(1, grouped=False, done_cv=engine.done_cv)
        request = make_request(Kind.ALLREDUCE, inputs[me].copy(), "lone.device", handle, 0, op=rr.Sum)
        request.backend = device
        request.signature = request.meta()
        engine.submit([request])
        assert_matches(handle.wait(), reference(inputs, rr.Sum), f"device memory, step {step}")
    _assert_general(_since(before), STEADY, "an all-reduce of device memory")


@mpi_test(nps=(2,), env={**LOCKSTEP, "MTRAIN_AUTOTUNE": "1"})
def test_lone_steady_ops_take_the_general_path_while_the_autotuner_runs():
    """The autotuner scores the bytes ``execute`` reports (``Tuner.note``): while it tunes, a
    steady lone op runs by the general path. (A job's tuning outlasts these few steps.)"""
    n, me = rr.size(), rr.rank()
    inputs = [values(r, (4099,), np.float64) for r in range(n)]
    want = reference(inputs, rr.Sum)
    before = rr.engine_stats()
    for step in range(STEPS):
        assert_matches(rr.allreduce(inputs[me], op=rr.Sum, name="lone.tuned"), want, f"autotuned, step {step}")
        mine = inputs[me].copy()
        assert rr.allreduce_(mine, op=rr.Sum, name="lone.tuned.in") is mine
        assert_matches(mine, want, f"autotuned in place, step {step}")
    _assert_general(_since(before), 2 * STEADY, "lone ops while the autotuner runs")
