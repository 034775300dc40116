"""The engine's steady-state path: cached batch plans, one-call packing, grouped completion.

A step that repeats the ops of an earlier one reuses that step's plan (rings and
fusion-buffer views); these tests check that the reuse happens and that it never
changes a result: batches that change every step, odd sizes, strided arrays,
in-place and out-of-place ops and groups mixed in one batch, scaling, and a
mismatch on a name whose plan is cached. Data differ per rank and per element.
"""
import random
import re
import sys

import numpy as np
import pytest
from mpi4py import MPI

import mtrain.ringreduce as rr
from tests.mpi.data import values
from tests.mpi.harness import launch, mpi_test

# Small fusion settings so that a handful of tensors already needs several rings,
# packed and in-place ones together.
SMALL_FUSION = {"MTRAIN_FUSION_THRESHOLD_BYTES": "4096", "MTRAIN_FUSION_INPLACE_MIN_BYTES": "2048"}
ODD_SIZES = [0, 1, 2, 3, 7, 13, 63, 257, 511, 1023, 4099, 100_003]


def _stats() -> rr.EngineStats:
    return rr.engine_stats()


def _wide(rank: int, shape, dtype, salt: int) -> np.ndarray:
    """Small integers (exact in every dtype and in any order of addition), distinct per rank,
    per element and per tensor; as int64."""
    count = int(np.prod(shape)) if shape else 1
    i = np.arange(count, dtype=np.int64)
    span = 16 if np.dtype(dtype).itemsize == 1 else 500
    return (((i * 7 + salt * 13) % span) + rank * 3).reshape(shape)


def _exact(rank: int, shape, dtype, salt: int) -> np.ndarray:
    return _wide(rank, shape, dtype, salt).astype(dtype)


def _sum_over_ranks(shape, dtype, salt: int) -> np.ndarray:
    return sum(_wide(r, shape, dtype, salt) for r in range(rr.size())).astype(dtype)


@mpi_test(nps=(1, 2, 3), env=SMALL_FUSION)
def test_repeated_steps_reuse_one_plan_and_stay_correct():
    me = rr.rank()
    specs = [(f"layer{i}.grad", (size,), dtype) for i, (size, dtype) in
             enumerate(zip(ODD_SIZES, [np.float32, np.float64, np.int32, np.float32] * 3))]
    for step in range(12):
        arrays = [_exact(me, shape, dtype, i + step) for i, (_, shape, dtype) in enumerate(specs)]
        handles = [rr.allreduce_async_(a, op=rr.Sum, name=name) for a, (name, _, _) in zip(arrays, specs)]
        for i, (handle, (name, shape, dtype)) in enumerate(zip(handles, specs)):
            result = rr.synchronize(handle)
            assert result is arrays[i], name  # in place: the caller's own array comes back
            assert np.array_equal(result, _sum_over_ranks(shape, dtype, i + step)), f"{name} step {step}"
    # Which of these ops share a cycle depends on timing (a loaded machine may split a step),
    # but the steps repeat: most batches are ones seen before.
    assert _stats().plans_reused > 0
    # A group reaches the engine in one piece, so its batch is the same every step: planned
    # once, reused by every later step.
    for step in range(8):
        shapes = [(i, shape) for i, (_, shape, dtype) in enumerate(specs) if dtype == np.float32]
        arrays = [_exact(me, shape, np.float32, i + step) for i, shape in shapes]
        results = rr.grouped_allreduce_(arrays, op=rr.Sum, name="group")
        for (i, shape), array, result in zip(shapes, arrays, results):
            assert result is array and np.array_equal(result, _sum_over_ranks(shape, np.float32, i + step))
        if step == 0:
            built, reused = _stats().plans_built, _stats().plans_reused
    stats = _stats()
    assert stats.plans_built == built and stats.plans_reused == reused + 7, (stats, built, reused)


