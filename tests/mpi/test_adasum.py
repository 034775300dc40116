"""Adasum (op=Adasum) through the runtime's NumPy API, against a NumPy reference of the same
recursion (tests/mpi/adasum_reference.py)."""
import math

import numpy as np
import pytest
from mpi4py import MPI

import mtrain.ringreduce as rr
from mtrain.ringreduce.transport import adasum
from mtrain.ringreduce.transport.backend import NumpyBackend
from tests.mpi.adasum_reference import assert_close, rank_tensors, reference
from tests.mpi.harness import mpi_test

def identical_everywhere(result: np.ndarray, what: str) -> None:
    blobs = MPI.COMM_WORLD.allgather(result.tobytes())
    assert all(blob == blobs[0] for blob in blobs), f"{what}: the ranks' results differ"


# Odd sizes, an empty one, a scalar, and one over the in-place threshold (1 MiB) that is reduced
# in its own memory beside the fused buffer: one logical buffer of several tensors.
SHAPES = [(7,), (3, 5), (0,), (), (101,), (1,), (13, 3), (300_001,)]


@mpi_test(nps=(1, 2, 4))
def test_adasum_matches_the_numpy_recursion_per_tensor():
    """horovod/common/ops/adasum/adasum.h (FusedAllreduce, FusedPairwiseReduceWithComm): several
    tensors fused in one cycle, each with its own dot product and norms, float16/32/64."""
    n, me = rr.size(), rr.rank()
    for dtype in (np.float16, np.float32, np.float64):
        name = np.dtype(dtype).name
        shapes = SHAPES if dtype is not np.float16 else SHAPES[:-1]
        per_rank = [rank_tensors(r, shapes, dtype) for r in range(n)]
        want = reference(per_rank)
        mine = [t.copy() for t in per_rank[me]]
        got = rr.grouped_allreduce(mine, op=rr.Adasum, name=f"adasum.{name}")
        for index, (g, w) in enumerate(zip(got, want)):
            what = f"{name} tensor {index} {shapes[index]} np={n} rank {me}"
            assert_close(g, w, what)
            identical_everywhere(g, what)
        assert all(np.array_equal(a, b) for a, b in zip(mine, per_rank[me])), "the inputs were modified"
        if n > 1:
            # The same data as one tensor gives other values: the coefficients above were per tensor.
            whole = reference([[np.concatenate([t.ravel() for t in ts[:-1]])] for ts in per_rank])[0]
            fused = np.concatenate([g.ravel() for g in got[:-1]])
            assert not np.allclose(whole.astype(np.float64), fused.astype(np.float64), rtol=1e-2), \
                f"{name}: per-tensor and whole-buffer coefficients gave the same result"
        # In place, one tensor at a time, with scaling (prescale before, postscale after).
        for index, tensor in enumerate(per_rank[me][:3]):
            inplace = tensor.copy()
            assert rr.allreduce_(inplace, op=rr.Adasum, name=f"adasum.one.{name}.{index}") is inplace
            assert_close(inplace, want[index], f"allreduce_ {name} tensor {index} np={n}")
        scaled = rr.allreduce(per_rank[me][4], op=rr.Adasum, prescale_factor=0.5, postscale_factor=3.0)
        halves = reference([[(ts[4].astype(np.float64) * 0.5).astype(dtype)] for ts in per_rank])[0]
        assert_close(scaled, (halves.astype(np.float64) * 3.0).astype(dtype), f"scaled {name} np={n}")


