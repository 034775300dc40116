"""Which all-reduce path runs a host buffer of a given size: measured at init, kept per topology.

NCCL's tuner and Open MPI's ``coll_tuned`` pick an algorithm by message size, from a cost
model or a fixed table. Ours is measured where it runs. At init (MTRAIN_ALLREDUCE_ALGORITHM
auto, two ranks or more) the ranks time every path their executor has, ``mpi`` (the
library's ``MPI_Allreduce``, ``library.py``), ``ring`` and, where there is shared memory,
``shm`` (hierarchical on several hosts), on float32 buffers of PROBE_SIZES:

* the paths take turns, PROBE_CALLS calls each per size; a rank keeps its best call per path
  (the least disturbed by the machine's other work);
* the slowest rank's best counts: one ``Allreduce(MAX)`` per size, which hands every rank the
  same numbers, so every rank derives the same table without a broadcast;
* each size's fastest path takes the buffers from halfway (geometrically) to the size below
  up to halfway to the size above; above the largest size probed, the path that won there.

Bounded: once the probe has taken PROBE_BUDGET_S (the slowest rank's clock, in the same
``Allreduce``), the larger sizes are left out and the last winner holds above.

Kept per topology: rank 0 writes the table to the user's cache folder
(``$XDG_CACHE_HOME/mtrain``, else ``~/.cache/mtrain``: a folder only this user may use,
``bindings/common/private.py``) under a key of what the times depend on: the MPI library, the
ranks on each host, the hosts' names and the paths on offer. The next init with the same
key reads it there and broadcasts it instead of probing. A file that is not this user's
own, that others may write, in a folder others may use, or that is not a table this module
wrote, is not read: the ranks probe again. Forcing a path (MTRAIN_ALLREDUCE_ALGORITHM=ring,
shm, hierarchical or mpi) probes nothing.
"""
from __future__ import annotations

import bisect
import hashlib
import json
import math
import os
import time
from typing import Any, Callable, NamedTuple

import numpy as np

from mtrain.common import private
from mtrain.ringreduce.core import log
from mtrain.ringreduce.transport import mpi

MPI = mpi.deferred(__name__)  # mpi4py's MPI from init() on (importing the runtime starts no MPI)

KiB = 1 << 10
PROBE_SIZES = (4 * KiB, 16 * KiB, 64 * KiB, 256 * KiB, 1 << 20, 4 << 20)
PROBE_CALLS = 4
PROBE_BUDGET_S = 0.2
FORMAT = 1  # the cache file's layout; a file of another is probed again

Runner = Callable[[np.ndarray], None]  # one all-reduce of a float32 buffer in place, by one path


class SizeTable(NamedTuple):
    """Buffers below ``bounds[0]`` bytes take ``paths[0]``, from ``bounds[i - 1]`` below
    ``bounds[i]`` take ``paths[i]``, from ``bounds[-1]`` up ``paths[-1]``."""

    bounds: "tuple[int, ...]"
    paths: "tuple[str, ...]"

    def path_for(self, nbytes: int) -> str:
        return self.paths[bisect.bisect_right(self.bounds, nbytes)]

    def describe(self) -> str:
        parts = []
        for index, path in enumerate(self.paths):
            if index < len(self.bounds):
                parts.append(f"{path} below {_size_text(self.bounds[index])}")
            else:
                parts.append(f"{path} from there up" if self.bounds else f"{path} at every size")
        return ", ".join(parts)


def from_winners(sizes: "list[int]", winners: "list[str]") -> SizeTable:
    """The table of per-size winners: neighbouring sizes won by the same path merge, and a
    boundary lies halfway (geometric mean) between two sizes won by different paths."""
    bounds: "list[int]" = []
    paths = [winners[0]]
    for index in range(1, len(sizes)):
        if winners[index] != paths[-1]:
            bounds.append(int(math.sqrt(sizes[index - 1] * sizes[index])))
            paths.append(winners[index])
    return SizeTable(tuple(bounds), tuple(paths))


