"""op=Adasum through mtrain.torch: the collectives, and DistributedOptimizer's delta optimizer.

horovod/torch/optimizer.py ``_DistributedAdasumOptimizer``: each rank steps the wrapped optimizer
on its own (accumulated) gradients, one parameter at a time; the step's delta is all-reduced
with Adasum and the parameter becomes its value before the step plus the combined delta.
"""
import numpy as np
import pytest

from tests.bindings.requires import require

require("torch", "pip install '.[torch]'")

import torch  # noqa: E402

from tests.mpi.adasum_reference import assert_close, rank_tensors, reference  # noqa: E402
from tests.mpi.harness import mpi_test  # noqa: E402


@mpi_test(nps=(2, 4))
def test_torch_collectives_take_adasum():
    """horovod/torch/mpi_ops.py: allreduce, allreduce_ and grouped_allreduce pass op=Adasum to the
    runtime; the results are the reference recursion's, tensor by tensor (float32 and float64)."""
    import mtrain.torch as hvd
    n, me = hvd.size(), hvd.rank()
    shapes = [(5,), (3, 7), (1,), (64, 9)]
    for dtype in (np.float32, np.float64):
        per_rank = [rank_tensors(r, shapes, dtype, salt=1) for r in range(n)]
        want = reference(per_rank)
        mine = [torch.from_numpy(t.copy()) for t in per_rank[me]]
        got = hvd.grouped_allreduce(mine, op=hvd.Adasum, name=f"torch.adasum.{np.dtype(dtype).name}")
        for index, (g, w) in enumerate(zip(got, want)):
            assert_close(g.numpy(), w, f"grouped {np.dtype(dtype).name} tensor {index} np={n}")
        one = hvd.allreduce(mine[1], op=hvd.Adasum)
        assert_close(one.numpy(), want[1], f"allreduce np={n}")
        in_place = mine[3].clone()
        assert hvd.allreduce_(in_place, op=hvd.Adasum, name="torch.adasum.inplace") is in_place
        assert_close(in_place.numpy(), want[3], f"allreduce_ np={n}")
    with pytest.raises(TypeError, match="Adasum reduces float16, float32 or float64"):
        hvd.allreduce(torch.arange(4), op=hvd.Adasum)


def _model() -> torch.nn.Module:
    torch.manual_seed(7)
    return torch.nn.Sequential(torch.nn.Linear(5, 4), torch.nn.Tanh(), torch.nn.Linear(4, 1)).double()


def _batch(rank: int, step: int, rows: int = 6):
    g = torch.Generator().manual_seed(1000 * rank + step)
    x = torch.randn(rows, 5, generator=g, dtype=torch.float64)
    y = (x @ torch.tensor([1.0, -2.0, 0.5, 3.0, -1.0], dtype=torch.float64)).unsqueeze(1) + 0.25 * rank
    return x, y


def _simulate(n: int, steps: int, passes: int, lr: float, momentum: float) -> "list[torch.Tensor]":
    """Every rank's local step, then the deltas combined by the NumPy reference: the parameters
    after ``steps`` steps, computed on one process (each rank keeps its own optimizer state)."""
    models = [_model() for _ in range(n)]
    opts = [torch.optim.SGD(m.parameters(), lr=lr, momentum=momentum) for m in models]
    for step in range(steps):
        starts = [p.detach().clone() for p in models[0].parameters()]
        deltas = []
        for r in range(n):
            for k in range(passes):
                x, y = _batch(r, step * passes + k)
                torch.nn.functional.mse_loss(models[r](x), y).backward()
            opts[r].step()
            opts[r].zero_grad()
            deltas.append([(p.detach() - s).numpy() for p, s in zip(models[r].parameters(), starts)])
        combined = reference(deltas)
        with torch.no_grad():
            for m in models:
                for p, s, d in zip(m.parameters(), starts, combined):
                    p.copy_(s + torch.from_numpy(d))
    return [p.detach().clone() for p in models[0].parameters()]


@mpi_test(nps=(1, 2, 4))
def test_distributed_optimizer_adasum_combines_the_steps_deltas():
    """horovod/torch/optimizer.py DistributedOptimizer(op=Adasum): the delta optimizer on more than
    one rank (with backward_passes_per_step=2: gradients summed over two passes, one step), and on
    one rank Horovod's plain optimizer (Adasum of one rank: the local step). Then a model trained
    with Adasum: the loss falls and every rank holds the same parameters."""
    import mtrain.torch as hvd
    n, me = hvd.size(), hvd.rank()
    lr, momentum, passes, steps = 0.05, 0.9, 2, 3
    model = _model()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum),
                                   named_parameters=model.named_parameters(), op=hvd.Adasum,
                                   backward_passes_per_step=passes)
    assert isinstance(opt, torch.optim.SGD)
    for step in range(steps):
        for k in range(passes):
            x, y = _batch(me, step * passes + k)
            torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    want = _simulate(n, steps, passes, lr, momentum)
    for (name, p), w in zip(model.named_parameters(), want):
        assert torch.allclose(p.detach(), w, rtol=1e-12, atol=1e-14), f"{name} np={n}: {p} != {w}"
    if n > 1:
        with pytest.raises(AssertionError, match="Skipping synchronization is not supported"):
            with opt.skip_synchronize():
                pass
    # Training: a fresh model and Adam, one backward pass per step.
    model = _model()
    opt = hvd.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=0.02),
                                   named_parameters=model.named_parameters(), op=hvd.Adasum)
    x, y = _batch(me, 99, rows=32)
    losses = []
    for _ in range(60):
        loss = torch.nn.functional.mse_loss(model(x), y)
        losses.append(float(loss))
        loss.backward()
        opt.step()
        opt.zero_grad()
    assert losses[-1] < 0.2 * losses[0], f"np={n}: loss {losses[0]:.3f} -> {losses[-1]:.3f}"
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).numpy()
    everyone = hvd.allgather_object(flat.tobytes())
    assert all(blob == everyone[0] for blob in everyone), "the ranks' parameters differ"


@mpi_test(nps=(2,))
def test_distributed_optimizer_adasum_refusals():
    """horovod/torch/optimizer.py: Adasum with a non-global process set is NotImplementedError;
    gradient_predivide_factor needs op=Average; a reduce-scatter never takes Adasum."""
    import mtrain.torch as hvd
    model = _model()
    pset = hvd.add_process_set([1])
    try:
        with pytest.raises(NotImplementedError, match="Adasum does not support non-global process sets yet"):
            hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), op=hvd.Adasum, process_set=pset)
    finally:
        hvd.remove_process_set(pset)
    with pytest.raises(ValueError, match="gradient_predivide_factor"):
        hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), op=hvd.Adasum,
                                 gradient_predivide_factor=2.0)
    with pytest.raises(RuntimeError, match="Reducescatter currently only supports AVERAGE and SUM"):
        hvd.reducescatter(torch.ones(4, 2), op=hvd.Adasum)
