"""The shared-memory and hierarchical all-reduce (ringreduce/transport/shm.py) and how the Executor picks it.

One host: every element is reduced by one rank in rank order, so results must equal
a reference reduced in rank order with the same NumPy operations, bit for bit.
Hierarchical: several "hosts" cut out of one (any split of COMM_WORLD works), the
reference reduces each host in rank order and then combines the host results.
"""
import os

import numpy as np
import pytest
from mpi4py import MPI

import mtrain.ringreduce as rr
from mtrain.ringreduce.transport import executor as collectives, shm
from mtrain.ringreduce.transport.backend import DeviceBackend, NumpyBackend
from mtrain.ringreduce.transport.executor import Executor, algorithm_from_environment
from mtrain.ringreduce.core.ops import SUPPORTED_DTYPES
from tests.mpi.data import DTYPES, OPS, assert_matches, reference, values
from tests.mpi.harness import mpi_test

_UFUNCS = {rr.Sum: np.add, rr.Average: np.add, rr.Min: np.minimum, rr.Max: np.maximum, rr.Product: np.multiply}
_HOST = NumpyBackend()  # its scale is the documented scaling rule (Horovod's)


def _combine(inputs, op):
    """Inputs reduced left to right: (((x0 op x1) op x2) …), in their dtype."""
    acc = inputs[0].copy()
    for x in inputs[1:]:
        if acc.dtype == np.bool_:
            (np.logical_and if op == rr.Min else np.logical_or)(acc, x, out=acc)
        else:
            _UFUNCS[op](acc, x, out=acc)
    return acc


def _finish(acc, op, ranks, postscale):
    _HOST.scale(acc, postscale / ranks if op == rr.Average else postscale)  # one scaling, as Horovod
    return acc


def _prescaled(inputs, prescale):
    out = [x.copy() for x in inputs]
    for x in out:
        _HOST.scale(x, prescale)
    return out


def rank_order(inputs, op, prescale=1.0, postscale=1.0):
    """What one host's shared-memory all-reduce must give, bit for bit."""
    return _finish(_combine(_prescaled(inputs, prescale), op), op, len(inputs), postscale)


def two_level(inputs, op, hosts, prescale=1.0, postscale=1.0):
    """Each host (consecutive ranks) in rank order, then the host results combined
    (two hosts: one op application, which commutes; the cross ring's order then does not matter)."""
    scaled = _prescaled(inputs, prescale)
    per = len(inputs) // hosts
    host_results = [_combine(scaled[h * per:(h + 1) * per], op) for h in range(hosts)]
    return _finish(_combine(host_results, op), op, len(inputs), postscale)


def _same_everywhere(comm, result, what):
    blobs = comm.allgather(result.tobytes())
    for r, blob in enumerate(blobs):
        assert blob == blobs[0], f"{what}: rank {r}'s result differs from rank 0's bit for bit"


def _same_bits(got, want, what):
    assert got.dtype == want.dtype and got.shape == want.shape, f"{what}: {got.dtype}{got.shape} vs {want.dtype}{want.shape}"
    if got.tobytes() != want.tobytes():
        bad = np.flatnonzero(got.view(np.uint8) != want.view(np.uint8))[0] // got.itemsize
        raise AssertionError(f"{what}: element {bad} is {got.reshape(-1)[bad]!r}, "
                             f"expected {want.reshape(-1)[bad]!r} (rank-order reference)")


def _executor(comm, local, cross, algorithm, stripe=None, transport="auto", block=None):
    """``stripe``: the segment's stripe; ``block``: bytes cma reads per call."""
    executor = Executor(comm, 512 << 10, 16 << 10, local, cross, algorithm=algorithm, shm_stripe_bytes=stripe,
                        shm_transport=transport)
    if executor.shared is not None:
        if transport == "cma":
            _expect_cma(executor.shared)
        else:
            assert executor.shared.transport == "segment", transport
        if block:
            executor.shared.cma_block_bytes = block
    return executor


def _expect_cma(shared):
    """Cross-memory attach is taken where the kernel allows it; CI (root) must allow it."""
    if os.environ.get("CI"):
        assert shared.cma, f"cross-memory attach refused in CI: {shared.notice}"
    elif not shared.cma:
        print(f"note: this machine refuses cross-memory attach ({shared.notice}); the segment ran")


