"""Rank 3 leaves while the others wait in a blocking call: `blocking_rank.py CALL HOW TOKEN`.

CALL: init, shutdown, add_process_set, remove_process_set, barrier, broadcast_object,
allgather_object, join, state_sync (an elastic ObjectState's sync).  Every call but
init and shutdown needs rank 3, which never makes it.
HOW (rank 3, about a second after the others went in): systemexit (`raise SystemExit(3)`),
thread_exit (a worker thread's sys.exit(3), raised again by Future.result()), thread_error
(a worker thread's exception, turned into `raise SystemExit(4)` by the program), exit0
(sys.exit(0): leaving politely, as if it had nothing more to do).
The token only marks the processes, so the test can find leftovers.
"""
import os
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import mtrain.ringreduce as rr
from mtrain.elastic import ObjectState

call, how = sys.argv[1], sys.argv[2]
rank = int(os.environ["OMPI_COMM_WORLD_RANK"])


def leave() -> None:
    time.sleep(1)  # the others are inside the call by now
    print(f"leaving at {time.time()}", flush=True)  # the job must end within seconds of this
    print(f"rank 3 leaving: {how}", file=sys.stderr, flush=True)
    if how == "systemexit":
        raise SystemExit(3)
    if how == "thread_exit":
        with ThreadPoolExecutor(1) as pool:
            pool.submit(sys.exit, 3).result()
    if how == "thread_error":
        failures = []
        threading.excepthook = failures.append
        worker = threading.Thread(target=lambda: 1 / 0)
        worker.start()
        worker.join()
        if failures:
            print(f"rank 3 leaving: {how}", file=sys.stderr, flush=True)
            raise SystemExit(4)
    if how == "exit0":
        sys.exit(0)
    raise AssertionError(how)


print(f"ready {rank}", flush=True)
if call == "init":
    if rank == 3:
        leave()  # before init(): the others wait for it there
    rr.init()
    time.sleep(300)
rr.init()
process_set = rr.add_process_set([0, 1, 2]) if call == "remove_process_set" else None
state = ObjectState(epoch=rank)
rr.barrier()
if rank == 3:
    leave()
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
