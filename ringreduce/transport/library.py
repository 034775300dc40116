"""The MPI library's own all-reduce (``MPI_Allreduce``), as one path among ours.

Our paths move raw bytes and reduce them in NumPy (``ring.py``, ``shm.py``). For small
buffers that costs more than it saves: a Python round of sends, receives and reductions,
or two shared-memory barriers, against one call into the library, which reduces in C. On
the 2-core test VM at 2 ranks, 4 KiB takes ~4 us through ``MPI_Allreduce`` and ~20 us through
the shared segment; from a few hundred KiB up ours win. ``size_table.py`` measures where.

What the library can reduce as we do: host buffers of 32- and 64-bit floats and integers
under Sum, Min, Max and Product (Average is Sum, then the same finishing scale as every
path: ``backend.finishing_factor``); ``supports`` says which. 16-bit floats, booleans and the
narrow integers (below) are not among them, and device buffers never come here (they go
through our staging, ``backend.py``, whatever the table says: ``Executor.allreduce_flat``).

Every rank of ``comm`` gets the same bits: Open MPI's all-reduce algorithms (recursive
doubling, ring, Rabenseifner) combine the same partial results on every rank, in an order
that only commutativity changes, which floating-point addition has
(``tests/mpi/test_size_table.py`` checks it at 2 and 3 ranks on random floats).
"""
from __future__ import annotations

from typing import Any

import numpy as np

from mtrain.ringreduce.core.ops import ReduceOp
from mtrain.ringreduce.transport import mpi
from mtrain.ringreduce.transport.backend import finishing_factor

MPI = mpi.deferred(__name__)  # mpi4py's MPI from init() on (importing the runtime starts no MPI)

# MPI's operator per op, by name: the handles exist only once MPI has started.
_OPS = {ReduceOp.Average: "SUM", ReduceOp.Sum: "SUM", ReduceOp.Min: "MIN", ReduceOp.Max: "MAX", ReduceOp.Product: "PROD"}
# Not the 8- and 16-bit integers: Open MPI 5's vectorised sums of those saturate (uint8 200 + 100
# gives 255), where NumPy's, Horovod's and ours wrap around (44).
_DTYPES = frozenset(np.dtype(t) for t in (np.float32, np.float64, np.int32, np.int64, np.uint32, np.uint64))


def supports(dtype: np.dtype, op: ReduceOp) -> bool:
    """Whether ``MPI_Allreduce`` reduces host buffers of ``dtype`` under ``op`` as we would."""
    return dtype in _DTYPES and op in _OPS


def allreduce(comm: MPI.Comm, flats: "list[np.ndarray]", op: ReduceOp, backend: Any, postscale: float) -> None:
    """Reduce ``flats`` (1-D, contiguous, host, one dtype ``supports`` takes) in place across
    ``comm`` as one logical buffer, then scale by ``finishing_factor``. Several buffers are packed
    into one of ``backend``'s scratch buffers for one call, and unpacked after."""
    mpi_op = getattr(MPI, _OPS[op])
    factor = finishing_factor(op, postscale, comm.Get_size())
    if len(flats) == 1:
        whole = flats[0]
        if whole.size:
            comm.Allreduce(MPI.IN_PLACE, whole, op=mpi_op)
            backend.scale(whole, factor)
        return
    scratch = backend.scratch("mpi", sum(flat.size for flat in flats), flats[0].dtype)
    start = 0
    for flat in flats:
        scratch[start:start + flat.size] = flat
        start += flat.size
    if start:
        comm.Allreduce(MPI.IN_PLACE, scratch, op=mpi_op)
        backend.scale(scratch, factor)
    start = 0
    for flat in flats:
        flat[:] = scratch[start:start + flat.size]
        start += flat.size
