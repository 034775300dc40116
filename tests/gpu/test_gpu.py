"""The GPU path on a real GPU: CuPy arrays and torch CUDA tensors, np=2 sharing one GPU.

Skipped (with the reason) where CuPy or a GPU is missing. Each body runs the
same collective on the device and on the host and wants the same bits: the
ring does the same additions in the same order either way. Both transfer modes
run: staged (MTRAIN_CUDA_AWARE=0) always, direct where MPI is CUDA-aware.
"""
import importlib.util

import numpy as np
import pytest

from ringreduce import cuda
from tests.mpi.harness import mpi_test

if cuda.gpu_count() == 0:
    pytest.skip("no GPU here (needs cupy-cuda12x/13x and a visible CUDA device: pip install '.[cuda13]')",
                allow_module_level=True)

STAGED = {"MTRAIN_CUDA_AWARE": "0"}
DIRECT = {"MTRAIN_CUDA_AWARE": "1"}
SIZES = [1, 3, 1000, 4099, (1 << 20) + 7, 3_000_001]  # below and above the small-buffer and segment sizes

needs_cuda_aware = pytest.mark.skipif(not cuda.query_cuda_support(),
                                      reason="this MPI is not CUDA-aware (MPIX_Query_cuda_support() is 0)")
needs_torch = pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="torch is not installed")


def _cupy_equals_host() -> None:
    import cupy

    import ringreduce as rr
    from ringreduce.ops import Average, Max, Min, Sum
    from tests.mpi.data import DTYPES, assert_matches, reference, values
    rank, size = rr.rank(), rr.size()
    for dtype in [d for d in DTYPES if d.name != "bfloat16"]:  # CuPy has no bfloat16
        for op in (Sum, Average, Min, Max):
            for count in SIZES:
                what = f"cupy {dtype.name} op={op.name} count={count}"
                mine = values(rank, (count,), dtype, op)
                on_device = cupy.asnumpy(rr.allreduce(cupy.asarray(mine), op, name=f"d.{what}"))
                on_host = rr.allreduce(mine, op, name=f"h.{what}")
                assert on_device.tobytes() == on_host.tobytes(), f"{what}: device result differs from host"
        everyone = [values(r, (4099,), dtype) for r in range(size)]
        got = rr.allreduce(cupy.asarray(everyone[rank]), Sum)
        assert isinstance(got, cupy.ndarray), "the result of a device all-reduce stays on the device"
        assert_matches(cupy.asnumpy(got), reference(everyone, Sum), f"cupy {dtype.name}")
    # Fused: many small device tensors in one ring, in place.
    parts = [cupy.asarray(values(rank, (n,), np.float32)) for n in (5, 17, 300, 4099)]
    rr.grouped_allreduce_(parts, Sum)
    for n, part in zip((5, 17, 300, 4099), parts):
        want = reference([values(r, (n,), np.float32) for r in range(size)], Sum)
        assert_matches(cupy.asnumpy(part), want, f"fused cupy float32[{n}]")
    gathered = rr.allgather(cupy.asarray(values(rank, (rank + 2, 3), np.int32)))
    want = np.concatenate([values(r, (r + 2, 3), np.int32) for r in range(size)])
    assert np.array_equal(cupy.asnumpy(gathered), want), "allgather of CuPy arrays"


@mpi_test(nps=(2,), env=STAGED, timeout=300)
def test_cupy_allreduce_staged_equals_host():
    _cupy_equals_host()


@needs_cuda_aware
@mpi_test(nps=(2,), env=DIRECT, timeout=300)
def test_cupy_allreduce_cuda_aware_equals_host():
    _cupy_equals_host()


@mpi_test(nps=(2,), env=STAGED)
def test_ranks_bound_to_gpus():
    import cupy

    import ringreduce as rr
    want = rr.local_rank() % cupy.cuda.runtime.getDeviceCount()
    assert cupy.cuda.Device().id == want, f"rank {rr.rank()} on GPU {cupy.cuda.Device().id}, expected {want}"


@needs_torch
@mpi_test(nps=(2,), env=STAGED, timeout=300)
def test_torch_cuda_tensors_equal_host():
    import torch

    import bindings.torch as hvd
    from tests.mpi.data import values
    rank = hvd.rank()
    for dtype in (torch.float16, torch.float32, torch.float64, torch.int32, torch.int64, torch.uint8):
        np_dtype = torch.empty(0, dtype=dtype).numpy().dtype
        for count in (1, 1001, (1 << 20) + 3):
            mine = torch.from_numpy(values(rank, (count,), np_dtype))
            what = f"torch {dtype} count={count}"
            on_device = hvd.allreduce(mine.cuda(), op=hvd.Sum, name=f"d.{what}")
            assert on_device.is_cuda, f"{what}: result left the GPU"
            on_host = hvd.allreduce(mine, op=hvd.Sum, name=f"h.{what}")
            assert torch.equal(on_device.cpu(), on_host), f"{what}: device result differs from host"
            in_place = mine.cuda()
            hvd.allreduce_(in_place, op=hvd.Sum, name=f"i.{what}")
            assert torch.equal(in_place.cpu(), on_host), f"{what}: in-place device result differs"


@needs_torch
@mpi_test(nps=(2,), env=STAGED, timeout=300)
def test_distributed_optimizer_on_cuda_model_equals_cpu():
    import torch

    import bindings.torch as hvd
    n, me, b = hvd.size(), hvd.rank(), 8

    def model() -> torch.nn.Module:
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4)).double()

    gen = torch.Generator().manual_seed(7)
    batches = [(torch.randn(n * b, 16, generator=gen, dtype=torch.float64),
                torch.randn(n * b, 4, generator=gen, dtype=torch.float64)) for _ in range(4)]
    trained = {}
    for device in ("cpu", "cuda"):
        net = model().to(device)
        opt = hvd.DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9),
                                       named_parameters=net.named_parameters())
        hvd.broadcast_parameters(net.state_dict(), root_rank=0)
        for x, y in batches:
            opt.zero_grad()
            rows = slice(me * b, (me + 1) * b)
            torch.nn.functional.mse_loss(net(x[rows].to(device)), y[rows].to(device)).backward()
            opt.step()
        trained[device] = torch.cat([p.detach().reshape(-1).cpu() for p in net.parameters()])
    assert all(p.is_cuda for p in net.parameters())
    assert not torch.equal(trained["cpu"], torch.cat([p.detach().reshape(-1) for p in model().parameters()]))
    # Same gradients, same ring order; only cuBLAS vs CPU BLAS rounding may differ.
    assert torch.allclose(trained["cuda"], trained["cpu"], rtol=1e-10, atol=1e-10), \
        f"max diff {(trained['cuda'] - trained['cpu']).abs().max()}"
