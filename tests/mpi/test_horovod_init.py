"""Horovod's ``hvd.init(comm=..., process_sets=...)`` in real jobs: the job on a sub-communicator
(an mpi4py one, or a list of COMM_WORLD ranks in its own order), bad ``comm`` values, static
process sets given at init, and ``HOROVOD_DYNAMIC_PROCESS_SETS=0`` refusing sets added later."""
import sys

import numpy as np
import pytest

import mtrain.ringreduce as rr
from tests.mpi.expect import raises
from tests.mpi.harness import launch, mpi_test

# Each rank's data: distinct per rank and per element, an odd size (7), so a sum over the wrong
# ranks, or in the wrong order for an allgather, gives other numbers.
SPLIT_SCRIPT = """
import numpy as np
from mpi4py import MPI
import mtrain.ringreduce as rr
world = MPI.COMM_WORLD
me, n = world.Get_rank(), world.Get_size()
sub = world.Split(color=me % 2, key=me)
rr.init(comm=sub)
same = [r for r in range(n) if r % 2 == me % 2]
assert (rr.rank(), rr.size()) == (same.index(me), len(same)), (rr.rank(), rr.size(), same)
assert (rr.local_rank(), rr.local_size()) == (same.index(me), len(same))  # one host
assert (rr.cross_rank(), rr.cross_size()) == (0, 1)
assert rr.global_process_set.ranks == list(range(len(same)))
def data(r):
    return (r + 1) * 1000.0 + np.arange(7) * (r + 2)
got = rr.allreduce(data(me), op=rr.Sum, name="g")
assert np.array_equal(got, sum(data(r) for r in same)), (me, got)
gathered = rr.allgather(np.full((me + 1, 2), me, dtype=np.int64), name="ag")
assert gathered[:, 0].tolist() == [r for r in same for _ in range(r + 1)], (me, gathered)
# root_rank names a rank of the communicator init() was given: its last one here.
assert rr.broadcast(data(me), root_rank=len(same) - 1, name="bc").tolist() == data(same[-1]).tolist()
rr.shutdown()
print("split ok", me, flush=True)
"""

# comm=[n-1, 0]: Horovod's MPI_Group_incl keeps the list's order, so COMM_WORLD's last rank is
# rank 0; a rank outside the list does not call init() (Horovod's ranks outside fall back to
# COMM_WORLD and hang; mtrain refuses them, LIST_OUTSIDER_SCRIPT).
LIST_SCRIPT = """
import numpy as np
from mpi4py import MPI
import mtrain.ringreduce as rr
world = MPI.COMM_WORLD
me, n = world.Get_rank(), world.Get_size()
order = [n - 1, 0]
if me in order:
    rr.init(comm=order)
    assert (rr.rank(), rr.size()) == (order.index(me), 2), (me, rr.rank(), rr.size())
    got = rr.allreduce((me + 1) * 100.0 + np.arange(5) * (me + 3), op=rr.Sum, name="g")
    assert np.array_equal(got, sum((r + 1) * 100.0 + np.arange(5) * (r + 3) for r in order)), got
    gathered = rr.allgather(np.array([me, me]), name="ag")
    assert gathered.tolist() == [n - 1, n - 1, 0, 0], gathered  # in the list's order
    assert rr.broadcast(np.array([float(me)] * 3), root_rank=0, name="bc").tolist() == [n - 1.0] * 3
    rr.shutdown()
world.Barrier()
rr.init(comm=[])  # Horovod's empty list: every rank
assert (rr.rank(), rr.size()) == (me, n)
assert rr.allreduce(np.array([me + 1.0]), op=rr.Sum).tolist() == [n * (n + 1) / 2]
rr.shutdown()
print("list ok", me, flush=True)
"""

BAD_COMM_SCRIPT = """
from mpi4py import MPI
import mtrain.ringreduce as rr
me, n = MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size()
def refused(comm, words):
    try:
        rr.init(comm=comm)
    except ValueError as error:
        assert words in str(error), error
    else:
        raise AssertionError(f"init(comm={comm!r}) was accepted")
    assert not rr.is_initialized()
refused("0,1", "list of integer ranks")
refused(1.5, "list of integer ranks")
refused([0, 0.5], "list of integer ranks")
refused(MPI.COMM_NULL, "not in the communicator")
refused([0, 0], "distinct ranks")
refused([0, n], "distinct ranks")
refused([r for r in range(n) if r != me], f"rank {me} is not in")
print("bad comm ok", me, flush=True)
"""


@pytest.mark.parametrize("nprocs", [2, 3])
def test_init_on_an_mpi4py_sub_communicator_runs_the_job_there(nprocs):
    """horovod/common/basics.py init(comm=MPI.Comm): the communicator is the job (Horovod dups it,
    mpi/mpi_context.cc); rank, size, local and cross ranks are its own; split by parity, the
    two halves run side by side."""
    result = launch(nprocs, [sys.executable, "-c", SPLIT_SCRIPT], timeout=90)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert result.stdout.count("split ok") == nprocs