@mpi_test(nps=(1, 2, 3), env=SMALL_FUSION)
def test_batches_that_change_every_step_stay_correct():
    me = rr.rank()
    dtypes = [np.float32, np.float64, np.int64, np.int32, np.float16, np.uint8]
    for step in range(15):
        rng = random.Random(step)  # the same choices on every rank
        count = rng.randint(1, 12)
        specs = []
        for i in range(count):
            # Names recur across steps with other shapes and dtypes (the cache entry changes).
            name = f"t{rng.randint(0, 9)}.{i}"
            if any(name == s[0] for s in specs):
                continue
            shape = rng.choice([(rng.choice(ODD_SIZES),), (3, rng.randint(0, 9)), (), (2, 3, 5)])
            specs.append((name, shape, rng.choice(dtypes), rng.choice(["inplace", "copy"])))
        order = list(range(len(specs)))
        random.Random(step * 100 + me).shuffle(order)  # each rank submits in its own order
        arrays, handles = {}, {}
        for k in order:
            name, shape, dtype, mode = specs[k]
            arrays[k] = _exact(me, shape, dtype, k + step)
            submit = rr.allreduce_async_ if mode == "inplace" else rr.allreduce_async
            handles[k] = submit(arrays[k], op=rr.Sum, name=name)
        for k, (name, shape, dtype, mode) in enumerate(specs):
            before = arrays[k].copy()
            result = rr.synchronize(handles[k])
            expected = _sum_over_ranks(shape, dtype, k + step)
            assert result.dtype == np.dtype(dtype) and result.shape == tuple(shape), name
            assert np.array_equal(result, expected), f"step {step} {name} {dtype} {shape} {mode}"
            if mode == "copy":
                assert result is not arrays[k] and np.array_equal(arrays[k], before), "input changed"


@mpi_test(nps=(1, 2, 3), env=SMALL_FUSION)
def test_in_place_copies_groups_strides_and_scaling_mixed_in_one_batch():
    n, me = rr.size(), rr.rank()
    for step in range(6):
        # Strided views (every other element, a transposed block) reduced in place: the
        # packing must read them in C order and the unpacking must write them back.
        base = _exact(me, (41,), np.float64, step)
        strided = base[::2]
        block = _exact(me, (5, 7), np.float32, step + 1).T
        grouped_inputs = [_exact(me, (size,), np.float32, step + j) for j, size in enumerate([3, 0, 300, 1])]
        grouped_inplace = [_exact(me, (size,), np.float64, step + j) for j, size in enumerate([9, 700])]
        copy_input = _exact(me, (257,), np.float32, step + 5)
        handles = [
            rr.allreduce_async_(strided, op=rr.Sum, name="strided"),
            rr.allreduce_async_(block, op=rr.Sum, name="block"),
            rr.grouped_allreduce_async(grouped_inputs, op=rr.Sum, name="group"),
            rr.grouped_allreduce_async_(grouped_inplace, op=rr.Average, name="group_inplace",
                                        prescale_factor=0.5, postscale_factor=4.0),
            rr.allreduce_async(copy_input, op=rr.Sum, name="copy", postscale_factor=0.25),
            rr.allreduce_async_(_exact(me, (33,), np.int32, step), op=rr.Max, name="max"),
        ]
        assert rr.synchronize(handles[0]) is strided
        assert np.array_equal(strided, _sum_over_ranks((41,), np.float64, step)[::2])
        assert np.array_equal(base[1::2], _exact(me, (41,), np.float64, step)[1::2]), "gaps written"
        assert np.array_equal(rr.synchronize(handles[1]), _sum_over_ranks((5, 7), np.float32, step + 1).T)
        grouped = rr.synchronize(handles[2])
        for j, (got, size) in enumerate(zip(grouped, [3, 0, 300, 1])):
            assert np.array_equal(got, _sum_over_ranks((size,), np.float32, step + j)), f"group {j}"
        got = rr.synchronize(handles[3])
        assert got[0] is grouped_inplace[0] and got[1] is grouped_inplace[1]
        for j, size in enumerate([9, 700]):
            expected = _sum_over_ranks((size,), np.float64, step + j) * 0.5 * 4.0 / n
            assert np.allclose(grouped_inplace[j], expected, rtol=1e-12), f"group_inplace {j}"
        assert np.array_equal(rr.synchronize(handles[4]), _sum_over_ranks((257,), np.float32, step + 5) * 0.25)
        expected_max = np.max([_exact(r, (33,), np.int32, step) for r in range(n)], axis=0)
        assert np.array_equal(rr.synchronize(handles[5]), expected_max)
    # Bit for bit the same on every rank.
    blob = strided.tobytes() + block.tobytes() + b"".join(a.tobytes() for a in grouped_inplace)
    blobs = MPI.COMM_WORLD.allgather(blob)
    assert all(b == blobs[0] for b in blobs)