def _host_split(comm):
    local = comm.Split_type(MPI.COMM_TYPE_SHARED, key=comm.Get_rank())
    cross = comm.Split(color=local.Get_rank(), key=comm.Get_rank())
    return local, cross


def _fake_hosts(comm, per_host):
    """Cut the job into "hosts" of ``per_host`` consecutive ranks (the last may be smaller)."""
    local = comm.Split(color=comm.Get_rank() // per_host, key=comm.Get_rank())
    cross = comm.Split(color=local.Get_rank(), key=comm.Get_rank())
    return local, cross


def _counts(n):
    # zero, fewer than the ranks, odd, around a stripe of a few hundred bytes, several stripes
    return [0, 1, max(n - 1, 1), 7, 31, 64, 257, 1000, 5003]


def _split_flats(x, n_flats):
    """``x`` as several flats over the same memory (the engine's fused + in-place layout),
    an empty one among them."""
    if n_flats == 1:
        return [x]
    cut = [0, x.size // 3, x.size // 3, x.size // 2, x.size]
    return [x[cut[i]:cut[i + 1]] for i in range(len(cut) - 1)]


def _run_cases(executor, comm, reference_of, dtypes, what, scalings=((1.0, 1.0), (0.5, 3.0))):
    n, me = comm.Get_size(), comm.Get_rank()
    for dtype in dtypes:
        for op in OPS + [rr.Min, rr.Max]:
            if np.dtype(dtype) == np.bool_ and op not in (rr.Min, rr.Max):
                continue
            for count in _counts(n):
                for n_flats in (1, 4):
                    for prescale, postscale in scalings:
                        case = (f"{what} {np.dtype(dtype).name} {op.name} count {count} flats {n_flats} "
                                f"pre {prescale} post {postscale} np={n} rank {me}")
                        inputs = [_inputs(r, count, dtype, op) for r in range(n)]
                        mine = inputs[me].copy()
                        executor.allreduce_flat(_split_flats(mine, n_flats), op, _HOST, prescale, postscale)
                        _same_bits(mine, reference_of(inputs, op, prescale, postscale), case)
                        _same_everywhere(comm, mine, case)
                        if prescale == 1.0 and postscale == 1.0 and np.dtype(dtype) != np.bool_:
                            assert_matches(mine, reference(inputs, op), case + " (float64 reference)")


def _inputs(rank, count, dtype, op):
    if np.dtype(dtype) == np.bool_:
        return (np.arange(count) * 7 + rank * 3) % 5 < 3
    return values(rank, (count,), dtype, op)


_SOME_DTYPES = [np.float16, np.float32, np.float64, np.int8, np.int32, np.uint16, np.int64, np.bool_]


# -- choosing the algorithm -----------------------------------------------------------


def test_algorithm_from_environment():
    Algorithm = collectives.Algorithm
    assert algorithm_from_environment({}) is Algorithm.AUTO
    for algorithm in Algorithm:
        assert algorithm_from_environment({"MTRAIN_ALLREDUCE_ALGORITHM": algorithm.value}) is algorithm
    assert algorithm_from_environment({"MTRAIN_ALLREDUCE_ALGORITHM": " SHM "}) is Algorithm.SHM
    assert algorithm_from_environment({"HOROVOD_HIERARCHICAL_ALLREDUCE": "1"}) is Algorithm.HIERARCHICAL
    assert algorithm_from_environment({"HOROVOD_HIERARCHICAL_ALLREDUCE": "0"}) is Algorithm.AUTO
    # Ours wins over Horovod's.
    assert algorithm_from_environment({"HOROVOD_HIERARCHICAL_ALLREDUCE": "1",
                                       "MTRAIN_ALLREDUCE_ALGORITHM": "ring"}) is Algorithm.RING
    with pytest.raises(ValueError) as raised:
        algorithm_from_environment({"MTRAIN_ALLREDUCE_ALGORITHM": "nccl"})
    message = str(raised.value)
    assert "MTRAIN_ALLREDUCE_ALGORITHM" in message and "'nccl'" in message
    assert "auto, ring, shm, hierarchical, mpi" in message


def test_transport_from_environment():
    Transport = shm.Transport
    assert collectives.transport_from_environment({}) is Transport.AUTO
    for transport in Transport:
        assert collectives.transport_from_environment({"MTRAIN_SHM_TRANSPORT": transport.value}) is transport
    assert collectives.transport_from_environment({"MTRAIN_SHM_TRANSPORT": " CMA "}) is Transport.CMA
    with pytest.raises(ValueError) as raised:
        collectives.transport_from_environment({"MTRAIN_SHM_TRANSPORT": "xpmem"})
    message = str(raised.value)
    assert "MTRAIN_SHM_TRANSPORT='xpmem'" in message and "auto, cma, segment" in message


def test_choices_are_still_their_text():
    """Benchmarks and user code pass and compare the settings' text, and print them: an
    Algorithm or Transport equals its text and formats as it; an unknown text names the choices."""
    Algorithm, Transport = collectives.Algorithm, shm.Transport
    assert Algorithm.of("hierarchical") is Algorithm.HIERARCHICAL and Algorithm.of(Algorithm.RING) is Algorithm.RING
    assert Transport.of("segment") is Transport.SEGMENT and Transport.of(Transport.CMA) is Transport.CMA
    assert Algorithm.SHM == "shm" and Transport.CMA != "segment"
    assert f"rr-{Algorithm.HIERARCHICAL}-{Transport.CMA}" == "rr-hierarchical-cma"
    with pytest.raises(ValueError, match="unknown all-reduce algorithm 'nccl'; use one of auto, ring, shm, hierarchical, mpi"):
        Algorithm.of("nccl")
    with pytest.raises(ValueError, match="unknown shared-memory transport 'xpmem'; use one of auto, cma, segment"):
        Transport.of("xpmem")
    with pytest.raises(ValueError, match="unknown shared-memory transport 'xpmem'"):
        Executor(MPI.COMM_SELF, 512 << 10, 16 << 10, algorithm="ring", shm_transport="xpmem")


def test_bad_algorithm_fails_when_the_executor_is_made(monkeypatch):
    monkeypatch.setenv("MTRAIN_ALLREDUCE_ALGORITHM", "fastest")
    with pytest.raises(ValueError, match="MTRAIN_ALLREDUCE_ALGORITHM='fastest'"):
        Executor(MPI.COMM_SELF, 512 << 10, 16 << 10)


# -- through the public API, each algorithm forced ---------------------------------


@mpi_test(nps=(1, 2, 3), timeout=240, env={"MTRAIN_ALLREDUCE_ALGORITHM": "auto"})
def test_api_auto():
    """rr.allreduce at every dtype, op and shape, with the algorithm the environment forces."""
    n, me = rr.size(), rr.rank()
    algorithm = os.environ.get("MTRAIN_ALLREDUCE_ALGORITHM", "auto")
    executor = rr.runtime.current().engine.executor
    expected_path = "ring" if algorithm == "ring" or n == 1 else "shm"  # one host: hierarchical is shm
    assert executor.allreduce_path == expected_path, (algorithm, executor.allreduce_path)
    exact = expected_path == "shm"
    for dtype in list(DTYPES) + [np.bool_]:
        for op in OPS:
            if np.dtype(dtype) == np.bool_ and op not in (rr.Min, rr.Max):
                continue
            for shape in [(0,), (1,), (max(n - 1, 1),), (7,), (101,), (3, 5, 7), (70_001,)]:
                for prescale, postscale in ((1.0, 1.0), (0.5, 3.0)):
                    what = (f"{algorithm}: allreduce {np.dtype(dtype).name} {op.name} shape {shape} "
                            f"pre {prescale} post {postscale} np={n} rank {me}")
                    if np.dtype(dtype) == np.bool_:
                        if prescale != 1.0:
                            continue
                        inputs = [(np.arange(np.prod(shape)).reshape(shape) + r) % 3 == 0 for r in range(n)]
                    else:
                        inputs = [values(r, shape, dtype, op) for r in range(n)]
                    result = rr.allreduce(inputs[me].copy(), op=op, prescale_factor=prescale,
                                          postscale_factor=postscale)
                    _same_everywhere(MPI.COMM_WORLD, result, what)
                    if exact:
                        flat = [x.reshape(-1) for x in inputs]
                        _same_bits(result.reshape(-1), rank_order(flat, op, prescale, postscale), what)
                    elif prescale == 1.0 and postscale == 1.0 and np.dtype(dtype) != np.bool_:
                        assert_matches(result, reference(inputs, op), what)


# The same body (it reads the variable) with each value forced.
_api_body = test_api_auto.rank_body
test_api_ring = mpi_test(nps=(2, 3), timeout=240, env={"MTRAIN_ALLREDUCE_ALGORITHM": "ring"})(_api_body)
test_api_shm = mpi_test(nps=(1, 2, 3), timeout=240, env={"MTRAIN_ALLREDUCE_ALGORITHM": "shm"})(_api_body)
# On one host hierarchical is shm (test_api_shm covers np=2): one job size is enough here.
test_api_hierarchical = mpi_test(nps=(3,), timeout=240,
                                 env={"MTRAIN_ALLREDUCE_ALGORITHM": "hierarchical"})(_api_body)
# Horovod's switch, and stripes of a few hundred bytes so large tensors take many stripes.
# The segment transport (forced) with stripes of a few hundred bytes, so large tensors take many.
test_api_horovod_hierarchical_segment_small_stripes = mpi_test(
    nps=(2, 3), timeout=240, env={"HOROVOD_HIERARCHICAL_ALLREDUCE": "1", "MTRAIN_SHM_STRIPE_BYTES": "384",
                                  "MTRAIN_SHM_TRANSPORT": "segment"},
)(_api_body)

_GROUPED_ENV = {"MTRAIN_ALLREDUCE_ALGORITHM": "shm", "MTRAIN_FUSION_THRESHOLD_BYTES": "4096",
                "MTRAIN_FUSION_INPLACE_MIN_BYTES": "2048"}


@mpi_test(nps=(2, 3), env=dict(_GROUPED_ENV, MTRAIN_SHM_TRANSPORT="cma"))
def test_grouped_through_the_engine():
    """Fused and in-place tensors in one all-reduce (several flats: the peers' buffers are
    read piece by piece), through the transport the environment forces."""
    n, me = rr.size(), rr.rank()
    transport = os.environ["MTRAIN_SHM_TRANSPORT"]
    shared = rr.runtime.current().engine.executor.shared
    if transport == "segment":
        assert shared.transport == "segment"
    else:
        _expect_cma(shared)
    counts = [0, 1, 5, 300, 700, 2049, 10_007, 3]
    for op in OPS:
        inputs = [[values(r, (c,), np.float32, op) for c in counts] for r in range(n)]
        results = rr.grouped_allreduce([x.copy() for x in inputs[me]], op=op)
        for k, got in enumerate(results):
            want = rank_order([inputs[r][k] for r in range(n)], op)
            _same_bits(got, want, f"grouped {op.name} tensor {k} ({counts[k]} elements) np={n} rank {me}")
    assert shared.calls > 0, "nothing went through shared memory"


test_grouped_through_the_engine_segment_many_stripes = mpi_test(
    nps=(2, 3), env=dict(_GROUPED_ENV, MTRAIN_SHM_TRANSPORT="segment", MTRAIN_SHM_STRIPE_BYTES="256"),
)(test_grouped_through_the_engine.rank_body)


# -- the Executor directly: several flats, tiny stripes, every op and scaling ---------


@mpi_test(nps=(1, 2, 3), timeout=300)
def test_shared_memory_executor_matches_rank_order():
    comm = MPI.COMM_WORLD
    local, cross = _host_split(comm)
    # Cross-memory attach in blocks (and stripes) of a few elements, and of the default size;
    # then the segment (auto's) in many stripes (some chunks empty), and in one.
    for transport, stripe, block in (("cma", None, 120), ("cma", None, None), ("auto", 200, None),
                                     ("segment", 128, None), ("segment", None, None)):
        executor = _executor(comm, local, cross, "shm", stripe, transport, block)
        assert executor.allreduce_path == ("shm" if comm.Get_size() > 1 else "ring")
        _run_cases(executor, comm, rank_order, _SOME_DTYPES, f"shm {transport} stripe {stripe} block {block}")
        executor.close()


# A job of its own (fresh): the body points shm's folder lookup nowhere for the rest of its process.
@mpi_test(nps=(2, 3), fresh=True)
def test_auto_reads_the_peers_buffers_where_the_segment_cannot_be_mapped():
    """No room for the segment (here: no such folder): auto falls back to cma; the segment
    transport, forced, leaves the all-reduces to the ring (and rank 0 says why)."""
    comm = MPI.COMM_WORLD
    local, cross = _host_split(comm)
    shm.shm_folder = lambda: "/nonexistent-mtrain-test"
    auto = Executor(comm, 512 << 10, 16 << 10, local, cross, algorithm="shm", shm_transport="auto")
    if auto.shared is None:  # cross-memory attach refused too: the ring runs
        assert not os.environ.get("CI"), "cross-memory attach refused in CI"
    else:
        assert auto.shared.transport == "cma" and auto.shared.segment is None
        _run_cases(auto, comm, rank_order, [np.float32, np.int64], "auto without a segment",
                   scalings=((1.0, 1.0),))
    segment = Executor(comm, 512 << 10, 16 << 10, local, cross, algorithm="shm", shm_transport="segment")
    assert segment.shared is None and segment.allreduce_path == "ring"


@mpi_test(nps=(2, 3))
def test_every_supported_dtype_on_shared_memory():
    comm = MPI.COMM_WORLD
    local, cross = _host_split(comm)
    dtypes = [d for d in SUPPORTED_DTYPES if d not in _SOME_DTYPES]
    for transport, stripe, block in (("cma", None, 200), ("segment", 200, None)):
        executor = _executor(comm, local, cross, "shm", stripe, transport, block)
        _run_cases(executor, comm, rank_order, dtypes, f"shm {transport}", scalings=((1.0, 1.0), (0.25, 3.0)))


@mpi_test(nps=(2, 3))
def test_device_buffers_keep_the_ring():
    """A device backend never reaches the shared segment (host memory only)."""
    from tests.mpi.test_staging import StandInDevice
    comm = MPI.COMM_WORLD
    local, cross = _host_split(comm)
    executor = _executor(comm, local, cross, "shm")
    device = DeviceBackend(StandInDevice(), "stand-in")
    n, me = comm.Get_size(), comm.Get_rank()
    inputs = [values(r, (1001,), np.float64) for r in range(n)]
    mine = inputs[me].copy()
    executor.allreduce_flat([mine], rr.Sum, device)
    assert executor.shared.calls == 0, "device buffers went through shared memory"
    assert_matches(mine, reference(inputs, rr.Sum), "device buffer on the ring")


# -- hierarchical: fake hosts cut out of this one -------------------------------------


@mpi_test(nps=(4,), timeout=400)
def test_hierarchical_two_hosts_of_two():
    comm = MPI.COMM_WORLD
    local, cross = _fake_hosts(comm, 2)
    for algorithm, stripe, transport in (("hierarchical", 96, "segment"), ("hierarchical", None, "cma"),
                                         ("auto", 200, "auto"), ("shm", 1000, "segment")):
        executor = _executor(comm, local, cross, algorithm, stripe, transport, 96 if transport == "cma" else None)
        assert executor.allreduce_path == "hierarchical", (algorithm, executor.allreduce_path)

        def two_hosts(inputs, op, prescale, postscale):
            return two_level(inputs, op, 2, prescale, postscale)

        dtypes = [np.float32, np.int32, np.uint8, np.bool_] if algorithm != "hierarchical" else _SOME_DTYPES
        _run_cases(executor, comm, two_hosts, dtypes, f"{algorithm} {transport} 2x2 stripe {stripe}")
        executor.close()
    # Forced ring: the same answers (to rounding), through the flat ring.
    ring_executor = _executor(comm, local, cross, "ring")
    assert ring_executor.allreduce_path == "ring"


@mpi_test(nps=(3,))
def test_uneven_hosts_fall_back_to_the_ring():
    """Hosts of 2 and 1 ranks: chunks would not line up across hosts, so the flat ring runs."""
    comm = MPI.COMM_WORLD
    local, cross = _fake_hosts(comm, 2)
    for algorithm in ("auto", "hierarchical", "shm"):
        executor = _executor(comm, local, cross, algorithm)
        assert executor.allreduce_path == "ring", (algorithm, executor.allreduce_path)
    n, me = comm.Get_size(), comm.Get_rank()
    inputs = [values(r, (5003,), np.float64) for r in range(n)]
    mine = inputs[me].copy()
    executor.allreduce_flat([mine], rr.Average, _HOST)
    assert_matches(mine, reference(inputs, rr.Average), "uneven hosts, ring")
    _same_everywhere(comm, mine, "uneven hosts, ring")


@mpi_test(nps=(2,))
def test_one_rank_per_host_is_the_ring():
    """Two fake hosts of one rank each: nothing to share, the flat ring runs."""
    comm = MPI.COMM_WORLD
    local, cross = _fake_hosts(comm, 1)
    assert _executor(comm, local, cross, "hierarchical").allreduce_path == "ring"
