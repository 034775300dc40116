"""The ways rank 3 leaves a job in the exit tests (exit_rank.py, blocking_rank.py), and what
mtrain must say of each: one place, so both tests mean the same by a name.

leave(how, settle), `settle` seconds after the others set off to where the test wants them:
exit7 (sys.exit(7)), raise, osexit (os._exit(7)), sigkill, sigsegv, exit0 (sys.exit(0):
leaving politely), return (the script just ends), and the ways nothing wrapped can see:
systemexit (`raise SystemExit(3)` in the main module), thread_exit (a worker thread's
sys.exit(3), raised again in the main thread by Future.result()), thread_error (a worker
thread raises; the program's threading.excepthook notes it and the main thread turns it into
`raise SystemExit(4)`).  It prints "leaving at <time>" first: the job must end within
seconds of it.
"""
from __future__ import annotations

import os
import signal
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

# How rank 3 leaves with an error -> (mtrain's exit status, what its report says of rank 3).
FAILURES = {
    "exit7": (7, "first failure: rank 3 on mtr-b: exit code 7 (rank 3 ending on purpose: exit7)"),
    "raise": (1, "first failure: rank 3 on mtr-b: exit code 1 (RuntimeError: rank 3 raised on purpose)"),
    "osexit": (7, "first failure: rank 3 on mtr-b: exit code 7 (rank 3 ending on purpose: osexit)"),
    "sigkill": (137, "first failure: rank 3 on mtr-b: killed by SIGKILL"),
    "sigsegv": (139, "first failure: rank 3 on mtr-b: killed by SIGSEGV"),
    "systemexit": (3, "first failure: rank 3 on mtr-b: exit code 3 (rank 3 ending on purpose: systemexit)"),
    "thread_exit": (3, "first failure: rank 3 on mtr-b: exit code 3 (rank 3 ending on purpose: thread_exit)"),
    "thread_error": (4, "first failure: rank 3 on mtr-b: exit code 4 (rank 3 ending on purpose: thread_error)"),
}
# From a barrier every rank has left, the others' next call is a few lines away: half a second
# puts them in it even on a busy machine, where a rank can wait that long for a core.
SETTLE = 0.5
UNSEEN = ["systemexit", "thread_exit", "thread_error"]  # no wrapped function sees these: the runner does
POLITE = ["exit0", "return"]  # status 0 while the others may still need rank 3


def leave(how: str, settle: float) -> None:
    time.sleep(settle)  # the others are where the test wants them by now
    print(f"leaving at {time.time()}", flush=True)
    print(f"rank 3 ending on purpose: {how}", file=sys.stderr, flush=True)
    if how == "exit7":
        sys.exit(7)
    if how == "raise":
        raise RuntimeError("rank 3 raised on purpose")
    if how == "osexit":
        os._exit(7)
    if how in ("sigkill", "sigsegv"):
        os.kill(os.getpid(), getattr(signal, how.upper()))
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
    if how != "return":
        raise AssertionError(f"rank 3 did not leave: {how}")
