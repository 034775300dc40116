"""All-reduce against a float64 reference, across dtypes, ops, shapes and job sizes."""
import os

import numpy as np
from mpi4py import MPI

import mtrain.ringreduce as rr
from mtrain.ringreduce.transport import ring
from mtrain.ringreduce import runtime
from mtrain.ringreduce.transport import shm
from tests.mpi.data import DTYPES, OPS, assert_matches, reference, values
from tests.mpi.harness import mpi_test


def _shapes(n: int):
    # 0, 1, fewer than the ranks, primes, multi-dimensional (a few KiB at most: the sizes that
    # cross the ring's segments and the shared-memory stripes are test_allreduce_past_segments_and_stripes').
    return [(0,), (1,), (max(n - 1, 1),), (7,), (13,), (101,), (4099,), (3, 5, 7), (2, 0, 3)]


def check_identical_everywhere(result: np.ndarray, what: str) -> None:
    blobs = MPI.COMM_WORLD.allgather(result.tobytes())
    for r, blob in enumerate(blobs):
        assert blob == blobs[0], f"{what}: rank {r}'s result differs from rank 0's bit for bit"


@mpi_test(nps=(1, 2, 3))
def test_allreduce_every_dtype_op_and_shape():
    n, me = rr.size(), rr.rank()
    for dtype in DTYPES:
        for op in OPS:
            for shape in _shapes(n):
                what = f"allreduce {np.dtype(dtype).name} {op.name} shape {shape} np={n} rank {me}"
                inputs = [values(r, shape, dtype, op) for r in range(n)]
                mine = inputs[me].copy()
                result = rr.allreduce(mine, op=op)
                assert np.array_equal(mine, inputs[me]), f"{what}: input was modified"
                assert result.dtype == np.dtype(dtype), f"{what}: dtype became {result.dtype}"
                assert_matches(result, reference(inputs, op), what)
                check_identical_everywhere(result, what)


# The same body on the ring (on one host auto would take shared memory) with the latency
# path off (the ring runs even for tiny buffers) and tiny segments, so the segment pipeline
# wraps its scratch buffers many times.
test_allreduce_ring_only_small_segments = mpi_test(
    nps=(2, 3), env={"MTRAIN_ALLREDUCE_ALGORITHM": "ring", "MTRAIN_SMALL_ALLREDUCE_BYTES": "0",
                     "MTRAIN_RING_SEGMENT_BYTES": "24"},
)(test_allreduce_every_dtype_op_and_shape.rank_body)


# One integer and one float dtype of every item size (and bfloat16): where a segment or a
# stripe ends, in elements, depends on the item size; each dtype's arithmetic is checked on
# every op by test_allreduce_every_dtype_op_and_shape.
LARGE_DTYPES = [d for d in DTYPES if np.dtype(d).name in
                ("int8", "float16", "bfloat16", "int32", "float32", "uint64", "float64")]


