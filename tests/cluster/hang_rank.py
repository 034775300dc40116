"""A rank of a job that hangs in one known way, for the flight recorder's hang report.

    python hang_rank.py SCENARIO [RELEASE_FILE] TOKEN

Every rank first runs allgather 'metrics' (seq 1 on every rank), then:
    skip       rank 3 skips allreduce 'layer4.grad' and waits in 'layer5.grad'
    sleep      rank 3 sits in a time.sleep loop instead of submitting 'layer4.grad'
    different  rank 0 waits in allreduce 'a', rank 1 in allgather 'b' (np 2)
    set        ranks 0 and 2 make process set [0, 2]; rank 0 waits in allreduce 'ps.grad' on
               it, rank 2 never calls it (ranks 1 and 3 sit in user code)
    usr1       like sleep, but rank 3 goes on once RELEASE_FILE exists: the job ends with 0
    raise      rank 3 raises instead of submitting 'layer4.grad'
"""
from __future__ import annotations

import os
import sys
import time

import numpy as np

import mtrain.ringreduce as rr


def sleepy(release: "str | None" = None) -> None:
    print(f"rank {rr.rank()} sleeping", flush=True)
    while release is None or not os.path.exists(release):
        time.sleep(0.05)


def main() -> None:
    scenario = sys.argv[1]
    rr.init()
    me = rr.rank()
    process_set = rr.add_process_set([0, 2]) if scenario == "set" else None
    rr.allgather(np.full((1, 2), me, np.float32), name="metrics")
    grad = np.full(8, me + 1.0, np.float32)
    if scenario in ("skip", "sleep", "usr1", "raise"):
        if me == 3 and scenario == "raise":
            raise ValueError("bad batch 17")
        if me == 3 and scenario == "skip":
            handle = rr.allreduce_async(grad, name="layer5.grad")
            print(f"rank {me} submitted", flush=True)
            rr.synchronize(handle)
        elif me == 3:
            sleepy(sys.argv[2] if scenario == "usr1" else None)
            print(f"rank {me} released", flush=True)
            rr.allreduce(grad, name="layer4.grad")
        else:
            handle = rr.allreduce_async(grad, name="layer4.grad")
            print(f"rank {me} submitted", flush=True)
            rr.synchronize(handle)
    elif scenario == "different":
        if me == 0:
            rr.allreduce(grad, name="a")
        else:
            rr.allgather(grad.reshape(1, -1), name="b")
    elif scenario == "set":
        if me == 0:
            rr.allreduce(grad, name="ps.grad", process_set=process_set)
        else:
            sleepy()
    print(f"rank {me} done", flush=True)
    rr.shutdown()


if __name__ == "__main__":
    main()
