"""Process sets over a job's life: init() with a communicator or with sets added later, shutdown,
a program that leaves without shutdown, the thread level sets need, and private sets."""
import sys
import time

import numpy as np
import pytest
from mpi4py import MPI

import mtrain.ringreduce as rr
from tests.mpi.data import values
from tests.mpi.harness import launch, mpi_test
from tests.mpi.expect import raises
from tests.mpi.process_set_helpers import engine_threads, register_sets, set_lists, threads_seen, wait_op


# -- init forms, shutdown and exit ---------------------------------------------------------------


COMM_SCRIPT = """
import numpy as np
from mpi4py import MPI
import mtrain.ringreduce as rr
world = MPI.COMM_WORLD
me, n = world.Get_rank(), world.Get_size()
sub = world.Split(color=me % 2, key=me)
ps = rr.ProcessSet(sub)
rr.init(world, process_sets=[ps])
same = [r for r in range(n) if r % 2 == me % 2]
assert ps.ranks == same, ps
assert ps.included() and ps.rank() == same.index(me) and ps.size() == len(same)
ids = world.allgather(ps.process_set_id)
assert all((ids[a] == ids[b]) == (a % 2 == b % 2) for a in range(n) for b in range(n)), ids
assert (ids[me] == 0) == (len(same) == n), ids
got = rr.allreduce(np.array([me, 10.0 * me + 1]), op=rr.Sum, process_set=ps)
assert got.tolist() == [sum(same), sum(10.0 * r + 1 for r in same)], got
assert rr.allgather(np.full((me + 1,), me), process_set=ps).tolist() == [r for r in same for _ in range(r + 1)]
assert rr.broadcast(np.full(2, me), root_rank=same[-1], process_set=ps).tolist() == [same[-1]] * 2
assert rr.allgather_object(me) == list(range(n))
print("comm set ok", me, flush=True)
"""

DYNAMIC_SCRIPT = """
import numpy as np
from mpi4py import MPI
import mtrain.ringreduce as rr
rr.init(process_sets="dynamic")
me, n = rr.rank(), rr.size()
assert rr.global_process_set.ranks == list(range(n))
wanted = [n - 1, 0] if n > 2 else [n - 1]
ps = rr.add_process_set(wanted)
assert ps.ranks == sorted(wanted) and ps.process_set_id == 1
if ps.included():
    got = rr.allreduce(np.array([me + 0.5]), process_set=ps)
    assert got.tolist() == [sum(wanted) / len(wanted) + 0.5], got
assert rr.remove_process_set(ps)
print("dynamic ok", me, flush=True)
"""


