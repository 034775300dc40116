"""A data-parallel training job for the Slurm tests: `slurm_train.py STEPS TOKEN`.

Each rank trains on its own rows of every batch with hvd.DistributedOptimizer; rank 0 then
trains the same model in one process on whole batches and says whether the parameters
agree.  Prints one JSON line per rank: rank, size, host, torchrun's RANK / LOCAL_RANK, and,
on rank 0, the verdict.  With "ready" in argv it prints `ready <rank>` and keeps training
until stopped (the scancel test).
"""
import json
import os
import socket
import sys

import torch

import mtrain.torch as hvd

steps = int(sys.argv[1])
forever = "forever" in sys.argv
hvd.init()
rank, size = hvd.rank(), hvd.size()
ROWS = 6  # per rank and step; distinct values per row, column and step


def batch(step: int) -> "tuple[torch.Tensor, torch.Tensor]":
    rows = torch.arange(size * ROWS * 7, dtype=torch.float64).reshape(size * ROWS, 7)
    inputs = torch.sin(rows * 0.37 + step)
    targets = torch.cos(inputs[:, :3] * 1.3 - step)
    return inputs, targets


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(7, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3)).double()


net = model()
optimizer = hvd.DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.1),
                                     named_parameters=net.named_parameters())
hvd.broadcast_parameters(net.state_dict(), root_rank=0)
step = 0
while step < steps or forever:
    inputs, targets = batch(step)
    mine = slice(rank * ROWS, (rank + 1) * ROWS)
    optimizer.zero_grad()
    torch.nn.functional.mse_loss(net(inputs[mine]), targets[mine]).backward()
    optimizer.step()
    step += 1
    if forever and step == 3:
        print(f"ready {rank}", flush=True)
result = {"rank": rank, "size": size, "host": socket.gethostname(), "env_rank": os.environ.get("RANK"),
          "local_rank": os.environ.get("LOCAL_RANK"), "master_addr": os.environ.get("MASTER_ADDR")}
if rank == 0:
    alone = model()
    single = torch.optim.SGD(alone.parameters(), lr=0.1)
    for step in range(steps):
        inputs, targets = batch(step)
        single.zero_grad()
        torch.nn.functional.mse_loss(alone(inputs), targets).backward()  # the whole batch at once
        single.step()
    result["equal_to_one_process"] = all(torch.allclose(a, b, rtol=0, atol=1e-12)
                                         for a, b in zip(net.parameters(), alone.parameters()))
    result["moved"] = not torch.equal(next(model().parameters()), next(net.parameters()))
print(json.dumps(result), flush=True)
