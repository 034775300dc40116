"""mtrain.torch against Horovod 0.28's own rules where they differ from the textbook ones:
the backward functions of the collectives, DistributedOptimizer on a rank outside its process
set and with sparse_as_dense, what broadcast_optimizer_state leaves behind, the class of a refused
op, and the step-after-synchronize warning.

Every rank body builds its reference from every rank's data itself (the data is a function of
the rank), so one job checks both sides. Each test names the Horovod source it follows.
"""
import pytest

from tests.bindings.requires import require

require("torch", "pip install '.[torch]'")

import torch  # noqa: E402

from tests.bindings.test_torch_parity import rank_data, rows_of  # noqa: E402  (distinct per rank and element)
from tests.mpi.harness import mpi_test  # noqa: E402


def _upstream(shape, r: int) -> torch.Tensor:
    """Rank r's gradient arriving at an op's output: distinct per rank and element, never zero."""
    count = 1
    for d in shape:
        count *= d
    return (torch.arange(count, dtype=torch.float64) * 0.11 + r * 0.7 + 0.3).reshape(shape)


def _grads(outs, inputs, me: int):
    """Backward from ``_upstream`` at each of ``outs``; the gradients of ``inputs``."""
    outs = list(outs) if isinstance(outs, (list, tuple)) else [outs]
    torch.autograd.backward(outs, [_upstream(o.shape, me) for o in outs])
    return [t.grad for t in inputs]


def _same(label: str, got: torch.Tensor, want: torch.Tensor) -> None:
    assert got is not None and got.shape == want.shape and torch.allclose(got, want, atol=1e-12), \
        f"{label}: got {got}, Horovod's rule gives {want}"


@mpi_test(nps=(2, 3))
def test_backward_of_each_collective_is_horovods():
    """horovod/torch/mpi_ops.py: HorovodAllgather / HorovodGroupedAllgather.backward (this rank's
    rows of an Average all-reduce of the gradient), HorovodBroadcast.backward (an Average all-reduce,
    zeroed off the root), HorovodReducescatter / HorovodGroupedReducescatter.backward (an allgather,
    times the set's size for Sum, times prescale and postscale), HorovodAlltoall.backward (an
    alltoall back with the received splits)."""
    import mtrain.torch as hvd
    n, me = hvd.size(), hvd.rank()

    # allgather: rows differ per rank (odd sizes); rank r's output is the whole concatenation.
    rows = [2 * r + 1 for r in range(n)]
    lo = sum(rows[:me])
    x = rank_data(me, (rows[me], 3)).requires_grad_()
    out = hvd.allgather(x)
    (got,) = _grads(out, [x], me)
    _same("allgather", got, sum(_upstream(out.shape, r) for r in range(n))[lo:lo + rows[me]] / n)

    a, b = rank_data(me, (rows[me], 2)).requires_grad_(), rank_data(me + 5, (me + 1,)).requires_grad_()
    outs = hvd.grouped_allgather([a, b])
    got_a, got_b = _grads(outs, [a, b], me)
    _same("grouped_allgather[0]", got_a, sum(_upstream(outs[0].shape, r) for r in range(n))[lo:lo + rows[me]] / n)
    lo_b = sum(r + 1 for r in range(me))
    _same("grouped_allgather[1]", got_b, sum(_upstream(outs[1].shape, r) for r in range(n))[lo_b:lo_b + me + 1] / n)

    for root in range(n):
        x = rank_data(me, (3, 5)).requires_grad_()
        (got,) = _grads(hvd.broadcast(x, root), [x], me)
        want = sum(_upstream((3, 5), r) for r in range(n)) / n if me == root else torch.zeros(3, 5, dtype=torch.float64)
        _same(f"broadcast root {root}", got, want)

    total = 2 * n + 1  # uneven split: the first total % n ranks get one more row
    for op, pre, post in ((hvd.Sum, 1.0, 1.0), (hvd.Average, 1.0, 1.0), (hvd.Sum, 0.5, 3.0), (hvd.Average, 2.0, 0.25)):
        factor = pre * post * (n if op == hvd.Sum else 1)
        x = rank_data(me, (total, 2)).requires_grad_()
        (got,) = _grads(hvd.reducescatter(x, op=op, prescale_factor=pre, postscale_factor=post), [x], me)
        gathered = torch.cat([_upstream((rows_of(total, n, r)[1] - rows_of(total, n, r)[0], 2), r)
                              for r in range(n)])
        _same(f"reducescatter {op!r} {pre} {post}", got, gathered * factor)
        a, b = rank_data(me, (total, 2)).requires_grad_(), rank_data(me + 1, (n + 2,)).requires_grad_()
        outs = hvd.grouped_reducescatter([a, b], op=op, prescale_factor=pre, postscale_factor=post)
        got_a, got_b = _grads(outs, [a, b], me)
        _same(f"grouped_reducescatter[0] {op!r}", got_a, gathered * factor)
        gathered_b = torch.cat([_upstream((rows_of(n + 2, n, r)[1] - rows_of(n + 2, n, r)[0],), r)
                                for r in range(n)])
        _same(f"grouped_reducescatter[1] {op!r}", got_b, gathered_b * factor)

    # alltoall: rank r sends splits[r][d] rows to rank d; the gradient of the rows rank me sent to d
    # is what d's upstream holds where d received them.
    splits = [[(r + 2 * d) % 3 + (r == d) for d in range(n)] for r in range(n)]
    x = rank_data(me, (sum(splits[me]), 2)).requires_grad_()
    received, _ = hvd.alltoall(x, splits=torch.tensor(splits[me], dtype=torch.int32))
    (got,) = _grads(received, [x], me)
    parts = []
    for d in range(n):
        at = sum(splits[src][d] for src in range(me))
        parts.append(_upstream((sum(splits[src][d] for src in range(n)), 2), d)[at:at + splits[me][d]])
    _same("alltoall splits", got, torch.cat(parts))


