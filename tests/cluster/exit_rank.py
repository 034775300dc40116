"""One rank ends in a chosen way while the others are somewhere: `exit_rank.py HOW OTHERS TOKEN`.

HOW (rank 3): exit7 (sys.exit(7)), raise, osexit (os._exit(7)), sigkill, sigsegv,
exit0 (sys.exit(0)), return (the script just ends), and the ways nothing wrapped can see:
systemexit (`raise SystemExit(3)` in the main module), thread_exit (a worker thread's
sys.exit(3), raised again in the main thread by Future.result()), thread_error (a worker
thread raises; the program's threading.excepthook notes it and the main thread turns it
into `raise SystemExit(4)`).
OTHERS: collective (looping in allreduce), sleep (outside MPI, then one allreduce),
barrier (waiting in barrier), synchronize (blocked on a handle of an op rank 3 never submits),
finish (outside MPI for a minute, then ending normally), remove_process_set (waiting in it
for rank 3).
The token only marks the processes, so the test can find leftovers.
"""
import os
import signal
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

import mtrain.ringreduce as rr

how, others = sys.argv[1], sys.argv[2]
rr.init()
rank = rr.rank()
if others == "remove_process_set":
    process_set = rr.add_process_set([0, 1, 2])
rr.barrier()
print(f"ready {rank}", flush=True)
if rank == 3:
    time.sleep(1)
    print(f"leaving at {time.time()}", flush=True)  # the job must end within seconds of this
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
    if how == "systemexit":
        raise SystemExit(3)
    if how == "thread_exit":
        with ThreadPoolExecutor(1) as pool:
            pool.submit(sys.exit, 3).result()
    if how == "thread_error":
        failures = []
        threading.excepthook = failures.append

        def load() -> None:
            raise OSError("the data loader lost its file")

        loader = threading.Thread(target=load)
        loader.start()
        loader.join()
        if failures:
            print(f"rank 3 ending on purpose: {how}", file=sys.stderr, flush=True)
            raise SystemExit(4)
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
elif others == "finish":
    time.sleep(60)  # a long epoch: rank 3's status must not wait for it
elif others == "remove_process_set":
    rr.remove_process_set(process_set)
    time.sleep(300)