@mpi_test(nps=(1, 2, 3))
def test_every_supported_dtype_through_a_repeated_fused_batch():
    n, me = rr.size(), rr.rank()
    dtypes = [np.float16, np.float32, np.float64, np.int8, np.int16, np.int32, np.int64,
              np.uint8, np.uint16, np.uint32, np.uint64]
    for step in range(3):
        arrays = [values(me, (11 + k,), dtype) for k, dtype in enumerate(dtypes)]
        handles = [rr.allreduce_async(a, op=rr.Max, name=f"dtype.{np.dtype(d).name}") for a, d in zip(arrays, dtypes)]
        for k, (handle, dtype) in enumerate(zip(handles, dtypes)):
            expected = np.max([values(r, (11 + k,), dtype) for r in range(n)], axis=0)
            assert np.array_equal(rr.synchronize(handle), expected), np.dtype(dtype).name
    flags = [np.array([True, me == 0, False, me >= 0]) for _ in range(2)]
    for _ in range(3):
        got = rr.grouped_allreduce(flags, op=rr.Min, name="flags")
        assert got[0].tolist() == [True, n == 1, False, True]


@mpi_test(nps=(2, 3))
def test_a_mismatch_after_the_plan_was_cached_errors_on_every_rank():
    n, me = rr.size(), rr.rank()
    names = [f"w{i}" for i in range(6)]
    for step in range(5):  # the batch is cached and its plan reused
        handles = [rr.allreduce_async(np.full(8, me + i, np.float32), op=rr.Sum, name=name)
                   for i, name in enumerate(names)]
        for i, handle in enumerate(handles):
            assert rr.synchronize(handle).tolist() == [sum(r + i for r in range(n))] * 8
    assert _stats().plans_reused > 0
    # The last rank changes one tensor's shape: that op fails everywhere, naming both
    # submissions; the rest of the batch still completes.
    shape = 9 if me == n - 1 else 8
    handles = [rr.allreduce_async(np.full(shape if name == "w3" else 8, me, np.float32), op=rr.Sum, name=name)
               for name in names]
    for name, handle in zip(names, handles):
        if name == "w3":
            with pytest.raises(rr.MismatchError) as info:
                rr.synchronize(handle)
            assert "'w3'" in str(info.value) and "float32[9]" in str(info.value)
            assert "float32[8]" in str(info.value)
        else:
            assert rr.synchronize(handle).tolist() == [n * (n - 1) / 2] * 8
    # A dtype change on one rank after more cached steps: the same.
    for _ in range(3):
        rr.allreduce(np.ones(4, np.float32), name="w0")
    with pytest.raises(rr.MismatchError, match="'w0'"):
        rr.allreduce(np.ones(4, np.float64 if me == 0 else np.float32), name="w0")
    # And the name works again once every rank agrees.
    for _ in range(2):
        assert rr.allreduce(np.ones(4, np.float32), op=rr.Sum, name="w0").tolist() == [float(n)] * 4


