"""The background engine: name matching, fusion, errors on every rank, stalls, shutdown."""
import json
import os
import random
import re
import sys
import tempfile

import numpy as np
import pytest
from mpi4py import MPI

import mtrain.ringreduce as rr
from tests.mpi.harness import launch, mpi_test

FUSE_SMALL = {"MTRAIN_FUSION_THRESHOLD_BYTES": "4096", "MTRAIN_FUSION_INPLACE_MIN_BYTES": "2048"}


def _tensors(rank: int):
    """Mixed dtypes and sizes: zero-size, tiny, odd, larger than the fusion threshold.

    Values are small multiples of 1/4, so every sum is exact and fused and
    unfused results must agree bit for bit whatever the order of additions."""
    specs = [(f"t{i}", dtype, count) for i, (dtype, count) in enumerate(
        [(np.float32, 0), (np.float32, 1), (np.float64, 3), (np.int32, 7), (np.float32, 257),
         (np.float64, 1000), (np.float32, 5000), (np.int64, 11), (np.float32, 13), (np.float16, 31),
         (np.float32, 1), (np.int32, 2048), (np.uint8, 9), (np.float32, 100_003)])]
    out = {}
    for k, (name, dtype, count) in enumerate(specs):
        i = np.arange(count)
        values = ((i * 3 + k * 7) % 64) / 4 + rank if np.dtype(dtype).kind == "f" else (i * 3 + k) % 50 + rank
        out[name] = values.astype(dtype)
    return out


@mpi_test(nps=(1, 2, 3), env=FUSE_SMALL)
def test_shuffled_submission_order_fused_equals_unfused():
    n, me = rr.size(), rr.rank()
    tensors = _tensors(me)
    names = list(tensors)
    for step in range(5):
        order = names[:]
        random.Random(me * 1000 + step).shuffle(order)  # every rank submits in its own order
        handles = {name: rr.allreduce_async(tensors[name], op=rr.Sum, name=f"{name}") for name in order}
        fused = {name: rr.synchronize(handles[name]) for name in names}
        for name in names:
            expected = sum(_tensors(r)[name].astype(np.float64) for r in range(n))
            assert np.array_equal(fused[name].astype(np.float64), expected), f"{name} step {step}"
            assert fused[name].dtype == tensors[name].dtype
        # The unfused path: one op at a time, nothing to fuse with.
        for name in names:
            alone = rr.allreduce(tensors[name], op=rr.Sum, name=f"{name}.alone")
            assert alone.tobytes() == fused[name].tobytes(), f"{name}: fused differs from unfused"
        blobs = MPI.COMM_WORLD.allgather(b"".join(fused[name].tobytes() for name in names))
        assert all(b == blobs[0] for b in blobs), "ranks differ bit for bit"
    # In place, grouped, with pre/post scaling inside the fused buffer.
    arrays = [tensors[name].astype(np.float64) for name in names]
    rr.grouped_allreduce_(arrays, op=rr.Sum, name="group", prescale_factor=0.5, postscale_factor=4.0)
    for name, got in zip(names, arrays):
        expected = sum(_tensors(r)[name].astype(np.float64) for r in range(n)) * 2.0
        assert np.array_equal(got, expected), f"grouped {name}"


