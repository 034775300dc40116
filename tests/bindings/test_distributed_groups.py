"""mtrain.distributed: subgroups (new_group on backend mtrain), reduce, all_to_all, reduce_scatter,
bitwise ops, object collectives, point-to-point, gather, scatter and monitored_barrier, against
NumPy references and gloo.

Each body runs inside every rank of a real ``mpirun`` job (``ddp_test``). Groups at np3 are
[0, 2] and [1] (np2: [0] and [1]); the checks run on the whole job, then on each rank's own
subgroup, with the other subgroup's ranks running the same checks on theirs meanwhile.
"""
import datetime
import time

import numpy as np
import pytest

from tests.bindings.requires import require

require("torch", "pip install '.[torch]'")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from tests.bindings.test_ddp_backend import REFERENCE, rank_data, init_mtrain, small_model, ddp_test  # noqa: E402

_BITWISE = {
    dist.ReduceOp.BAND: np.bitwise_and,
    dist.ReduceOp.BOR: np.bitwise_or,
    dist.ReduceOp.BXOR: np.bitwise_xor,
}


def _bits(rank: int, shape, dtype) -> torch.Tensor:
    """Distinct bits per rank and per element (bool: a pattern that differs per rank)."""
    values = rank_data(rank, shape, torch.int64) * (rank + 5)
    if dtype == torch.bool:
        return (values % 3 == 0)
    return values.to(dtype)


def _count(src: int, dst: int) -> int:
    """Elements group rank ``src`` sends to group rank ``dst`` in the uneven all-to-alls (0 included)."""
    return (src + 2 * dst) % 3


def _sent(global_src: int, dst: int, count: int) -> torch.Tensor:
    return 1000.0 * global_src + 10.0 * dst + torch.arange(count, dtype=torch.float64)


