"""Bad input and mismatched calls: clear errors on every rank, never a hang."""
import pickle
import sys
import time

import numpy as np
import pytest
from mpi4py import MPI

import mtrain.ringreduce as rr
from mtrain.ringreduce.core.requests import RequestState
from tests.mpi.expect import raises
from tests.mpi.harness import launch, mpi_test


@mpi_test(nps=(2, 3))
def test_mismatched_calls_fail_on_every_rank_naming_each_side():
    n, me = rr.size(), rr.rank()
    # Different sizes.
    raises(lambda: rr.allreduce(np.zeros(10 + (me == 1), np.float32), name="grad.w"),
            rr.MismatchError, "'grad.w'", "rank 0: allreduce float32[10]", "rank 1: allreduce float32[11]")
    # Different dtypes.
    dtype = np.float64 if me == n - 1 else np.float32
    raises(lambda: rr.allreduce(np.zeros(4, dtype)), rr.MismatchError, "float64[4]", "float32[4]")
    # Different ops.
    raises(lambda: rr.allreduce(np.zeros(4), op=rr.Max if me == 0 else rr.Sum), rr.MismatchError,
            "op=Max", "op=Sum")
    # Different collectives altogether.
    call = (lambda: rr.broadcast(np.zeros(3), 0)) if me == 0 else (lambda: rr.allreduce(np.zeros(3)))
    raises(call, rr.MismatchError, "rank 0: broadcast", "rank 1: allreduce")
    # Different broadcast roots.
    raises(lambda: rr.broadcast(np.zeros(3), root_rank=me % 2), rr.MismatchError, "root_rank=0", "root_rank=1")
    # allgather with different trailing shapes.
    raises(lambda: rr.allgather(np.zeros((2, 3 + me))), rr.MismatchError, "allgather")
    # After all that, the runtime still works.
    assert rr.allreduce(np.full(3, me + 1.0), op=rr.Sum).tolist() == [n * (n + 1) / 2] * 3


