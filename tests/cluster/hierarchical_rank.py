"""Run as each rank by test_hierarchical.py: all-reduces on two hosts, checked exactly; one JSON line.

Values are small integers (also in the float dtypes), so every order of reduction
gives the same bits and the expected result is exact.
"""
import json
import os
import socket

import numpy as np

import mtrain.ringreduce as rr
from mtrain.ringreduce import runtime

rr.init()
rank, size = rr.rank(), rr.size()
problems = []


def inputs(r, count, dtype, op):
    i = np.arange(count, dtype=np.int64)
    if op == rr.Product:
        return ((i + r) % 3 + 1).astype(dtype)
    return ((i * 7 + r * 31) % 101 - 50).astype(dtype)


def expected(count, dtype, op, postscale):
    stack = np.stack([inputs(r, count, np.int64, op) for r in range(size)])
    if op in (rr.Sum, rr.Average):
        total = stack.sum(axis=0)
    elif op == rr.Min:
        total = stack.min(axis=0)
    elif op == rr.Max:
        total = stack.max(axis=0)
    else:
        total = stack.prod(axis=0)
    if op == rr.Average:
        # Horovod's CPU rule (collective_operations.cc, ScaleBuffer; tests/horovod_scaling.py, which
        # this script, run from its own folder on the hosts, cannot import): the exact sum scaled
        # once by postscale / size, a float in its own dtype by the factor rounded to that dtype,
        # an integer in float64 and truncated.
        factor = postscale / size
        if np.dtype(dtype).kind == "f":
            return total.astype(dtype) * np.dtype(dtype).type(factor)
        return np.trunc(total * factor).astype(dtype)
    return total.astype(dtype)


for dtype in (np.float32, np.float64, np.int32, np.int64):
    for op in (rr.Sum, rr.Average, rr.Min, rr.Max, rr.Product):
        for count in (0, 1, 3, 1001, 300_007):
            post = 2.0 if op == rr.Average else 1.0
            got = rr.allreduce(inputs(rank, count, dtype, op), op=op, postscale_factor=post,
                               name=f"{np.dtype(dtype).name}.{op.name}.{count}")
            want = expected(count, dtype, op, post)
            if got.dtype != want.dtype or not np.array_equal(got, want):
                problems.append(f"{np.dtype(dtype).name} {op.name} count {count}")
# Several tensors in one all-reduce (the engine's fusion buffer and in-place tensors).
group = rr.grouped_allreduce([inputs(rank, c, np.float32, rr.Sum) for c in (5, 70_000, 3_000_001)], op=rr.Sum)
for c, got in zip((5, 70_000, 3_000_001), group):
    if not np.array_equal(got, expected(c, np.float32, rr.Sum, 1.0)):
        problems.append(f"grouped float32 Sum count {c}")

print(json.dumps({
    "rank": rank, "size": size, "host": socket.gethostname(), "local_size": rr.local_size(),
    "cross_size": rr.cross_size(), "algorithm": os.environ.get("MTRAIN_ALLREDUCE_ALGORITHM", ""),
    "path": runtime.current().engine.executor.allreduce_path, "problems": problems,
    "transport": getattr(runtime.current().engine.executor.shared, "transport", None),
}), flush=True)
rr.shutdown()