def probe(comm: MPI.Comm, runners: "dict[str, Runner]", budget_s: float = PROBE_BUDGET_S,
          sizes: "tuple[int, ...]" = PROBE_SIZES, calls: int = PROBE_CALLS) -> "tuple[SizeTable, list]":
    """Time every runner at each size (collective over ``comm``); the table, and per size probed
    the slowest rank's best seconds per path (``[(size, {path: seconds})]``)."""
    names = list(runners)
    began = time.perf_counter()
    measured, winners = [], []
    for nbytes in sizes:
        count = nbytes // 4
        # Small, distinct, finite values: sums of a few calls stay normal floats.
        data = (np.arange(count, dtype=np.float32) % 251 + comm.Get_rank() + 1) * np.float32(2.0 ** -60)
        buffers = {name: data.copy() for name in names}
        best = np.full(len(names) + 1, np.inf)
        for _ in range(calls):
            for index, name in enumerate(names):
                start = time.perf_counter()
                runners[name](buffers[name])
                best[index] = min(best[index], time.perf_counter() - start)
        best[-1] = time.perf_counter() - began
        slowest = np.empty_like(best)
        comm.Allreduce(best, slowest, op=MPI.MAX)
        seconds = {name: float(slowest[index]) for index, name in enumerate(names)}
        measured.append((nbytes, seconds))
        winners.append(min(names, key=seconds.__getitem__))  # ties: the first listed
        if slowest[-1] > budget_s:
            break
    return from_winners([size for size, _ in measured], winners), measured


def cache_folder(environ: "dict[str, str] | None" = None) -> "str | None":
    """This user's cache folder for mtrain (not made here), or None without a home."""
    environ = os.environ if environ is None else environ
    base = environ.get("XDG_CACHE_HOME") or ""
    if not os.path.isabs(base):
        home = os.path.expanduser("~")
        if not os.path.isabs(home):
            return None
        base = os.path.join(home, ".cache")
    return os.path.join(base, "mtrain")


def topology_key(comm: MPI.Comm, local_sizes: "list[int]", paths: "list[str]") -> str:
    """What the table depends on, as a file name's stem (collective: the hosts' names)."""
    hosts = comm.allgather(MPI.Get_processor_name())
    library = MPI.Get_library_version().replace("\0", "").splitlines()[0].strip()
    text = json.dumps([FORMAT, library, local_sizes, hosts, paths])
    return "allreduce-paths-" + hashlib.sha256(text.encode()).hexdigest()[:24]


def read_cached(path: str, paths: "list[str]") -> "SizeTable | None":
    """The table kept in ``path``, if it is ours, private and well formed; else None."""
    try:
        record = json.loads(private.read_private(path))
        bounds = tuple(int(b) for b in record["bounds"])
        kept = tuple(str(p) for p in record["paths"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if (record.get("format") != FORMAT or len(kept) != len(bounds) + 1 or not set(kept) <= set(paths)
            or list(bounds) != sorted(set(bounds)) or any(b <= 0 for b in bounds)):
        return None
    return SizeTable(bounds, kept)


def write_cached(path: str, table: SizeTable, measured: list) -> None:
    """Keep ``table`` (and the times it came from) in ``path``; a cache we cannot write is no error."""
    record = {"format": FORMAT, "bounds": list(table.bounds), "paths": list(table.paths),
              "measured": [[size, seconds] for size, seconds in measured]}
    try:
        private.private_folder(os.path.dirname(path))
        private.write_private(path, json.dumps(record).encode())
    except private.PrivatePathError as exc:  # the one line says what to do
        log.warning(f"the all-reduce path table is not kept (every init probes again): {exc}")
    except OSError as exc:  # no home, a full disk: probe again next time
        log.debug(f"all-reduce path table not kept: {exc}")


def choose(comm: MPI.Comm, local_sizes: "list[int]", runners: "dict[str, Runner]",
           environ: "dict[str, str] | None" = None) -> SizeTable:
    """The table for ``comm`` (collective): rank 0's kept one, else probed now (and kept)."""
    paths = list(runners)
    key = topology_key(comm, local_sizes, paths)
    folder = cache_folder(environ)
    path = os.path.join(folder, key + ".json") if folder else None
    rank = comm.Get_rank()
    table = read_cached(path, paths) if rank == 0 and path else None
    table = comm.bcast(table, root=0)
    if table is not None:
        if rank == 0:
            log.debug(f"all-reduce paths by size (kept from an earlier probe): {table.describe()}")
        return table
    table, measured = probe(comm, runners)
    if rank == 0:
        log.debug(f"all-reduce paths by size (probed now): {table.describe()}\n{describe_measured(measured)}")
        if path:
            write_cached(path, table, measured)
    return table


def _size_text(nbytes: int) -> str:
    for unit, scale in (("MiB", 1 << 20), ("KiB", KiB)):
        if nbytes >= scale:
            return f"{nbytes / scale:g} {unit}"
    return f"{nbytes} B"


def describe_measured(measured: "list[tuple[int, dict[str, Any]]]") -> str:
    """The probe's times, one size per line (benchmarks and the debug log)."""
    return "\n".join(f"{_size_text(size):>9}: " + ", ".join(f"{name} {seconds * 1e6:.1f} us"
                                                            for name, seconds in times.items())
                     for size, times in measured)
