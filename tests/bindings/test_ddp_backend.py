"""mtrain.distributed: the "mtrain" torch.distributed backend, its collectives, and DDP on it equal to gloo.

Each test body runs inside every rank of a real ``mpirun`` job. torch's env://
rendezvous needs MASTER_ADDR/MASTER_PORT (a free port picked by the test, per
job) and RANK/WORLD_SIZE (the MPI rank and size, set inside the rank).
"""
import os
import socket
import sys

import numpy as np
import pytest

from tests.bindings.requires import require

require("torch", "pip install '.[torch]'")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from tests.mpi.harness import mpi_test  # noqa: E402


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rendezvous() -> "dict[str, str]":
    return {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port())}


def ddp_test(nps=(2, 3), timeout: float = 240, rendezvous: bool = True):
    """Like ``mpi_test``, with a fresh rendezvous port for every run of the body."""
    return mpi_test(nps, timeout, body_env=_rendezvous if rendezvous else None)


def init_mtrain() -> "tuple[int, int]":
    import mtrain.distributed  # noqa: F401  (registers the backend)
    os.environ["RANK"] = os.environ["OMPI_COMM_WORLD_RANK"]
    os.environ["WORLD_SIZE"] = os.environ["OMPI_COMM_WORLD_SIZE"]
    hook = sys.excepthook
    dist.init_process_group("mtrain")
    sys.excepthook = hook  # torch's hook would swallow the traceback of an aborting rank
    assert dist.get_backend() == "mtrain"
    return dist.get_rank(), dist.get_world_size()


def _dtypes():
    dtypes = [torch.float32, torch.float64, torch.float16, torch.int32, torch.int64, torch.uint8]
    try:
        import ml_dtypes  # noqa: F401
        dtypes.append(torch.bfloat16)
    except ImportError:
        pass
    return dtypes


def rank_data(rank: int, shape, dtype) -> torch.Tensor:
    """Distinct per rank and per element, small enough for products and low precision."""
    count = int(np.prod(shape, dtype=np.int64))
    values = (np.arange(count) * 7 + rank * 3) % 11 + 1 + rank  # 1 .. 11 + rank
    if dtype.is_floating_point:
        values = values / 4.0  # exact in every float type here
    return torch.from_numpy(values.reshape(shape)).to(dtype)


REFERENCE = {
    dist.ReduceOp.SUM: lambda xs: np.sum(xs, axis=0),
    dist.ReduceOp.AVG: lambda xs: np.mean(xs, axis=0),
    dist.ReduceOp.MIN: lambda xs: np.min(xs, axis=0),
    dist.ReduceOp.MAX: lambda xs: np.max(xs, axis=0),
    dist.ReduceOp.PRODUCT: lambda xs: np.prod(xs, axis=0),
}


def _expected(op, shape, dtype, size) -> np.ndarray:
    inputs = np.stack([rank_data(r, shape, dtype).double().numpy() for r in range(size)])
    return REFERENCE[op](inputs)


def _close(got: torch.Tensor, want: np.ndarray, dtype) -> bool:
    tol = {torch.float16: 1e-2, torch.bfloat16: 2e-2, torch.float32: 1e-5}.get(dtype, 1e-12)
    return np.allclose(got.double().numpy(), want, rtol=tol, atol=tol)