def _count_past_segments_and_stripes(dtype, n: int, segment_bytes: int, stripe_bytes: int) -> int:
    """An element count of a few MiB whose every ring chunk at `n` ranks holds two whole
    segments and part of a third, and that fills one shared-memory stripe and part of
    another: odd and not a multiple of 3, so the chunks and the stripe's pieces come out uneven."""
    itemsize = np.dtype(dtype).itemsize
    count = max(n * (2 * segment_bytes + segment_bytes // 4), stripe_bytes + stripe_bytes // 8) // itemsize
    while count % 2 == 0 or count % 3 == 0:
        count += 1
    return count


@mpi_test(nps=(1, 2, 3), timeout=240)
def test_allreduce_past_segments_and_stripes():
    """Every op on a few MiB at the default segment and stripe sizes, on the path the job
    takes: shared memory on one host (MTRAIN_ALLREDUCE_ALGORITHM=ring: the ring)."""
    n, me = rr.size(), rr.rank()
    executor = runtime.current().engine.executor
    forced = os.environ.get("MTRAIN_ALLREDUCE_ALGORITHM", "auto")
    expected_path = "ring" if forced == "ring" or n == 1 else "shm"
    assert executor.allreduce_path == expected_path, (forced, n, executor.allreduce_path)
    # The defaults are what runs: neither size is set here.
    assert "MTRAIN_RING_SEGMENT_BYTES" not in os.environ and "MTRAIN_SHM_STRIPE_BYTES" not in os.environ
    segment_bytes, stripe_bytes = executor.segment_bytes, shm.DEFAULT_STRIPE_BYTES
    assert segment_bytes == ring.DEFAULT_SEGMENT_BYTES
    for dtype in LARGE_DTYPES:
        count = _count_past_segments_and_stripes(dtype, n, segment_bytes, stripe_bytes)
        plain = [values(r, (count,), dtype) for r in range(n)]  # every op's data but Product's
        for op in OPS:
            inputs = [values(r, (count,), dtype, op) for r in range(n)] if op == rr.Product else plain
            what = f"allreduce {np.dtype(dtype).name} {op.name} count {count} path {expected_path} np={n} rank {me}"
            mine = inputs[me].copy()
            result = rr.allreduce(mine, op=op)
            assert np.array_equal(mine, inputs[me]), f"{what}: input was modified"
            assert_matches(result, reference(inputs, op), what)
            check_identical_everywhere(result, what)


test_allreduce_past_segments_on_the_ring = mpi_test(
    nps=(2, 3), timeout=240, env={"MTRAIN_ALLREDUCE_ALGORITHM": "ring"},
)(test_allreduce_past_segments_and_stripes.rank_body)


@mpi_test(nps=(1, 2, 3))
def test_allreduce_large_buffers():
    n, me = rr.size(), rr.rank()
    for dtype, count in [(np.float32, (1 << 20) + 3), (np.float64, 655_357), (np.int32, (1 << 19) + 1)]:
        for op in (rr.Sum, rr.Average, rr.Max):
            what = f"allreduce {np.dtype(dtype).name} {op.name} count {count} np={n}"
            inputs = [values(r, (count,), dtype, op) for r in range(n)]
            result = rr.allreduce(inputs[me].copy(), op=op)
            assert_matches(result, reference(inputs, op), what)
            check_identical_everywhere(result, what)
    # Scaling on the ring path (Average's division and the postscale are applied to each
    # rank's own chunk, segment by segment, before the all-gather).
    inputs = [values(r, (655_357,), np.float64) for r in range(n)]
    got = rr.allreduce(inputs[me], op=rr.Average, prescale_factor=0.25, postscale_factor=3.0)
    assert_matches(got, reference(inputs, rr.Average) * 0.75, f"scaled Average np={n}")
    check_identical_everywhere(got, "scaled Average")


@mpi_test(nps=(1, 2, 3))
def test_allreduce_in_place_noncontiguous_and_scaling():
    n, me = rr.size(), rr.rank()
    base = [values(r, (6, 10), np.float64) for r in range(n)]
    # In place on a contiguous array.
    a = base[me].copy()
    out = rr.allreduce_(a, op=rr.Sum)
    assert out is a
    assert_matches(a, reference(base, rr.Sum), "allreduce_ in place")
    # A strided view: handled (copied internally), result written back into the view.
    holder = base[me].copy()
    view = holder[:, ::3]
    rr.allreduce_(view, op=rr.Sum)
    assert_matches(view, reference([b[:, ::3] for b in base], rr.Sum), "allreduce_ on a strided view")
    assert_matches(holder[:, 1::3], base[me][:, 1::3].astype(np.float64), "untouched columns")
    # Fortran order input, out-of-place.
    f = np.asfortranarray(base[me])
    assert_matches(rr.allreduce(f, op=rr.Max), reference(base, rr.Max), "allreduce of Fortran-order")
    # Pre/post scaling: sum(x * 0.5) * 3.
    got = rr.allreduce(base[me], op=rr.Sum, prescale_factor=0.5, postscale_factor=3.0)
    assert_matches(got, reference(base, rr.Sum) * 1.5, "allreduce with pre/post scaling")
    # bool: Min is logical and, Max logical or.
    flags = [np.array([True, r % 2 == 0, False, r == 0]) for r in range(n)]
    assert rr.allreduce(flags[me], op=rr.Min).tolist() == np.logical_and.reduce(flags).tolist()
    assert rr.allreduce(flags[me], op=rr.Max).tolist() == np.logical_or.reduce(flags).tolist()


@mpi_test(nps=(1, 2, 3))
def test_ring_over_a_layout_of_many_buffers_equals_one_contiguous_buffer():
    from mtrain.ringreduce.transport import ring
    from mtrain.ringreduce.transport.backend import NumpyBackend
    n, me = rr.size(), rr.rank()
    comm = MPI.COMM_WORLD.Dup()
    backend = NumpyBackend()
    sizes = [0, 1, 7, 0, 1000, 3, 4099, 2, n]  # boundaries fall inside chunks and segments
    for op in (rr.Sum, rr.Average, rr.Max):
        for segment_bytes in (24, 4096, 1 << 20):
            parts = [values(me, (k,), np.float64, op) + i for i, k in enumerate(sizes)]
            whole = np.concatenate(parts)
            ring.allreduce(comm, ring.Layout(parts), op, backend, segment_bytes, small_bytes=0)
            ring.allreduce(comm, whole, op, backend, segment_bytes, small_bytes=0)
            got = np.concatenate(parts)
            assert got.tobytes() == whole.tobytes(), f"{op.name} seg {segment_bytes}: layout != contiguous"
            want = reference([np.concatenate([values(r, (k,), np.float64, op) + i for i, k in enumerate(sizes)])
                              for r in range(n)], op)
            assert_matches(got, want, f"layout allreduce {op.name} seg {segment_bytes}")
        # Small enough for the gather path: a layout is packed and reduced in rank order,
        # so every element gets the same bits as when its buffer is reduced on its own.
        rng = np.random.default_rng(me)  # inexact sums: association would show in the bits
        small = [rng.standard_normal(k) * 10.0 ** rng.integers(-3, 4, k) for k in (3, 0, 5, 1, 2, 9)]
        alone = [p.copy() for p in small]
        ring.allreduce(comm, ring.Layout(small), op, backend, postscale=0.5)
        for i, p in enumerate(alone):
            ring.allreduce(comm, p, op, backend, postscale=0.5)
            assert p.tobytes() == small[i].tobytes(), f"{op.name}: small part {i} depends on its group"
    comm.Free()