def _check_collectives(group, members: "list[int]") -> None:
    """Every collective of the backend on ``group`` (global ranks ``members``), against NumPy."""
    me = dist.get_rank()
    size, mine = len(members), members.index(me)
    assert (dist.get_world_size(group), dist.get_rank(group)) == (size, mine)
    where = f"group {members}, rank {me}"

    # all_reduce: every op of the runtime, and the bitwise ones (zero-size and 0-d too).
    for op, reference in REFERENCE.items():
        for dtype in (torch.float64, torch.int32):
            if op == dist.ReduceOp.AVG and not dtype.is_floating_point:
                continue
            tensor = rank_data(me, (7,), dtype)
            dist.all_reduce(tensor, op=op, group=group)
            want = reference(np.stack([rank_data(r, (7,), dtype).double().numpy() for r in members]))
            assert np.allclose(tensor.double().numpy(), want), f"{where}: all_reduce {op} {dtype}"
    for op, fold in _BITWISE.items():
        for dtype in (torch.int64, torch.int32, torch.uint8, torch.bool):
            for shape in [(7,), (3, 2), (), (0,)]:
                tensor = _bits(me, shape, dtype)
                dist.all_reduce(tensor, op=op, group=group)
                want = fold.reduce(np.stack([_bits(r, shape, dtype).numpy() for r in members]), axis=0)
                assert tensor.dtype == dtype and tensor.shape == torch.Size(shape), f"{where}: {op} {dtype}"
                assert np.array_equal(tensor.numpy(), want), f"{where}: all_reduce {op} {dtype} {shape}"
    assert len({_bits(r, (7,), torch.int64).numpy().tobytes() for r in members}) == size  # data can tell

    # reduce: the result on the destination (a global rank in torch's API); the others keep theirs.
    for root in members:
        for op, tensor_of, reference in [
                (dist.ReduceOp.SUM, lambda r: rank_data(r, (5, 3), torch.float64), lambda xs: xs.sum(axis=0)),
                (dist.ReduceOp.MAX, lambda r: rank_data(r, (9,), torch.int64), lambda xs: xs.max(axis=0)),
                (dist.ReduceOp.BXOR, lambda r: _bits(r, (6,), torch.int32), lambda xs: np.bitwise_xor.reduce(xs))]:
            tensor = tensor_of(me)
            dist.reduce(tensor, dst=root, op=op, group=group)
            want = reference(np.stack([tensor_of(r).numpy() for r in members])) if me == root else tensor_of(me).numpy()
            assert np.array_equal(tensor.numpy(), want), f"{where}: reduce {op} to {root}"
    base = torch.stack([rank_data(me, (9,), torch.float64)] * 3)  # a non-contiguous tensor on the root
    dist.reduce(base[:, ::2], dst=members[-1], group=group)
    if me == members[-1]:
        assert np.array_equal(base[:, ::2].numpy(), np.stack([sum(rank_data(r, (9,), torch.float64).numpy()[::2]
                                                                   for r in members)] * 3))
        assert torch.equal(base[:, 1::2], torch.stack([rank_data(me, (9,), torch.float64)[1::2]] * 3))
    z = torch.complex(rank_data(me, (4,), torch.float64), -rank_data(me, (4,), torch.float64))
    dist.reduce(z, dst=members[0], group=group)
    if me == members[0]:
        want = sum(rank_data(r, (4,), torch.float64).numpy() for r in members)
        assert np.allclose(z.numpy(), want - 1j * want), f"{where}: complex reduce"

    # broadcast from the last member (a global rank), all_gather, all_gather_into_tensor.
    tensor = rank_data(me, (2, 3), torch.float32)
    dist.broadcast(tensor, src=members[-1], group=group)
    assert torch.equal(tensor, rank_data(members[-1], (2, 3), torch.float32)), f"{where}: broadcast"
    outputs = [torch.zeros(5, dtype=torch.int64) for _ in range(size)]
    dist.all_gather(outputs, rank_data(me, (5,), torch.int64), group=group)
    assert all(torch.equal(o, rank_data(r, (5,), torch.int64)) for o, r in zip(outputs, members)), where
    out = torch.zeros(size * 3)
    dist.all_gather_into_tensor(out, rank_data(me, (3,), torch.float32), group=group)
    assert torch.equal(out, torch.cat([rank_data(r, (3,), torch.float32) for r in members])), where

    # reduce_scatter_tensor (SUM and a bitwise op), reduce_scatter with sizes that differ per rank.
    total = np.sum([rank_data(r, (size * 5,), torch.float64).numpy() for r in members], axis=0)
    part = torch.zeros(5, dtype=torch.float64)
    dist.reduce_scatter_tensor(part, rank_data(me, (size * 5,), torch.float64), group=group)
    assert np.array_equal(part.numpy(), total[mine * 5:(mine + 1) * 5]), f"{where}: reduce_scatter_tensor"
    part = torch.zeros(4, dtype=torch.int64)
    dist.reduce_scatter_tensor(part, _bits(me, (size * 4,), torch.int64), op=dist.ReduceOp.BOR, group=group)
    want = np.bitwise_or.reduce([_bits(r, (size * 4,), torch.int64).numpy() for r in members])
    assert np.array_equal(part.numpy(), want[mine * 4:(mine + 1) * 4]), f"{where}: reduce_scatter_tensor BOR"
    for op in (dist.ReduceOp.SUM, dist.ReduceOp.MIN):
        out = torch.full((1 + 2 * mine,), -1.0, dtype=torch.float64)
        inputs = [rank_data(me + 10 * g, (1 + 2 * g,), torch.float64) for g in range(size)]
        dist.reduce_scatter(out, inputs, op=op, group=group)
        stack = np.stack([rank_data(r + 10 * mine, (1 + 2 * mine,), torch.float64).numpy() for r in members])
        want = stack.sum(axis=0) if op == dist.ReduceOp.SUM else stack.min(axis=0)
        assert np.array_equal(out.numpy(), want), f"{where}: reduce_scatter {op}"

    # all_to_all: uneven sizes (some empty); all_to_all_single with and without split sizes.
    outputs = [torch.full((_count(g, mine),), -1.0, dtype=torch.float64) for g in range(size)]
    dist.all_to_all(outputs, [_sent(me, g, _count(mine, g)) for g in range(size)], group=group)
    for g, got in enumerate(outputs):
        assert torch.equal(got, _sent(members[g], mine, _count(g, mine))), f"{where}: all_to_all from {g}"
    rows = rank_data(me, (size * 2, 3), torch.int32)
    out = torch.zeros(size * 2, 3, dtype=torch.int32)
    dist.all_to_all_single(out, rows, group=group)
    want = torch.cat([rank_data(r, (size * 2, 3), torch.int32)[2 * mine:2 * mine + 2] for r in members])
    assert torch.equal(out, want), f"{where}: all_to_all_single"
    send = [_count(mine, g) + 1 for g in range(size)]
    receive = [_count(g, mine) + 1 for g in range(size)]
    rows = torch.cat([_sent(me, g, 2 * n).reshape(n, 2) for g, n in enumerate(send)])
    out = torch.full((sum(receive), 2), -1.0, dtype=torch.float64)
    dist.all_to_all_single(out, rows, output_split_sizes=receive, input_split_sizes=send, group=group)
    want = torch.cat([_sent(members[g], mine, 2 * n).reshape(n, 2) for g, n in enumerate(receive)])
    assert torch.equal(out, want), f"{where}: all_to_all_single with splits"
    empty = torch.zeros(0, 2)
    dist.all_to_all_single(empty, torch.zeros(0, 2), [0] * size, [0] * size, group=group)

    # Objects: torch builds them on all_gather and broadcast.
    gathered = [None] * size
    dist.all_gather_object(gathered, {"rank": me, "items": list(range(me))}, group=group)
    assert gathered == [{"rank": r, "items": list(range(r))} for r in members], f"{where}: {gathered}"
    objects = [("from", me), {"x": [me] * (me + 2)}] if me == members[-1] else [None, None]
    dist.broadcast_object_list(objects, src=members[-1], group=group)
    assert objects == [("from", members[-1]), {"x": [members[-1]] * (members[-1] + 2)}], f"{where}: {objects}"
    dist.barrier(group=group)

    # Bad arguments: one-line errors (ValueError, and RuntimeError as gloo raises); no op is left behind.
    for error in (ValueError, RuntimeError):
        with pytest.raises(error, match="PREMUL_SUM is not supported.*ReduceOp.SUM"):
            dist.all_reduce(torch.ones(3), op=dist._make_nccl_premul_sum(2.0), group=group)
    with pytest.raises(RuntimeError, match="BAND with non-integral dtype"):
        dist.all_reduce(torch.ones(3), op=dist.ReduceOp.BAND, group=group)
    with pytest.raises(RuntimeError, match="invalid root rank 7"):
        dist.reduce(torch.ones(3), group_dst=7, group=group)
    if size > 1:
        with pytest.raises(RuntimeError, match="does not divide equally"):
            dist.all_to_all_single(torch.zeros(size), torch.zeros(size + 1), group=group)
    with pytest.raises(RuntimeError, match="number of splits must equal the group size"):
        dist.all_to_all_single(torch.zeros(size), torch.zeros(size), [1] * size, [1] * (size + 1), group=group)
    with pytest.raises(RuntimeError, match=r"summing to the input's dim 0"):
        dist.all_to_all_single(torch.zeros(size), torch.zeros(size), [1] * size, [2] * size, group=group)
    with pytest.raises(RuntimeError, match="one per rank of the group"):
        dist.all_to_all([torch.zeros(1)] * size, [torch.zeros(1)] * (size + 1), group=group)
    with pytest.raises(RuntimeError, match="one per rank of the group"):
        dist.reduce_scatter(torch.zeros(1), [torch.zeros(1)] * (size + 1), group=group)
    if size > 1:  # the ranks disagree on split sizes: the rank whose expectation is wrong raises, naming both
        receive = [1] * size
        receive[0], receive[1] = (2, 0) if mine == 0 else (1, 1)
        work = dist.all_to_all_single(torch.zeros(size), torch.zeros(size), receive if mine == 0 else [1] * size,
                                      [1] * size, group=group, async_op=True)
        if mine == 0:
            with pytest.raises(RuntimeError, match=r"expected \[2, 0.*but they sent \[1, 1"):
                work.wait()
        else:
            work.wait()
    t = rank_data(me, (3,), torch.float64)
    dist.all_reduce(t, group=group)  # the group still works
    assert np.array_equal(t.numpy(), sum(rank_data(r, (3,), torch.float64).numpy() for r in members)), where