@mpi_test(nps=(2, 3))
def test_distributed_optimizer_outside_its_set_sparse_as_dense_and_the_step_warning():
    """horovod/torch/optimizer.py: _DistributedOptimizer.__init__ registers no hooks on a rank
    outside process_set and synchronize() returns at once there (local training);
    synchronize() makes a sparse_as_dense gradient sparse again (``to_sparse``) before the update;
    step() after synchronize() outside skip_synchronize() warns "optimizer.step() called without
    optimizer.skip_synchronize() ..."."""
    import mtrain.torch as hvd
    hvd.init(process_sets="dynamic")
    n, me = hvd.size(), hvd.rank()
    members = [r for r in range(n) if r != 1]  # rank 1 is outside: a set of one rank at np 2
    subset = hvd.add_process_set(members)

    def batch(r: int, step: int):
        x = rank_data(r + step, (r + 2, 3))
        return x, x.sum(dim=1, keepdim=True) * 0.5 - r

    torch.manual_seed(3)
    model = torch.nn.Linear(3, 1).double()
    reference = torch.nn.Linear(3, 1).double()
    reference.load_state_dict(model.state_dict())
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters(), process_set=subset)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    mine = members if me in members else [me]  # whose batches this rank's update averages
    for step in range(3):
        opt.zero_grad()
        x, y = batch(me, step)
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        ref_opt.zero_grad()
        sum(torch.nn.functional.mse_loss(reference(batch(r, step)[0]), batch(r, step)[1])
            for r in mine).div(len(mine)).backward()
        ref_opt.step()
    for p, q in zip(model.parameters(), reference.parameters()):
        assert torch.allclose(p, q, atol=1e-12), (me, p, q)
    hvd.barrier()

    # sparse_as_dense with SparseAdam (which takes sparse gradients only) equals one process
    # averaging every rank's gradient. Ids overlap between ranks; weights are positive, so no
    # touched entry sums to zero.
    torch.manual_seed(5)
    emb = torch.nn.Embedding(11, 3, sparse=True).double()
    ref_emb = torch.nn.Embedding(11, 3, sparse=True).double()
    ref_emb.load_state_dict(emb.state_dict())
    opt = hvd.DistributedOptimizer(torch.optim.SparseAdam(emb.parameters(), lr=0.05),
                                   named_parameters=emb.named_parameters(), sparse_as_dense=True)
    ref_opt = torch.optim.SparseAdam(ref_emb.parameters(), lr=0.05)

    def ids(r: int, step: int) -> torch.Tensor:
        return torch.tensor([(3 * r + 2 * step + k) % 11 for k in range(2 * r + 3)])

    for step in range(3):
        opt.zero_grad()
        (emb(ids(me, step)) * _upstream((2 * me + 3, 3), me)).sum().backward()
        assert emb.weight.grad.is_sparse
        opt.synchronize()
        assert emb.weight.grad.is_sparse, "sparse_as_dense left a dense gradient: SparseAdam refuses it"
        with opt.skip_synchronize():
            opt.step()
        ref_opt.zero_grad()
        sum((ref_emb(ids(r, step)) * _upstream((2 * r + 3, 3), r)).sum() for r in range(n)).div(n).backward()
        ref_opt.step()
        assert torch.allclose(emb.weight, ref_emb.weight, atol=1e-12), (step, emb.weight, ref_emb.weight)

    # step() after synchronize() without skip_synchronize(): Horovod's words open the warning.
    p = torch.nn.Parameter(torch.zeros(3, dtype=torch.float64))
    opt = hvd.DistributedOptimizer(torch.optim.SGD([p], lr=1.0), named_parameters=[("p", p)])
    (p * (me + 1.0)).sum().backward()
    opt.synchronize()
    with pytest.warns(UserWarning, match=r"^optimizer\.step\(\) called without optimizer\.skip_synchronize\(\)") \
            as caught:
        opt.step()
    text = str(caught[0].message)
    assert "skip_synchronize():" in text and len(text) > 120, text  # and our remedy after it
    assert torch.allclose(p.detach(), torch.full((3,), -(n + 1) / 2, dtype=torch.float64))


