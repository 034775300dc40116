"""mtrain.torch: collectives on tensors, DistributedOptimizer equal to large-batch training, broadcasts, errors.

Every rank body also trains the single-process reference itself (on the
concatenated batch), so one job checks both sides.
"""
import copy

import numpy as np
import pytest

from tests.bindings.requires import require

require("torch", "pip install '.[torch]'")

import torch  # noqa: E402

from tests.mpi.harness import mpi_test  # noqa: E402


def _model(seed: int, dtype=torch.float64):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3)).to(dtype)


def _batches(steps: int, rows: int, dtype=torch.float64):
    g = torch.Generator().manual_seed(1234)
    return [(torch.randn(rows, 6, generator=g, dtype=dtype), torch.randn(rows, 3, generator=g, dtype=dtype))
            for _ in range(steps)]


def _flat(model) -> np.ndarray:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).numpy()


def _assert_identical_across_ranks(hvd, array: np.ndarray, what: str) -> None:
    gathered = hvd.allgather(torch.from_numpy(np.ascontiguousarray(array).reshape(1, -1)))
    for r in range(hvd.size()):
        assert gathered[r].numpy().tobytes() == array.tobytes(), f"{what}: rank {r} differs from rank {hvd.rank()}"


@mpi_test(nps=(2, 3))
def test_distributed_optimizer_equals_one_process_on_the_concatenated_batch():
    import mtrain.torch as hvd
    n, me, b, steps = hvd.size(), hvd.rank(), 4, 3
    optimizers = {
        "sgd-momentum": lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9, weight_decay=0.01),
        "adam": lambda params: torch.optim.Adam(params, lr=0.05),
    }
    cases = [(1, hvd.Compression.none, 1e-12), (2, hvd.Compression.none, 1e-12), (1, hvd.Compression.fp16, 3e-3)]
    for opt_name, make in optimizers.items():
        for passes, compression, tol in cases:
            what = f"{opt_name} passes={passes} {compression.__name__}"
            reference = _model(0)
            model = copy.deepcopy(reference)
            ref_opt = make(reference.parameters())
            opt = hvd.DistributedOptimizer(make(model.parameters()), named_parameters=model.named_parameters(),
                                           compression=compression, backward_passes_per_step=passes)
            assert isinstance(opt, type(ref_opt)) and type(opt).__name__ == type(ref_opt).__name__
            for x, y in _batches(steps, n * b):
                ref_opt.zero_grad()
                torch.nn.functional.mse_loss(reference(x), y).backward()
                ref_opt.step()
                opt.zero_grad()
                mine_x, mine_y = x[me * b:(me + 1) * b], y[me * b:(me + 1) * b]
                for k in range(passes):  # local accumulation: each pass sees 1/passes of the rank's rows
                    part = slice(k * b // passes, (k + 1) * b // passes)
                    loss = torch.nn.functional.mse_loss(model(mine_x[part]), mine_y[part]) / passes
                    loss.backward()
                opt.step()
            got, want = _flat(model), _flat(reference)
            assert np.allclose(got, want, rtol=tol, atol=tol), f"{what}: max diff {np.abs(got - want).max()}"
            assert not np.allclose(want, _flat(_model(0))), f"{what}: training did not move the parameters"
            _assert_identical_across_ranks(hvd, got, what)
            assert opt.state_dict()["state"].keys() == ref_opt.state_dict()["state"].keys(), what


@mpi_test(nps=(3,))  # every root of a 3-rank job
def test_broadcast_makes_differently_initialised_ranks_identical():
    import mtrain.torch as hvd
    n, me = hvd.size(), hvd.rank()
    for root in range(n):
        for root_stepped in (True, False):
            model = _model(seed=100 + me)  # different on every rank
            opt = torch.optim.Adam(model.parameters(), lr=0.01 * (me + 1), weight_decay=0.1)
            if me != root or root_stepped:  # ranks with state, and (once) a root without any
                x, y = _batches(1, 5)[0]
                torch.nn.functional.mse_loss(model(x * (me + 1)), y).backward()
                opt.step()
            hvd.broadcast_parameters(model.state_dict(), root_rank=root)
            hvd.broadcast_optimizer_state(opt, root_rank=root)
            what = f"root {root} stepped={root_stepped}"
            _assert_identical_across_ranks(hvd, _flat(model), what + " parameters")
            state = opt.state_dict()
            assert hvd.broadcast_object(repr(state["param_groups"]), root) == repr(state["param_groups"]), what
            assert len(state["state"]) == (len(list(model.parameters())) if root_stepped else 0), what
            for i, s in state["state"].items():
                for key in ("exp_avg", "exp_avg_sq", "step"):
                    _assert_identical_across_ranks(hvd, s[key].numpy(), f"{what} state {i}.{key}")
            # One distributed step later the ranks are still identical.
            dist = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters())
            x, y = _batches(1, 4)[0]
            torch.nn.functional.mse_loss(model(x + me), y).backward()
            dist.step()
            _assert_identical_across_ranks(hvd, _flat(model), what + " after a step")
    # named_parameters() generators and plain lists work too.
    model = _model(seed=7 + me)
    hvd.broadcast_parameters(model.named_parameters(), root_rank=0)
    _assert_identical_across_ranks(hvd, _flat(model), "named_parameters()")


