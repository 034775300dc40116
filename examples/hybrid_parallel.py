"""Hybrid parallelism: a model cut into 2 pipeline stages, each stage replicated data-parallel.

    mtrain run -np 4 -H hostA:2,hostB:2 python examples/hybrid_parallel.py            # Horovod-style
    mtrain run -np 4 -H hostA:2,hostB:2 python examples/hybrid_parallel.py --api torch  # torch.distributed

With -np 4 on two hosts (ranks 0, 1 on host A; 2, 3 on host B):

        host A: stage 0 (layers 1-2)              host B: stage 1 (layers 3-4, loss)
      +--------------------------+  activations  +--------------------------+
      | rank 0  replica 0        | ------------> | rank 2  replica 0        |
      |                          | <------------ |                          |
      |                          |   gradients   |                          |
      | rank 1  replica 1        | ------------> | rank 3  replica 1        |
      |                          | <------------ |                          |
      +--------------------------+               +--------------------------+
        gradients averaged over                   gradients averaged over
        ranks 0, 1 (stage 0's set)                ranks 2, 3 (stage 1's set)

Each replica takes its share of the batch, in microbatches (GPipe: every forward,
then every backward). Activations go down the pipeline and their gradients come back
with point-to-point transfers; each stage's gradients are averaged within the stage's
data-parallel group. ``-np 2N`` runs N replicas of the two stages.

``--api hvd`` (default) uses mtrain.torch as Horovod users write it: process sets, and
mtrain's ``send``/``recv``. ``--api torch`` is plain torch.distributed on backend
"mtrain": ``new_group`` for the pipelines and the data-parallel groups, torch's own
``torch.distributed.pipelining`` (a PipelineStage per rank, ScheduleGPipe or, with
``--schedule 1f1b``, Schedule1F1B) and ``all_reduce`` on the data-parallel group.

At the end every rank trains the whole model on the whole batch in one process and
checks that its stage's parameters equal that run's (to 1e-5): the exit status says.
"""
from __future__ import annotations

import argparse
import sys
import time

import torch

FEATURES, HIDDEN, OUTPUTS = 12, 16, 4
BATCH = 24  # the global batch: every replica takes BATCH / replicas rows


def whole_model() -> torch.nn.Sequential:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(FEATURES, HIDDEN), torch.nn.Tanh(),
                               torch.nn.Linear(HIDDEN, HIDDEN), torch.nn.Tanh(), torch.nn.Linear(HIDDEN, OUTPUTS))


def stage_of(model: torch.nn.Sequential, stage: int) -> torch.nn.Sequential:
    """Stage 0: layers 1-2 (Linear, Tanh); stage 1: the rest."""
    return model[:2] if stage == 0 else model[2:]


def batch(step: int) -> "tuple[torch.Tensor, torch.Tensor]":
    """The global batch of ``step``: the same on every rank."""
    generator = torch.Generator().manual_seed(100 + step)
    inputs = torch.randn(BATCH, FEATURES, generator=generator)
    targets = torch.sin(inputs[:, :OUTPUTS] * 2.0) + 0.1 * torch.randn(BATCH, OUTPUTS, generator=generator)
    return inputs, targets


