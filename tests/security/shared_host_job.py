"""An elastic job for the shared-host tests: `shared_host_job.py GO_FILE COMMITS`.

Every rank prints `ready <rank>` once initialized, then waits (outside MPI) until GO_FILE
exists, so that the test can look at or plant paths before the job makes its snapshot
folder; then it commits COMMITS times, printing `committed <rank> <n>`, pausing between
commits while `GO_FILE.hold` exists, and prints `done <rank>` at the end.
"""
import os
import sys
import time

import mtrain.ringreduce as rr
from mtrain.elastic import ObjectState, run

go, commits = sys.argv[1], int(sys.argv[2])
rr.init()
print(f"ready {rr.rank()}", flush=True)
while not os.path.exists(go):
    time.sleep(0.05)


@run
def train(state):
    while state.step < commits:
        state.step += 1
        state.commit()
        print(f"committed {rr.rank()} {state.step}", flush=True)
        while os.path.exists(go + ".hold"):
            time.sleep(0.05)


train(ObjectState(step=0))
print(f"done {rr.rank()}", flush=True)
