"""Process sets (Horovod 0.28 semantics): ops on subsets of the ranks, each set with its own engine.

The sets used: np=3 ``[0, 2]`` and ``[1]``; np=2 ``[0]`` and ``[1]``; np=1 ``[0]`` (the global
set itself). ``root_rank`` is a global rank, results are in set-rank order, and a set's
Average divides by the set's size. Every wait is bounded, so a deadlock fails the test
instead of hanging the suite.
"""
import random
import threading

import numpy as np
from mpi4py import MPI

import mtrain.ringreduce as rr
from tests.mpi.data import assert_matches, reference, values
from tests.mpi.harness import mpi_test
from tests.mpi.expect import raises
from tests.mpi.process_set_helpers import WAIT_S, engine_threads, register_sets, same_everywhere, set_lists, wait_op

# -- queries ---------------------------------------------------------------------------------


@mpi_test(nps=(1, 2, 3))
def test_set_queries_agree_on_every_rank():
    n, me = rr.size(), rr.rank()
    unregistered = rr.ProcessSet([2, 0])
    assert unregistered.ranks == [0, 2]  # sorted, as in Horovod
    assert (unregistered.size(), unregistered.rank(), unregistered.included()) == (None, None, None)
    sets = register_sets()
    for ps, ranks in zip(sets, set_lists(n)):
        assert ps.ranks == ranks, ps
        assert ps.size() == len(ranks)
        assert ps.included() is (me in ranks)
        if me in ranks:
            assert ps.rank() == ranks.index(me)
        else:
            raises(ps.rank, ValueError, f"rank {me}", "not part of")
    ids = [ps.process_set_id for ps in sets]
    same_everywhere(ids, "process set ids")
    if n == 1:
        assert ids == [0]  # [0] is every rank: the global set itself
    else:
        assert len(set(ids)) == len(ids) and 0 not in ids, ids
    g = rr.global_process_set
    assert g.process_set_id == 0 and g.ranks == list(range(n))
    assert (g.size(), g.rank(), g.included()) == (n, me, True)
    # A fresh ProcessSet of the same ranks registers as the same set.
    again = rr.ProcessSet(set_lists(n)[0])
    rr.init(process_sets=[again])
    assert again.process_set_id == ids[0]
    # Bad constructions are ValueErrors, before any collective.
    for bad in ([0, 0], [0.5], [True], 3, "01"):
        raises(lambda: rr.ProcessSet(bad), ValueError, "ProcessSet")
    raises(lambda: rr.init(process_sets=5), ValueError, "process_sets")
    raises(lambda: rr.init(process_sets=[[0]]), ValueError, "process_sets")


# -- every op on each set --------------------------------------------------------------------