@ddp_test()
def test_collectives_match_numpy_for_every_op_dtype_and_size():
    me, n = init_mtrain()
    shapes = [(7,), (3, 5), (), (0,), (300_001,)]  # odd, 2-d, 0-d, empty, large enough for the ring
    for dtype in _dtypes():
        for op in REFERENCE:
            if op == dist.ReduceOp.PRODUCT and dtype == torch.uint8:
                continue  # overflows
            if op == dist.ReduceOp.AVG and not dtype.is_floating_point:
                continue
            for shape in shapes:
                if op == dist.ReduceOp.PRODUCT and shape == (300_001,):
                    shape = (1001,)
                what = f"all_reduce {op} {dtype} {shape}"
                tensor = rank_data(me, shape, dtype)
                dist.all_reduce(tensor, op=op)
                want = _expected(op, shape, dtype, n)
                assert tensor.shape == torch.Size(shape) and tensor.dtype == dtype, what
                assert _close(tensor, want, dtype), f"{what}: got {tensor.flatten()[:8]}, want {want.flatten()[:8]}"

    # A non-contiguous tensor is reduced in place; the elements around it stay.
    base = torch.stack([rank_data(me, (9,), torch.float64)] * 4)
    view = base[:, ::2]
    dist.all_reduce(view, op=dist.ReduceOp.MAX)
    want = np.stack([_expected(dist.ReduceOp.MAX, (9,), torch.float64, n)[::2]] * 4)
    assert np.array_equal(view.numpy(), want)
    assert torch.equal(base[:, 1::2], torch.stack([rank_data(me, (9,), torch.float64)[1::2]] * 4))

    # Complex sums reduce real and imaginary parts.
    z = torch.complex(rank_data(me, (5,), torch.float64), -rank_data(me, (5,), torch.float64))
    dist.all_reduce(z)
    want = _expected(dist.ReduceOp.SUM, (5,), torch.float64, n)
    assert np.allclose(z.numpy(), want - 1j * want)

    # Broadcast from the last rank (non-zero root), every dtype, odd and empty sizes.
    for dtype in _dtypes():
        for shape in [(7,), (2, 3), (0,), (100_003,)]:
            tensor = rank_data(me, shape, dtype)
            dist.broadcast(tensor, src=n - 1)
            assert torch.equal(tensor, rank_data(n - 1, shape, dtype)), f"broadcast {dtype} {shape}"

    # all_gather: one output tensor per rank, in rank order.
    for dtype in _dtypes():
        for shape in [(3,), (2, 5), (), (0, 4)]:
            outputs = [torch.full(shape, 99).to(dtype) for _ in range(n)]
            dist.all_gather(outputs, rank_data(me, shape, dtype))
            for r, out in enumerate(outputs):
                assert torch.equal(out, rank_data(r, shape, dtype)), f"all_gather {dtype} {shape} from rank {r}"

    out = torch.zeros(n * 6, dtype=torch.int64)
    dist.all_gather_into_tensor(out, rank_data(me, (6,), torch.int64))
    assert torch.equal(out, torch.cat([rank_data(r, (6,), torch.int64) for r in range(n)]))

    # reduce_scatter_tensor: rank r keeps part r of the sum.
    mine = torch.zeros(5, dtype=torch.float64)
    dist.reduce_scatter_tensor(mine, rank_data(me, (n * 5,), torch.float64))
    assert np.allclose(mine.numpy(), _expected(dist.ReduceOp.SUM, (n * 5,), torch.float64, n)[me * 5:(me + 1) * 5])

    dist.barrier()
    dist.destroy_process_group()


@ddp_test(nps=(2, 3))
def test_async_handles_futures_barrier_and_errors():
    me, n = init_mtrain()
    # More async ops of one signature than the group keeps name slots for: names are reused safely.
    tensors = [rank_data(me + i, (11,), torch.float32) for i in range(10)]
    works = [dist.all_reduce(t, async_op=True) for t in tensors]
    futures = [w.get_future() for w in works]
    gathered = [torch.zeros(3) for _ in range(n)]
    gather_work = dist.all_gather(gathered, torch.full((3,), float(me)), async_op=True)
    broadcast_me = torch.full((4,), float(me))
    broadcast_work = dist.broadcast(broadcast_me, src=n - 1, async_op=True)
    barrier_work = dist.barrier(async_op=True)
    for i, (work, future, tensor) in enumerate(zip(works, futures, tensors)):
        assert work.wait()
        assert work.is_completed() and work.is_success()
        (result,) = future.wait()
        assert result is tensor or result.data_ptr() == tensor.data_ptr()
        want = sum(rank_data(r + i, (11,), torch.float32).double().numpy() for r in range(n))
        assert np.allclose(tensor.numpy(), want), f"async all_reduce {i}"
    gather_work.wait()
    assert [g[0].item() for g in gathered] == [float(r) for r in range(n)]
    broadcast_work.wait()
    assert torch.equal(broadcast_me, torch.full((4,), float(n - 1)))
    barrier_work.wait()

    # A chained future, as DDP's comm hooks use it.
    t = torch.ones(6) * (me + 1)
    chained = dist.all_reduce(t, async_op=True).get_future().then(lambda f: f.value()[0] / n)
    assert np.allclose(chained.wait().numpy(), (n + 1) / 2)

    # A second mtrain group over all ranks: its ops are named apart from the default group's.
    second = dist.new_group(backend="mtrain")
    a, b = torch.full((4,), float(me)), torch.full((4,), 10.0 * me)
    work_b = dist.all_reduce(b, group=second, async_op=True)
    dist.all_reduce(a)
    work_b.wait()
    assert torch.equal(a, torch.full((4,), float(sum(range(n))))) and torch.equal(b, 10 * a)

    # Errors that say what to do.
    with pytest.raises(ValueError, match="PREMUL_SUM is not supported"):
        dist.all_reduce(torch.ones(3), op=dist._make_nccl_premul_sum(2.0))
    with pytest.raises(ValueError, match="complex"):
        dist.all_reduce(torch.ones(3, dtype=torch.complex64), op=dist.ReduceOp.MAX)
    with pytest.raises(NotImplementedError, match="gloo"), pytest.warns(FutureWarning):
        dist.all_gather_coalesced([[torch.zeros(1) for _ in range(n)]], [torch.zeros(1)])
    # The group still works after the errors (they were raised before anything was submitted).
    t = torch.full((2,), float(me))
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    assert torch.equal(t, torch.zeros(2))
    # A subgroup's ranks must be torch's ranks of this job (tests/bindings/test_distributed_groups.py
    # runs subgroups).
    from torch._C._distributed_c10d import _DistributedBackendOptions
    from mtrain.distributed.groups import create_group
    options = _DistributedBackendOptions()
    options.group_id, options.global_ranks_in_group = "wrong", list(range(n))
    options.group_rank, options.group_size = (me + 1) % n, n
    with pytest.raises(RuntimeError, match="torch's global ranks must be the MPI ranks"):
        create_group(options)
    dist.barrier()
    dist.destroy_process_group()