@pytest.mark.parametrize("nprocs", [1, 3])
def test_init_with_a_set_from_a_split_communicator(nprocs):
    result = launch(nprocs, [sys.executable, "-c", COMM_SCRIPT], timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.count("comm set ok") == nprocs


@pytest.mark.parametrize("nprocs", [2, 3])
def test_init_dynamic_then_add(nprocs):
    result = launch(nprocs, [sys.executable, "-c", DYNAMIC_SCRIPT], timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.count("dynamic ok") == nprocs


@mpi_test(nps=(1, 3))
def test_shutdown_stops_every_engine_and_forgets_the_sets():
    n, me = rr.size(), rr.rank()
    sets = register_sets()
    old_ids = [ps.process_set_id for ps in sets]
    mine = sum(1 for ranks in set_lists(n) if me in ranks and len(ranks) < n)
    assert engine_threads() == 1 + mine
    MPI.COMM_WORLD.Barrier()  # every rank has counted before any shuts down
    rr.shutdown()
    assert engine_threads() == 0
    for ps, old in zip(sets, old_ids):  # the sets went with the runtime; the global set stays
        assert ps.process_set_id == (0 if old == 0 else None), ps
    assert rr.global_process_set.process_set_id == 0
    rr.init()
    # A set from before the shutdown is gone, even when a new set now has its old id.
    added = rr.add_process_set([0]) if n > 1 else None
    if added is not None and me == 0:
        assert added.process_set_id == old_ids[0]  # the id is reused ...
        stale = rr.ProcessSet(set_lists(n)[0])
        stale.process_set_id = old_ids[0]
        # ... but a [0, 2] set holding that id must not run on [0]:
        raises(lambda: rr.allreduce(np.ones(2), process_set=stale), rr.InvalidArgumentError, "not registered")
        raises(lambda: rr.allreduce(np.ones(2), process_set=sets[0]), rr.InvalidArgumentError, "not registered")
    if n > 1:
        rr.init(process_sets=sets)  # registered afresh, it works again
        if sets[0].included():
            assert rr.allreduce(np.ones(2), op=rr.Sum, process_set=sets[0]).tolist() == [2, 2]


EXIT_SCRIPT = """
import sys, numpy as np, mtrain.ringreduce as rr
rr.init()
me, n = rr.rank(), rr.size()
pair = rr.add_process_set([0, n - 1]) if n > 1 else rr.global_process_set
single = rr.add_process_set([1]) if n == 3 else None
for i in range(20):
    if pair.included():
        rr.allreduce(np.ones(5) * i, process_set=pair)
    if single is not None and single.included():
        rr.allreduce(np.ones(5) * i, process_set=single)
    rr.allreduce(np.ones(3))
if sys.argv[1] == "abandon" and me == 0:
    rr.allreduce_async(np.ones(3), name="never.matched", process_set=pair)  # left in flight at exit
rr.allreduce(np.ones(3), name="last")  # no rank leaves before rank 0 has submitted 'never.matched'
print("leaving", me, flush=True)
"""


@pytest.mark.parametrize("nprocs", [1, 3])
@pytest.mark.parametrize("how", ["clean", "abandon"])
def test_a_program_with_sets_exits_zero_without_shutdown(nprocs, how):
    start = time.monotonic()
    result = launch(nprocs, [sys.executable, "-c", EXIT_SCRIPT, how], timeout=90)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.count("leaving") == nprocs
    assert time.monotonic() - start < 60


THREAD_LEVEL_SCRIPT = """
import mpi4py
mpi4py.rc.thread_level = "serialized"
import numpy as np
import mtrain.ringreduce as rr
rr.init()
try:
    rr.add_process_set([0])
except rr.InvalidArgumentError as error:
    assert "MPI_THREAD_MULTIPLE" in str(error), error
    print("refused", rr.rank(), flush=True)
assert rr.allreduce(np.ones(2), op=rr.Sum).tolist() == [rr.size()] * 2
"""


def test_sets_need_thread_multiple_and_say_so_on_every_rank():
    result = launch(2, [sys.executable, "-c", THREAD_LEVEL_SCRIPT], timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.count("refused") == 2, result.stdout + result.stderr


@mpi_test(nps=(3,))
def test_private_sets_are_made_by_their_members_alone_and_kept_apart():
    n, me = rr.size(), rr.rank()
    # Overlapping sets, made while the ranks outside each do something else: rank 1 makes
    # [0, 1] then [1, 2]; rank 2 comes to [1, 2] while rank 1 is still making [0, 1].
    low = rr.private_process_set([1, 0]) if me in (0, 1) else None
    high = rr.private_process_set([1, 2]) if me in (1, 2) else None
    alone = rr.private_process_set([me])
    for ps in (low, high, alone):
        if ps is not None:
            assert ps.included() and ps.process_set_id < 0 and ps.rank() == ps.ranks.index(me), ps
    assert low is None or low.ranks == [0, 1]
    pending = rr.allreduce_async(values(me, (5,), np.float64), op=rr.Sum, name="global.meanwhile")
    if low is not None:
        got = wait_op(rr.allreduce_async(values(me, (7,), np.float64), op=rr.Sum, name="x", process_set=low))
        assert np.array_equal(got, values(0, (7,), np.float64) + values(1, (7,), np.float64))
        assert rr.broadcast_object(("from", 1), root_rank=1, process_set=low) == ("from", 1)
    if high is not None:
        got = wait_op(rr.allgather_async(values(me, (3,), np.int64), name="x", process_set=high))
        assert np.array_equal(got, np.concatenate([values(r, (3,), np.int64) for r in (1, 2)]))
    assert rr.allgather_object(me, process_set=alone) == [me]
    assert np.array_equal(wait_op(pending), sum(values(r, (5,), np.float64) for r in range(n)))
    # Kept apart from Horovod's sets: no id that process_set_by_id finds, and registered ids unchanged.
    raises(lambda: rr.process_set_by_id(alone.process_set_id), rr.InvalidArgumentError, "no process set")
    registered = rr.add_process_set([0, 2])
    assert registered.process_set_id == 1
    # Released by its members alone; then it is gone, and the other sets still work.
    if low is not None:
        assert rr.remove_process_set(low)
        raises(lambda: rr.allreduce(np.ones(2), process_set=low), rr.InvalidArgumentError, "not registered")
    if high is not None:
        assert rr.allreduce(np.ones(2), op=rr.Sum, process_set=high).tolist() == [2, 2]
    if registered.included():
        assert rr.allreduce(np.ones(2), op=rr.Sum, process_set=registered).tolist() == [2, 2]
    MPI.COMM_WORLD.Barrier()  # every rank is done with its sets before any counts
    counted, seen = engine_threads(), threads_seen()
    # ... and has counted before any shuts down: a peer's shutdown() stops the engines of the sets
    # this rank shares with it (rank 2's stopped rank 0's engine of [0, 2] before rank 0, slow out
    # of the first barrier on a busy machine, had counted it).
    MPI.COMM_WORLD.Barrier()
    assert counted == 1 + (high is not None) + 1 + registered.included(), seen
    rr.shutdown()  # stops the private sets' engines too
    assert engine_threads() == 0
    assert alone.process_set_id is None and (high is None or high.process_set_id is None)
    rr.init()
