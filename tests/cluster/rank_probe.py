"""Run as each rank by the cluster tests: report topology and an allreduce as one JSON line."""
import json
import socket
import sys

import numpy as np

import mtrain.ringreduce as rr

rr.init()
rank, size = rr.rank(), rr.size()
# Distinct values per rank and per element, so a wrong segment or a missing rank shows.
data = np.arange(1000, dtype=np.float64) * (rank + 1) + rank * 1e6
total = rr.allreduce(data, op=rr.Sum)
expected = np.arange(1000, dtype=np.float64) * sum(range(1, size + 1)) + 1e6 * sum(range(size))
maximum = rr.allreduce(np.full(3, float(rank)), op=rr.Max)
print(json.dumps({
    "rank": rank, "size": size, "local_rank": rr.local_rank(), "local_size": rr.local_size(),
    "cross_rank": rr.cross_rank(), "cross_size": rr.cross_size(), "host": socket.gethostname(),
    "sum_ok": bool(np.array_equal(total, expected)), "max": maximum.tolist(), "argv": sys.argv[1:],
}), flush=True)
rr.shutdown()
