"""Run as each rank by tests/cluster/test_stragglers.py: training steps in which one rank, or
one host, is slower than the rest; rank 0 prints what straggler_stats() says, as JSON.

    straggler_rank.py sleep SLOW_RANK STEPS TOKEN   SLOW_RANK sleeps 40 ms more than the others per step
    straggler_rank.py cpu HOST CORE STEPS TOKEN     every rank computes; HOST's ranks run on core CORE,
                                                    the others on core OTHER (1 - CORE)
"""
import json
import os
import shutil
import socket
import sys
import time

mode = sys.argv[1]
if mode == "cpu" and "MTRAIN_TEST_PINNED" not in os.environ:
    # This host's ranks go onto the core the test keeps busy, the others onto the other core: the
    # program starts again under taskset.
    core = sys.argv[3] if socket.gethostname() == sys.argv[2] else str(1 - int(sys.argv[3]))
    os.environ["MTRAIN_TEST_PINNED"] = "1"
    os.execv(shutil.which("taskset"), ["taskset", "-c", core, sys.executable, *sys.argv])

import numpy as np  # noqa: E402

import mtrain.ringreduce as rr  # noqa: E402

rr.init()
me = rr.rank()
steps = int(sys.argv[3] if mode == "sleep" else sys.argv[4])
grads = [np.arange(n, dtype=np.float32) * (me + 1) for n in (4099, 17, 0, 300_001)]
for step in range(steps):
    if mode == "sleep":
        time.sleep(0.045 if me == int(sys.argv[2]) else 0.005)
    else:
        total = 0
        for i in range(150_000):  # CPU work of the same size on every rank (~10 ms on a free core)
            total += i * i
    handles = [rr.allreduce_async(g, name=f"layer{i}.grad", op=rr.Sum) for i, g in enumerate(grads)]
    for handle in handles:
        rr.synchronize(handle)
rows = rr.straggler_stats()
if me == 0:
    print(json.dumps({"stats": [row._asdict() for row in rows]}), flush=True)
rr.shutdown()
