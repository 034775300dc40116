"""The GPU path on a real GPU: CuPy arrays and torch CUDA tensors, np=2 sharing one GPU.

Skipped (with the reason) where CuPy or a GPU is missing. Each body runs the
same collective on the device and on the host and wants the same bits: the
ring does the same additions in the same order either way. Both transfer modes
run: staged (MTRAIN_CUDA_AWARE=0) always, direct where MPI is CUDA-aware.
"""
import importlib.util

import numpy as np
import pytest

from mtrain.ringreduce.transport import cuda
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

    import mtrain.ringreduce as rr
    from mtrain.ringreduce.core.ops import Average, Max, Min, Sum
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

    import mtrain.ringreduce as rr
    want = rr.local_rank() % cupy.cuda.runtime.getDeviceCount()
    assert cupy.cuda.Device().id == want, f"rank {rr.rank()} on GPU {cupy.cuda.Device().id}, expected {want}"


@needs_torch
@mpi_test(nps=(2,), env=STAGED, timeout=300)
def test_torch_cuda_tensors_equal_host():
    import torch

    import mtrain.torch as hvd
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

    import mtrain.torch as hvd
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


@mpi_test(nps=(2,), env=STAGED, timeout=300)
def test_cupy_scaled_allreduce_equals_host():
    # Integer pre/postscale is computed in float64 on the device as on the host (CuPy 13
    # promotes int8 * np.float64 to float16). Factors below 1 keep every product in range.
    import cupy

    import mtrain.ringreduce as rr
    from mtrain.ringreduce.core.ops import Average, Sum
    from tests.mpi.data import values
    rank = rr.rank()
    for dtype in (np.int8, np.uint8, np.int16, np.int32, np.float16, np.float32):
        for op in (Sum, Average):
            for pre, post in ((0.9, 0.6), (0.3, 0.7)):
                what = f"scaled cupy {np.dtype(dtype).name} op={op.name} pre={pre} post={post}"
                mine = values(rank, (4099,), dtype, op)
                on_device = cupy.asnumpy(rr.allreduce(cupy.asarray(mine), op, name=f"d.{what}",
                                                      prescale_factor=pre, postscale_factor=post))
                on_host = rr.allreduce(mine, op, name=f"h.{what}", prescale_factor=pre, postscale_factor=post)
                assert on_device.tobytes() == on_host.tobytes(), f"{what}: device result differs from host"


@needs_torch
@mpi_test(nps=(2,), env=STAGED, timeout=300)
def test_torch_cuda_side_stream_and_other_collectives():
    import torch

    import mtrain.torch as hvd
    from tests.mpi.data import values
    rank, size = hvd.rank(), hvd.size()
    sleep = getattr(torch.cuda, "_sleep", None)  # widens the window a missing stream wait would leave

    # Produced and read on a torch side stream (non-blocking: no implicit order with the runtime's).
    count = (1 << 22) + 5
    want = sum(torch.arange(count, dtype=torch.float64) * (r + 1) for r in range(size))
    side = torch.cuda.Stream()
    for i in range(3):
        with torch.cuda.stream(side):
            x = torch.arange(count, dtype=torch.float64, device="cuda")
            if sleep is not None:
                sleep(50_000_000)
            x.mul_(rank + 1)
            y = hvd.allreduce(x, op=hvd.Sum, name=f"side.out.{i}")
            hvd.allreduce_(x, op=hvd.Sum, name=f"side.in.{i}")
            got_out, got_in = y.cpu(), x.cpu()
        assert torch.equal(got_out, want), f"side-stream all-reduce, round {i}"
        assert torch.equal(got_in, want), f"side-stream in-place all-reduce, round {i}"

    # Reduce-scatter with scaling (done by torch for CUDA tensors), all-to-all (staged through host).
    t = torch.from_numpy(values(rank, (6, 5), np.float32))
    for pre, post in ((1.0, 1.0), (0.5, 4.0)):
        d = hvd.reducescatter(t.cuda(), op=hvd.Sum, prescale_factor=pre, postscale_factor=post, name=f"rs.d.{pre}")
        h = hvd.reducescatter(t, op=hvd.Sum, prescale_factor=pre, postscale_factor=post, name=f"rs.h.{pre}")
        assert d.is_cuda and torch.equal(d.cpu(), h), f"reducescatter pre={pre} post={post}"
    t = torch.arange(size * 3 * 2, dtype=torch.int32).reshape(size * 3, 2) + 1000 * rank
    d, h = hvd.alltoall(t.cuda(), name="a2a.d"), hvd.alltoall(t, name="a2a.h")
    assert d.is_cuda and torch.equal(d.cpu(), h), "alltoall of a CUDA tensor"

    # Optimizer state on the GPU on root: every rank receives it into GPU memory (same backend).
    torch.manual_seed(rank)
    net = torch.nn.Linear(4, 3).cuda()
    opt = torch.optim.Adam(net.parameters(), lr=0.01)
    net(torch.randn(2, 4, device="cuda")).sum().backward()
    opt.step()  # exp_avg, exp_avg_sq on the GPU, different on every rank
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    mine = [opt.state[p][k].cpu() for p in net.parameters() for k in ("exp_avg", "exp_avg_sq")]
    root = hvd.broadcast_object(mine, root_rank=0, name="root_state")
    assert all(torch.equal(a, b) for a, b in zip(mine, root)), "optimizer state differs from root's"


@needs_torch
@mpi_test(nps=(2,), env=STAGED, timeout=300)
def test_point_to_point_of_device_arrays_and_cuda_tensors():
    """rr.send/recv of CuPy arrays and hvd.send/recv of CUDA tensors (staged through host memory):
    small, several chunks, non-contiguous targets, and a tensor produced on a torch side stream."""
    import cupy
    import torch

    import mtrain.ringreduce as rr
    import mtrain.torch as hvd
    from tests.mpi.data import values
    rank = rr.rank()
    peer = 1 - rank
    for count in (0, 7, 3_000_001):
        sent = values(rank, (count,), np.float32)
        into = cupy.zeros(count, dtype=cupy.float32)
        pending = rr.recv_async(into, peer, tag=1)
        rr.send(cupy.asarray(sent), peer, tag=1)
        assert rr.synchronize(pending) is into
        assert np.array_equal(cupy.asnumpy(into), values(peer, (count,), np.float32)), f"cupy float32[{count}]"
    grid = cupy.zeros((5, 4), dtype=cupy.float64)
    pending = rr.recv_async(grid[:, 2], peer)  # a non-contiguous column on the device
    rr.send(cupy.arange(5, dtype=cupy.float64) + 10 * rank, peer)
    rr.synchronize(pending)
    assert np.array_equal(cupy.asnumpy(grid[:, 2]), np.arange(5.0) + 10 * peer) and float(grid.sum()) == \
        float(grid[:, 2].sum()), "a strided device recv"
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        produced = torch.arange(1 << 20, dtype=torch.float32, device="cuda")
        sleep = getattr(torch.cuda, "_sleep", None)
        if sleep is not None:
            sleep(20_000_000)  # a send that did not wait for the side stream would read too early
        produced.mul_(rank + 2)
        target = torch.zeros(1 << 20, dtype=torch.float32, device="cuda")
        handle = hvd.recv_async(target, peer, tag=3)
        hvd.send(produced, peer, tag=3)
        assert hvd.synchronize(handle) is target
        got = target.cpu()
    assert torch.equal(got, torch.arange(1 << 20, dtype=torch.float32) * (peer + 2)), "CUDA tensor send/recv"