@mpi_test(nps=(2, 3))
def test_mismatches_of_every_collective_reach_every_rank():
    # The negotiation is the only cross-rank check: each collective's mismatch must still fail
    # on every rank, naming what each one passed.
    n, me = rr.size(), rr.rank()
    last = me == n - 1
    raises(lambda: rr.reducescatter(np.zeros((n, 2 + last)), name="rs.shape"), rr.MismatchError,
            f"rank 0: reducescatter float64[{n}, 2]", f"rank {n - 1}: reducescatter float64[{n}, 3]")
    raises(lambda: rr.reducescatter(np.zeros(n), op=rr.Max if last else rr.Sum), rr.MismatchError,
            "op=Sum", "op=Max")
    raises(lambda: rr.allgather(np.zeros((me + 1, 2), np.int32 if last else np.float32), name="ag.dtype"),
            rr.MismatchError, "'ag.dtype'", "allgather float32[1, 2]", f"allgather int32[{n}, 2]")
    raises(lambda: rr.alltoall(np.zeros((n, 1 + last))), rr.MismatchError,
            f"alltoall float64[{n}, 1]", f"alltoall float64[{n}, 2]")
    raises(lambda: rr.broadcast_object(me, root_rank=1 if last else 0), rr.MismatchError,
            "broadcast_object root_rank=0", "broadcast_object root_rank=1")
    # Unnamed ops of different kinds meet under one auto-name.
    raises(lambda: rr.barrier() if me == 0 else rr.allgather_object(me), rr.MismatchError,
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
    raises(lambda: rr.allreduce(np.zeros(3, np.complex64)), TypeError, "unsupported dtype complex64")
    raises(lambda: rr.allreduce(np.zeros(3), op=42), ValueError, "unsupported reduction op 42")
    raises(lambda: rr.allreduce(np.zeros(3, np.int32), op=rr.Adasum), TypeError, "Adasum reduces float16")
    raises(lambda: rr.allreduce([1.0, 2.0]), TypeError, "numpy.asarray")
    raises(lambda: rr.allreduce(np.zeros(2, bool), op=rr.Sum), TypeError, "bool")
    raises(lambda: rr.broadcast(np.zeros(3), root_rank=rr.size()), ValueError, "root_rank")
    raises(lambda: rr.alltoall(np.zeros(3), splits=[1] * (rr.size() + 1)), ValueError, "splits")
    raises(lambda: rr.reducescatter(np.ones(())), ValueError, "at least one dimension")
    if rr.size() > 1:
        raises(lambda: rr.alltoall(np.zeros(rr.size() + 1)), ValueError, "divisible")
    raises(lambda: rr.alltoall(np.zeros(3), splits=[0.5] * rr.size()), ValueError, "splits")
    # Pickled in the caller's thread: the call itself fails, on the rank that passed the object.
    raises(lambda: rr.allgather_object(lambda: rr.rank()), (pickle.PicklingError, AttributeError, TypeError))
    # Every rank refused the same calls, so the runtime is still in step.
    assert rr.allgather_object(rr.rank() + 7) == [r + 7 for r in range(rr.size())]
    # Only the root holds the unpicklable object: every rank fails with the root's error class
    # (the root's own error; on the others one naming the root's), none waits forever.
    root = rr.size() - 1
    payload = (lambda: rr.rank()) if rr.rank() == root else None
    with pytest.raises((pickle.PicklingError, AttributeError, TypeError)) as info:
        rr.broadcast_object(payload, root_rank=root)
    classes = rr.allgather_object(type(info.value).__name__)
    assert len(set(classes)) == 1, f"broadcast_object of an unpicklable object raised {classes} on the ranks"
    if rr.rank() != root:
        assert f"rank {root}: " in str(info.value), str(info.value)
    assert rr.broadcast_object([rr.rank(), 3], root_rank=root) == [root, 3]
    # A name that is not a str (the engine thread used to fail on it, ending the runtime).
    raises(lambda: rr.allreduce(np.ones(3), name=5), TypeError, "name must be a str")
    raises(lambda: rr.broadcast(np.ones(3), 0, name=b"w"), TypeError, "name must be a str")
    # An in-place op on a read-only array (the engine thread used to fail writing the result).
    frozen = np.ones(3)
    frozen.flags.writeable = False
    raises(lambda: rr.allreduce_(frozen, name="frozen"), rr.InvalidArgumentError, "read-only")
    raises(lambda: rr.broadcast_(frozen, 0), rr.InvalidArgumentError, "read-only")
    raises(lambda: rr.grouped_allreduce_([np.ones(2), frozen]), rr.InvalidArgumentError, "read-only")
    assert rr.allreduce(frozen, op=rr.Sum, name="frozen").tolist() == [rr.size()] * 3  # out of place: fine
    # Refused twice under one name, then run at once: each waits its turn, none is "already in flight".
    raises(lambda: rr.allreduce_async(np.ones(3, np.int64), name="thrice", op=rr.Adasum), TypeError, "Adasum")
    raises(lambda: rr.allreduce_async(np.ones(3), name="thrice", op="nonsense"), ValueError, "nonsense")
    assert rr.allreduce(np.ones(3), op=rr.Sum, name="thrice").tolist() == [rr.size()] * 3


def _refused_calls(n: int) -> list:
    """(what, the class the refusing rank raises, call(bad, name)): one bad argument each."""
    good = np.arange(2 * n, dtype=np.float32)

    def read_only() -> np.ndarray:
        frozen = good.copy()
        frozen.flags.writeable = False
        return frozen
    unpicklable = (pickle.PicklingError, AttributeError, TypeError)
    return [
        ("dtype", TypeError, lambda bad, name: rr.allreduce(good.astype(np.complex64) if bad else good, name=name)),
        ("a list", TypeError, lambda bad, name: rr.allgather(good.tolist() if bad else good, name=name)),
        ("op", ValueError, lambda bad, name: rr.reducescatter(good, op=42 if bad else rr.Sum, name=name)),
        ("bool op", TypeError, lambda bad, name: rr.grouped_allreduce([good, good > 1 if bad else good], op=rr.Sum,
                                                                       name=name)),
        ("scale", ValueError, lambda bad, name: rr.allreduce_async(good, prescale_factor="x" if bad else 1.0,
                                                                    name=name).wait()),
        ("root", rr.InvalidArgumentError, lambda bad, name: rr.broadcast(good, root_rank=n if bad else 0, name=name)),
        ("splits", ValueError, lambda bad, name: rr.alltoall(good, splits=[-1] + [2] * (n - 2) + [5] if bad
                                                             else [2] * n, name=name)),
        ("0-d", rr.InvalidArgumentError, lambda bad, name: rr.reducescatter(good[0] if bad else good, name=name)),
        ("read-only", rr.InvalidArgumentError, lambda bad, name: rr.allreduce_(read_only() if bad else good.copy(),
                                                                               name=name)),
        ("object", unpicklable, lambda bad, name: rr.allgather_object((lambda: 0) if bad else 0, name=name)),
        ("root's object", unpicklable, lambda bad, name: rr.broadcast_object((lambda: 0) if bad else 0,
                                                                            root_rank=n - 1, name=name)),
    ]


@mpi_test(nps=(2, 3), timeout=90)
def test_arguments_refused_on_one_rank_fail_on_every_rank_with_its_class():
    # The last rank's arguments are refused where it submits; the others submitted the op and used to
    # wait for it forever (or get a StallError). The refusing rank takes the op's name into the
    # negotiation anyway: every rank raises its class, at once, and unnamed ops stay numbered alike.
    n, me = rr.size(), rr.rank()
    bad = me == n - 1
    for what, kind, call in _refused_calls(n):
        for name in (f"refused.{what}", None):
            with pytest.raises(kind) as info:
                call(bad, name)
            classes = rr.allgather_object(type(info.value).__name__)
            assert len(set(classes)) == 1, f"{what} (name {name!r}): the ranks raised {classes}"
            if not bad:
                assert f"rank {n - 1}: " in str(info.value), f"{what}: {info.value}"
            if name is not None:  # a retry under the name at once: held back until the refusal has ended
                got = rr.allreduce(np.full(2, me, np.int64), op=rr.Sum, name=name)
                assert got.tolist() == [n * (n - 1) // 2] * 2, f"{what}: retry gave {got}"
            # unnamed ops still meet: every rank numbered the refused op alike
            assert rr.allreduce(np.full(2, me + 1.0), op=rr.Sum).tolist() == [n * (n + 1) / 2] * 2, what


def _wait_until_reported(handle) -> None:
    """Until this rank's op has gone to the coordinator (its report is in the coordinator's table)."""
    while handle.state is not RequestState.REPORTED:
        time.sleep(0.001)


@mpi_test(nps=(2,), timeout=60, env={"MTRAIN_STALL_SHUTDOWN_SECONDS": "1"})
def test_a_name_that_stalled_is_negotiated_afresh_when_it_comes_late():
    # Rank 0's op 'late' stalls (rank 1 submits 'other'). The coordinator used to keep rank 0's report
    # of it: rank 1 submitting 'late' later completed it, and rank 0's engine, told to run an op it no
    # longer had, failed (KeyError), ending the runtime.
    me = rr.rank()
    raises(lambda: rr.allreduce(np.ones(3), name="late" if me == 0 else "other"), rr.StallError)
    if me == 0:
        MPI.COMM_WORLD.send("stalled", dest=1, tag=22)  # rank 0's 'late' has ended (else rank 1's would join it)
        assert MPI.COMM_WORLD.recv(source=1, tag=23) == "reported"
        handle = rr.allreduce_async(np.full(3, 2.0), op=rr.Sum, name="late")
    else:
        assert MPI.COMM_WORLD.recv(source=0, tag=22) == "stalled"
        handle = rr.allreduce_async(np.ones(3), op=rr.Sum, name="late")
        _wait_until_reported(handle)
        MPI.COMM_WORLD.send("reported", dest=0, tag=23)
    assert rr.synchronize(handle).tolist() == [3.0] * 3


@mpi_test(nps=(2, 3), timeout=60)
def test_a_cached_op_with_new_arguments_on_one_rank_first_is_a_mismatch_everywhere():
    # 'w' is cached. The last rank submits it with a new shape first (a report to the coordinator),
    # the others then with the cached one (a cache bit): the others used to wait on the bit forever,
    # stall limit or not. The coordinator now drops the entry at once, and every rank reports afresh.
    n, me = rr.size(), rr.rank()
    last = n - 1
    for _ in range(2):
        assert rr.allreduce(np.ones(3), op=rr.Sum, name="w").tolist() == [n] * 3
    if me == last:
        handle = rr.allreduce_async(np.ones(4), op=rr.Sum, name="w")
        _wait_until_reported(handle)
        for peer in range(last):
            MPI.COMM_WORLD.send("reported", dest=peer, tag=24)
    else:
        assert MPI.COMM_WORLD.recv(source=last, tag=24) == "reported"
        handle = rr.allreduce_async(np.ones(3), op=rr.Sum, name="w")
    raises(lambda: rr.synchronize(handle), rr.MismatchError, "'w'", "float64[3]", f"rank {last}: allreduce float64[4]")
    assert rr.allreduce(np.ones(3), op=rr.Sum, name="w").tolist() == [n] * 3


@mpi_test(nps=(2, 3), timeout=60)
def test_grouped_ops_of_different_lengths_mismatch_on_every_rank():
    # Rank 0 groups one tensor, the others two: rank 0's 'g.0' used to run with the others' 'g.0'
    # and succeed, while the others waited for a 'g.1' rank 0 never submits. The group's length is
    # now part of what ranks must agree on, and the others' extra part fails with the group at
    # once: the same group again right away meets no leftover of it.
    n, me = rr.size(), rr.rank()
    arrays = [np.ones(3), np.ones(2)][:1 if me == 0 else 2]
    raises(lambda: rr.grouped_allreduce(arrays, op=rr.Sum, name="g"), rr.MismatchError,
            "'g.0'", "rank 0: allreduce float64[3] op=Sum;", "(part 1 of 2)")
    again = rr.grouped_allreduce([np.full(3, me), np.full(2, 10 * me)], op=rr.Sum, name="g")
    total = n * (n - 1) // 2
    assert [a.tolist() for a in again] == [[total] * 3, [10 * total] * 2]


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
    assert "rank 1 raised the uncaught exception above" in result.stderr
    assert "boom from the test" in result.stderr