@mpi_test(nps=(2, 4))
def test_adasum_algebra_orthogonal_add_identical_average_tiny_stay_finite():
    """The properties Horovod's user guide states (docs/adasum_user_guide.rst): orthogonal gradients
    add, identical gradients average (stay as they are); adasum.h's sqrt(DBL_MIN) guard keeps tiny
    and zero gradients finite."""
    n, me = rr.size(), rr.rank()
    # Orthogonal: rank r holds e_r (scaled): every pair is orthogonal, at every level.
    basis = np.zeros(2 * n)
    basis[2 * me:2 * me + 2] = [me + 1.0, -(me + 2.0)]
    total = np.zeros(2 * n)
    for r in range(n):
        total[2 * r:2 * r + 2] = [r + 1.0, -(r + 2.0)]
    assert np.allclose(rr.allreduce(basis, op=rr.Adasum), total, rtol=1e-15, atol=0)
    # Identical on every rank: the result is that vector itself.
    same = np.linspace(-3.0, 5.0, 17, dtype=np.float32)
    assert np.allclose(rr.allreduce(same, op=rr.Adasum), same, rtol=1e-6)
    # Parallel but of different lengths: a·b/‖a‖² etc. with float64 sums; the reference agrees.
    scaled = same.astype(np.float64) * (me + 1)
    assert np.allclose(rr.allreduce(scaled, op=rr.Adasum),
                       reference([[same.astype(np.float64) * (r + 1)] for r in range(n)])[0], rtol=1e-13)
    # Tiny magnitudes: squared norms below sqrt(DBL_MIN) leave the coefficients at 1 (a sum);
    # zeros on some ranks leave the others' values as they are.
    tiny = np.full(5, 1e-160 * (me + 1))
    got = rr.allreduce(tiny, op=rr.Adasum)
    assert np.all(np.isfinite(got)) and np.allclose(got, np.full(5, 1e-160 * n * (n + 1) / 2), rtol=1e-12)
    zeros_on_odd = np.arange(1.0, 6.0) * (me + 1) if me % 2 == 0 else np.zeros(5)
    want = reference([[np.arange(1.0, 6.0) * (r + 1) if r % 2 == 0 else np.zeros(5)] for r in range(n)])[0]
    got = rr.allreduce(zeros_on_odd, op=rr.Adasum)
    assert np.all(np.isfinite(got)) and np.allclose(got, want, rtol=1e-13)
    small32 = np.full(4, 1e-30, dtype=np.float32) * np.float32(me + 1)  # squares underflow float32, not float64
    got = rr.allreduce(small32, op=rr.Adasum)
    assert np.all(np.isfinite(got)) and np.allclose(got, reference([[np.full(4, 1e-30, np.float32) * np.float32(r + 1)]
                                                                     for r in range(n)])[0], rtol=1e-6)


