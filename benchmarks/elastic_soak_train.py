"""The training program of the elastic soak (benchmarks/elastic_soak.py).

    elastic_soak_train.py STEPS COMMIT_EVERY PAUSE [TOKEN]

A small MLP learns a fixed random teacher with Adam for STEPS committed optimizer
steps, committing every COMMIT_EVERY steps, under ``@hvd.elastic.run``.  Step ``s``
trains on one global batch drawn from seed ``s``; rank ``r`` of ``n`` takes rows
``r::n`` of it, so the averaged gradient is the global batch's whatever the number of
ranks, and the result can be checked against one process replaying the steps
(``replay``).  TOKEN only marks the command line, so the soak finds the processes.

What the soak reads (stdout; rank 0 unless said otherwise):

    soak-resume <size> <step> <commit>     a generation starts from `step` (commit -1: the start)
    soak-step <rank> <host> <step> <pid>   every rank, after each optimizer step
    soak-commit <commit> <step>            a commit is on this host's snapshot
    {"rank": …, "steps": …, "applied": […], "adam_steps": …, "params": […]}   every rank, at the end
"""
from __future__ import annotations

import json
import os
import socket
import sys
import time

import torch

GLOBAL_BATCH = 24          # divisible by every generation size the soak uses (1, 2, 3, 4, 6, 8)
INPUTS, HIDDEN, CLASSES = 32, 64, 10


def build_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(INPUTS, HIDDEN), torch.nn.ReLU(),
                               torch.nn.Linear(HIDDEN, HIDDEN), torch.nn.ReLU(),
                               torch.nn.Linear(HIDDEN, CLASSES))


def build_optimizer(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.Adam(model.parameters(), lr=1e-3)


def global_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Step `step`'s inputs and labels: the labels come from a fixed random teacher."""
    generator = torch.Generator().manual_seed(step)
    inputs = torch.randn(GLOBAL_BATCH, INPUTS, generator=generator)
    teacher = torch.Generator().manual_seed(12345)
    weights = torch.randn(INPUTS, CLASSES, generator=teacher)
    return inputs, (inputs @ weights).argmax(dim=1)


def train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, inputs: torch.Tensor,
               labels: torch.Tensor) -> float:
    optimizer.zero_grad()
    loss = torch.nn.functional.cross_entropy(model(inputs), labels)
    loss.backward()
    optimizer.step()
    return float(loss.detach())


def adam_steps(optimizer: torch.optim.Optimizer) -> list[int]:
    """Adam's own count of the steps it applied, per parameter (it lives in the committed state)."""
    return sorted({int(state["step"]) for state in optimizer.state.values()})


def replay(steps: int) -> list[list[float]]:
    """The parameters one process reaches with the same `steps` (the soak's reference)."""
    model = build_model()
    optimizer = build_optimizer(model)
    for step in range(steps):
        train_step(model, optimizer, *global_batch(step))
    return [p.detach().double().flatten().tolist() for p in model.parameters()]


def main() -> None:
    import mtrain.torch as hvd  # starts MPI: only in the ranks, never in the soak's replay

    steps, commit_every, pause = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])
    hvd.init()
    host, pid = socket.gethostname(), os.getpid()
    model = build_model()
    optimizer = hvd.DistributedOptimizer(build_optimizer(model), named_parameters=model.named_parameters())

    def landed(state) -> None:
        if hvd.rank() == 0:
            print(f"soak-commit {state.commit_number} {state.step}", flush=True)

    def commit(state) -> None:
        try:
            state.commit()
        except hvd.elastic.HostsUpdatedInterrupt:
            landed(state)  # raised after the commit's snapshot was written: it counts
            raise
        landed(state)

    @hvd.elastic.run
    def train(state) -> None:
        if GLOBAL_BATCH % hvd.size():
            raise SystemExit(f"{hvd.size()} ranks do not divide the global batch of {GLOBAL_BATCH}")
        if hvd.rank() == 0:
            print(f"soak-resume {hvd.size()} {state.step} {state.commit_number}", flush=True)
        while state.step < steps:
            inputs, labels = global_batch(state.step)
            train_step(model, optimizer, inputs[hvd.rank()::hvd.size()], labels[hvd.rank()::hvd.size()])
            state.applied.append(state.step)
            state.step += 1
            print(f"soak-step {hvd.rank()} {host} {state.step} {pid}", flush=True)
            if state.step % commit_every == 0 or state.step == steps:
                commit(state)
            time.sleep(pause)

    state = hvd.elastic.TorchState(model=model, optimizer=optimizer, step=0, applied=[])
    train(state)
    print(json.dumps({"rank": hvd.rank(), "size": hvd.size(), "host": host, "steps": state.step,
                      "applied": state.applied, "adam_steps": adam_steps(optimizer),
                      "params": [p.detach().double().flatten().tolist() for p in model.parameters()]}),
          flush=True)


if __name__ == "__main__":
    main()
