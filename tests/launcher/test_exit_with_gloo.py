"""A rank that ends well while torch.distributed's gloo still has work in flight exits with status 0,
not SIGABRT: mtrain's rank runner (launcher/pymain.py) closes the program's process groups before
the interpreter finalizes.

The exit path follows Horovod's (horovod/common/basics.py: ``init`` registers the library's
shutdown to run at exit, while the interpreter is whole), and torch's advice for torchrun programs
(destroy the process groups before exiting), which this program does not follow.
"""
from __future__ import annotations

import os
import sys

import numpy as np
import pytest

from tests.jobs import run_job

pytestmark = pytest.mark.timeout(240)

# Every rank but the last submits a gloo allreduce with a Python callback and leaves; the last
# one joins it only after the others have left their program (an mtrain barrier they passed,
# then a margin). Without the runner's cleanup, the early ranks' gloo thread finishes the
# allreduce while their interpreter finalizes, needs the GIL for the callback and is ended
# inside C++: "terminate called without an active exception", status 134.
PROGRAM = r'''
import sys, time
import mtrain.torch as hvd
hvd.init()
import torch
import torch.distributed as dist
dist.init_process_group("gloo")  # env:// from what mtrain run sets
rank, n = dist.get_rank(), dist.get_world_size()
assert (rank, n) == (hvd.rank(), hvd.size())
t = torch.arange(3, dtype=torch.float64) + 10 * rank
if rank < n - 1:
    work = dist.all_reduce(t, async_op=True)
    done = work.get_future().then(lambda f: print(rank, "callback", f.value()[0].tolist(), flush=True))
    hvd.barrier()
else:
    hvd.barrier()
    time.sleep(1.0)  # the early ranks are past their program's end by now
    dist.all_reduce(t)
    print(rank, "result", t.tolist(), flush=True)
'''


@pytest.mark.parametrize("np_", [2, 3])
def test_a_program_leaving_gloo_work_in_flight_exits_cleanly(tmp_path, np_):
    pytest.importorskip("torch")
    program = tmp_path / "gloo_in_flight.py"
    program.write_text(PROGRAM)
    env = dict(os.environ)
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
    done = run_job([sys.executable, "-m", "mtrain.launcher.cli.main", "run", "-np", str(np_), sys.executable,
                    str(program)], 180, env=env)
    assert done.returncode == 0, f"status {done.returncode}\n{done.stderr[-4000:]}"
    for sign in ("terminate called", "Aborted", "Signal: 6", "SIGABRT"):
        assert sign not in done.stderr, done.stderr[-4000:]
    lines = [line.split(">:", 1)[1] for line in done.stdout.splitlines() if ">:" in line]
    want = (10.0 * sum(range(np_)) + np_ * np.arange(3)).tolist()
    # The last rank's result, and every early rank's callback: the work left in flight completed.
    assert sorted(lines) == sorted([f"{r} callback {want}" for r in range(np_ - 1)] + [f"{np_ - 1} result {want}"]), \
        done.stdout
