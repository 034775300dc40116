"""torch.distributed.pipelining as torch users write it, on backend "mtrain" and on gloo in one job.

    pipeline_plain.py gpipe|1f1b [mismatch]

One stage per rank (a Linear + Tanh each; the loss after the last), 4 microbatches, two
training steps. The same schedule runs on the default group (backend "mtrain") and on a
gloo group over the same ranks; every rank also runs the whole model in one process with
the same microbatches. Prints one JSON line per rank: its largest differences of losses
(last stage) and gradients between mtrain and gloo, and between mtrain and one process.
``mismatch``: the last stage expects inputs of another width than the stage before it
sends, which must fail on the receiving stage saying what was sent.
"""
import json
import socket
import sys

import torch
import torch.distributed as dist
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

import mtrain.distributed  # noqa: F401  (registers the backend)

WIDTH, BATCH, MICRO = 6, 8, 4
schedule_type = Schedule1F1B if sys.argv[1] == "1f1b" else ScheduleGPipe
mismatch = sys.argv[2:3] == ["mismatch"]

dist.init_process_group("mtrain")
rank, size = dist.get_rank(), dist.get_world_size()
groups = {"mtrain": dist.group.WORLD, "gloo": dist.new_group(backend="gloo")}


def whole() -> torch.nn.Sequential:
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(WIDTH, WIDTH), torch.nn.Tanh())
                                 for _ in range(size)])


def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return ((output - target) ** 2).mean()


def data(step: int):
    generator = torch.Generator().manual_seed(step)
    return torch.randn(BATCH, WIDTH, generator=generator), torch.randn(BATCH, WIDTH, generator=generator)


def run(group) -> "tuple[list, list]":
    stage_module = whole()[rank]
    width = WIDTH + 1 if mismatch and rank == size - 1 else WIDTH
    stage = PipelineStage(stage_module, rank, size, torch.device("cpu"),
                          input_args=(torch.empty(BATCH // MICRO, width),), group=group)
    schedule = schedule_type(stage, n_microbatches=MICRO, loss_fn=loss_fn)
    optimizer = torch.optim.SGD(stage_module.parameters(), lr=0.5)
    losses, grads = [], []
    for step in range(2):
        inputs, targets = data(step)
        optimizer.zero_grad()
        mine: list = []
        if rank == 0:
            schedule.step(inputs)
        elif rank == size - 1:
            schedule.step(target=targets, losses=mine)
        else:
            schedule.step()
        losses += [float(x.detach()) for x in mine]
        grads += [p.grad.clone() for p in stage_module.parameters()]
        optimizer.step()
    return losses, grads


def reference() -> "tuple[list, list]":
    model = whole()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    losses, grads = [], []
    for step in range(2):
        inputs, targets = data(step)
        optimizer.zero_grad()
        parts = [loss_fn(model(x), y) for x, y in zip(inputs.chunk(MICRO), targets.chunk(MICRO))]
        (sum(parts) / MICRO).backward()  # the schedule scales gradients by the microbatch count
        if rank == size - 1:
            losses += [float(x.detach()) for x in parts]
        grads += [p.grad.clone() for p in model[rank].parameters()]
        optimizer.step()
    return losses, grads


def largest(a: list, b: list) -> float:
    assert len(a) == len(b), (len(a), len(b))
    return max([abs(float((x - y).abs().max()) if torch.is_tensor(x) else x - y) for x, y in zip(a, b)], default=0.0)


results = {name: run(group) for name, group in groups.items()}
want = reference()
report = {"rank": rank, "host": socket.gethostname(),
          "losses": len(results["mtrain"][0]),
          "vs_gloo": max(largest(results["mtrain"][0], results["gloo"][0]),
                         largest(results["mtrain"][1], results["gloo"][1])),
          "vs_one_process": max(largest(results["mtrain"][0], want[0]), largest(results["mtrain"][1], want[1]))}
print(json.dumps(report), flush=True)
dist.destroy_process_group()