def _check_every_op(ps, members: "list[int]") -> None:
    """Every op kind on ``ps`` (sync, async, in place, grouped), checked against NumPy."""
    me = rr.rank()
    k, sr = len(members), members.index(me)
    where = f"set {ps.process_set_id} {members}"
    kw = {"process_set": ps}

    # allreduce: each op, several dtypes, zero-size, one element, odd sizes; Average over k ranks.
    for dtype in (np.float32, np.float64, np.int32, np.int64, np.uint8, np.float16):
        for op in (rr.Sum, rr.Average, rr.Min, rr.Max, rr.Product):
            for shape in ((0,), (1,), (7,), (3, 5), (1001,)):
                got = rr.allreduce(values(me, shape, dtype, op), op=op, **kw)
                want = reference([values(r, shape, dtype, op) for r in members], op)
                assert_matches(got, want, f"{where} allreduce {np.dtype(dtype).name} {op} {shape}")
    shape = (13,)
    want_sum = reference([values(r, shape, np.float64) for r in members], rr.Sum)
    # in place
    x = values(me, shape, np.float64)
    assert rr.allreduce_(x, op=rr.Sum, **kw) is x
    assert_matches(x, want_sum, f"{where} allreduce_")
    # async, out of place and in place, with scaling
    h1 = rr.allreduce_async(values(me, shape, np.float64), op=rr.Average, **kw)
    y = values(me, shape, np.float64)
    h2 = rr.allreduce_async_(y, op=rr.Sum, prescale_factor=0.5, postscale_factor=3.0, **kw)
    assert_matches(wait_op(h1), want_sum / k, f"{where} allreduce_async Average")
    assert wait_op(h2) is y
    assert_matches(y, want_sum * 1.5, f"{where} allreduce_async_ scaled")
    # grouped, out of place and in place, and async
    shapes = [(0,), (5,), (2, 3), (1,)]
    mine = [values(me, s, np.float32) for s in shapes]
    wants = [reference([values(r, s, np.float32) for r in members], rr.Sum) for s in shapes]
    for got, want, s in zip(rr.grouped_allreduce(mine, op=rr.Sum, **kw), wants, shapes):
        assert_matches(got, want, f"{where} grouped_allreduce {s}")
    arrays = [a.copy() for a in mine]
    out = wait_op(rr.grouped_allreduce_async_(arrays, op=rr.Average, **kw))
    for got, array, want, s in zip(out, arrays, wants, shapes):
        assert got is array
        assert_matches(got, want / k, f"{where} grouped_allreduce_async_ {s}")
    arrays = [a.copy() for a in mine]
    rr.grouped_allreduce_(arrays, op=rr.Max, **kw)
    for got, s in zip(arrays, shapes):
        assert_matches(got, reference([values(r, s, np.float32) for r in members], rr.Max), f"{where} grouped max")
    for got, want in zip(wait_op(rr.grouped_allreduce_async(mine, op=rr.Sum, **kw)), wants):
        assert_matches(got, want, f"{where} grouped_allreduce_async")

    # allgather: rows differ per rank (rank 0 and 3 send none); result in set-rank order.
    def rows(r):
        return r % 3

    gathered = rr.allgather(values(me, (rows(me), 3), np.int32), **kw)
    want = np.concatenate([values(r, (rows(r), 3), np.int32) for r in members])
    assert_matches(gathered, want, f"{where} allgather")
    got = wait_op(rr.allgather_async(values(me, (rows(me) + 1,), np.float64), **kw))
    assert_matches(got, np.concatenate([values(r, (rows(r) + 1,), np.float64) for r in members]),
                   f"{where} allgather_async")
    pair = rr.grouped_allgather([values(me, (rows(me), 2), np.float32), values(me, (1,), np.int64)], **kw)
    assert_matches(pair[0], np.concatenate([values(r, (rows(r), 2), np.float32) for r in members]),
                   f"{where} grouped_allgather[0]")
    assert_matches(pair[1], np.concatenate([values(r, (1,), np.int64) for r in members]),
                   f"{where} grouped_allgather[1]")
    pair = wait_op(rr.grouped_allgather_async([values(me, (0, 4), np.float64)], **kw))
    assert pair[0].shape == (0, 4)

    # broadcast: root_rank is a global rank of the set.
    for root in members:
        want = values(root, (7,), np.float64)
        assert_matches(rr.broadcast(values(me, (7,), np.float64), root_rank=root, **kw), want,
                       f"{where} broadcast root {root}")
        z = values(me, (7,), np.float64)
        assert rr.broadcast_(z, root_rank=root, **kw) is z
        assert_matches(z, want, f"{where} broadcast_ root {root}")
        assert_matches(wait_op(rr.broadcast_async(values(me, (2, 3), np.int32), root_rank=root, **kw)),
                       values(root, (2, 3), np.int32), f"{where} broadcast_async root {root}")
        z = values(me, (0,), np.float32)
        assert wait_op(rr.broadcast_async_(z, root_rank=root, **kw)) is z
        assert rr.broadcast_object({"from": me, "list": [me] * 3}, root_rank=root, **kw) == \
            {"from": root, "list": [root] * 3}

    # reducescatter: rows fewer than ranks, odd, zero; the first rows % k set ranks get one more.
    for nrows in (0, 1, k + 1, 2 * k + 1):
        for op in (rr.Sum, rr.Average):
            full = reference([values(r, (nrows, 3), np.float64) for r in members], op)
            base, extra = divmod(nrows, k)
            start = sr * base + min(sr, extra)
            mine_rows = full[start:start + base + (sr < extra)]
            got = rr.reducescatter(values(me, (nrows, 3), np.float64), op=op, **kw)
            assert_matches(got, mine_rows, f"{where} reducescatter {nrows} rows {op}")
    got = wait_op(rr.reducescatter_async(values(me, (k + 2,), np.float32), op=rr.Sum, **kw))
    full = reference([values(r, (k + 2,), np.float32) for r in members], rr.Sum)
    base, extra = divmod(k + 2, k)
    start = sr * base + min(sr, extra)
    assert_matches(got, full[start:start + base + (sr < extra)], f"{where} reducescatter_async")
    outs = rr.grouped_reducescatter([values(me, (1,), np.float64), values(me, (k, 2), np.float64)], op=rr.Sum, **kw)
    first = reference([values(r, (1,), np.float64) for r in members], rr.Sum)
    assert_matches(outs[0], first[:1] if sr == 0 else first[:0], f"{where} grouped_reducescatter[0]")
    second = reference([values(r, (k, 2), np.float64) for r in members], rr.Sum)
    assert_matches(outs[1], second[sr:sr + 1], f"{where} grouped_reducescatter[1]")
    outs = wait_op(rr.grouped_reducescatter_async([values(me, (k,), np.int32)], op=rr.Sum, **kw))
    assert_matches(outs[0], reference([values(r, (k,), np.int32) for r in members], rr.Sum)[sr:sr + 1],
                   f"{where} grouped_reducescatter_async")

    # alltoall: splits have one entry per set rank, some zero; rows labelled source/destination.
    def splits_of(source_set_rank):
        return [(source_set_rank + j) % 3 for j in range(k)]

    def rows_for(source, dest_set_rank, count):
        return [source * 1000 + dest_set_rank * 10 + t for t in range(count)]

    splits = splits_of(sr)
    send = np.array([v for j in range(k) for v in rows_for(me, j, splits[j])], dtype=np.int64)
    received, received_splits = rr.alltoall(send, splits=splits, **kw)
    want_splits = [splits_of(si)[sr] for si in range(k)]
    assert received_splits.tolist() == want_splits, f"{where} alltoall splits {received_splits}"
    assert received.tolist() == [v for si, r in enumerate(members) for v in rows_for(r, sr, want_splits[si])], \
        f"{where} alltoall {received.tolist()}"
    even = np.arange(2 * k * 3, dtype=np.float32).reshape(2 * k, 3) + 100 * me
    got = rr.alltoall(even, **kw)  # no splits: equal shares, just the array back
    want = np.concatenate([np.arange(2 * k * 3, dtype=np.float32).reshape(2 * k, 3)[2 * sr:2 * sr + 2] + 100 * r
                           for r in members])
    assert_matches(got, want, f"{where} alltoall without splits")
    received, received_splits = wait_op(rr.alltoall_async(np.zeros((0, 2)), splits=[0] * k, **kw))
    assert received.shape == (0, 2) and received_splits.tolist() == [0] * k

    # barrier and the object collectives
    rr.barrier(**kw)
    assert rr.allgather_object({"rank": me, "tag": f"r{me}"}, **kw) == [{"rank": r, "tag": f"r{r}"} for r in members]