@mpi_test(nps=(2, 3))
def test_collectives_on_tensors_and_partial_gradients():
    import mtrain.torch as hvd
    n, me = hvd.size(), hvd.rank()
    base = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    mine = base * (me + 1) - me
    want_sum = sum(base * (r + 1) - r for r in range(n))
    assert torch.equal(hvd.allreduce(mine, op=hvd.Sum), want_sum)
    assert torch.allclose(hvd.allreduce(mine), want_sum / n)
    assert torch.allclose(hvd.allreduce(mine, average=True), want_sum / n)
    every = torch.stack([base * (r + 1) - r for r in range(n)])
    assert torch.equal(hvd.allreduce(mine, op=hvd.Max), every.max(0).values)
    assert torch.equal(hvd.allreduce(mine, op=hvd.Min), every.min(0).values)
    assert torch.equal(hvd.allreduce(mine, op=hvd.Sum, prescale_factor=2.0, postscale_factor=0.5), want_sum)
    inplace = mine.clone()
    assert hvd.allreduce_(inplace, op=hvd.Sum) is inplace and torch.equal(inplace, want_sum)
    # Non-contiguous in place: written back into the caller's strided view.
    wide = torch.zeros(4, 3, dtype=torch.int64)
    column = wide.t()[1]
    column.copy_(torch.arange(4) + 10 * me)
    hvd.allreduce_(column, op=hvd.Sum)
    assert wide[:, 1].tolist() == [sum(k + 10 * r for r in range(n)) for k in range(4)] and wide[:, 0].eq(0).all()
    # bfloat16 and the fp16 compressor.
    bf = hvd.allreduce(torch.full((5,), float(me + 1), dtype=torch.bfloat16), op=hvd.Sum)
    assert bf.dtype == torch.bfloat16 and bf.float().tolist() == [float(n * (n + 1) // 2)] * 5
    fp = hvd.allreduce(torch.full((3,), 1.5 + me, dtype=torch.float64), compression=hvd.Compression.fp16)
    assert fp.dtype == torch.float64 and torch.allclose(fp, torch.full((3,), 1.5 + (n - 1) / 2, dtype=torch.float64))
    # Async handles, grouped.
    handle = hvd.allreduce_async(mine, op=hvd.Sum, name="async.one")
    group = hvd.grouped_allreduce([mine, mine[0] * 2], op=hvd.Sum)
    assert torch.equal(hvd.synchronize(handle), want_sum) and hvd.poll(handle)
    assert torch.equal(group[0], want_sum) and torch.equal(group[1], want_sum[0] * 2)
    # Differentiable all-reduce: the gradient is the all-reduce of the gradients.
    x = torch.full((2,), float(me + 1), requires_grad=True)
    (hvd.allreduce(x, op=hvd.Sum) * (me + 1)).sum().backward()
    assert x.grad.tolist() == [float(n * (n + 1) // 2)] * 2
    # allgather with different first dimensions, broadcast, reducescatter, alltoall.
    got = hvd.allgather(torch.full((me + 1, 2), me, dtype=torch.int32))
    assert got.tolist() == [[r, r] for r in range(n) for _ in range(r + 1)]
    for root in range(n):
        t = torch.arange(6.0).reshape(2, 3) + me
        assert torch.equal(hvd.broadcast(t, root), torch.arange(6.0).reshape(2, 3) + root)
        assert hvd.broadcast_(t, root_rank=root) is t and torch.equal(t, torch.arange(6.0).reshape(2, 3) + root)
    rows = torch.arange(n * 2 + 1, dtype=torch.float64).reshape(-1, 1) * (me + 1)
    share = hvd.reducescatter(rows, op=hvd.Sum)
    lo = me * 2 + min(me, 1)
    total = n * (n + 1) / 2
    assert share.reshape(-1).tolist() == [k * total for k in range(lo, lo + 2 + (1 if me < 1 else 0))]
    splits = [(me + r) % 2 + 1 for r in range(n)]
    data = torch.cat([torch.full((s,), 100 * me + dest) for dest, s in enumerate(splits)])
    received, received_splits = hvd.alltoall(data, splits=splits)
    assert received_splits.tolist() == [(src + me) % 2 + 1 for src in range(n)]
    assert received.tolist() == [100 * src + me for src in range(n) for _ in range((src + me) % 2 + 1)]
    assert hvd.broadcast_object({"r": me}, root_rank=n - 1) == {"r": n - 1}
    assert hvd.allgather_object(me * 3) == [r * 3 for r in range(n)]

    # DistributedOptimizer: a gradient missing on some ranks counts as zeros; synchronize, clip, step.
    torch.manual_seed(0)
    a, b = torch.nn.Parameter(torch.ones(3, dtype=torch.float64)), torch.nn.Parameter(torch.ones(2, dtype=torch.float64))
    opt = hvd.DistributedOptimizer(torch.optim.SGD([a, b], lr=1.0), named_parameters=[("a", a), ("b", b)])
    # Rank r's loss uses b only on rank 0: b's averaged gradient is rank 0's / n.
    loss = (a * (me + 1)).sum() + ((b * 3).sum() if me == 0 else 0)
    loss.backward()
    opt.synchronize()
    mean_rank = sum(range(1, n + 1)) / n
    assert torch.allclose(a.grad, torch.full((3,), mean_rank, dtype=torch.float64)), a.grad
    assert torch.allclose(b.grad, torch.full((2,), 3.0 / n, dtype=torch.float64)), b.grad
    torch.nn.utils.clip_grad_norm_([a, b], max_norm=0.5)
    with opt.skip_synchronize():
        opt.step()
    clipped = np.concatenate([a.detach().numpy(), b.detach().numpy()])
    _assert_identical_across_ranks(hvd, clipped, "after clipping")
    # synchronize() then step() without the context does not average a second time.
    opt.zero_grad()
    (a * (me + 1)).sum().backward()
    opt.synchronize()
    before = a.detach().clone()
    opt.step()
    assert torch.allclose(a.detach(), before - mean_rank), "step() after synchronize() changed the gradients"


@mpi_test(nps=(2,))
def test_errors_name_the_problem():
    import mtrain.torch as hvd
    me = hvd.rank()
    model = _model(0)
    params = list(model.named_parameters())
    with pytest.raises(ValueError, match="duplicates: 0.weight"):
        hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                 named_parameters=params + [params[0]])
    with pytest.raises(ValueError, match=r"misses 1 .*\(8,\)"):
        hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                 named_parameters=[p for p in params if p[0] != "0.bias"])
    with pytest.raises(ValueError, match="tuples"):
        hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=model.parameters())
    with pytest.raises(ValueError, match="op=Average or op=Sum"):
        hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), op=hvd.Min)
    with pytest.raises(ValueError, match="op=Average"):
        hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), op=hvd.Sum,
                                 gradient_predivide_factor=2.0)
    with pytest.raises(ValueError, match="positive integer"):
        hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), backward_passes_per_step=0)
    with pytest.raises(TypeError, match="torch.optim.Optimizer"):
        hvd.DistributedOptimizer(model)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=params)
    x, y = _batches(1, 4)[0]
    torch.nn.functional.mse_loss(model(x), y).backward()
    with pytest.raises(RuntimeError, match="zero_grad.*before"):
        opt.zero_grad()
    with pytest.raises(RuntimeError, match="more than backward_passes_per_step=1"):
        torch.nn.functional.mse_loss(model(x), y).backward()
    opt.step()
    with pytest.raises(NotImplementedError, match="supports CPU and CUDA tensors"):
        hvd.allreduce(torch.zeros(3, device="meta"))
    with pytest.raises(TypeError, match="torch.Tensor"):
        hvd.allreduce(np.zeros(3))
    with pytest.raises(ValueError, match="state_dict"):
        hvd.broadcast_parameters(3, root_rank=0)
    # A model that differs between ranks: the runtime names the tensor and the shapes.
    other = torch.nn.Linear(3 + me, 2).double()
    odd = hvd.DistributedOptimizer(torch.optim.SGD(other.parameters(), lr=0.1),
                                   named_parameters=other.named_parameters())
    other(torch.zeros(1, 3 + me, dtype=torch.float64)).sum().backward()
    with pytest.raises(hvd.MismatchError, match="weight"):
        odd.step()