@ddp_test(nps=(2, 3))
def test_collectives_on_the_job_and_on_subgroups_match_numpy():
    me, n = init_mtrain()
    layout = {2: [[0], [1]], 3: [[0, 2], [1]]}[n]
    groups = [dist.new_group(ranks) for ranks in layout]  # every rank makes every group, in order
    for ranks, group in zip(layout, groups):
        assert (group is dist.GroupMember.NON_GROUP_MEMBER) == (me not in ranks)
    _check_collectives(None, list(range(n)))
    # Each rank's own subgroup, while the ranks of the other subgroup run theirs.
    (ranks, group), = [(r, g) for r, g in zip(layout, groups) if me in r]
    assert "ProcessGroupMtrain" in repr(group) and dist.get_backend(group) == "mtrain"
    _check_collectives(group, ranks)
    # A group's ops and the job's, in flight together, waited for in another order.
    t = torch.full((4,), float(me))
    work_group = dist.all_reduce(t, group=group, async_op=True)
    everyone = torch.full((4,), 1.0)
    work_job = dist.all_reduce(everyone, async_op=True)
    work_job.wait()
    work_group.wait()
    assert torch.equal(t, torch.full((4,), float(sum(ranks)))) and torch.equal(everyone, torch.full((4,), float(n)))
    dist.destroy_process_group(group)  # releases the group's set on its members
    dist.barrier()
    dist.destroy_process_group()


