"""mtrain.torch process sets and join(), against Horovod 0.28's semantics.

Every rank body builds the single-process reference from every rank's data itself
(the data is a function of the rank), so one job checks both sides.
"""
import numpy as np

from tests.bindings.requires import require

require("torch", "pip install '.[torch]'")

import torch  # noqa: E402

from tests.bindings.test_torch_parity import rank_data  # noqa: E402  (distinct per rank and element)
from tests.mpi.harness import mpi_test  # noqa: E402


# -- process sets ------------------------------------------------------------------------------

@mpi_test(nps=(3,))
def test_ops_on_two_sets_interleaved_with_their_gradients():
    import mtrain.torch as hvd
    even, odd = hvd.ProcessSet([0, 2]), hvd.ProcessSet([1])
    hvd.init(process_sets=[even, odd])
    me = hvd.rank()
    assert (even.size(), odd.size()) == (2, 1)
    assert even.included() == (me != 1) and odd.included() == (me == 1)
    assert even.process_set_id != odd.process_set_id and 0 not in (even.process_set_id, odd.process_set_id)
    mine = even if me != 1 else odd
    members = mine.ranks
    # Interleave: a global op in flight while set ops run, in a different order per rank.
    pending = hvd.allreduce_async(rank_data(me, (5,)), op=hvd.Sum, name="global.first")
    x = rank_data(me, (3, 4)).requires_grad_()
    reduced = hvd.allreduce(x, name="set.ar", process_set=mine)
    expected = sum(rank_data(r, (3, 4)) for r in members) / len(members)
    assert torch.allclose(reduced, expected)
    reduced.backward(torch.full((3, 4), 2.0, dtype=torch.float64))
    # The gradient of an average is the average of the gradients, over the set.
    assert torch.allclose(x.grad, torch.full((3, 4), 2.0, dtype=torch.float64))
    rows = 1 + 2 * mine.rank()  # odd sizes, different per rank of the set
    y = rank_data(me, (rows, 3)).requires_grad_()
    gathered = hvd.allgather(y, name="set.ag", process_set=mine)
    assert torch.equal(gathered.detach(), torch.cat([rank_data(r, (1 + 2 * members.index(r), 3)) for r in members]))
    (gathered * torch.arange(gathered.numel(), dtype=torch.float64).reshape(gathered.shape)).sum().backward()
    # Backward: this rank's rows of the gradient averaged over the set (Horovod's
    # HorovodAllgather.backward, horovod/torch/mpi_ops.py); every rank's upstream is the same here.
    start = sum(1 + 2 * i for i in range(mine.rank()))
    weights = torch.arange(gathered.numel(), dtype=torch.float64).reshape(gathered.shape)
    assert torch.allclose(y.grad, weights[start:start + rows])
    root = members[-1]  # a global rank
    b = hvd.broadcast(rank_data(me, (2, 2)), root_rank=root, name="set.bc", process_set=mine)
    assert torch.equal(b, rank_data(root, (2, 2)))
    scattered = hvd.reducescatter(rank_data(me, (5, 2)), op=hvd.Sum, name="set.rs", process_set=mine)
    total = sum(rank_data(r, (5, 2)) for r in members)
    lo = sum(len(c) for c in np.array_split(np.arange(5), len(members))[:mine.rank()])
    assert torch.allclose(scattered, total[lo:lo + scattered.shape[0]])
    grouped = hvd.grouped_allreduce([rank_data(me, (3,)), rank_data(me, (0,)), rank_data(me, (1, 1))], op=hvd.Sum,
                                    name="set.gar", process_set=mine)
    for got, shape in zip(grouped, [(3,), (0,), (1, 1)]):
        assert torch.allclose(got, sum(rank_data(r, shape) for r in members))
    received, splits = hvd.alltoall(rank_data(me, (len(members), 2)), splits=[1] * len(members), name="set.a2a",
                                    process_set=mine)
    assert splits.tolist() == [1] * len(members)
    assert torch.equal(received, torch.stack([rank_data(r, (len(members), 2))[mine.rank()] for r in members]))
    assert hvd.allgather_object({"rank": me}, process_set=mine) == [{"rank": r} for r in members]
    assert hvd.broadcast_object(me * 10, root_rank=root, process_set=mine) == root * 10
    hvd.barrier(process_set=mine)
    assert torch.allclose(hvd.synchronize(pending), sum(rank_data(r, (5,)) for r in range(3)))