def small_model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 16), torch.nn.Tanh(),
                               torch.nn.Linear(16, 3)).double()


def _train(model: torch.nn.Module, rank: int, steps: int = 4) -> np.ndarray:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    g = torch.Generator().manual_seed(100 + rank)
    for _ in range(steps):
        x, y = torch.randn(5, 6, generator=g, dtype=torch.float64), torch.randn(5, 3, generator=g, dtype=torch.float64)
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).numpy()


@ddp_test()
def test_ddp_on_mtrain_equals_ddp_on_gloo():
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.nn.parallel import DistributedDataParallel as DDP
    me, n = init_mtrain()
    gloo = dist.new_group(backend="gloo")
    # Ranks start from different weights: DDP broadcasts rank 0's. gloo trains first (see below).
    runs = {
        "gloo": DDP(small_model(me), process_group=gloo),
        "mtrain": DDP(small_model(me)),
        "mtrain, tiny buckets": DDP(small_model(me), bucket_cap_mb=0.0005),
        "mtrain, Python allreduce_hook": DDP(small_model(me)),
    }
    runs["mtrain, Python allreduce_hook"].register_comm_hook(None, default_hooks.allreduce_hook)
    initial = torch.cat([p.detach().reshape(-1) for p in small_model(0).parameters()]).numpy()
    results = {name: _train(model, me) for name, model in runs.items()}
    want = results["gloo"]
    assert not np.allclose(want, initial), "training did not move the parameters"
    for name, got in results.items():
        assert np.allclose(got, want, rtol=1e-12, atol=1e-12), f"{name}: max diff {np.abs(got - want).max()}"
        everyone = [torch.zeros(got.size, dtype=torch.float64) for _ in range(n)]
        # On the mtrain group: a gloo all_gather just before the gloo group is freed can deadlock in
        # torch (~ProcessGroupGloo, under the GIL, joins a gloo thread that waits for the GIL).
        dist.all_gather(everyone, torch.from_numpy(got))
        for r, theirs in enumerate(everyone):
            assert theirs.numpy().tobytes() == got.tobytes(), f"{name}: rank {r} differs from rank {me}"
    dist.destroy_process_group()


@ddp_test(nps=(2,), rendezvous=False)
def test_init_process_group_helper_needs_no_environment():
    import mtrain.distributed as mtrain_dist
    import mtrain.ringreduce as rr
    for key in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE"):
        os.environ.pop(key, None)
    mtrain_dist.init_process_group()
    assert (dist.get_rank(), dist.get_world_size()) == (rr.rank(), rr.size())
    t = torch.full((3,), float(rr.rank() + 1))
    dist.all_reduce(t, op=dist.ReduceOp.AVG)
    assert torch.equal(t, torch.full((3,), (rr.size() + 1) / 2))
    dist.destroy_process_group()
