"""One rank ends in a chosen way while the others are somewhere: `exit_rank.py HOW OTHERS TOKEN`.

HOW (rank 3): one of leaving.py's ways.
OTHERS: collective (looping in allreduce), sleep (outside MPI, then one allreduce),
barrier (waiting in barrier), synchronize (blocked on a handle of an op rank 3 never submits),
finish (outside MPI for a minute, then ending normally), remove_process_set (waiting in it
for rank 3).
The token only marks the processes, so the test can find leftovers.
"""
import sys
import time

import numpy as np

import mtrain.ringreduce as rr
from leaving import SETTLE, leave

how, others = sys.argv[1], sys.argv[2]
rr.init()
rank = rr.rank()
if others == "remove_process_set":
    process_set = rr.add_process_set([0, 1, 2])
rr.barrier()
print(f"ready {rank}", flush=True)
if rank == 3:
    leave(how, SETTLE)  # "return": on to the script's end
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
elif others == "finish":
    time.sleep(60)  # a long epoch: rank 3's status must not wait for it
elif others == "remove_process_set":
    rr.remove_process_set(process_set)
    time.sleep(300)
