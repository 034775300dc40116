"""allgather, broadcast, reducescatter, alltoall, barrier and the object collectives."""
import numpy as np

import mtrain.ringreduce as rr
from tests.mpi.data import DTYPES, assert_matches, reference, values
from tests.mpi.harness import mpi_test


@mpi_test(nps=(1, 2, 3))
def test_allgather_with_different_first_dimensions():
    n, me = rr.size(), rr.rank()
    for dtype in DTYPES:
        for trailing in [(), (3,), (2, 5)]:
            rows = [(r * 2 + 1) % 4 for r in range(n)]  # 1, 3, 0: one rank sends nothing at n=3
            inputs = [values(r, (rows[r],) + trailing, dtype) + 0 for r in range(n)]
            got = rr.allgather(inputs[me])
            want = np.concatenate(inputs, axis=0)
            assert got.shape == want.shape, f"{dtype} {trailing}: {got.shape} != {want.shape}"
            assert got.tobytes() == want.tobytes(), f"allgather {np.dtype(dtype).name} {trailing}: wrong data"
    # A large one through the ring, and a scalar (gathered as one row each).
    big = [values(r, (300_001 + r,), np.float32) for r in range(n)]
    assert rr.allgather(big[me]).tobytes() == np.concatenate(big).tobytes()
    assert rr.allgather(np.array(me * 10 + 1)).tolist() == [r * 10 + 1 for r in range(n)]


@mpi_test(nps=(1, 2, 3))
def test_broadcast_from_every_root():
    n, me = rr.size(), rr.rank()
    for root in range(n):
        for dtype in DTYPES:
            for shape in [(0,), (1,), (17,), (4, 3)]:
                inputs = [values(r, shape, dtype) for r in range(n)]
                got = rr.broadcast(inputs[me].copy(), root_rank=root)
                assert got.tobytes() == inputs[root].tobytes(), f"broadcast {dtype} {shape} root {root}"
        a = values(me, (5, 7), np.float64)[:, ::2]  # non-contiguous, in place
        rr.broadcast_(a, root_rank=root)
        assert a.tobytes() == values(root, (5, 7), np.float64)[:, ::2].tobytes()
    obj = {"rank": me, "text": "x" * me, "nested": [me, (me,)]}
    for root in range(n):
        assert rr.broadcast_object(obj, root_rank=root) == {"rank": root, "text": "x" * root,
                                                             "nested": [root, (root,)]}
    assert rr.allgather_object(("r", me)) == [("r", r) for r in range(n)]
    rr.barrier()


@mpi_test(nps=(1, 2, 3))
def test_reducescatter_splits_rows_like_horovod():
    n, me = rr.size(), rr.rank()
    for dtype in DTYPES:
        for op in (rr.Sum, rr.Average, rr.Max):
            for shape in [(1,), (2,), (n + 2, 3), (7, 2, 2), (0, 4), (5, 0)]:
                inputs = [values(r, shape, dtype, op) for r in range(n)]
                got = rr.reducescatter(inputs[me].copy(), op=op)
                full = reference(inputs, op)
                base, extra = divmod(shape[0], n)
                lo = me * base + min(me, extra)
                hi = lo + base + (1 if me < extra else 0)
                assert_matches(got, full[lo:hi], f"reducescatter {np.dtype(dtype).name} {op.name} {shape}")


@mpi_test(nps=(1, 2, 3))
def test_alltoall_with_and_without_splits():
    n, me = rr.size(), rr.rank()
    # splits[r] rows go to rank r; row values encode (sender, destination, index).
    splits = [(me + r) % 3 for r in range(n)]
    rows = []
    for dest in range(n):
        rows += [[me * 100 + dest * 10 + k, -1] for k in range(splits[dest])]
    data = np.array(rows, dtype=np.int32).reshape(-1, 2)
    got, received = rr.alltoall(data, splits=splits)
    expect = [[src * 100 + me * 10 + k, -1] for src in range(n) for k in range((src + me) % 3)]
    assert received.tolist() == [(src + me) % 3 for src in range(n)]
    assert got.reshape(-1, 2).tolist() == expect, f"rank {me}: {got.tolist()} != {expect}"
    even = np.arange(n * 2, dtype=np.float64) + 1000 * me
    got = rr.alltoall(even)
    assert got.tolist() == [1000 * src + 2 * me + k for src in range(n) for k in range(2)]