def loss_sum(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return ((outputs - targets) ** 2).sum()


def reference(steps: int, lr: float) -> torch.nn.Sequential:
    """One process, the whole model, the whole batch: loss = mean over samples of the squared error."""
    model = whole_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    for step in range(steps):
        inputs, targets = batch(step)
        optimizer.zero_grad()
        (loss_sum(model(inputs), targets) / BATCH).backward()
        optimizer.step()
    return model


def layout(rank: int, size: int) -> "tuple[int, int, int]":
    """(stage, replica, replicas) of ``rank``: the first half of the ranks is stage 0."""
    if size < 2 or size % 2 or BATCH % (size // 2):
        sys.exit(f"hybrid_parallel.py: run it on an even number of ranks (2 stages x N replicas, N dividing "
                 f"{BATCH}); this job has {size}")
    replicas = size // 2
    return rank // replicas, rank % replicas, replicas


def replica_batch(step: int, replica: int, replicas: int) -> "tuple[torch.Tensor, torch.Tensor]":
    """This replica's share of the global batch of ``step``."""
    share = BATCH // replicas
    rows = slice(replica * share, (replica + 1) * share)
    inputs, targets = batch(step)
    return inputs[rows], targets[rows]


# -- Horovod-style: mtrain.torch ------------------------------------------------------------

def train_hvd(args: argparse.Namespace) -> "tuple[torch.nn.Module, int, int, int]":
    import mtrain.torch as hvd
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    stage, replica, replicas = layout(rank, size)
    stage_sets = [hvd.ProcessSet(list(range(s * replicas, (s + 1) * replicas))) for s in range(2)]
    for process_set in stage_sets:
        hvd.add_process_set(process_set)
    mine = stage_sets[stage]
    partner = rank + replicas if stage == 0 else rank - replicas  # the same replica's other stage
    part = stage_of(whole_model(), stage)
    optimizer = torch.optim.SGD(part.parameters(), lr=args.lr)
    local = BATCH // replicas
    micro = local // args.microbatches
    for step in range(args.steps):
        started = time.perf_counter()
        inputs, targets = replica_batch(step, replica, replicas)
        optimizer.zero_grad()
        total = torch.zeros(1)  # the stage's loss (the last stage's)
        if stage == 0:
            outputs, sends = [], []
            for i in range(args.microbatches):  # every forward; the next stage starts on the first
                output = part(inputs[i * micro:(i + 1) * micro])
                sends.append(hvd.send_async(output.detach(), partner, tag=i))
                outputs.append(output)
            for i, output in enumerate(outputs):  # then every backward, as the gradients come back
                grad = hvd.recv(torch.empty_like(output), partner, tag=args.microbatches + i)
                output.backward(grad)
            for handle in sends:
                hvd.synchronize(handle)
        else:
            for i in range(args.microbatches):
                activation = hvd.recv(torch.empty(micro, HIDDEN), partner, tag=i).requires_grad_()
                loss = loss_sum(part(activation), targets[i * micro:(i + 1) * micro]) / local
                loss.backward()
                hvd.send(activation.grad, partner, tag=args.microbatches + i)
                total += loss.detach()
        # Average each stage's gradients over its replicas (its process set), then step.
        hvd.grouped_allreduce_([p.grad for p in part.parameters()], op=hvd.Average, process_set=mine)
        optimizer.step()
        report(step, stage, replica, replicas,
               hvd.allreduce(total, op=hvd.Average, process_set=mine), time.perf_counter() - started)
    return part, rank, stage, replica


# -- plain torch.distributed on backend "mtrain" --------------------------------------------

def train_torch(args: argparse.Namespace) -> "tuple[torch.nn.Module, int, int, int]":
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    import mtrain.distributed  # noqa: F401  (registers the backend "mtrain")
    dist.init_process_group("mtrain")  # mtrain run sets RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT
    rank, size = dist.get_rank(), dist.get_world_size()
    stage, replica, replicas = layout(rank, size)
    # Every rank creates every group, in the same order (torch's rule for new_group).
    pipelines = [dist.new_group([r, r + replicas]) for r in range(replicas)]
    stage_groups = [dist.new_group(list(range(s * replicas, (s + 1) * replicas))) for s in range(2)]
    part = stage_of(whole_model(), stage)
    local = BATCH // replicas
    micro = local // args.microbatches
    example = torch.empty(micro, FEATURES if stage == 0 else HIDDEN)
    pipeline_stage = PipelineStage(part, stage, 2, torch.device("cpu"), input_args=(example,),
                                   group=pipelines[replica])
    schedule_type = Schedule1F1B if args.schedule == "1f1b" else ScheduleGPipe
    # The loss of one microbatch, averaged over its rows; the schedule divides by the count.
    schedule = schedule_type(pipeline_stage, n_microbatches=args.microbatches,
                             loss_fn=lambda output, target: loss_sum(output, target) / micro)
    optimizer = torch.optim.SGD(part.parameters(), lr=args.lr)
    for step in range(args.steps):
        started = time.perf_counter()
        inputs, targets = replica_batch(step, replica, replicas)
        optimizer.zero_grad()
        total = torch.zeros(1)
        if stage == 0:
            schedule.step(inputs)
        else:
            losses: list = []
            schedule.step(target=targets, losses=losses)
            total += torch.stack(losses).sum().detach() / args.microbatches
        for p in part.parameters():
            dist.all_reduce(p.grad, op=dist.ReduceOp.AVG, group=stage_groups[stage])
        optimizer.step()
        dist.all_reduce(total, op=dist.ReduceOp.AVG, group=stage_groups[stage])
        report(step, stage, replica, replicas, total, time.perf_counter() - started)
    dist.destroy_process_group()
    return part, rank, stage, replica


def report(step: int, stage: int, replica: int, replicas: int, loss: torch.Tensor, seconds: float) -> None:
    """One line per step from the last stage's first replica: the loss and the throughput."""
    if stage == 1 and replica == 0:
        print(f"step {step}: loss {loss.item():.5f}, {BATCH / seconds:.0f} samples/s "
              f"({replicas} replica(s) x 2 stages)", flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--api", choices=("hvd", "torch"), default="hvd")
    parser.add_argument("--schedule", choices=("gpipe", "1f1b"), default="gpipe",
                        help="the torch.distributed.pipelining schedule (--api torch)")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--microbatches", type=int, default=2)
    parser.add_argument("--lr", type=float, default=0.1)
    args = parser.parse_args()
    if args.steps < 1 or args.microbatches < 1:
        parser.error("--steps and --microbatches must be at least 1")
    part, rank, stage, replica = (train_torch if args.api == "torch" else train_hvd)(args)
    want = stage_of(reference(args.steps, args.lr), stage)
    diff = max((a - b).abs().max().item() for a, b in zip(part.parameters(), want.parameters()))
    verdict = "equal" if diff <= 1e-5 else "DIFFER FROM"
    print(f"rank {rank} (stage {stage}, replica {replica}): parameters {verdict} one process training the "
          f"whole model on the whole batch (max |diff| {diff:.2e})", flush=True)
    return 0 if diff <= 1e-5 else 1


if __name__ == "__main__":
    sys.exit(main())
