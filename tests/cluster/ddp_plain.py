"""A plain torch.distributed + DDP program, as torchrun users write it: `ddp_plain.py BACKEND [MODE]`.

No mtrain import (except `import mtrain.distributed` for backend "mtrain", which registers it).
Prints one JSON line per rank: its torchrun variables, host and the trained parameters.
MODE `raise` makes rank 1 raise in the middle of training.
"""
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
# No destroy_process_group() and no garbage collection here: mtrain's rank runner closes the
# groups a program leaves open when it ends well (launcher/pymain.py, close_torch_process_groups).