@pytest.mark.parametrize("nprocs", [2, 3])
def test_init_on_a_list_of_ranks_keeps_the_lists_order(nprocs):
    """horovod/common/basics.py init(comm=[ranks]) and mpi/mpi_context.cc (MPI_Group_incl in the
    list's order, MPI_Comm_create_group); an empty list is COMM_WORLD (basics.py: None -> [])."""
    result = launch(nprocs, [sys.executable, "-c", LIST_SCRIPT], timeout=90)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert result.stdout.count("list ok") == nprocs


@pytest.mark.parametrize("nprocs", [2, 3])
def test_a_bad_comm_is_a_value_error_before_anything_starts(nprocs):
    """horovod/common/basics.py: "Invalid type of argument comm" is a ValueError; a rank outside
    the list, or holding MPI.COMM_NULL, is refused with one line instead of hanging."""
    result = launch(nprocs, [sys.executable, "-c", BAD_COMM_SCRIPT], timeout=90)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert result.stdout.count("bad comm ok") == nprocs


def _set_data(me: int) -> np.ndarray:
    return (me + 1) * 10.0 + np.arange(3) * (me + 5)


@mpi_test(nps=(2, 3), env={"HOROVOD_DYNAMIC_PROCESS_SETS": "0"})
def test_static_sets_given_at_init_and_adding_later_raises():
    """horovod/common/process_sets.py and basics.py (_add_process_set_impl /
    _remove_process_set_impl): with HOROVOD_DYNAMIC_PROCESS_SETS=0 the sets given to
    init(process_sets=[...]) are the job's; add_process_set and remove_process_set raise
    ValueError("Set HOROVOD_DYNAMIC_PROCESS_SETS=1 ..."). test/parallel/test_process_sets_static.py:
    a set listed twice (ranks in any order) is a ValueError, the others stay registered."""
    n, me = rr.size(), rr.rank()
    first, rest = rr.ProcessSet([0]), rr.ProcessSet(list(range(n - 1, 0, -1)))  # ranks in any order
    rr.init(process_sets=[first, rest])
    assert (first.process_set_id, rest.process_set_id) == (1, 2)
    assert rest.ranks == list(range(1, n))
    mine = first if me == 0 else rest
    got = rr.allreduce(_set_data(me), op=rr.Sum, process_set=mine)
    assert np.array_equal(got, sum(_set_data(r) for r in mine.ranks)), got
    raises(lambda: rr.add_process_set([0, n - 1]), ValueError, "HOROVOD_DYNAMIC_PROCESS_SETS=1")
    raises(lambda: rr.remove_process_set(rest), ValueError, "HOROVOD_DYNAMIC_PROCESS_SETS=1")
    assert rest.process_set_id == 2 and rr.remove_process_set(rr.global_process_set) is False
    # Still there, and still usable, after the refusals.
    assert np.array_equal(rr.allreduce(_set_data(me), op=rr.Max, process_set=mine),
                          _set_data(max(mine.ranks)))
    # [n-1] is `rest` at np 2 (id 2), a new set at np 3 (id 3); listed twice, the second is refused.
    twin_a, again, twin_b = rr.ProcessSet([n - 1]), rr.ProcessSet([0]), rr.ProcessSet([n - 1])
    raises(lambda: rr.init(process_sets=[twin_a, again, twin_b]), ValueError, "entry number 2 is a duplicate")
    assert (twin_a.process_set_id, again.process_set_id, twin_b.process_set_id) == (2 if n == 2 else 3, 1, None)
    if twin_a.included():
        assert np.array_equal(rr.allreduce(_set_data(me), op=rr.Sum, process_set=twin_a), _set_data(n - 1))


@mpi_test(nps=(2, 3), env={"HOROVOD_DYNAMIC_PROCESS_SETS": "0"})
def test_process_sets_dynamic_at_init_allows_adding_later():
    """horovod/common/basics.py: init(process_sets="dynamic") (any case) turns dynamic sets on
    whatever HOROVOD_DYNAMIC_PROCESS_SETS says; here on the running job (the harness's init())."""
    n, me = rr.size(), rr.rank()
    rr.init(process_sets="Dynamic")
    wanted = [n - 1, 0] if n > 2 else [n - 1]  # not every rank: that is the global set
    pair = rr.add_process_set(wanted)
    assert pair.ranks == sorted(wanted) and pair.process_set_id == 1
    if pair.included():
        got = rr.allreduce(_set_data(me), op=rr.Sum, process_set=pair)
        assert np.array_equal(got, sum(_set_data(r) for r in wanted)), got
    assert rr.remove_process_set(pair) and pair.process_set_id is None