@mpi_test(nps=(1, 2, 3))
def test_ops_finish_without_anyone_waiting():
    """Submitted ops complete though no thread ever blocks on them (only polls)."""
    import time
    me = rr.size(), rr.rank()
    for step in range(3):
        handles = [rr.allreduce_async(np.arange(5, dtype=np.float64) + i, op=rr.Sum, name=f"p{i}")
                   for i in range(4)]
        deadline = time.monotonic() + 30
        while not all(rr.poll(h) for h in handles):
            assert time.monotonic() < deadline, "ops never finished without a waiter"
            time.sleep(0.001)
        for i, handle in enumerate(handles):
            assert rr.synchronize(handle).tolist() == ((np.arange(5) + i) * rr.size()).tolist()
    del me


# A long cycle time: a burst that repeats the last step is held until all of it is here, so
# on any machine every step after the first two is one whole batch (the steady batch).
STEADY = {"MTRAIN_CYCLE_TIME_MS": "50"}


def _steady_specs():
    """A step of mixed ops: two dtypes (two rings), odd sizes and a zero-size one, in place and
    out of place, a group, and a scaled op."""
    return [("w.a", (257,), np.float32, "inplace"), ("w.b", (0,), np.float32, "inplace"),
            ("w.c", (3, 7), np.float64, "copy"), ("w.d", (1,), np.float32, "inplace"),
            ("w.e", (1023,), np.float64, "inplace"), ("w.f", (2,), np.float32, "group"),
            ("w.g", (13,), np.float32, "scaled")]


def _submit_step(me: int, step: int, order: "list[int]"):
    specs = _steady_specs()
    arrays = {k: _exact(me, specs[k][1], specs[k][2], k + step) for k in range(len(specs))}
    group = [_exact(me, (2,), np.float32, 50 + step), _exact(me, (5,), np.float32, 60 + step)]
    handles = {}
    for k in order:
        name, _, _, mode = specs[k]
        if mode == "inplace":
            handles[k] = rr.allreduce_async_(arrays[k], op=rr.Sum, name=name)
        elif mode == "copy":
            handles[k] = rr.allreduce_async(arrays[k], op=rr.Sum, name=name)
        elif mode == "group":
            handles[k] = rr.grouped_allreduce_async_(group, op=rr.Sum, name=name)
        else:
            handles[k] = rr.allreduce_async_(arrays[k], op=rr.Sum, name=name, prescale_factor=0.5,
                                             postscale_factor=4.0)
    return arrays, group, handles


def _check_step(step: int, arrays, group, handles) -> None:
    for k, (name, shape, dtype, mode) in enumerate(_steady_specs()):
        result = rr.synchronize(handles[k])
        if mode == "group":
            assert result[0] is group[0] and result[1] is group[1], name
            assert np.array_equal(group[0], _sum_over_ranks((2,), np.float32, 50 + step)), f"step {step} {name}"
            assert np.array_equal(group[1], _sum_over_ranks((5,), np.float32, 60 + step)), f"step {step} {name}"
            continue
        expected = _sum_over_ranks(shape, dtype, k + step) * (2.0 if mode == "scaled" else 1.0)
        assert result.shape == shape and result.dtype == np.dtype(dtype), name
        assert np.array_equal(result, expected), f"step {step} {name} ({mode})"
        assert (result is arrays[k]) == (mode != "copy"), name


@mpi_test(nps=(1, 2, 3), env=STEADY)
def test_repeated_steps_run_as_the_steady_batch_in_each_ranks_own_order():
    me = rr.rank()
    # Each rank submits in an order of its own (the same every step): the agreed order of
    # execution is the cache's, so the ranks must still pack alike.
    order = list(range(len(_steady_specs())))
    random.Random(me).shuffle(order)
    for step in range(10):
        _check_step(step, *_submit_step(me, step, order))
    assert _stats().steady_cycles >= 5, _stats()
    # Bit for bit the same everywhere (Sum of the same values, packed in the same order).
    arrays, group, handles = _submit_step(me, 99, order)
    _check_step(99, arrays, group, handles)
    results = [rr.synchronize(handles[k]) for k in sorted(handles)]  # a second wait returns the same
    blob = b"".join(r.tobytes() for r in results if not isinstance(r, list)) + b"".join(g.tobytes() for g in group)
    assert all(b == blob for b in MPI.COMM_WORLD.allgather(blob))


