"""A plain torch.distributed + DDP program, as torchrun users write it: `ddp_plain.py BACKEND [MODE]`.

No mtrain import (except `import mtrain.distributed` for backend "mtrain", which registers it).
Prints one JSON line per rank: its torchrun variables, host and the trained parameters.
MODE `raise` makes rank 1 raise in the middle of training.
"""
import gc
import json
import os
import socket
import sys

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

backend = sys.argv[1]
mode = sys.argv[2] if len(sys.argv) > 2 else ""  # a third word (a token) only marks the processes
if backend == "mtrain":
    import mtrain.distributed  # noqa: F401  (registers the backend)

dist.init_process_group(backend)  # env:// from RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT
rank, world = dist.get_rank(), dist.get_world_size()
torch.manual_seed(0)
model = DistributedDataParallel(torch.nn.Sequential(torch.nn.Linear(7, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3)))
optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
for step in range(6):
    # Distinct data per rank and step: the averaged gradient differs from every local one.
    generator = torch.Generator().manual_seed(1000 * step + rank)
    inputs, targets = torch.randn(4 + rank, 7, generator=generator), torch.randn(4 + rank, 3, generator=generator)
    optimizer.zero_grad()
    torch.nn.functional.mse_loss(model(inputs), targets).backward()
    optimizer.step()
    if mode == "raise" and rank == 1 and step == 3:
        raise RuntimeError("simulated failure in DDP rank 1")
print(json.dumps({"rank": rank, "world": world, "host": socket.gethostname(),
                  "local_rank": int(os.environ["LOCAL_RANK"]), "local_world_size": int(os.environ["LOCAL_WORLD_SIZE"]),
                  "group_rank": int(os.environ["GROUP_RANK"]), "group_world_size": int(os.environ["GROUP_WORLD_SIZE"]),
                  "params": [p.detach().double().flatten().tolist() for p in model.parameters()]}), flush=True)
# As torch asks: without it, gloo's worker threads are still alive when the interpreter
# finalizes, and one that frees a tensor then needs the GIL it can no longer get: the
# process dies with "terminate called without an active exception" (SIGABRT) now and then.
# The DDP model holds the group too (its reducer): dropped first, so that the group itself
# is destroyed here, while the interpreter is whole, not at finalization.
del model, optimizer
dist.destroy_process_group()
# The gloo group can outlive destroy_process_group() in a reference cycle, and then its threads
# meet the interpreter's finalization all the same (measured: 1 job in 13 to 20 aborted after
# every rank's "destroyed"; 0 in 36 with this collection).  Collected here, while the interpreter
# is whole.
gc.collect()
