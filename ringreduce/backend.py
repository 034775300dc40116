"""Array helpers the collectives need, one backend per kind of memory.

The ring (``ring.py``) is written once against this small interface; the only
thing that differs between host and device memory is how a buffer is created,
reduced, scaled, copied and made ready for MPI. A CuPy backend implements the
same methods for device buffers.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from .ops import Average, Max, Min, Product, ReduceOp, Sum

_REDUCERS = {
    Sum: np.add,
    Average: np.add,  # averaging divides once after the sum (see ring.allreduce)
    Min: np.minimum,
    Max: np.maximum,
    Product: np.multiply,
}


class NumpyBackend:
    """Host memory: NumPy arrays, reductions by NumPy ufuncs in place."""

    name = "numpy"

    def __init__(self) -> None:
        # Reused scratch space, one byte buffer per slot, grown on demand so a
        # steady stream of collectives allocates nothing new.
        self._scratch: dict = {}

    def owns(self, array: Any) -> bool:
        return isinstance(array, np.ndarray)

    def empty(self, count: int, dtype: np.dtype) -> np.ndarray:
        return np.empty(count, dtype=dtype)

    def flatten(self, array: np.ndarray) -> "tuple[np.ndarray, bool]":
        """A contiguous 1-D view of ``array``, or a copy when it is not contiguous.

        The flag says whether a copy was made (and so results must be copied back).
        """
        if array.flags.c_contiguous:
            return array.reshape(-1), False
        return np.ascontiguousarray(array).reshape(-1), True

    def scratch(self, slot: "int | str", count: int, dtype: np.dtype) -> np.ndarray:
        """A reusable buffer of ``count`` elements; contents undefined."""
        nbytes = count * dtype.itemsize
        buf = self._scratch.get(slot)
        if buf is None or buf.nbytes < nbytes:
            buf = np.empty(max(nbytes, 1), dtype=np.uint8)
            self._scratch[slot] = buf
        return buf[:nbytes].view(dtype)

    def reduce_into(self, dst: np.ndarray, src: np.ndarray, op: ReduceOp) -> None:
        """dst = op(dst, src), elementwise, in place."""
        if dst.dtype == np.bool_ and op in (Min, Max):
            (np.logical_and if op == Min else np.logical_or)(dst, src, out=dst)
            return
        _REDUCERS[op](dst, src, out=dst)

    def scale(self, buf: np.ndarray, factor: float) -> None:
        """buf *= factor in place; integers are scaled in float64 and floored."""
        if factor == 1.0 or buf.size == 0:
            return
        if buf.dtype.kind in "iu":
            buf[...] = np.floor(buf * np.float64(factor)).astype(buf.dtype)
        else:
            np.multiply(buf, buf.dtype.type(factor), out=buf)

    def divide(self, buf: np.ndarray, divisor: int) -> None:
        """buf /= divisor in place (floor division for integers): the Average step."""
        if divisor == 1 or buf.size == 0:
            return
        if buf.dtype.kind in "iu":
            np.floor_divide(buf, divisor, out=buf)
        else:
            np.true_divide(buf, buf.dtype.type(divisor), out=buf)

    def copy(self, dst: np.ndarray, src: np.ndarray) -> None:
        np.copyto(dst, src)

    def as_bytes(self, buf: np.ndarray) -> np.ndarray:
        """The byte view MPI moves: every transfer is raw bytes, reductions are ours."""
        return buf.view(np.uint8)

    def ready_for_mpi(self) -> None:
        """Host memory is always ready; a device backend synchronizes its stream here."""


_NUMPY = NumpyBackend()


def backend_for(array: Any) -> NumpyBackend:
    """The backend that owns ``array``; TypeError for anything that is not an array we know."""
    if isinstance(array, np.ndarray):
        return _NUMPY
    if type(array).__module__.startswith("cupy"):
        raise TypeError("CuPy arrays are not supported by this build of ringreduce yet; "
                        "copy to host with cupy.asnumpy() first")
    raise TypeError(f"expected a numpy.ndarray, got {type(array).__name__}; "
                    "wrap Python data with numpy.asarray() first")
