"""Pure pieces of the runtime: chunk bounds, ops, dtypes, the not-initialized error."""
import subprocess
import sys

import numpy as np
import pytest

from mtrain.ringreduce.core import ops
from mtrain.ringreduce.transport.backend import NumpyBackend
from mtrain.ringreduce.transport.ring import even_bounds, segment_bounds
from tests.horovod_scaling import horovod_scaled


@pytest.mark.parametrize("count", [0, 1, 2, 3, 5, 7, 64, 101, 4099])
@pytest.mark.parametrize("parts", [1, 2, 3, 4, 7])
def test_segment_bounds_tile_the_buffer_evenly(count, parts):
    bounds = even_bounds(count, parts)
    assert bounds[0][0] == 0 and bounds[-1][1] == count
    for (lo, hi), (next_lo, _) in zip(bounds, bounds[1:]):
        assert hi == next_lo
    lengths = [hi - lo for lo, hi in bounds]
    assert max(lengths) - min(lengths) <= 1
    assert lengths == sorted(lengths, reverse=True)  # the first count % parts are the longer ones
    assert segment_bounds(count, parts, parts - 1) == bounds[-1]


def test_op_values_match_horovod():
    assert (ops.Average, ops.Sum, ops.Adasum, ops.Min, ops.Max, ops.Product) == (0, 1, 2, 3, 4, 5)


def test_unsupported_op_and_dtype_are_named():
    with pytest.raises(ValueError, match="unsupported reduction op 'sum'"):
        ops.check_op("sum")
    assert ops.check_op(ops.Adasum) is ops.Adasum and ops.check_op(2) is ops.Adasum
    with pytest.raises(TypeError, match="Adasum reduces float16, float32 or float64 arrays, got int32"):
        ops.check_reducible(np.dtype(np.int32), ops.Adasum)
    with pytest.raises(TypeError, match="unsupported dtype complex128"):
        ops.dtype_code(np.complex128)
    for dtype in ("float16", "float32", "float64", "int32", "int64", "uint8"):
        assert ops.dtype_from_code(ops.dtype_code(dtype)) == np.dtype(dtype)


def _fresh(code: str) -> str:
    """What ``code`` prints in an interpreter of its own (nothing imported before it)."""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def test_importing_the_runtime_leaves_ml_dtypes_until_bfloat16_is_needed():
    # Importing ml_dtypes takes most of a second; every rank of every job paid it at import.
    assert _fresh("import sys, mtrain.ringreduce, mtrain.ringreduce.core.ops as ops; "
                  "ops.dtype_code('float32'); ops.dtype_from_code(1); print('ml_dtypes' in sys.modules)") == "False"


def test_bfloat16_keeps_its_wire_code_however_it_is_first_met():
    pytest.importorskip("ml_dtypes")
    # Sent by this rank (its own array), received from another (a code alone), or listed.
    assert _fresh("import numpy as np, ml_dtypes, mtrain.ringreduce.core.ops as ops; "
                  "print(ops.dtype_code(np.zeros(2, ml_dtypes.bfloat16).dtype))") == str(ops.BFLOAT16_CODE)
    assert _fresh("import mtrain.ringreduce.core.ops as ops; print(ops.dtype_from_code(ops.BFLOAT16_CODE))") == "bfloat16"
    assert _fresh("from mtrain.ringreduce.core.ops import SUPPORTED_DTYPES; print(SUPPORTED_DTYPES[-1], "
                  "len(SUPPORTED_DTYPES))") == f"bfloat16 {ops.BFLOAT16_CODE + 1}"
    assert ops.BFLOAT16_CODE == 12  # after the twelve built-in dtypes: the order is the wire code


def test_reducer_takes_each_array_modules_own_functions():
    """One table for NumPy and CuPy: the functions come from the module passed in (a stand-in
    module here), and bool Min/Max are logical and/or."""
    class FakeModule:
        add, minimum, maximum, multiply = "add", "minimum", "maximum", "multiply"
        logical_and, logical_or = "logical_and", "logical_or"

    fake = FakeModule()
    want = {ops.Average: "add", ops.Sum: "add", ops.Min: "minimum", ops.Max: "maximum",
            ops.Product: "multiply"}
    for op, name in want.items():
        assert ops.reducer(fake, op, np.dtype(np.float32)) == name, op
        assert ops.reducer(np, op, np.dtype(np.int64)) is getattr(np, name), op
    assert ops.reducer(fake, ops.Min, np.dtype(np.bool_)) == "logical_and"
    assert ops.reducer(fake, ops.Max, np.dtype(np.bool_)) == "logical_or"
    assert ops.reducer(np, ops.Max, np.dtype(np.bool_)) is np.logical_or
    dst, src = np.array([True, False, False]), np.array([True, True, False])
    NumpyBackend().reduce_into(dst, src, ops.Min)
    assert dst.tolist() == [True, False, False]


def test_backend_scale_is_horovods_rule_bit_for_bit():
    backend = NumpyBackend()
    rng = np.random.default_rng(7)
    for dtype in (np.float16, np.float32, np.float64, np.int32, np.int64, np.uint8):
        x = (rng.standard_normal(513) * 60 + (100 if dtype == np.uint8 else 0)).astype(dtype)
        for factor in (0.37, 1 / 3, 0.5, -0.7, 3.0, 1e-3):
            if dtype == np.uint8 and not 0 < factor <= 1:  # out of range: C's cast is undefined there
                continue
            got = x.copy()
            backend.scale(got, factor)
            want = horovod_scaled(x, factor)
            assert got.dtype == dtype, (dtype, factor)
            assert got.view(np.uint8).tobytes() == want.view(np.uint8).tobytes(), \
                (dtype, factor, got[got != want][:4], want[got != want][:4])
    # float32 is scaled in float32 by the factor rounded to float32 (0.11000001 for 1.1 * 0.1), not
    # in float64 with the exact factor (0.11, one ulp away).
    x = np.array([3.0, 7.0, 1.1], dtype=np.float32)
    backend.scale(x, 0.1)
    assert x.tolist() == (np.array([3.0, 7.0, 1.1], np.float32) * np.float32(0.1)).tolist()
    assert x.tolist() != np.float32(np.array([3.0, 7.0, np.float32(1.1)]) * 0.1).tolist()
    # Integers truncate toward zero; float16 as Horovod, not in float16 (which gives 24.906).
    ints = np.array([7, -7, 9], dtype=np.int32)
    backend.scale(ints, 0.5)
    assert ints.tolist() == [3, -3, 4]


def test_average_is_one_scaling_by_postscale_over_size():
    from mtrain.ringreduce.transport.backend import finishing_factor
    assert finishing_factor(ops.Average, 3.0, 4) == 0.75
    assert finishing_factor(ops.Sum, 3.0, 4) == 3.0
    assert finishing_factor(ops.Max, 1.0, 4) == 1.0


def test_scratch_buffers_are_reused():
    backend = NumpyBackend()
    first = backend.scratch(0, 100, np.dtype(np.float32))
    again = backend.scratch(0, 50, np.dtype(np.float64))
    assert np.shares_memory(first, again)


def test_collective_before_init_says_to_call_init():
    code = "import numpy, mtrain.ringreduce as rr\ntry:\n    rr.allreduce(numpy.ones(2))\nexcept ValueError as e:\n    print(e)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert "call init() first" in out.stdout, out.stderr
    assert out.returncode == 0
