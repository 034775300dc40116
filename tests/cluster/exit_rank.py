"""One rank ends in a chosen way while the others are somewhere: `exit_rank.py HOW OTHERS TOKEN`.

HOW (rank 3): exit7 (sys.exit(7)), raise, osexit (os._exit(7)), sigkill, sigsegv,
exit0 (sys.exit(0)), return (the script just ends).
OTHERS: collective (looping in allreduce), sleep (outside MPI, then one allreduce),
barrier (waiting in barrier), synchronize (blocked on a handle of an op rank 3 never submits).
The token only marks the processes, so the test can find leftovers.
"""
import os
import signal
import sys
import time

import numpy as np

import mtrain.ringreduce as rr

how, others = sys.argv[1], sys.argv[2]
rr.init()
rank = rr.rank()
rr.barrier()
print(f"ready {rank}", flush=True)
if rank == 3:
    time.sleep(1)
    print(f"rank 3 ending on purpose: {how}", file=sys.stderr, flush=True)
    if how == "exit7":
        sys.exit(7)
    if how == "raise":
        raise RuntimeError("rank 3 raised on purpose")
    if how == "osexit":
        os._exit(7)
    if how == "sigkill":
        os.kill(os.getpid(), signal.SIGKILL)
    if how == "sigsegv":
        os.kill(os.getpid(), signal.SIGSEGV)
    if how == "exit0":
        sys.exit(0)
    # "return": fall off the end of the script
elif others == "collective":
    while True:
        rr.allreduce(np.arange(1000, dtype=np.float64) + rank, name="loop")
elif others == "sleep":
    time.sleep(4)  # loading data, evaluating, checkpointing: no MPI at all
    rr.allreduce(np.ones(10), name="after-sleep")
    time.sleep(300)
elif others == "barrier":
    rr.barrier()
    time.sleep(300)
elif others == "synchronize":
    handle = rr.allreduce_async(np.ones(10) * rank, name="never-matched")
    rr.synchronize(handle)
    time.sleep(300)
