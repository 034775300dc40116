"""Rank 3 leaves while the others wait in a blocking call: `blocking_rank.py CALL HOW TOKEN`.

CALL: init, shutdown, add_process_set, remove_process_set, barrier, broadcast_object,
allgather_object, join, state_sync (an elastic ObjectState's sync).  Every call but
init and shutdown needs rank 3, which never makes it.
HOW (rank 3): one of leaving.py's ways.
The token only marks the processes, so the test can find leftovers.
"""
import os
import sys
import time

import mtrain.ringreduce as rr
from leaving import SETTLE, leave
from mtrain.elastic import ObjectState

call, how = sys.argv[1], sys.argv[2]
rank = int(os.environ["OMPI_COMM_WORLD_RANK"])
print(f"ready {rank}", flush=True)
if call == "init":
    if rank == 3:
        leave(how, 1.0)  # before init(): the others wait for it there, once they have imported it all
    rr.init()
    time.sleep(300)
rr.init()
process_set = rr.add_process_set([0, 1, 2]) if call == "remove_process_set" else None
state = ObjectState(epoch=rank)
rr.barrier()
if rank == 3:
    leave(how, SETTLE)
elif call == "shutdown":
    rr.shutdown()  # needs no other rank's program: it returns, and this rank ends normally
elif call == "add_process_set":
    rr.add_process_set([0, 1, 2])
elif call == "remove_process_set":
    rr.remove_process_set(process_set)
elif call == "barrier":
    rr.barrier()
elif call == "broadcast_object":
    rr.broadcast_object({"step": rank}, root_rank=3)
elif call == "allgather_object":
    rr.allgather_object(rank)
elif call == "join":
    rr.join()
elif call == "state_sync":
    state.sync()
else:
    raise AssertionError(call)
if call != "shutdown":
    time.sleep(300)  # never reached when the call fails as it should