@mpi_test(nps=(2, 3))
def test_mixed_collectives_matched_by_name_in_any_order():
    n, me = rr.size(), rr.rank()
    ops = {
        "gather": lambda: rr.allgather_async(np.full((me + 1, 2), me, np.int32), name="gather"),
        "bcast": lambda: rr.broadcast_async(np.full(5, me, np.float32), root_rank=n - 1, name="bcast"),
        "rs": lambda: rr.reducescatter_async(np.arange(n * 2, dtype=np.float64) * (me + 1), op=rr.Sum, name="rs"),
        "a2a": lambda: rr.alltoall_async(np.arange(n, dtype=np.int64) + 10 * me, name="a2a"),
        "sum": lambda: rr.allreduce_async(np.full(4, me, np.int64), op=rr.Sum, name="sum"),
    }
    order = list(ops)
    random.Random(me).shuffle(order)
    handles = {key: ops[key]() for key in order}
    gathered = rr.synchronize(handles["gather"])
    assert gathered[:, 0].tolist() == [r for r in range(n) for _ in range(r + 1)]
    assert rr.synchronize(handles["bcast"]).tolist() == [n - 1] * 5
    total = n * (n + 1) / 2
    assert rr.synchronize(handles["rs"]).tolist() == [(2 * me) * total, (2 * me + 1) * total]
    received, splits = rr.synchronize(handles["a2a"])
    assert received.tolist() == [10 * src + me for src in range(n)] and splits.tolist() == [1] * n
    assert rr.synchronize(handles["sum"]).tolist() == [n * (n - 1) // 2] * 4
    assert rr.poll(handles["sum"])


@mpi_test(nps=(2, 3))
def test_errors_reach_every_rank_and_name_the_tensor():
    n, me = rr.size(), rr.rank()
    # Same name, different shape on one rank; submitted among good ops, in shuffled order.
    good = [rr.allreduce_async(np.ones(3) * me, name=f"ok{i}") for i in range(3)]
    bad = rr.allreduce_async(np.ones(4 if me == n - 1 else 5), name="layer3.weight.grad")
    with pytest.raises(rr.MismatchError) as info:
        rr.synchronize(bad)
    text = str(info.value)
    assert "'layer3.weight.grad'" in text and f"rank {n - 1}: allreduce float64[4]" in text
    assert "rank 0: allreduce float64[5]" in text
    for h in good:
        assert rr.synchronize(h).tolist() == [(n - 1) / 2] * 3
    # Different dtype and different op under one name.
    h = rr.allreduce_async(np.ones(2, np.float32 if me else np.float64), name="dtype.clash")
    with pytest.raises(rr.MismatchError, match="float32"):
        rr.synchronize(h)
    h = rr.allreduce_async(np.ones(2), op=rr.Min if me else rr.Max, name="op.clash")
    with pytest.raises(rr.MismatchError, match="op=Max"):
        rr.synchronize(h)
    # A rank calling a different collective than the others: an error, not a stall.
    call = (lambda: rr.broadcast(np.zeros(3), 0)) if me == 0 else (lambda: rr.allreduce(np.zeros(3)))
    with pytest.raises(rr.MismatchError, match="rank 0: broadcast"):
        call()
    # The same name twice while the first is in flight.
    first = rr.allreduce_async(np.ones(2), name="twice")
    with pytest.raises(ValueError, match="'twice' is already in flight"):
        rr.allreduce_async(np.ones(2), name="twice")
    rr.synchronize(first)
    rr.synchronize(rr.allreduce_async(np.ones(2), name="twice"))  # fine once the first is done
    # A cached name whose shape changes on one rank only: the cache entry is dropped, error everywhere.
    for _ in range(3):
        rr.allreduce(np.ones(6), name="cached")
    with pytest.raises(rr.MismatchError, match="'cached'"):
        rr.allreduce(np.ones(6 if me else 7), name="cached")
    assert rr.allreduce(np.ones(8), name="cached").tolist() == [1.0] * 8  # new shape everywhere: fine


@mpi_test(nps=(2, 3), env={"MTRAIN_STALL_WARNING_SECONDS": "0.5", "MTRAIN_STALL_SHUTDOWN_SECONDS": "3"})
def test_stall_shutdown_fails_waiting_ranks_naming_the_missing_one():
    n, me = rr.size(), rr.rank()
    if me != 1:
        with pytest.raises(rr.StallError) as info:
            rr.synchronize(rr.allreduce_async(np.ones(3), name="only.some.ranks"))
        assert "not yet by rank(s) [1]" in str(info.value)
        assert "'only.some.ranks'" in str(info.value)
        MPI.COMM_WORLD.send("stalled", dest=1, tag=31)  # (the world, never the runtime's communicators)
    else:
        # Rank 1 skips that op. It joins the barrier below once the others gave up on it, so
        # that no one's wait there comes near the stall limit.
        for _ in range(n - 1):
            assert MPI.COMM_WORLD.recv(source=MPI.ANY_SOURCE, tag=31) == "stalled"
    rr.barrier()
    assert rr.allreduce(np.ones(2), op=rr.Sum, name="after").tolist() == [n, n]


STALL_WARNING_SCRIPT = """
import sys, threading, numpy as np, mtrain.ringreduce as rr
from mpi4py import MPI
rr.init()
if rr.rank() == 0:  # the coordinator, which warns: it tells rank 1 once it has
    warned = threading.Event()

    class Watched:  # rank 0's stderr (the runtime looks sys.stderr up for every line)
        def write(self, text):
            if "stall warning" in text:
                warned.set()
            return sys.__stderr__.write(text)

        def flush(self):
            sys.__stderr__.flush()

    sys.stderr = Watched()
    threading.Thread(target=lambda: warned.wait() and MPI.COMM_WORLD.send("warned", dest=1, tag=32),
                     daemon=True).start()
if rr.rank() == 1:
    MPI.COMM_WORLD.recv(source=0, tag=32)  # rank 1 is late: the others wait on 'late.grad' meanwhile
rr.synchronize(rr.allreduce_async(np.ones(3), name="late.grad"))
rr.shutdown()
print("finished", rr.rank() if rr.is_initialized() else "")
"""


@pytest.mark.parametrize("nprocs", [2, 3])
def test_stall_warning_names_op_and_missing_rank(nprocs):
    result = launch(nprocs, [sys.executable, "-c", STALL_WARNING_SCRIPT], timeout=90,
                    env={"MTRAIN_STALL_WARNING_SECONDS": "0.5"})
    assert result.returncode == 0, result.stderr
    assert "stall warning" in result.stderr
    assert "'late.grad'" in result.stderr and "not yet by rank(s) [1]" in result.stderr
    assert result.stdout.count("finished") == nprocs


SHUTDOWN_SCRIPT = """
import sys, numpy as np, mtrain.ringreduce as rr
rr.init()
if rr.rank() == 0:
    handle = rr.allreduce_async(np.ones(10), name="never.matched")
    try:
        rr.synchronize(handle)
    except rr.ShutdownError as e:
        print("rank 0 got ShutdownError:", e)
else:
    rr.shutdown()  # rank 1 leaves while rank 0 has an op in flight
# Every rank starts again (rank 0's engine stopped when rank 1 left). Then the
# interpreter exits with an op in flight, never synchronized: that must not hang either.
rr.init()
rr.allreduce_async(np.ones(3), name=f"abandoned.{rr.rank()}")
"""


@pytest.mark.parametrize("nprocs", [2, 3])
def test_shutdown_with_ops_in_flight_never_hangs(nprocs):
    result = launch(nprocs, [sys.executable, "-c", SHUTDOWN_SCRIPT], timeout=90)
    assert result.returncode == 0, result.stderr
    # Ranks 1.. shut down on their own clocks: the engine stops in the first cycle that sees one
    # of them leave, so the error names those seen in that cycle (one or more), never rank 0.
    named = re.search(r"rank 0 got ShutdownError: rank\(s\) \[([0-9, ]+)\] left the job", result.stdout)
    assert named, result.stdout
    leavers = [int(r) for r in named.group(1).split(",")]
    assert leavers and set(leavers) <= set(range(1, nprocs)), leavers


LATE_ENGINE_EXIT_SCRIPT = """
import threading, numpy as np, mtrain.ringreduce as rr
from mtrain.ringreduce.engine.dispatch import Dispatcher
from mtrain.ringreduce.engine.cycle import Engine
original = Dispatcher.fail_all


def fail_all_then_linger(self, error):
    original(self, error)
    asked.wait(10)  # the engine thread has failed its ops but has not ended yet


asked = threading.Event()  # until init() asks the stopped engine to shut down, its thread lingers
original_shutdown = Engine.shutdown


def shutdown_releasing(self, *args, **kwargs):
    asked.set()
    original_shutdown(self, *args, **kwargs)


Engine.shutdown = shutdown_releasing
Dispatcher.fail_all = fail_all_then_linger
rr.init()
if rr.rank() == 0:
    try:
        rr.synchronize(rr.allreduce_async(np.ones(4), name="left.behind"))
    except rr.ShutdownError:
        pass
else:
    rr.shutdown()
rr.init()  # on rank 0 the stopped engine's thread is still alive here
print("sum", rr.rank(), rr.allreduce(np.arange(3.0) + rr.rank(), op=rr.Sum, name="again").tolist())
"""


def test_init_after_a_peer_left_starts_afresh_while_the_stopped_engine_winds_down():
    # An engine that a peer's leaving stopped fails its ops, then its thread ends: init() called
    # in between (the CI run of test_shutdown_with_ops_in_flight_never_hangs) must not keep it.
    result = launch(2, [sys.executable, "-c", LATE_ENGINE_EXIT_SCRIPT], timeout=90)
    assert result.returncode == 0, result.stderr
    assert sorted(line for line in result.stdout.splitlines() if line.startswith("sum ")) == [
        "sum 0 [1.0, 3.0, 5.0]", "sum 1 [1.0, 3.0, 5.0]"], result.stdout


@mpi_test(nps=(2,), timeout=240)
def test_memory_and_file_descriptors_stable_over_thousands_of_steps():
    grads = [np.ones(n, np.float32) for n in (10, 1000, 30_000, 300_000)]

    def step(i):
        handles = [rr.allreduce_async_(g, name=f"g{k}") for k, g in enumerate(grads)]
        for h in handles:
            rr.synchronize(h)

    def rss_kib():
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("VmRSS"))

    for i in range(300):
        step(i)
    rss_before, fds_before = rss_kib(), len(os.listdir("/proc/self/fd"))
    for i in range(2700):
        step(i)
    rss_after, fds_after = rss_kib(), len(os.listdir("/proc/self/fd"))
    assert fds_after == fds_before, f"file descriptors {fds_before} -> {fds_after}"
    assert rss_after - rss_before < 4096, f"RSS grew {rss_after - rss_before} KiB over 2700 steps"