@ddp_test(nps=(2, 3))
def test_send_recv_gather_and_scatter_on_the_job_and_a_subgroup():
    """Point-to-point (blocking, isend/irecv, batch_isend_irecv, a future) around a ring of the
    group's ranks, then gather and scatter to and from every root, on the job and on [0, n-1]."""
    me, n = init_mtrain()
    pair = dist.new_group([0, n - 1])
    with pytest.raises(NotImplementedError, match="any source"):
        dist.recv(torch.zeros(1))  # torch's recv from whichever rank sends
    for group, members in ((None, list(range(n))), (pair, [0, n - 1])):
        if me not in members:
            continue
        mine, size = members.index(me), len(members)
        after, before = members[(mine + 1) % size], members[(mine - 1) % size]  # global ranks, as torch takes
        where = f"group {members}, rank {me}"
        for dtype, count in ((torch.float32, 7), (torch.int64, 0), (torch.complex64, 5), (torch.bfloat16, 300_001)):
            def made(src: int, dst: int) -> torch.Tensor:
                values = _sent(src, dst, count)
                return torch.complex(values, -values).to(dtype) if dtype.is_complex else values.to(dtype)
            work = dist.isend(made(me, after), after, group=group, tag=count % 3)
            got = torch.empty(count, dtype=dtype)
            dist.recv(got, before, group=group, tag=count % 3)
            work.wait()
            assert torch.equal(got, made(before, me)), f"{dtype}[{count}] from {before}, {where}"
        # batch_isend_irecv (what pipelining uses), into a non-contiguous column.
        column = torch.zeros(9, 3)
        works = dist.batch_isend_irecv([dist.P2POp(dist.isend, _sent(me, after, 9).float(), after, group),
                                        dist.P2POp(dist.irecv, column[:, 1], before, group)])
        for work in works:
            work.wait()
        assert torch.equal(column[:, 1], _sent(before, me, 9).float()) and not column[:, 0].any(), where
        # A future, completed when the transfer lands.
        landing = torch.zeros(6, dtype=torch.float64)
        future = dist.irecv(landing, before, group=group, tag=5).get_future()
        dist.send(_sent(me, after, 6), after, group=group, tag=5)
        assert torch.equal(future.wait()[0], _sent(before, me, 6)) and torch.equal(landing, _sent(before, me, 6))
        # A recv that does not fit what was sent says so; both ends go on.
        work = dist.isend(torch.ones(5), after, group=group, tag=7)
        with pytest.raises(RuntimeError, match=r"sent float32\[5\], but this buffer holds float32\[4\]"):
            dist.recv(torch.zeros(4), before, group=group, tag=7)
        work.wait()
        for root in members:
            outputs = [torch.zeros(4, dtype=torch.float64) for _ in members] if me == root else None
            dist.gather(_sent(me, root, 4), outputs, dst=root, group=group)
            if me == root:
                for member, out in zip(members, outputs):
                    assert torch.equal(out, _sent(member, root, 4)), f"gather to {root} from {member}, {where}"
            inputs = [_sent(root, member, 4) for member in members] if me == root else None
            into = torch.zeros(4, dtype=torch.float64)
            dist.scatter(into, inputs, src=root, group=group)
            assert torch.equal(into, _sent(root, me, 4)), f"scatter from {root}, {where}"
    dist.barrier()
    dist.destroy_process_group()


