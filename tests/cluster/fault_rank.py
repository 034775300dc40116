"""A rank for the fault tests: `fault_rank.py MODE TOKEN`.

Every rank prints `ready <rank> <pid>`, then all ranks loop in allreduce
(ranks blocked in a collective are the hard case for cleanup).  With MODE
`exit` rank 2 instead writes to stderr and exits at once with status 7 (as a
crash would: no atexit handlers); with MODE `raise` it raises an exception.
"""
import os
import sys
import time

import numpy as np

import mtrain.ringreduce as rr

mode = sys.argv[1]
rr.init()
rank = rr.rank()
rr.barrier()
print(f"ready {rank} {os.getpid()}", flush=True)
if mode == "exit" and rank == 2:
    time.sleep(0.5)
    print("rank 2 giving up: simulated failure", file=sys.stderr, flush=True)
    os._exit(7)
if mode == "raise" and rank == 2:
    time.sleep(0.5)
    raise RuntimeError("simulated failure in rank 2")
while True:
    rr.allreduce(np.ones(1024), op=rr.Sum)
    time.sleep(0.05)
