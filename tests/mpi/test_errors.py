"""Bad input and mismatched calls: clear errors on every rank, never a hang."""
import sys

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


ABORT_SCRIPT = """
import time, numpy as np, ringreduce as rr
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