def _batches(rank: int, steps: int):
    g = torch.Generator().manual_seed(100 + rank)
    return [(torch.randn(5, 6, generator=g, dtype=torch.float64), torch.randn(5, 3, generator=g, dtype=torch.float64))
            for _ in range(steps)]


def _flat(model: torch.nn.Module) -> np.ndarray:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).numpy()


def _zero_equals_one_process(group, ranks: "list[int]", me: int, steps: int) -> None:
    """ZeroRedundancyOptimizer (Adam) with DDP over ``group`` (global ranks ``ranks``) ends where one
    process does on the group's mean gradient, and each rank holds only its shard of Adam's state."""
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel as DDP
    reference = small_model(ranks[0])
    optimizer = torch.optim.Adam(reference.parameters(), lr=0.01)
    for step in range(steps):
        optimizer.zero_grad()
        for r in ranks:
            x, y = _batches(r, steps)[step]
            (torch.nn.functional.mse_loss(reference(x), y) / len(ranks)).backward()
        optimizer.step()
    model = DDP(small_model(me), process_group=group)
    zero = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.Adam, process_group=group, lr=0.01)
    for x, y in _batches(me, steps):
        zero.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        zero.step()
    got, want = _flat(model.module), _flat(reference)
    where = f"rank {me}, ZeRO over {ranks}"
    assert np.allclose(got, want, rtol=1e-5, atol=1e-5), f"{where}: differs by {np.abs(got - want).max()}"
    held = {id(p) for p in zero.optim.state}
    shard = {id(p) for p in zero.optim.param_groups[0]["params"]}
    every = {id(p) for p in model.parameters()}
    assert held == shard and 0 < len(held) < len(every), f"{where}: holds state of {len(held)}/{len(every)}"
    everyone = [None] * len(ranks)
    dist.all_gather_object(everyone, sorted(i for i, p in enumerate(model.parameters()) if id(p) in held), group=group)
    assert sorted(sum(everyone, [])) == list(range(len(every))), f"{where}: shards {everyone} do not partition"