@mpi_test(nps=(4,))
def test_adasum_hierarchical_sums_within_a_host_then_adasum_across():
    """horovod/common/ops/adasum_gpu_operations.cc (NcclHierarchical): the ranks of a host sum, then
    the hosts' sums are combined with Adasum. Two fake hosts of two ranks (adasum.hierarchical, the
    form device buffers take), against the reference on the hosts' sums."""
    me = rr.rank()
    world = MPI.COMM_WORLD
    local = world.Split(me // 2, me)
    cross = world.Split(local.Get_rank(), me)
    try:
        shapes = [(5,), (1,), (33,), (2, 2)]
        per_rank = [rank_tensors(r, shapes, np.float64, salt=3) for r in range(4)]
        host_sums = [[a + b for a, b in zip(per_rank[2 * h], per_rank[2 * h + 1])] for h in range(2)]
        want = np.concatenate([t.ravel() for t in reference(host_sums)])
        buf = np.concatenate([t.ravel() for t in per_rank[me]])
        adasum.hierarchical(local, cross, buf, [math.prod(s) for s in shapes], np.empty(buf.size), NumpyBackend())
        np.testing.assert_allclose(buf, want, rtol=1e-13)
        identical_everywhere(buf, "hierarchical")
    finally:
        cross.Free()
        local.Free()


@mpi_test(nps=(3,))
def test_adasum_refuses_a_non_power_of_two_number_of_ranks():
    """horovod/torch/mpi_ops.py _allreduce_async / _grouped_allreduce_async: NotImplementedError
    'Running Adasum with non-power of 2 ranks is not supported yet.'"""
    for call in (lambda: rr.allreduce(np.ones(3), op=rr.Adasum),
                 lambda: rr.allreduce_(np.ones(3), op=rr.Adasum, name="adasum.np3"),
                 lambda: rr.grouped_allreduce([np.ones(3), np.ones(2)], op=rr.Adasum)):
        with pytest.raises(NotImplementedError, match="Running Adasum with non-power of 2 ranks is not supported yet"):
            call()
    assert rr.allreduce(np.ones(3), op=rr.Sum).tolist() == [3.0] * 3  # still in step


@mpi_test(nps=(2,))
def test_adasum_refusals():
    """Horovod's refusals: integer dtypes (adasum.h supports float16/32/64 only), non-global process
    sets (horovod/torch/mpi_ops.py: NotImplementedError), reduce-scatter (horovod/common/operations.cc:
    'Reducescatter currently only supports AVERAGE and SUM.'); every one a RuntimeError or TypeError
    raised at once on every rank, the runtime still in step afterwards."""
    with pytest.raises(TypeError, match="Adasum reduces float16, float32 or float64"):
        rr.allreduce(np.ones(3, np.int32), op=rr.Adasum)
    with pytest.raises(TypeError, match="Adasum"):
        rr.grouped_allreduce([np.ones(3), np.ones(2, bool)], op=rr.Adasum)
    for call in (lambda: rr.reducescatter(np.ones((2, 2)), op=rr.Adasum),
                 lambda: rr.grouped_reducescatter([np.ones((2, 2))], op=rr.Adasum)):
        with pytest.raises(RuntimeError, match="Reducescatter currently only supports AVERAGE and SUM"):
            call()
    pset = rr.add_process_set([1])
    try:
        if rr.rank() == 1:
            with pytest.raises(NotImplementedError, match="Adasum does not support non-global process sets yet"):
                rr.allreduce(np.ones(3), op=rr.Adasum, process_set=pset)
    finally:
        rr.remove_process_set(pset)
    assert rr.allreduce(np.ones(3), op=rr.Adasum).tolist() == [1.0] * 3  # identical inputs: themselves


@mpi_test(nps=(2,))
def test_adasum_has_horovods_names_on_the_timeline():
    """horovod/common/message.cc and common.h: an Adasum all-reduce is a request of type ADASUM
    (NEGOTIATE_ADASUM, then ADASUM around MPI_ADASUM_ALLREDUCE); a Sum beside it stays ALLREDUCE."""
    import json
    import os
    import shutil
    import tempfile
    folder = MPI.COMM_WORLD.bcast(tempfile.mkdtemp() if rr.rank() == 0 else None, root=0)
    path = os.path.join(folder, "timeline.json")
    rr.start_timeline(path)
    handles = [rr.allreduce_async(np.arange(5.0) + rr.rank(), op=rr.Adasum, name="combined.a"),
               rr.allreduce_async(np.arange(3.0) * (rr.rank() + 1), op=rr.Adasum, name="combined.b")]
    [rr.synchronize(h) for h in handles]
    rr.allreduce(np.ones(4), op=rr.Sum, name="summed")
    rr.stop_timeline()
    rr.barrier()
    if rr.rank() == 0:
        with open(path) as f:
            events = json.load(f)
        shutil.rmtree(folder)
        pids = {e["pid"]: e["args"]["name"] for e in events if e.get("name") == "process_name" and e["pid"]}
        names = {}
        for e in events:
            if e.get("ph") == "B" and e.get("pid") in pids:
                names.setdefault(pids[e["pid"]], set()).add(e["name"])
        for tensor in ("combined.a", "combined.b"):
            assert {"NEGOTIATE_ADASUM", "ADASUM", "MPI_ADASUM_ALLREDUCE"} <= names[tensor], names
            assert not names[tensor] & {"ALLREDUCE", "MPI_ALLREDUCE"}, names
        assert {"NEGOTIATE_ALLREDUCE", "ALLREDUCE", "MPI_ALLREDUCE"} <= names["summed"], names