@mpi_test(nps=(1, 2, 3), timeout=240)
def test_every_op_on_each_set_and_on_the_global_set():
    n, me = rr.size(), rr.rank()
    sets = register_sets()
    for ps, ranks in zip(sets, set_lists(n)):
        if me in ranks:
            _check_every_op(ps, ranks)
    _check_every_op(rr.global_process_set, list(range(n)))


@mpi_test(nps=(2, 3))
def test_ops_interleaved_across_sets_in_a_different_order_on_each_rank():
    n, me = rr.size(), rr.rank()
    sets = register_sets()
    mine = [(rr.global_process_set, list(range(n)))] + [(ps, r) for ps, r in zip(sets, set_lists(n)) if me in r]
    for step in range(4):
        # Per set: unnamed ops (same order on every member) and named ops (any order).
        queues = []
        for index, (ps, members) in enumerate(mine):
            ops = []
            for i in range(6):
                shape = (2 * i + 1,)
                ops.append((f"unnamed {index}.{i}", ps, members, shape, None))
            queues.append(ops)
        named = [(f"named {index}.{i}", ps, members, (i + 3,), f"same.{i}")  # same names in every set
                 for index, (ps, members) in enumerate(mine) for i in range(4)]
        rng = random.Random(me * 100 + step)
        rng.shuffle(named)
        # Merge the queues at random (keeping each set's own order), named ops thrown in anywhere.
        order = []
        while any(queues) or named:
            choices = [q for q in queues if q] + ([named] if named else [])
            order.append(rng.choice(choices).pop(0))
        handles = []
        for what, ps, members, shape, name in order:
            h = rr.allreduce_async(values(me, shape, np.float64) * (step + 1), op=rr.Sum, name=name, process_set=ps)
            handles.append((what, members, shape, h))
        rng.shuffle(handles)
        for what, members, shape, h in handles:
            want = reference([values(r, shape, np.float64) * (step + 1) for r in members], rr.Sum)
            assert_matches(wait_op(h, what), want, f"step {step} {what}")