@mpi_test(nps=(2, 3), env=STEADY)
def test_a_steady_batch_another_rank_changes_still_runs_right():
    """Once the batch is steady, the last rank brings something else: an extra op the others
    submit only later, only part of the batch at first, and a shape that differs. Every rank
    still gets the right results (or the same error), and the batch becomes steady again."""
    n, me = rr.size(), rr.rank()
    last = n - 1
    order = list(range(len(_steady_specs())))
    world = MPI.COMM_WORLD  # the test's own signals, apart from the runtime's communicators
    for step in range(4):
        _check_step(step, *_submit_step(me, step, order))
    # An extra op on the last rank only, in the same burst as the batch: the batch runs; the
    # extra op waits until the others submit it (after the batch is done).
    extra = np.full(3, me + 1.0)
    if me == last:
        extra_handle = rr.allreduce_async_(extra, op=rr.Sum, name="w.extra")
    _check_step(4, *_submit_step(me, 4, order))
    if me != last:
        extra_handle = rr.allreduce_async_(extra, op=rr.Sum, name="w.extra")
    assert rr.synchronize(extra_handle).tolist() == [n * (n + 1) / 2] * 3
    # Part of the batch at first on the last rank: that part runs, the rest when it comes.
    if me == last:
        arrays, group, handles = _submit_step(me, 5, order[:3])
        for k in order[:3]:
            rr.synchronize(handles[k])
        world.Barrier()
        more = _submit_step(me, 5, order[3:])
        arrays.update({k: more[0][k] for k in order[3:]})
        group, handles = more[1], {**handles, **more[2]}
    else:
        arrays, group, handles = _submit_step(me, 5, order)
        world.Barrier()
    _check_step(5, arrays, group, handles)
    if me != last:  # they sent the steady batch; the last rank's differed both times
        assert _stats().steady_fallbacks >= 2, _stats().steady_fallbacks
    # A shape that differs on the last rank: that op fails on every rank, the rest completes.
    shape = (258,) if me == last else (257,)
    odd = rr.allreduce_async_(np.ones(shape, np.float32), op=rr.Sum, name="w.a")
    with pytest.raises(rr.MismatchError, match="'w.a'"):
        rr.synchronize(odd)
    steady_before = _stats().steady_cycles
    for step in range(6, 12):
        _check_step(step, *_submit_step(me, step, order))
    assert _stats().steady_cycles > steady_before


STEADY_LEAVER_SCRIPT = """
import numpy as np, mtrain.ringreduce as rr
rr.init()
arrays = [np.full(5, rr.rank() + 1.0) for _ in range(4)]
for step in range(6):
    for h in [rr.allreduce_async_(a, op=rr.Sum, name=f"g{i}") for i, a in enumerate(arrays)]:
        rr.synchronize(h)
steady = rr.engine_stats().steady_cycles
if rr.rank() == rr.size() - 1:
    rr.shutdown()  # leaves while the others submit the steady batch again
    print("left after", steady, "steady cycles")
else:
    try:  # the leaver may be seen while these are submitted, or after
        for h in [rr.allreduce_async_(a, op=rr.Sum, name=f"g{i}") for i, a in enumerate(arrays)]:
            rr.synchronize(h)
    except rr.ShutdownError as e:
        print("got ShutdownError:", e)
    else:
        print("no error")
"""


@pytest.mark.parametrize("nprocs", [2, 3])
def test_a_rank_leaving_while_the_others_run_the_steady_batch_is_named(nprocs):
    result = launch(nprocs, [sys.executable, "-c", STEADY_LEAVER_SCRIPT], timeout=90, env=STEADY)
    assert result.returncode == 0, result.stderr
    steady = [int(s) for s in re.findall(r"left after (\d+) steady cycles", result.stdout)]
    assert steady and steady[0] >= 2, result.stdout
    assert result.stdout.count(f"got ShutdownError: rank(s) [{nprocs - 1}] left the job") == nprocs - 1, \
        result.stdout