@mpi_test(nps=(3,))
def test_outsiders_and_wrong_roots_get_a_clear_error():
    import pytest as _pytest

    import mtrain.torch as hvd
    pair = hvd.ProcessSet([0, 2])
    hvd.init(process_sets=[pair])
    me = hvd.rank()
    if me == 1:
        with _pytest.raises(RuntimeError, match=r"rank 1 is not part of process set"):
            hvd.allreduce(torch.ones(2), process_set=pair)
        with _pytest.raises(ValueError, match="not part of"):
            pair.rank()
        assert pair.included() is False
    else:
        with _pytest.raises(RuntimeError, match=r"root_rank 1 is not part of process set"):
            hvd.broadcast(torch.ones(2), root_rank=1, process_set=pair)
        assert pair.rank() == (0 if me == 0 else 1)
    unregistered = hvd.ProcessSet([0, 1])
    with _pytest.raises(RuntimeError, match="not registered"):
        hvd.allreduce(torch.ones(1), process_set=unregistered)
    hvd.barrier()


@mpi_test(nps=(3,))
def test_distributed_optimizer_on_a_set_equals_one_process_on_the_sets_batch():
    import mtrain.torch as hvd
    hvd.init(process_sets="dynamic")
    pair = hvd.add_process_set([0, 2])
    me = hvd.rank()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 1)).double()
    reference = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 1)).double()
    reference.load_state_dict(model.state_dict())
    if pair.included():
        opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                       named_parameters=model.named_parameters(), process_set=pair)
        ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
        for step in range(3):
            batch = {r: rank_data(r + step, (2 * (r + 1), 3)) for r in pair.ranks}
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(batch[me]), batch[me].sum(dim=1, keepdim=True)).backward()
            opt.step()
            # One process on both ranks' batches: the shards differ in size, so the reference
            # averages the per-rank mean losses, as averaging the gradients does.
            ref_opt.zero_grad()
            sum(torch.nn.functional.mse_loss(reference(batch[r]), batch[r].sum(dim=1, keepdim=True))
                for r in pair.ranks).div(2).backward()
            ref_opt.step()
        for p, q in zip(model.parameters(), reference.parameters()):
            assert torch.allclose(p, q, atol=1e-12), (p, q)
    hvd.barrier()
    assert hvd.remove_process_set(pair) is True
    assert pair.process_set_id is None
    assert hvd.remove_process_set(hvd.global_process_set) is False


# -- join --------------------------------------------------------------------------------------

@mpi_test(nps=(1, 2, 3))
def test_join_with_ranks_finishing_at_different_steps():
    """Horovod's rule (horovod/common/controller.cc, ConstructResponse): while any rank has joined,
    all-reduces run with the joined ranks as zeros, and allgather, alltoall, reducescatter and
    broadcast raise a RuntimeError "... is not supported with Join" on every rank still running,
    after which the job goes on."""
    import pytest as _pytest

    import mtrain.torch as hvd
    hvd.init()
    n, me = hvd.size(), hvd.rank()
    steps = [2 + 2 * r for r in range(n)]  # rank r stops after steps[r]: the last rank trains longest
    for step in range(steps[me]):
        active = [r for r in range(n) if steps[r] > step]
        summed = hvd.allreduce(rank_data(me + step, (3, 5)), op=hvd.Sum, name="join.sum")
        assert torch.allclose(summed, sum(rank_data(r + step, (3, 5)) for r in active)), step
        # Average divides by every rank: the joined ones count as zeros (as Horovod).
        averaged = hvd.allreduce(rank_data(me + step, (7,)), name="join.avg")
        assert torch.allclose(averaged, sum(rank_data(r + step, (7,)) for r in active) / n)
        lowest = hvd.allreduce(rank_data(me + step, (4,)), op=hvd.Min, name="join.min")
        assert torch.allclose(lowest, torch.stack([rank_data(r + step, (4,)) for r in active]).min(dim=0).values)
        refused = {
            "Allgather": lambda: hvd.allgather(rank_data(me, (me + 1, 2)), name="join.ag"),
            "Alltoall": lambda: hvd.alltoall(rank_data(me, (n, 3)), name="join.a2a"),
            "Reducescatter": lambda: hvd.reducescatter(rank_data(me, (n + 1, 2)), op=hvd.Sum, name="join.rs"),
            "Broadcast": lambda: hvd.broadcast(rank_data(me, (2,)), root_rank=n - 1, name="join.bc.live"),
        }
        if len(active) < n:
            for what, call in refused.items():
                with _pytest.raises(RuntimeError, match=f"{what} is not supported with Join"):
                    call()
        else:
            assert torch.equal(refused["Allgather"](), torch.cat([rank_data(r, (r + 1, 2)) for r in range(n)]))
            assert torch.equal(refused["Broadcast"](), rank_data(n - 1, (2,)))
    assert hvd.join() == n - 1
    # After every rank joined, the job carries on together, unnamed ops included.
    assert torch.allclose(hvd.allreduce(torch.full((2,), float(me)), op=hvd.Sum), torch.full((2,), float(sum(range(n)))))


