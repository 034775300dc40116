"""mtrain.torch's per-tensor path: NumPy views kept from step to step, and when they are not.

A kept view is only valid for the very tensor it was made from, with the same
memory and shape: these tests change each of those between steps (new gradient
tensors from zero_grad(set_to_none=True), gradients kept with set_to_none=False,
a tensor given new storage or resized under the same name) and check every result.
"""
import numpy as np
import pytest

from tests.bindings.requires import require

require("torch", "pip install '.[torch]'")

import torch  # noqa: E402

from tests.mpi.harness import mpi_test  # noqa: E402


def _expected_sum(n: int, shape, salt: int) -> torch.Tensor:
    return sum(_values(r, shape, salt) for r in range(n))


def _values(rank: int, shape, salt: int) -> torch.Tensor:
    count = int(np.prod(shape)) if shape else 1
    return ((torch.arange(count, dtype=torch.float64) * 3 + salt * 7) % 101 + rank * 1000).reshape(shape)


@mpi_test(nps=(1, 2, 3))
def test_named_tensors_reused_replaced_resized_and_restored():
    import mtrain.torch as hvd
    n, me = hvd.size(), hvd.rank()
    kept = _values(me, (4, 5), 0)
    for step in range(8):
        if step == 3:
            kept = _values(me, (4, 5), step)  # a new tensor under the same name
        elif step == 4:
            kept.data = _values(me, (4, 5), step)  # same tensor object, new storage
        elif step == 5:
            kept.resize_(7)  # same tensor object, new shape
            kept.copy_(_values(me, (7,), step))
        else:
            kept.copy_(_values(me, tuple(kept.shape), step))
        before = kept
        handle = hvd.allreduce_async_(kept, op=hvd.Sum, name="kept")
        result = hvd.synchronize(handle)
        assert result is before
        assert torch.equal(result, _expected_sum(n, tuple(kept.shape), step)), f"step {step}"
    # Grouped, in place, and unnamed: the same answers.
    group = [_values(me, (3,), 1), _values(me, (2, 2), 2)]
    results = hvd.grouped_allreduce_(group, op=hvd.Sum, name="group")
    assert all(a is b for a, b in zip(results, group))
    assert torch.equal(group[1], _expected_sum(n, (2, 2), 2))
    unnamed = _values(me, (5,), 9)
    assert torch.equal(hvd.allreduce_(unnamed, op=hvd.Sum), _expected_sum(n, (5,), 9))


@mpi_test(nps=(1, 2, 3))
def test_optimizer_gradients_with_and_without_set_to_none():
    import mtrain.torch as hvd
    n, me = hvd.size(), hvd.rank()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.ReLU(), torch.nn.Linear(7, 2)).double()
    reference = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.ReLU(), torch.nn.Linear(7, 2)).double()
    reference.load_state_dict(model.state_dict())
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters())
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(7)
    for step in range(8):
        batches = [torch.randn(4, 5, generator=g, dtype=torch.float64) for _ in range(n)]
        set_to_none = step % 3 != 0  # both ways, and switching between them
        opt.zero_grad(set_to_none=set_to_none)
        model(batches[me]).pow(2).sum().backward()
        opt.step()
        # The reference: the averaged gradient, computed on one process.
        ref_opt.zero_grad()
        (sum(reference(b).pow(2).sum() for b in batches) / n).backward()
        ref_opt.step()
        for p, q in zip(model.parameters(), reference.parameters()):
            assert torch.allclose(p, q, rtol=1e-10, atol=1e-12), f"step {step}"


@mpi_test(nps=(1, 2, 3))
def test_a_kept_view_follows_each_steps_op_and_factors():
    """A kept view also keeps the last submit's checked op, factors and signature; a step that
    changes any of them (the op, as an enum or as Horovod's int, a prescale or postscale
    factor, average=) must be checked and reduced as asked, not as the step before."""
    import mtrain.torch as hvd
    n, me = hvd.size(), hvd.rank()
    kept = _values(me, (6,), 0)
    summed = _expected_sum(n, (6,), 0)
    everyone = [_values(r, (6,), 0) for r in range(n)]
    cases = [
        ({"op": hvd.Sum}, summed),
        ({"op": hvd.Sum}, summed),  # reused as it was
        ({"op": 1}, summed),  # Horovod's int for Sum
        ({"op": hvd.Max}, torch.stack(everyone).max(0).values),
        ({"op": hvd.Sum, "prescale_factor": 0.5}, summed * 0.5),
        ({"op": hvd.Sum, "prescale_factor": 0.5, "postscale_factor": 4.0}, summed * 2.0),
        ({}, summed / n),  # the default: Average
        ({"average": False}, summed),
        ({"op": hvd.Min}, torch.stack(everyone).min(0).values),
        ({"op": hvd.Min}, torch.stack(everyone).min(0).values),
    ]
    for step, (kwargs, expected) in enumerate(cases):
        kept.copy_(_values(me, (6,), 0))
        result = hvd.synchronize(hvd.allreduce_async_(kept, name="kept", **kwargs))
        assert result is kept
        assert torch.allclose(result, expected, rtol=1e-12), f"step {step} {kwargs}: {result} != {expected}"
    # A bad op after a cached one is still refused, with the usual error.
    with pytest.raises(TypeError, match="Adasum reduces float16, float32 or float64"):
        hvd.allreduce_async_(kept.to(torch.int64), name="kept", op=hvd.Adasum)
    with pytest.raises(ValueError, match="unsupported reduction op 42"):
        hvd.allreduce_async_(kept, name="kept", op=42)
    with pytest.raises(ValueError, match="unsupported reduction op"):
        hvd.allreduce_async_(kept, name="kept", op="nonsense")
    assert torch.equal(hvd.allreduce_(kept.copy_(_values(me, (6,), 0)), name="kept", op=hvd.Sum), summed)
