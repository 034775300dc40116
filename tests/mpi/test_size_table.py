"""The all-reduce path per size (size_table.py) and the library's own MPI_Allreduce path (library.py).

Results first: every dtype, op and shape on the library's path (forced), the integer sums
wrapping around as NumPy's do, every rank holding the same bits. Then the choice: the probe
gives every rank the same table and routes each size it measured to that size's fastest path;
the executor follows the table only for what the library reduces as we do; the table is kept
in a private cache folder and read back only from there.
"""
import json
import os
import stat
import tempfile

import numpy as np
from mpi4py import MPI

import mtrain.ringreduce as rr
from mtrain.ringreduce import runtime
from mtrain.ringreduce.transport import size_table
from mtrain.ringreduce.transport.backend import NumpyBackend
from mtrain.ringreduce.transport.executor import Algorithm, Executor
from mtrain.ringreduce.core.ops import Average, Max, Min, Product, Sum
from tests.mpi.harness import mpi_test
from tests.mpi import test_allreduce as allreduce_tests
from tests.mpi.test_allreduce import check_identical_everywhere

LIBRARY = {"MTRAIN_ALLREDUCE_ALGORITHM": "mpi"}

# The whole dtype x op x shape body with the library's path forced (the dtypes it does not
# take, float16, bfloat16 and the narrow integers, run on the ring).
test_allreduce_on_the_library_path = mpi_test(nps=(2, 3), env=LIBRARY)(
    allreduce_tests.test_allreduce_every_dtype_op_and_shape.rank_body)


@mpi_test(nps=(2, 3), env=LIBRARY)
def test_the_library_path_wraps_integers_and_scales_floats_as_ours():
    """Integer sums past the dtype's range wrap around (NumPy's rule, which Horovod's CPU ops
    follow); floats: Average with pre- and postscale matches the reference on every rank."""
    n, me = rr.size(), rr.rank()
    assert runtime.current().engine.executor.allreduce_path == "mpi"
    for dtype in (np.int32, np.int64, np.uint32, np.uint64):
        top = np.iinfo(dtype).max
        inputs = [np.full(37, top, dtype) - np.arange(37).astype(dtype) * dtype(r + 1) for r in range(n)]
        want = inputs[0].copy()
        for other in inputs[1:]:
            np.add(want, other, out=want)  # wraps around
        got = rr.allreduce(inputs[me], op=Sum, name=f"wrap.{np.dtype(dtype).name}")
        assert np.array_equal(got, want), (np.dtype(dtype).name, got[:4], want[:4])
    for dtype in (np.float32, np.float64):
        inputs = [np.random.default_rng(100 + r).standard_normal(1001).astype(dtype) for r in range(n)]
        got = rr.allreduce(inputs[me], op=Average, prescale_factor=0.5, postscale_factor=3.0,
                           name=f"scaled.{np.dtype(dtype).name}")
        want = sum(a.astype(np.float64) * 0.5 for a in inputs) / n * 3.0
        assert got.dtype == dtype
        np.testing.assert_allclose(got, want, rtol=1e-5 if dtype == np.float32 else 1e-12)
        check_identical_everywhere(got, f"Average {np.dtype(dtype).name} np={n}")


def _auto_executor() -> Executor:
    comm = MPI.COMM_WORLD
    local = comm.Split_type(MPI.COMM_TYPE_SHARED, key=comm.Get_rank())
    cross = comm.Split(color=local.Get_rank(), key=comm.Get_rank())
    return Executor(comm, 512 << 10, 16 << 10, local, cross, algorithm="auto")