@mpi_test(nps=(2, 3))
def test_optimizer_state_broadcast_leaves_zero_gradients_and_refusals_are_runtime_errors():
    """horovod/torch/functions.py broadcast_optimizer_state: a stateless optimizer's parameters that
    require a gradient are given a zero one (sparse for SparseAdam and a model's sparse embeddings);
    horovod/torch/mpi_ops.py and horovod/common/operations.cc / controller.cc: an op a collective
    does not support, an Adasum it cannot run, a scalar to alltoall and a collective before init
    are refused as RuntimeError (NotImplementedError, HorovodInternalError); horovod/torch/mpi_ops.py
    reducescatter and its async and grouped forms take process_set before the scale factors, so
    positional callers pass them in that order."""
    import mtrain.torch as hvd
    n, me = hvd.size(), hvd.rank()

    torch.manual_seed(me)  # different on every rank: root's must win
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2)).double()
    model[1].bias.requires_grad_(False)
    model[0].bias.grad = torch.full((4,), me + 0.5, dtype=torch.float64)  # one that exists stays
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    before = [p.detach().clone() for p in model.parameters()]
    hvd.broadcast_optimizer_state(opt, root_rank=0, model=model)
    assert opt.state_dict()["state"] == {}, "broadcast_optimizer_state stepped the optimizer"
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before)), "parameters moved"
    for name, p in model.named_parameters():
        if name == "1.bias":
            assert p.grad is None, "a frozen parameter got a gradient"
        elif name == "0.bias":
            assert torch.equal(p.grad, torch.full((4,), me + 0.5, dtype=torch.float64)), name
        else:
            assert p.grad is not None and not p.grad.is_sparse and torch.equal(p.grad, torch.zeros_like(p)), name
    emb = torch.nn.Embedding(7, 2, sparse=True).double()
    hvd.broadcast_optimizer_state(torch.optim.SparseAdam(emb.parameters()), root_rank=n - 1)
    assert emb.weight.grad.is_sparse and torch.equal(emb.weight.grad.to_dense(), torch.zeros(7, 2).double())

    # Refusals: every rank makes the same call, so each raises at once.
    def refused(call, fragment: str) -> None:
        with pytest.raises(RuntimeError, match=fragment) as caught:
            call()
        assert isinstance(caught.value, ValueError), "still the ValueError mtrain raised before"

    t = rank_data(me, (n, 2))
    if n == 3:  # Adasum needs a power-of-two number of ranks: Horovod's NotImplementedError
        for call in (lambda: hvd.allreduce(t, op=hvd.Adasum),
                     lambda: hvd.allreduce_async_(t.clone(), name="rules.adasum", op=hvd.Adasum),
                     lambda: hvd.grouped_allreduce([t, t * 2], op=hvd.Adasum)):
            with pytest.raises(NotImplementedError, match="non-power of 2 ranks"):
                call()
    refused(lambda: hvd.reducescatter(t, op=hvd.Adasum), "Adasum")
    refused(lambda: hvd.grouped_reducescatter([t], op=hvd.Adasum), "Adasum")
    refused(lambda: hvd.sparse_allreduce_async(t.to_sparse(), name="rules.sparse", op=hvd.Min), "op=Average")
    refused(lambda: hvd.alltoall(torch.tensor(1.5 + me)), "at least one dimension")
    # The runtime still works afterwards.
    assert torch.equal(hvd.allreduce(torch.full((3,), me + 1.0), op=hvd.Sum), torch.full((3,), n * (n + 1) / 2))
    hvd.shutdown()
    refused(lambda: hvd.allreduce(t), "not initialized")
    hvd.init()  # the harness shuts it down after the body
    assert torch.equal(hvd.broadcast(t, root_rank=0), rank_data(0, (n, 2)))

    # Horovod's parameter order of the reduce-scatters, called positionally (rows: an uneven split).
    rows = rank_data(me, (2 * n + 1, 2))
    want = hvd.reducescatter(rows, op=hvd.Sum, prescale_factor=0.5, postscale_factor=3.0)
    assert not torch.equal(want, hvd.reducescatter(rows, op=hvd.Sum))  # the factors count
    none, world = hvd.Compression.none, hvd.global_process_set
    assert torch.equal(hvd.reducescatter(rows, "rules.rs", none, hvd.Sum, world, 0.5, 3.0), want)
    assert torch.equal(hvd.synchronize(hvd.reducescatter_async(rows, "rules.rsa", hvd.Sum, world, 0.5, 3.0)), want)
    got = hvd.grouped_reducescatter([rows, rows * 2], "rules.grs", none, hvd.Sum, world, 0.5, 3.0)
    assert torch.equal(got[0], want) and torch.equal(got[1], want * 2)
    got = hvd.synchronize(hvd.grouped_reducescatter_async([rows], "rules.grsa", hvd.Sum, world, 0.5, 3.0))
    assert torch.equal(got[0], want)
