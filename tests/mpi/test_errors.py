"""Bad input and mismatched calls: clear errors on every rank, never a hang."""
import pickle
import sys
import time

import numpy as np
import pytest

import mtrain.ringreduce as rr
from tests.mpi.harness import launch, mpi_test


def _raises(fn, kind, *fragments):
    with pytest.raises(kind) as info:
        fn()
    text = str(info.value)
    for fragment in fragments:
        assert fragment in text, f"{fragment!r} not in error: {text}"
    return text


@mpi_test(nps=(2, 3))
def test_mismatched_calls_fail_on_every_rank_naming_each_side():
    n, me = rr.size(), rr.rank()
    # Different sizes.
    _raises(lambda: rr.allreduce(np.zeros(10 + (me == 1), np.float32), name="grad.w"),
            rr.MismatchError, "'grad.w'", "rank 0: allreduce float32[10]", "rank 1: allreduce float32[11]")
    # Different dtypes.
    dtype = np.float64 if me == n - 1 else np.float32
    _raises(lambda: rr.allreduce(np.zeros(4, dtype)), rr.MismatchError, "float64[4]", "float32[4]")
    # Different ops.
    _raises(lambda: rr.allreduce(np.zeros(4), op=rr.Max if me == 0 else rr.Sum), rr.MismatchError,
            "op=Max", "op=Sum")
    # Different collectives altogether.
    call = (lambda: rr.broadcast(np.zeros(3), 0)) if me == 0 else (lambda: rr.allreduce(np.zeros(3)))
    _raises(call, rr.MismatchError, "rank 0: broadcast", "rank 1: allreduce")
    # Different broadcast roots.
    _raises(lambda: rr.broadcast(np.zeros(3), root_rank=me % 2), rr.MismatchError, "root_rank=0", "root_rank=1")
    # allgather with different trailing shapes.
    _raises(lambda: rr.allgather(np.zeros((2, 3 + me))), rr.MismatchError, "allgather")
    # After all that, the runtime still works.
    assert rr.allreduce(np.full(3, me + 1.0), op=rr.Sum).tolist() == [n * (n + 1) / 2] * 3


@mpi_test(nps=(2, 3))
def test_mismatches_of_every_collective_reach_every_rank():
    # The negotiation is the only cross-rank check: each collective's mismatch must still fail
    # on every rank, naming what each one passed.
    n, me = rr.size(), rr.rank()
    last = me == n - 1
    _raises(lambda: rr.reducescatter(np.zeros((n, 2 + last)), name="rs.shape"), rr.MismatchError,
            f"rank 0: reducescatter float64[{n}, 2]", f"rank {n - 1}: reducescatter float64[{n}, 3]")
    _raises(lambda: rr.reducescatter(np.zeros(n), op=rr.Max if last else rr.Sum), rr.MismatchError,
            "op=Sum", "op=Max")
    _raises(lambda: rr.allgather(np.zeros((me + 1, 2), np.int32 if last else np.float32), name="ag.dtype"),
            rr.MismatchError, "'ag.dtype'", "allgather float32[1, 2]", f"allgather int32[{n}, 2]")
    _raises(lambda: rr.alltoall(np.zeros((n, 1 + last))), rr.MismatchError,
            f"alltoall float64[{n}, 1]", f"alltoall float64[{n}, 2]")
    _raises(lambda: rr.broadcast_object(me, root_rank=1 if last else 0), rr.MismatchError,
            "broadcast_object root_rank=0", "broadcast_object root_rank=1")
    # Unnamed ops of different kinds meet under one auto-name.
    _raises(lambda: rr.barrier() if me == 0 else rr.allgather_object(me), rr.MismatchError,
            "rank 0: barrier", "rank 1: allgather_object")
    # Afterwards every collective still runs.
    assert rr.allgather_object(me * 10 + 1) == [r * 10 + 1 for r in range(n)]
    assert rr.broadcast_object({"from": me}, root_rank=n - 1) == {"from": n - 1}
    got, splits = rr.alltoall(np.arange(n * 2, dtype=np.int64) + 100 * me, splits=[2] * n)
    assert got.tolist() == [100 * r + 2 * me + k for r in range(n) for k in range(2)]
    assert splits.tolist() == [2] * n


@mpi_test(nps=(2, 3))
def test_barrier_waits_for_every_rank():
    me = rr.rank()
    time.sleep(0.3 * me)
    arrived = time.time()
    rr.barrier()
    left = time.time()
    arrivals = rr.allgather_object(arrived)
    assert left >= max(arrivals), f"rank {me} left the barrier at {left} before rank(s) arrived: {arrivals}"


@mpi_test(nps=(1, 2))
def test_bad_arguments_raise_type_and_value_errors():
    _raises(lambda: rr.allreduce(np.zeros(3, np.complex64)), TypeError, "unsupported dtype complex64")
    _raises(lambda: rr.allreduce(np.zeros(3), op=42), ValueError, "unsupported reduction op 42")
    _raises(lambda: rr.allreduce(np.zeros(3), op=rr.Adasum), ValueError, "Adasum is not supported")
    _raises(lambda: rr.allreduce([1.0, 2.0]), TypeError, "numpy.asarray")
    _raises(lambda: rr.allreduce(np.zeros(2, bool), op=rr.Sum), TypeError, "bool")
    _raises(lambda: rr.broadcast(np.zeros(3), root_rank=rr.size()), ValueError, "root_rank")
    _raises(lambda: rr.alltoall(np.zeros(3), splits=[1] * (rr.size() + 1)), ValueError, "splits")
    _raises(lambda: rr.reducescatter(np.ones(())), ValueError, "at least one dimension")
    if rr.size() > 1:
        _raises(lambda: rr.alltoall(np.zeros(rr.size() + 1)), ValueError, "divisible")
    _raises(lambda: rr.alltoall(np.zeros(3), splits=[0.5] * rr.size()), ValueError, "splits")
    # Pickled in the caller's thread: the call itself fails, on the rank that passed the object.
    _raises(lambda: rr.allgather_object(lambda: rr.rank()), (pickle.PicklingError, AttributeError, TypeError))
    # Every rank raised before submitting anything, so the runtime is still in step.
    assert rr.allgather_object(rr.rank() + 7) == [r + 7 for r in range(rr.size())]
    # Only the root holds the unpicklable object: every rank still fails, none waits forever.
    root = rr.size() - 1
    payload = (lambda: rr.rank()) if rr.rank() == root else None
    if rr.rank() == root:
        _raises(lambda: rr.broadcast_object(payload, root_rank=root), (pickle.PicklingError, AttributeError, TypeError))
    else:
        _raises(lambda: rr.broadcast_object(payload, root_rank=root), pickle.PicklingError,
                f"root rank {root} could not pickle its object")
    assert rr.broadcast_object([rr.rank(), 3], root_rank=root) == [root, 3]


ABORT_SCRIPT = """
import time, numpy as np, mtrain.ringreduce as rr
rr.init()
if rr.rank() == 1:
    time.sleep(0.5)
    raise RuntimeError("boom from the test")
rr.allreduce(np.ones(10))  # the other ranks wait here for rank 1, which never comes
"""


@pytest.mark.parametrize("nprocs", [2, 3])
def test_uncaught_exception_in_one_rank_aborts_the_job(nprocs):
    result = launch(nprocs, [sys.executable, "-c", ABORT_SCRIPT], timeout=60)
    assert result.returncode != 0
    assert "rank 1 raised an uncaught exception" in result.stderr
    assert "boom from the test" in result.stderr
