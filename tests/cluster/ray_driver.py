"""The Ray driver of tests/cluster/test_ray.py, run inside host mtr-a: `ray_driver.py STEPS`.

It uses mtrain.ray as a Horovod user uses horovod.ray, and prints one `RESULT {json}` line per
thing it learned; after each executor's shutdown() it prints `SHUT DOWN` and waits for a line on
stdin, so the test can look for leftovers on both hosts while this driver (and its Ray
connection) still lives.  The first executor spreads one rank to each host and works; the
second packs two ranks and loses one mid-call; the third runs until the test kills the driver.
"""
import json
import os
import socket
import sys
import time

import ray
import torch

from mtrain.ray import RankFailed, RayExecutor


def emit(name, value):
    print("RESULT " + json.dumps({name: value}), flush=True)


class Probe:
    """The executable_cls: made once in each rank at start(). Each instance draws a token of its own
    and counts the calls it served, so a rank whose instance were made again would show it."""

    def __init__(self, value, scale=1):
        self.value = value * scale
        self.pid = os.getpid()
        self.token = os.urandom(8).hex()
        self.calls = 0

    def serve(self):
        self.calls += 1
        return [self.value, self.pid, self.token, self.calls]


def where(_=None):
    """This rank: its number, host, the variable start() passed, and its ancestors up to init."""
    chain, pid = [], os.getpid()
    while pid > 1:
        with open(f"/proc/{pid}/cmdline", "rb") as handle:
            line = handle.read().replace(b"\0", b" ").decode(errors="replace")
        chain.append([pid, line[:200]])
        with open(f"/proc/{pid}/stat", "rb") as handle:
            pid = int(handle.read().rsplit(b")", 1)[1].split()[1])
    return {"rank": int(os.environ["OMPI_COMM_WORLD_RANK"]), "host": socket.gethostname(),
            "word": os.environ.get("RAY_TEST_WORD"), "ancestors": chain, "pid": os.getpid()}


def batch(size):
    generator = torch.Generator().manual_seed(7)
    inputs = torch.randn(size, 5, generator=generator)
    targets = inputs @ torch.arange(1.0, 6.0).unsqueeze(1) + 0.5 * torch.randn(size, 1, generator=generator)
    return inputs, targets


def train(steps, rows_per_rank):
    """DistributedOptimizer training: each rank on its own rows of one fixed batch."""
    import mtrain.torch as hvd
    hvd.init()
    torch.manual_seed(1234 + hvd.rank())  # different starts: broadcast_parameters must make them one
    model = torch.nn.Linear(5, 1)
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05),
                                         named_parameters=model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    inputs, targets = batch(rows_per_rank * hvd.size())
    mine = slice(hvd.rank() * rows_per_rank, (hvd.rank() + 1) * rows_per_rank)
    for _ in range(steps):
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(model(inputs[mine]), targets[mine]).backward()
        optimizer.step()
    return {"rank": hvd.rank(), "size": hvd.size(),
            "weights": [p.detach().flatten().tolist() for p in model.parameters()]}


def train_alone(steps, rows, start_seed):
    """The same training in one process, on all rows, from rank 0's start."""
    torch.manual_seed(start_seed)
    model = torch.nn.Linear(5, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    inputs, targets = batch(rows)
    for _ in range(steps):
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(model(inputs), targets).backward()
        optimizer.step()
    return [p.detach().flatten().tolist() for p in model.parameters()]


def fail_on_rank_1():
    rank = int(os.environ["OMPI_COMM_WORLD_RANK"])
    if rank == 1:
        raise ValueError(f"batch 17 is corrupt on {socket.gethostname()}")
    return rank


def die_on_rank_1():
    if int(os.environ["OMPI_COMM_WORLD_RANK"]) == 1:
        sys.stdout.flush()
        os._exit(3)
    return 0


def main():
    steps = int(sys.argv[1])
    executor = RayExecutor(RayExecutor.create_settings(timeout_s=120, verbose=2), num_hosts=2,
                           num_workers_per_host=1, cpus_per_worker=1)
    executor.start(executable_cls=Probe, executable_args=[7], executable_kwargs={"scale": 3},
                   extra_env_vars={"RAY_TEST_WORD": "w7"})
    emit("actors", executor.placement.actor_pids)
    emit("where", executor.run(where))
    emit("order", executor.run(lambda base, step=1: int(os.environ["OMPI_COMM_WORLD_RANK"]) * step + base,
                               args=[100], kwargs={"step": 10}))
    emit("execute", [executor.execute(lambda probe: probe.serve()) for _ in range(2)])
    emit("execute_single", executor.execute_single(lambda probe: probe.serve()))
    emit("trained", executor.run(train, args=[steps, 4]))
    emit("alone", train_alone(steps, 8, 1234))
    emit("untrained", train_alone(0, 8, 1234))
    try:
        executor.run(fail_on_rank_1)
        emit("failure", None)
    except Exception as error:
        emit("failure", {"type": type(error).__name__, "text": str(error), "rank": getattr(error, "rank", None)})
    emit("after_failure", executor.run(lambda: int(os.environ["OMPI_COMM_WORLD_RANK"])))
    refs = executor.run_remote(lambda x: int(os.environ["OMPI_COMM_WORLD_RANK"]) + x, args=[5])
    emit("run_remote", {"types": sorted({type(r).__name__ for r in refs}), "values": ray.get(refs, timeout=60)})
    try:
        ray.get(executor.run_remote(fail_on_rank_1), timeout=60)
        emit("run_remote_failure", None)
    except Exception as error:
        emit("run_remote_failure", {"rank_failed": isinstance(error, RankFailed), "rank": getattr(error, "rank", None),
                                    "text": str(error)[-300:]})
    executor.shutdown()
    print("SHUT DOWN", flush=True)
    sys.stdin.readline()
    # A second executor, packed (num_workers), whose rank 1 dies in the middle of a call. PACK puts its two
    # 1-CPU bundles on one node once a node has 2 CPUs free: wait until Ray has freed the first executor's.
    deadline = time.monotonic() + 60
    while ray.available_resources().get("CPU", 0) < ray.cluster_resources().get("CPU", 0):
        if time.monotonic() > deadline:
            break  # (the test then sees where the ranks went, and the resources, in the report)
        time.sleep(0.2)
    emit("free_before_packing", ray.available_resources().get("CPU", 0))
    packed = RayExecutor(RayExecutor.create_settings(timeout_s=120), num_workers=2)
    packed.start()
    emit("packed", packed.run(lambda: [int(os.environ["OMPI_COMM_WORLD_RANK"]), socket.gethostname()]))
    emit("packed_nodes", [[node.hostname, node.slots] for node in packed.placement.nodes])
    try:
        packed.run(die_on_rank_1)
        emit("death", None)
    except Exception as error:
        emit("death", {"type": type(error).__name__, "text": str(error)})
    try:
        packed.run(lambda: 1)
        emit("after_death", None)
    except Exception as error:
        emit("after_death", {"type": type(error).__name__, "text": str(error)})
    packed.shutdown()
    print("SHUT DOWN", flush=True)
    sys.stdin.readline()
    # A third one, left running: the test kills this driver (SIGKILL, no shutdown()).
    orphaned = RayExecutor(RayExecutor.create_settings(timeout_s=120), num_hosts=2)
    orphaned.start()
    emit("orphaned", orphaned.run(lambda: socket.gethostname()))
    print("RUNNING", flush=True)
    sys.stdin.readline()


if __name__ == "__main__":
    main()