@ddp_test(nps=(4,), timeout=300)
def test_ddp_and_zero_on_disjoint_subgroups_equal_gloo_and_one_process():
    """Data parallel over [0, 1] and [2, 3] (mtrain), a model-parallel layout [0, 2], [1, 3] too; ZeRO
    over a data-parallel subgroup and over the job."""
    from torch.nn.parallel import DistributedDataParallel as DDP
    me, n = init_mtrain()
    dp, _ = dist.new_subgroups_by_enumeration([[0, 1], [2, 3]])  # this rank's group, and all of them
    dp_ranks = [[0, 1], [2, 3]][me // 2]
    mp, _ = dist.new_subgroups_by_enumeration([[0, 2], [1, 3]])
    gloo_dp, _ = dist.new_subgroups_by_enumeration([[0, 1], [2, 3]], backend="gloo")
    assert dist.get_backend(dp) == "mtrain" and dist.get_backend(gloo_dp) == "gloo"
    # The two layouts' groups at once: a data-parallel op and a model-parallel op in flight together.
    a, b = torch.full((3,), float(me)), torch.full((3,), 10.0 * me)
    work_a, work_b = dist.all_reduce(a, group=dp, async_op=True), dist.all_reduce(b, group=mp, async_op=True)
    work_b.wait()
    work_a.wait()
    assert torch.equal(a, torch.full((3,), float(sum(dp_ranks))))
    assert torch.equal(b, torch.full((3,), 10.0 * (me % 2 + (me % 2 + 2))))

    steps = 4
    # DDP on the mtrain subgroup equals DDP on the gloo subgroup (ranks start from different weights:
    # DDP broadcasts group rank 0's; each pair trains on its own data).
    results = {}
    for name, group in (("gloo", gloo_dp), ("mtrain", dp)):
        model = DDP(small_model(me), process_group=group)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        for x, y in _batches(me, steps):
            optimizer.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            optimizer.step()
        results[name] = _flat(model.module)
    assert not np.allclose(results["mtrain"], _flat(small_model(dp_ranks[0]))), "training did not move the parameters"
    assert np.allclose(results["mtrain"], results["gloo"], rtol=1e-12, atol=1e-12), \
        f"rank {me}: DDP on mtrain differs from gloo by {np.abs(results['mtrain'] - results['gloo']).max()}"

    # ZeRO over the mtrain subgroup, then over the whole job (what already ran on backend mtrain).
    _zero_equals_one_process(dp, dp_ranks, me, steps)
    _zero_equals_one_process(None, list(range(n)), me, steps)
    dist.barrier()
    dist.destroy_process_group()


@ddp_test(nps=(3,))
def test_monitored_barrier_passes_and_names_the_ranks_that_stay_away():
    import mtrain.distributed as mtrain_dist
    me, n = init_mtrain()
    pair = dist.new_group([0, 2])
    gloo = dist.new_group(backend="gloo")
    store = dist.distributed_c10d._get_default_store()
    second = datetime.timedelta(seconds=1)
    mtrain_dist.monitored_barrier(timeout=second)
    mtrain_dist.monitored_barrier()  # the group's own timeout
    mtrain_dist.monitored_barrier(gloo, timeout=datetime.timedelta(seconds=30))  # torch's own, for gloo
    if me != 1:
        mtrain_dist.monitored_barrier(pair, timeout=second)
    else:
        assert mtrain_dist.monitored_barrier(pair, timeout=second) is None  # not a member: nothing to do
    with pytest.raises(ValueError, match="only implemented for GLOO"):
        dist.monitored_barrier(timeout=second)  # torch's refusal, why ours exists

    # Rank 1 stays away until rank 0 has given up (an event, not a sleep). Rank 2 waits longer than
    # rank 0 (each rank has its own timeout), so rank 0's verdict reaches it before its own deadline.
    long = datetime.timedelta(seconds=60)
    if me == 1:
        store.wait(["test.rank0.gave_up"])
    start = time.monotonic()
    with pytest.raises(RuntimeError) as info:
        mtrain_dist.monitored_barrier(timeout=second if me == 0 else long)
    elapsed = time.monotonic() - start
    if me == 0:
        store.set("test.rank0.gave_up", "1")
        assert str(info.value) == "monitored_barrier: rank 1 of the group did not arrive within 1 s", info.value
        assert 0.9 < elapsed < 10, f"rank 0 gave up after {elapsed:.2f} s"
    else:
        assert "rank 0 reports: rank 1 of the group did not arrive" in str(info.value), info.value
        assert elapsed < 30, f"rank {me} heard of it after {elapsed:.2f} s"
    # wait_all_ranks names every missing rank; a subgroup's ranks are named with their global ranks.
    if me != 0:
        store.wait(["test.rank0.gave_up.all"])
    with pytest.raises(RuntimeError, match=r"ranks 1, 2 of the group did not arrive" if me == 0 else
                       r"rank 0 reports: ranks 1, 2 of the group"):
        mtrain_dist.monitored_barrier(timeout=datetime.timedelta(seconds=0.5), wait_all_ranks=True)
    if me == 0:
        store.set("test.rank0.gave_up.all", "1")
        with pytest.raises(RuntimeError, match=r"rank 1 \(global rank 2\) of the group did not arrive"):
            mtrain_dist.monitored_barrier(pair, timeout=0.3)
        store.set("test.rank0.gave_up.pair", "1")
    elif me == 2:
        store.wait(["test.rank0.gave_up.pair"])
        with pytest.raises(RuntimeError, match=r"rank 1 \(global rank 2\) arrived, but group rank 0 reports"):
            mtrain_dist.monitored_barrier(pair, timeout=long)
    # Rank 0 stays away: the others give up by their own deadline, naming it. Rank 0 comes later, finds
    # everyone arrived and passes (as on gloo, where the others' messages were sent before they gave up).
    if me == 0:
        store.wait(["test.others.gave_up.1", "test.others.gave_up.2"])
        mtrain_dist.monitored_barrier(timeout=second)
    else:
        start = time.monotonic()
        with pytest.raises(RuntimeError, match=r"but group rank 0 \(0\) did not release it within 1 s"):
            mtrain_dist.monitored_barrier(timeout=second)
        assert time.monotonic() - start < 10
        store.set(f"test.others.gave_up.{me}", "1")
    mtrain_dist.monitored_barrier(timeout=datetime.timedelta(seconds=60))  # and it works again
    dist.barrier()
    dist.destroy_process_group()