TIMELINE_SCRIPT = """
import numpy as np, mtrain.ringreduce as rr
rr.init()
handles = [rr.allreduce_async(np.ones(n), name=f"w{n}") for n in (5, 50, 500_000)]
[rr.synchronize(h) for h in handles]
rr.shutdown()
"""


def test_timeline_is_chrome_trace_json_from_rank_0():
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "timeline.json")
        result = launch(2, [sys.executable, "-c", TIMELINE_SCRIPT], timeout=60,
                        env={"MTRAIN_TIMELINE": path, "MTRAIN_FUSION_INPLACE_MIN_BYTES": "100000"})
        assert result.returncode == 0, result.stderr
        with open(path) as f:
            events = json.load(f)
    phases = {(e["args"].get("name") if e["ph"] == "M" else e.get("name")) for e in events}
    assert {"w5", "w50", "w500000"} <= phases
    assert {"NEGOTIATE_ALLREDUCE", "ALLREDUCE", "MEMCPY_IN_FUSION_BUFFER", "MPI_ALLREDUCE",
            "MEMCPY_OUT_FUSION_BUFFER"} <= phases
    assert all(e["dur"] >= 0 for e in events if e["ph"] == "X")


DYING_RANK_SCRIPT = """
import os, signal, time, numpy as np, mtrain.ringreduce as rr
rr.init()
for step in range(1000):
    if rr.rank() == 1 and step == 20:
        os.kill(os.getpid(), signal.SIGKILL)
    rr.allreduce(np.ones(1000), name="grad")
"""


