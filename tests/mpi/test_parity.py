"""ringreduce against Horovod's semantics: error classes, integer scaling, grouped gather/scatter,
timeline control at run time, homogeneity."""
import json
import os
import tempfile

import numpy as np
import pytest

import mtrain.ringreduce as rr
from tests.mpi.harness import mpi_test


def test_error_classes_are_runtime_errors():
    for cls in (rr.MismatchError, rr.StallError, rr.ShutdownError, rr.EngineError):
        assert issubclass(cls, rr.HorovodInternalError) and issubclass(cls, RuntimeError), cls
    assert issubclass(rr.MismatchError, ValueError)  # what it was before
    assert issubclass(rr.InvalidArgumentError, RuntimeError) and issubclass(rr.InvalidArgumentError, ValueError)


def test_integer_scaling_truncates_toward_zero():
    from mtrain.ringreduce.transport.backend import NumpyBackend, scale_in_place
    for dtype in (np.int8, np.int32, np.int64, np.uint16):
        values = np.array([-37, 37, -3, 3, -1, 1, 0, 101], dtype=np.int64)
        if np.dtype(dtype).kind == "u":
            values = np.abs(values)
        buf = values.astype(dtype)
        NumpyBackend().scale(buf, 0.5)
        assert buf.tolist() == np.trunc(values * 0.5).astype(np.int64).tolist(), dtype
        device_rule = values.astype(dtype)
        scale_in_place(np, device_rule, 0.5)  # the rule as the device backend runs it (xp = CuPy there)
        assert device_rule.tolist() == buf.tolist(), dtype


@mpi_test(nps=(1, 2, 3))
def test_scaled_integer_collectives_and_grouped_gather_scatter():
    n, me = rr.size(), rr.rank()
    every = [np.array([-37, 37, -3, 5, -1, 0, 9], dtype=np.int32) * (r + 1) - r for r in range(n)]
    got = rr.allreduce(every[me], op=rr.Sum, prescale_factor=0.5)
    assert got.tolist() == sum(np.trunc(e * 0.5).astype(np.int64) for e in every).tolist()
    rows = 2 * n + 1
    mats = [np.arange(rows * 2, dtype=np.int64).reshape(rows, 2) * (r + 1) - 5 * r for r in range(n)]
    share = rr.reducescatter(mats[me], op=rr.Sum, prescale_factor=0.5, postscale_factor=0.5)
    full = np.trunc(sum(np.trunc(m * 0.5) for m in mats) * 0.5).astype(np.int64)
    lo = sum(rows // n + (1 if r < rows % n else 0) for r in range(me))
    assert share.tolist() == full[lo:lo + share.shape[0]].tolist()
    # Grouped all-gather (first dimensions differ per rank) and grouped reduce-scatter.
    arrays = [np.full((me + 1, 2), me, np.float32), np.arange(me + 3, dtype=np.int16) + me]
    gathered = rr.grouped_allgather(arrays, name="p.gag")
    assert gathered[0].tolist() == [[r, r] for r in range(n) for _ in range(r + 1)]
    assert gathered[1].tolist() == [k + r for r in range(n) for k in range(r + 3)]
    floats = [np.arange(rows * 3, dtype=np.float64).reshape(rows, 3) * (r + 1) for r in range(n)]
    parts = rr.grouped_reducescatter([floats[me], floats[me][:, 0].copy()], op=rr.Average, postscale_factor=2.0)
    mean = sum(floats) / n * 2.0
    assert np.allclose(parts[0], mean[lo:lo + parts[0].shape[0]])
    assert np.allclose(parts[1], mean[lo:lo + parts[1].shape[0], 0])
    with pytest.raises(RuntimeError, match="arrays.1."):
        rr.grouped_reducescatter([np.ones(n), np.ones(())])
    if n > 1:
        with pytest.raises(rr.MismatchError, match="prescale"):  # scaling is part of what ranks agree on
            rr.reducescatter(np.ones(n), prescale_factor=1.0 + (me == n - 1), name="p.rs.scale")
    assert rr.is_homogeneous() is True


@mpi_test(nps=(1, 2))
def test_timeline_started_and_stopped_at_run_time():
    me = rr.rank()
    path = rr.broadcast_object(os.path.join(tempfile.mkdtemp(), "t.json") if me == 0 else None)
    rr.start_timeline(path, mark_cycles=True)
    rr.allreduce(np.ones(3), name="t.in")
    rr.stop_timeline()
    rr.allreduce(np.ones(3), name="t.out")
    rr.barrier()
    if me == 0:
        events = json.load(open(path))
        names = {e["args"].get("name") for e in events if e.get("name") == "process_name"}
        assert "t.in" in names and "t.out" not in names
        assert any(e.get("name") == "CYCLE_START" for e in events)
    with pytest.raises(ValueError):
        rr.start_timeline("")