@mpi_test(nps=(2, 3))
def test_the_executor_follows_the_table_for_what_the_library_takes():
    """``path_for``: below the bound the table's ``mpi``, except for dtypes and ops the library
    does not reduce as we do; ``use`` (the autotuner's choice) overrides the table until it
    picks auto again. A fused buffer of several tensors goes through the library packed, and
    unpacks to the right values."""
    n, me = rr.size(), rr.rank()
    executor = _auto_executor()
    shared = executor.allreduce_path
    assert shared == "shm"  # one host, several ranks
    executor.by_size = size_table.SizeTable((1000,), (Algorithm.MPI, Algorithm.SHM))  # as choose_paths keeps it
    f32 = np.dtype(np.float32)
    assert executor.path_for(999, f32, Sum) is Algorithm.MPI
    assert executor.path_for(999, np.dtype(np.int64), Max) is Algorithm.MPI
    assert executor.path_for(1000, f32, Sum) is Algorithm.SHM
    # What the library does not take falls back to auto's own rule (tiny buffers: the ring).
    for dtype in (np.float16, np.uint8, np.int16, np.bool_):
        assert executor.path_for(16, np.dtype(dtype), Sum) is Algorithm.RING, dtype
    # Without its shared memory (a benchmark swaps it out), the table's shm falls back to the ring.
    segment, executor.shared = executor.shared, None
    assert executor.path_for(1000, f32, Sum) is Algorithm.RING
    executor.shared = segment
    executor.use(Algorithm.RING, executor.segment_bytes)
    assert executor.path_for(999, f32, Sum) is Algorithm.RING
    executor.use(Algorithm.AUTO, executor.segment_bytes)
    assert executor.path_for(999, f32, Sum) is Algorithm.MPI
    # Three tensors of odd sizes as one logical buffer, on the library's path.
    sizes = (1, 7, 61)
    flats = [np.arange(k, dtype=np.float64) * (me + 1) + 1000 * i for i, k in enumerate(sizes)]
    assert executor.path_for(sum(f.nbytes for f in flats), flats[0].dtype, Product) is Algorithm.MPI
    executor.allreduce_flat(flats, Product, NumpyBackend(), 1.0, 2.0)
    for i, (k, flat) in enumerate(zip(sizes, flats)):
        want = np.prod([np.arange(k, dtype=np.float64) * (r + 1) + 1000 * i for r in range(n)], axis=0) * 2.0
        assert np.array_equal(flat, want), (i, flat, want)
    for op in (Min, Sum):
        flats = [np.arange(k, dtype=np.int32) * (me + 1) - 5 for k in sizes]
        executor.allreduce_flat(flats, op, NumpyBackend())
        for k, flat in zip(sizes, flats):
            stack = np.stack([np.arange(k, dtype=np.int32) * (r + 1) - 5 for r in range(n)])
            assert np.array_equal(flat, stack.min(0) if op is Min else stack.sum(0).astype(np.int32)), (op, flat)
    executor.close()


@mpi_test(nps=(2, 3))
def test_the_probe_gives_every_rank_one_table_of_the_fastest_paths():
    comm = MPI.COMM_WORLD
    executor = _auto_executor()
    runners = executor.runners()
    assert set(runners) == {"mpi", "ring", "shm"}
    table, measured = size_table.probe(comm, runners)
    assert comm.allgather(table) == [table] * comm.Get_size(), "the ranks derived different tables"
    assert [size for size, _ in measured] == list(size_table.PROBE_SIZES[:len(measured)])
    for size, seconds in measured:
        assert set(seconds) == set(runners) and all(0 < s < 1 for s in seconds.values()), seconds
        assert table.path_for(size) == min(seconds, key=seconds.__getitem__), (size, seconds, table)
    # Past the budget after the first size: that size alone is probed, its winner holds everywhere.
    table, measured = size_table.probe(comm, runners, budget_s=0.0)
    assert len(measured) == 1 and table.bounds == () and len(table.paths) == 1
    executor.close()
    # The job's own engine chose at init: its table holds the paths as the executor routes by them.
    job = runtime.current().engine.executor
    assert job.by_size is not None and all(type(path) is Algorithm for path in job.by_size.paths), job.by_size
    assert comm.allgather(job.by_size) == [job.by_size] * comm.Get_size()
    assert job.path_for(4096, np.dtype(np.float32), Sum) in set(job.by_size.paths) | {Algorithm.RING}