def test_a_killed_rank_ends_the_job_naming_it():
    result = launch(3, [sys.executable, "-c", DYING_RANK_SCRIPT], timeout=60)
    assert result.returncode != 0
    assert "rank 1" in result.stderr, result.stderr


@mpi_test(nps=(1,))
def test_engine_thread_adopts_the_gpu_bound_in_the_creating_thread():
    # CUDA's current device is per thread and a new thread starts on GPU 0: the engine
    # thread must switch to the GPU init() bound before any device work. A stand-in
    # for CuPy's runtime records which thread asked for which device.
    import threading
    import types
    from mtrain.ringreduce.transport.executor import Executor
    from mtrain.ringreduce.engine.cycle import Engine
    from mtrain.common.settings import EngineConfig

    calls = []
    runtime = types.SimpleNamespace(getDevice=lambda: 3,
                                    setDevice=lambda i: calls.append((threading.current_thread().name, i)))
    sys.modules["cupy"] = types.SimpleNamespace(cuda=types.SimpleNamespace(runtime=runtime))
    try:
        engine = Engine(Executor(MPI.COMM_WORLD.Dup(), 1 << 20, 0), MPI.COMM_WORLD.Dup(),
                        EngineConfig.from_environment())
        engine.shutdown()
    finally:
        del sys.modules["cupy"]
    assert calls == [("mtrain-engine", 3)]