@mpi_test(nps=(2, 3))
def test_distributed_optimizer_keeps_training_after_a_rank_joined():
    import mtrain.torch as hvd
    hvd.init()
    n, me = hvd.size(), hvd.rank()
    torch.manual_seed(1)
    model = torch.nn.Linear(4, 2).double()
    reference = torch.nn.Linear(4, 2).double()
    reference.load_state_dict(model.state_dict())
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05),
                                   named_parameters=model.named_parameters())
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.05)
    steps = [3 + r for r in range(n)]
    for step in range(max(steps)):
        active = [r for r in range(n) if steps[r] > step]
        if me in active:
            opt.zero_grad()
            model(rank_data(me + step, (2, 4))).pow(2).sum().backward()
            opt.step()
        if me in active:
            # The reference: the gradients of the active ranks, summed, divided by every rank.
            ref_opt.zero_grad()
            sum(reference(rank_data(r + step, (2, 4))).pow(2).sum() for r in active).div(n).backward()
            ref_opt.step()
        if step == steps[me] - 1:
            last = hvd.join()
            assert last == n - 1
            break
    if me == n - 1:
        for p, q in zip(model.parameters(), reference.parameters()):
            assert torch.allclose(p, q, atol=1e-12), (p, q)


# -- SyncBatchNorm in float32 -------------------------------------------------------------------

@mpi_test(nps=(2, 3))
def test_sync_batch_norm_float32_keeps_the_variance_of_data_far_from_zero():
    """Data whose mean is large next to its spread: E[x²] - E[x]² in float32 cancels to noise."""
    import mtrain.torch as hvd
    hvd.init()
    n, me = hvd.size(), hvd.rank()
    whole = torch.cat([(rank_data(r, (5, 3)) * 0.01 + 3000.0 + r) for r in range(n)]).float()
    reference = torch.nn.BatchNorm1d(3)
    sync = hvd.SyncBatchNorm(3)
    out_all = reference(whole)
    out = sync(whole[me * 5:(me + 1) * 5])
    assert torch.allclose(out, out_all[me * 5:(me + 1) * 5], atol=2e-3), (out, out_all[me * 5:(me + 1) * 5])
    assert torch.allclose(sync.running_var, reference.running_var, rtol=1e-3)


@mpi_test(nps=(3,))
def test_join_stands_in_on_every_set_the_rank_belongs_to():
    """Rank 0 joins while rank 2, its partner in set [0, 2], still reduces on that set; an allgather
    on the set is refused there as Horovod's controller refuses it (controller.cc)."""
    import pytest as _pytest

    import mtrain.torch as hvd
    hvd.init()
    pair = hvd.add_process_set([0, 2])
    me = hvd.rank()
    if me == 2:
        for step in range(3):
            got = hvd.allreduce(rank_data(step, (4,)), op=hvd.Sum, name="pair.sum", process_set=pair)
            assert torch.equal(got, rank_data(step, (4,))), step  # rank 0 stands in with zeros
            with _pytest.raises(RuntimeError, match=r"Allgather is not supported with Join.*\[0\]"):
                hvd.allgather(rank_data(me, (2, 1)), name="pair.ag", process_set=pair)
    assert hvd.join() == 2
    if pair.included():
        got = hvd.allreduce(torch.full((2,), float(me)), op=hvd.Sum, name="pair.after", process_set=pair)
        assert torch.equal(got, torch.full((2,), 2.0))


# -- point-to-point (mtrain's own) ------------------------------------------------------------

@mpi_test(nps=(2, 3))
def test_send_and_recv_of_tensors_along_a_pipeline_of_ranks():
    """Activations down a chain of ranks and gradients back up, as pipeline stages pass them,
    with hvd.send/recv (async too): each rank adds its own part, so a misrouted tensor shows."""
    import mtrain.torch as hvd
    hvd.init()
    me, size = hvd.rank(), hvd.size()
    for dtype, shape in ((torch.float32, (3, 5)), (torch.bfloat16, (7,)), (torch.int64, (0, 4))):
        activation = torch.zeros(shape, dtype=dtype)
        if me > 0:
            assert hvd.recv(activation, me - 1, tag=1) is activation
        activation += rank_data(me, shape, dtype)
        if me < size - 1:
            hvd.synchronize(hvd.send_async(activation, me + 1, tag=1))
        want = torch.zeros(shape, dtype=dtype)
        for r in range(me + 1):  # the same additions, in the same order and dtype
            want += rank_data(r, shape, dtype)
        assert torch.equal(activation, want), f"{dtype} on rank {me}"
    # Backwards into a non-contiguous view (a transposed buffer's column).
    grad = torch.zeros(4, 6)
    pending = hvd.recv_async(grad.t()[2], me + 1) if me < size - 1 else None
    if me > 0:
        hvd.send(torch.arange(4.0) * (me + 1), me - 1)
    if pending is not None:
        assert hvd.synchronize(pending) is not None
        assert torch.equal(grad[:, 2], torch.arange(4.0) * (me + 2)) and grad.sum() == grad[:, 2].sum()
    try:
        hvd.send(torch.zeros(2), me)
        raise AssertionError("a send to this rank itself was taken")
    except ValueError as error:
        assert "is this rank" in str(error)
    hvd.barrier()