# -- errors ------------------------------------------------------------------------------------


@mpi_test(nps=(2, 3))
def test_outsiders_and_roots_outside_the_set_get_clear_errors_on_every_rank():
    n, me = rr.size(), rr.rank()
    sets = register_sets()
    first = sets[0]  # [0, 2] at np=3, [0] at np=2: rank 1 is outside, and is no root of it
    sid = first.process_set_id
    x = np.arange(6, dtype=np.float32) + me
    calls = {
        "allreduce": lambda: rr.allreduce(x, process_set=first),
        "allreduce_": lambda: rr.allreduce_(x.copy(), process_set=first),
        "allreduce_async": lambda: rr.allreduce_async(x, process_set=first),
        "allreduce_async_": lambda: rr.allreduce_async_(x.copy(), process_set=first),
        "grouped_allreduce": lambda: rr.grouped_allreduce([x], process_set=first),
        "grouped_allreduce_": lambda: rr.grouped_allreduce_([x.copy()], process_set=first),
        "allgather": lambda: rr.allgather(x, process_set=first),
        "grouped_allgather": lambda: rr.grouped_allgather([x], process_set=first),
        "broadcast": lambda: rr.broadcast(x, root_rank=0, process_set=first),
        "broadcast_": lambda: rr.broadcast_(x.copy(), root_rank=0, process_set=first),
        "broadcast_async": lambda: rr.broadcast_async(x, root_rank=0, process_set=first),
        "reducescatter": lambda: rr.reducescatter(x, process_set=first),
        "grouped_reducescatter": lambda: rr.grouped_reducescatter([x], process_set=first),
        "alltoall": lambda: rr.alltoall(x, splits=[6] + [0] * (first.size() - 1), process_set=first),
        "barrier": lambda: rr.barrier(process_set=first),
        "broadcast_object": lambda: rr.broadcast_object(me, root_rank=0, process_set=first),
        "allgather_object": lambda: rr.allgather_object(me, process_set=first),
        "grouped_allreduce_async": lambda: rr.grouped_allreduce_async([x], process_set=first),
        "grouped_allreduce_async_": lambda: rr.grouped_allreduce_async_([x.copy()], process_set=first),
        "allgather_async": lambda: rr.allgather_async(x, process_set=first),
        "grouped_allgather_async": lambda: rr.grouped_allgather_async([x], process_set=first),
        "broadcast_async_": lambda: rr.broadcast_async_(x.copy(), root_rank=0, process_set=first),
        "reducescatter_async": lambda: rr.reducescatter_async(x, process_set=first),
        "grouped_reducescatter_async": lambda: rr.grouped_reducescatter_async([x], process_set=first),
        "alltoall_async": lambda: rr.alltoall_async(x, process_set=first),
    }
    if me == 1:
        for what, call in calls.items():  # every op kind is refused, before anything is submitted
            raises(call, rr.InvalidArgumentError, f"rank 1 is not part of process set {sid}", "included()")
        raises(first.rank, ValueError, "rank 1")
        assert first.included() is False and first.size() == len(set_lists(n)[0])
    else:
        # A root outside the set, given as a global rank: refused on every caller, before submitting.
        for call in (lambda: rr.broadcast(x, root_rank=1, process_set=first),
                     lambda: rr.broadcast_(x.copy(), root_rank=1, process_set=first),
                     lambda: rr.broadcast_async(x, root_rank=1, process_set=first),
                     lambda: rr.broadcast_async_(x.copy(), root_rank=1, process_set=first),
                     lambda: rr.broadcast_object(me, root_rank=1, process_set=first)):
            raises(call, rr.InvalidArgumentError, f"root_rank 1 is not part of process set {sid}", "global rank")
        raises(lambda: rr.broadcast(x, root_rank=n, process_set=first), rr.InvalidArgumentError, "root_rank")
        # alltoall splits count the set's ranks, not the job's.
        raises(lambda: rr.alltoall(x, splits=[2] * n + [6 - 2 * n], process_set=first), ValueError,
                f"{first.size()} non-negative integers")
    # Not a set, or not registered: refused on every rank.
    raises(lambda: rr.allreduce(x, process_set="everyone"), rr.InvalidArgumentError, "ProcessSet")
    raises(lambda: rr.allreduce(x, process_set=rr.ProcessSet([0])), rr.InvalidArgumentError, "not registered")
    # Both classes, as Horovod's errors are RuntimeErrors and mtrain's were ValueErrors.
    assert issubclass(rr.InvalidArgumentError, RuntimeError) and issubclass(rr.InvalidArgumentError, ValueError)
    # Nothing was submitted: every set still works.
    if first.included():
        members = set_lists(n)[0]
        assert rr.allgather_object(me, process_set=first) == members
    assert rr.allreduce(np.full(2, me), op=rr.Sum).tolist() == [n * (n - 1) // 2] * 2


@mpi_test(nps=(3,))
def test_mismatch_inside_a_set_raises_on_every_member_naming_global_ranks():
    me = rr.rank()
    pair, single = register_sets()
    if pair.included():
        raises(lambda: rr.allreduce(np.zeros(4 if me == 0 else 5), name="pair.grad", process_set=pair),
                rr.MismatchError, "'pair.grad'", "rank 0: allreduce float64[4]", "rank 2: allreduce float64[5]")
        raises(lambda: rr.broadcast(np.zeros(3), root_rank=me, process_set=pair), rr.MismatchError,
                "rank 0: broadcast", "rank 2: broadcast")  # different roots
        raises(lambda: rr.allgather(np.zeros((1, 2 + me)), process_set=pair), rr.MismatchError, "rank 2: allgather")
        # The set keeps working afterwards.
        assert rr.allreduce(np.full(3, me), op=rr.Sum, process_set=pair).tolist() == [2, 2, 2]
    else:
        for i in range(5):  # rank 1 meanwhile runs its own set, undisturbed
            assert rr.allreduce(np.full(2, i), op=rr.Sum, process_set=single).tolist() == [i, i]
    assert rr.allreduce(np.ones(2), op=rr.Sum).tolist() == [3, 3]


@mpi_test(nps=(3,))
def test_a_root_mismatch_inside_a_set_names_the_global_roots():
    me = rr.rank()
    pair, _ = register_sets()
    if pair.included():
        raises(lambda: rr.broadcast(np.zeros(3), root_rank=me, process_set=pair), rr.MismatchError,
                "rank 0: broadcast float64[3] root_rank=0", "rank 2: broadcast float64[3] root_rank=2")


@mpi_test(nps=(3,), env={"MTRAIN_STALL_WARNING_SECONDS": "0.5", "MTRAIN_STALL_SHUTDOWN_SECONDS": "3"})
def test_a_stall_inside_a_set_names_the_missing_global_rank():
    me = rr.rank()
    pair, _ = register_sets()
    if me == 0:
        raises(lambda: wait_op(rr.allreduce_async(np.ones(3), name="only.rank0", process_set=pair)),
                rr.StallError, "'only.rank0'", "not yet by rank(s) [2]")
        for peer in (1, 2):  # (the world, never the runtime's communicators)
            MPI.COMM_WORLD.send("stalled", dest=peer, tag=33)
    else:
        # Join the barrier once rank 0 gave up on its op: no one's wait there nears the limit.
        assert MPI.COMM_WORLD.recv(source=0, tag=33) == "stalled"
    rr.barrier()
    if pair.included():
        assert rr.allreduce(np.ones(2), op=rr.Sum, process_set=pair, name="after").tolist() == [2, 2]


# -- concurrency -------------------------------------------------------------------------------


@mpi_test(nps=(2, 3), timeout=120)
def test_a_pending_op_on_one_set_never_blocks_another_set():
    n, me = rr.size(), rr.rank()
    world = MPI.COMM_WORLD  # the test's own signals, apart from the runtime's communicators
    sets = register_sets()
    near = sets[0]  # holds rank 0 and not rank 1
    members = set_lists(n)[0]
    # 1. Rank 1 waits on a global op; rank 0 (and 2) meanwhile complete many ops on their set.
    if me == 1:
        pending = rr.allreduce_async(np.full(3, me, np.float64), op=rr.Sum, name="global.first")
        world.recv(source=0, tag=11)  # rank 0 finished its set's ops without this op
        assert not rr.poll(pending), "the global op finished before rank 0 submitted it"
        world.send("go", dest=0, tag=12)
    else:
        for i in range(40):
            got = wait_op(rr.allreduce_async(np.full(5, me + i, np.float64), op=rr.Sum, process_set=near), f"near op {i}")
            assert got.tolist() == [sum(r + i for r in members)] * 5
            got = wait_op(rr.allgather_async(np.full((1,), me * 10 + i), process_set=near), f"near allgather {i}")
            assert got.tolist() == [r * 10 + i for r in members]
        rr.barrier(process_set=near)
        if me == 0:
            world.send("done", dest=1, tag=11)
            world.recv(source=1, tag=12)
        pending = rr.allreduce_async(np.full(3, me, np.float64), op=rr.Sum, name="global.first")
    assert wait_op(pending, "global.first").tolist() == [n * (n - 1) / 2] * 3
    # 2. The other way round: an op pending on the set while the global set runs many ops.
    # (np=3 only: at np=2 the set is rank 0 alone, where the op would run at once.)
    if me == 0 and n == 3:
        late = rr.allreduce_async(np.full(2, me), op=rr.Sum, name="near.late", process_set=near)
    for i in range(30):
        if me == 0 and n == 3 and i == 29:
            # The last rank of the set submits near.late only after all 30 global ops,
            # and this last one cannot finish before rank 0 submits it.
            assert not rr.poll(late), "near.late finished before every member submitted it"
        assert rr.allreduce(np.full(2, me + i), op=rr.Sum, name=f"g{i}").tolist() == [sum(range(n)) + n * i] * 2
    if near.included() and n == 3:
        if me != 0:  # the set's other rank submits it only now
            late = rr.allreduce_async(np.full(2, me), op=rr.Sum, name="near.late", process_set=near)
        assert wait_op(late, "near.late").tolist() == [sum(members)] * 2


@mpi_test(nps=(2, 3), timeout=120)
def test_threads_run_ops_on_different_sets_at_the_same_time():
    n, me = rr.size(), rr.rank()
    sets = register_sets()
    failures = []

    def run(ps, ranks, label):
        try:
            for i in range(25):
                got = rr.allreduce(np.full(4, me * 3 + i, np.float64), op=rr.Sum, process_set=ps, name=f"{label}.{i}")
                assert got.tolist() == [sum(r * 3 + i for r in ranks)] * 4, (label, i, got)
        except BaseException as error:  # reported by the main thread
            failures.append(f"{label}: {error!r}")

    threads = [threading.Thread(target=run, args=(rr.global_process_set, list(range(n)), "global"))]
    threads += [threading.Thread(target=run, args=(ps, ranks, f"set{ps.process_set_id}"))
                for ps, ranks in zip(sets, set_lists(n)) if me in ranks]
    for t in threads:
        t.start()
    for t in threads:
        t.join(WAIT_S)
        assert not t.is_alive(), f"rank {me}: thread still running after {WAIT_S}s (deadlock?)"
    assert not failures, failures


# -- adding and removing -----------------------------------------------------------------------


@mpi_test(nps=(2, 3), timeout=120)
def test_add_and_remove_while_other_sets_have_ops_in_flight():
    n, me = rr.size(), rr.rank()
    near_ranks = [0, 2] if n == 3 else [0]
    other_ranks = [0, 1] if n == 3 else [1]
    near = rr.add_process_set(near_ranks)
    assert near.ranks == near_ranks and near.included() is (me in near_ranks)
    def submit_near():
        return [rr.allreduce_async(values(me, (i + 1,), np.float64), op=rr.Sum, name=f"near.{i}", process_set=near)
                for i in range(10)]

    # Rank 0 submits its ops on 'near' now; the set's other rank (np=3) only after the adds and
    # removes below, so those ops stay in flight on rank 0 all the while.
    if me == 0:
        handles = submit_near()
    for round_ in range(2):
        other = rr.add_process_set(other_ranks)
        same_everywhere(other.process_set_id, "the added set's id")
        assert other.process_set_id not in (0, near.process_set_id)
        assert other.included() is (me in other_ranks) and other.size() == len(other_ranks)
        if other.included():
            assert other.rank() == other_ranks.index(me)
            got = rr.allreduce(np.full(2, me + round_), op=rr.Sum, process_set=other)
            assert got.tolist() == [sum(other_ranks) + len(other_ranks) * round_] * 2
            assert rr.allgather_object(me, process_set=other) == other_ranks
            root = other_ranks[-1]
            assert rr.broadcast(np.full(2, me), root_rank=root, process_set=other).tolist() == [root] * 2
        old_id = other.process_set_id
        twin = rr.ProcessSet(other_ranks)
        rr.init(process_sets=[twin])  # another object for the same set
        assert twin.process_set_id == old_id
        assert rr.remove_process_set(other) is True
        for gone in (other, twin):  # every object of the set is invalidated, as in Horovod
            assert gone.process_set_id is None and gone.included() is None and gone.size() is None
        # Using it now is a clear error on every rank; removing it again too.
        raises(lambda: rr.allreduce(np.ones(2), process_set=other), rr.InvalidArgumentError, "not registered")
        raises(lambda: rr.remove_process_set(other), rr.InvalidArgumentError, "not registered")
        # Another object for the removed id is not registered either.
        ghost = rr.ProcessSet(other_ranks)
        ghost.process_set_id = old_id
        raises(lambda: rr.barrier(process_set=ghost), rr.InvalidArgumentError, "not registered")
    assert rr.remove_process_set(rr.global_process_set) is False
    assert rr.allreduce(np.ones(2), op=rr.Sum).tolist() == [n, n]  # the global set stays
    if near.included():
        if me != 0:
            handles = submit_near()
        elif n == 3:
            assert not any(rr.poll(h) for h in handles), "near's ops finished before rank 2 submitted them"
        for i, h in enumerate(handles):
            want = reference([values(r, (i + 1,), np.float64) for r in near_ranks], rr.Sum)
            assert_matches(wait_op(h, f"near.{i}"), want, f"near.{i}")
    # Engines: the global one plus one per set this rank is in (the removed ones are stopped).
    assert engine_threads() == 1 + near.included()
    MPI.COMM_WORLD.Barrier()  # no rank shuts down (ending every engine) before all have counted


@mpi_test(nps=(2, 3), timeout=120)
def test_bad_adds_fail_on_every_rank_without_a_hang():
    n, me = rr.size(), rr.rank()
    first = rr.add_process_set([0])
    # The same ranks again: as a list, as a new ProcessSet, as the same object: ValueError everywhere.
    raises(lambda: rr.add_process_set([0]), ValueError, "exists already", f"process_set_id={first.process_set_id}")
    raises(lambda: rr.add_process_set(rr.ProcessSet([0])), ValueError, "exists already")
    raises(lambda: rr.add_process_set(first), ValueError, "exists already")
    raises(lambda: rr.add_process_set(list(range(n))), ValueError, "exists already", "process_set_id=0")
    # Different lists on different ranks.
    raises(lambda: rr.add_process_set([0, 1] if me == 0 else [1]), rr.InvalidArgumentError,
            "different ranks", "rank 0: [0, 1]", "rank 1: [1]")
    # One rank names an existing set, the others a new one: no rank may be left waiting.
    raises(lambda: rr.add_process_set([0] if me == 1 else [1]), rr.InvalidArgumentError, "different ranks")
    # One rank passes something that is no set at all: it raises its own error, the others name it.
    if me == 0:
        raises(lambda: rr.add_process_set([1, 1]), ValueError, "distinct")
    else:
        raises(lambda: rr.add_process_set([1]), rr.InvalidArgumentError, "rank 0: ValueError", "distinct")
    # Out-of-range ranks, an empty set, a communicator: refused on every rank.
    raises(lambda: rr.add_process_set([0, n]), rr.InvalidArgumentError, "out of range")
    raises(lambda: rr.add_process_set([]), rr.InvalidArgumentError, "at least one rank")
    raises(lambda: rr.add_process_set(rr.ProcessSet(MPI.COMM_WORLD)), NotImplementedError, "list of ranks")
    # init() with a list that differs by rank registers the union; a bad list on one rank fails everywhere.
    if me == 0:
        raises(lambda: rr.init(process_sets=[rr.ProcessSet([n + 5])]), rr.InvalidArgumentError, "out of range")
    else:
        raises(lambda: rr.init(process_sets=[rr.ProcessSet([1])]), rr.InvalidArgumentError,
                "rank 0: ProcessSet ranks", "out of range")
    # After all that, every rank still agrees: one more set gets the same id everywhere and works.
    last = rr.add_process_set([n - 1])
    same_everywhere(last.process_set_id, "id after the failed adds")
    assert last.process_set_id == first.process_set_id + 1
    if last.included():
        assert rr.allreduce(np.full(2, 7.0), process_set=last).tolist() == [7.0, 7.0]
    assert rr.allgather_object(me) == list(range(n))