def test_winners_become_bounds_halfway_between_sizes():
    table = size_table.from_winners([4096, 16384, 65536, 262144], ["mpi", "mpi", "shm", "mpi"])
    assert table == size_table.SizeTable((32768, 131072), ("mpi", "shm", "mpi"))
    assert [table.path_for(b) for b in (1, 32767, 32768, 131071, 131072, 1 << 30)] == \
        ["mpi", "mpi", "shm", "shm", "mpi", "mpi"]
    assert size_table.from_winners([4096], ["ring"]).describe() == "ring at every size"
    assert "mpi below 32 KiB" in table.describe()


def _counting(runners):
    calls = []

    def wrap(name, run):
        def counted(buf):
            calls.append(name)
            run(buf)
        return counted
    return {name: wrap(name, run) for name, run in runners.items()}, calls


@mpi_test(nps=(2,))
def test_the_table_is_kept_in_a_private_folder_and_read_back_only_from_there():
    comm = MPI.COMM_WORLD
    me = comm.Get_rank()
    executor = _auto_executor()
    base = comm.bcast(tempfile.mkdtemp(prefix="mtrain-cache-test-") if me == 0 else None, root=0)
    environ = {"XDG_CACHE_HOME": base}
    folder = os.path.join(base, "mtrain")
    try:
        runners, calls = _counting(executor.runners())
        first = size_table.choose(comm, [2], runners, environ)
        assert calls, "nothing was kept yet: the first choice must probe"
        if me == 0:
            [name] = os.listdir(folder)
            assert stat.S_IMODE(os.stat(folder).st_mode) == 0o700
            assert stat.S_IMODE(os.stat(os.path.join(folder, name)).st_mode) == 0o600
        path = comm.bcast(os.path.join(folder, os.listdir(folder)[0]) if me == 0 else None, root=0)
        calls.clear()
        assert size_table.choose(comm, [2], runners, environ) == first and not calls, "the kept table was not used"

        def probes_again(tamper, what):
            if me == 0:
                tamper()
            comm.Barrier()
            calls.clear()
            size_table.choose(comm, [2], runners, environ)
            assert calls, f"a table {what} was read"
            comm.Barrier()

        def rewrite(record):
            os.unlink(path)
            with open(path, "w") as handle:
                json.dump(record, handle)
            os.chmod(path, 0o600)

        kept = None
        if me == 0:
            with open(path) as handle:
                kept = json.load(handle)
        probes_again(lambda: os.chmod(path, 0o666), "others may write")
        probes_again(lambda: rewrite({**kept, "paths": ["nccl"] * len(kept["paths"])}), "naming a path not on offer")
        probes_again(lambda: rewrite({**kept, "format": 0}), "of another format")
        probes_again(lambda: (os.unlink(path), open(path, "w").write("{")), "that is not JSON")

        def plant_symlink():
            elsewhere = os.path.join(base, "planted.json")
            with open(elsewhere, "w") as handle:
                json.dump(kept, handle)
            os.chmod(elsewhere, 0o600)
            os.unlink(path)
            os.symlink(elsewhere, path)
        probes_again(plant_symlink, "through a symlink")
        probes_again(lambda: os.chmod(folder, 0o755), "in a folder others may enter")
        if os.geteuid() == 0:  # (as root: a file of another user's, in a folder of theirs)
            def someone_elses():
                os.chmod(folder, 0o700)
                rewrite(kept)
                os.chown(path, 65534, 65534)
            probes_again(someone_elses, "owned by another user")
            probes_again(lambda: (os.chown(path, 0, 0), os.chown(folder, 65534, 65534)),
                         "in another user's folder")
    finally:
        comm.Barrier()
        if me == 0:
            import shutil
            shutil.rmtree(base, ignore_errors=True)
        executor.close()
