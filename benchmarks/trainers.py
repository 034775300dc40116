"""Lightning, Accelerate and Transformers' Trainer: step time on the "mtrain" backend against gloo.

    python benchmarks/trainers.py [--np 2] [--rounds 2] [--steps 30]

Runs every trainer under ``mtrain run -np N`` once per backend per round, the backends taking
turns (mtrain, gloo, mtrain, gloo, …) so a drifting machine favours neither, and prints a table:
the median step time (after the warm-up steps) of each backend, the best round's, and the ratio.
A step is the trainer's whole step: forward, backward with DDP's gradient all-reduce, optimizer.
Each rank uses one torch thread. Workloads (about 5 M and 3 M parameters, so the reduce matters):

* Lightning: an MLP 512-2048-2048-10, batch 32 per rank, ``DDPStrategy(process_group_backend=…)``;
* Accelerate: the same MLP, ``Accelerator(cpu=True)`` on the group the program made;
* Transformers: ``Trainer`` on a BertForSequenceClassification (hidden 256, 4 layers, 64 tokens)
  built from its config, batch 8 per rank.

With ``--worker`` this file is the program each rank runs.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

TRAINERS = ("lightning", "accelerate", "transformers")
BACKENDS = ("mtrain", "gloo")
WARMUP = 5


def mlp():
    import torch

    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(512, 2048), torch.nn.ReLU(), torch.nn.Linear(2048, 2048),
                               torch.nn.ReLU(), torch.nn.Linear(2048, 10))


def mlp_data(steps: int, batch: int):
    import torch

    x = torch.randn(steps * batch * 2, 512)
    return torch.utils.data.TensorDataset(x, torch.randint(0, 10, (len(x),)))


def run_lightning(backend: str, steps: int) -> "list[float]":
    import lightning as L
    import torch
    from lightning.pytorch.strategies import DDPStrategy

    class Classifier(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = mlp()

        def training_step(self, batch, index):
            return torch.nn.functional.cross_entropy(self.net(batch[0]), batch[1])

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01)

    class Clock(L.Callback):
        def __init__(self) -> None:
            self.times: "list[float]" = []

        def on_train_batch_start(self, *args) -> None:
            self.start = time.perf_counter()

        def on_train_batch_end(self, *args) -> None:
            self.times.append(time.perf_counter() - self.start)

    clock = Clock()
    trainer = L.Trainer(accelerator="cpu", strategy=DDPStrategy(process_group_backend=backend), max_steps=steps,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, callbacks=[clock])
    trainer.fit(Classifier(), torch.utils.data.DataLoader(mlp_data(steps, 32), batch_size=32))
    return clock.times


def run_accelerate(backend: str, steps: int) -> "list[float]":
    import torch
    import torch.distributed as dist
    from accelerate import Accelerator

    dist.init_process_group(backend)
    accelerator = Accelerator(cpu=True)
    net = mlp()
    opt = torch.optim.SGD(net.parameters(), lr=0.01)
    loader = torch.utils.data.DataLoader(mlp_data(steps, 32), batch_size=32)
    net, opt, loader = accelerator.prepare(net, opt, loader)
    times = []
    for (x, y), _ in zip(loader, range(steps)):
        start = time.perf_counter()
        opt.zero_grad()
        accelerator.backward(torch.nn.functional.cross_entropy(net(x), y))
        opt.step()
        times.append(time.perf_counter() - start)
    return times


def run_transformers(backend: str, steps: int) -> "list[float]":
    import torch
    import torch.distributed as dist
    from transformers import (BertConfig, BertForSequenceClassification, Trainer, TrainerCallback,
                              TrainingArguments)

    dist.init_process_group(backend)  # Transformers trains on the group that exists
    config = BertConfig(vocab_size=1000, hidden_size=256, num_hidden_layers=4, num_attention_heads=4,
                        intermediate_size=1024, max_position_embeddings=64, num_labels=2)
    ids = torch.randint(0, 1000, (steps * 16, 64))

    class Tokens(torch.utils.data.Dataset):
        def __len__(self) -> int:
            return len(ids)

        def __getitem__(self, index: int) -> dict:
            return {"input_ids": ids[index], "labels": int(ids[index, 0]) % 2}

    class Clock(TrainerCallback):
        def __init__(self) -> None:
            self.times: "list[float]" = []

        def on_step_begin(self, *args, **kwargs) -> None:
            self.start = time.perf_counter()

        def on_step_end(self, *args, **kwargs) -> None:
            self.times.append(time.perf_counter() - self.start)

    clock = Clock()
    torch.manual_seed(0)
    args = TrainingArguments(output_dir=tempfile.mkdtemp(), per_device_train_batch_size=8, max_steps=steps,
                             use_cpu=True, report_to=[], save_strategy="no", disable_tqdm=True, logging_steps=10 ** 6)
    Trainer(model=BertForSequenceClassification(config), args=args, train_dataset=Tokens(),
            callbacks=[clock]).train()
    return clock.times


def worker(trainer: str, backend: str, steps: int) -> None:
    import torch

    torch.set_num_threads(1)
    times = {"lightning": run_lightning, "accelerate": run_accelerate, "transformers": run_transformers}[trainer](
        backend, steps)
    if int(os.environ.get("RANK", "0")) == 0:
        print("STEP_TIMES " + json.dumps(times), flush=True)


def one_job(trainer: str, backend: str, args: argparse.Namespace) -> float:
    """The median step time (s) of one job, after its warm-up steps."""
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", CUDA_VISIBLE_DEVICES="")
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
    argv = [sys.executable, "-m", "mtrain.launcher.cli.main", "run", "-np", str(args.np), sys.executable,
            os.path.abspath(__file__), "--worker", trainer, "--backend", backend, "--steps", str(args.steps)]
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=600)
    for line in done.stdout.splitlines():
        _, _, rest = line.partition(">:")
        if rest.startswith("STEP_TIMES "):
            return statistics.median(json.loads(rest[len("STEP_TIMES "):])[WARMUP:])
    raise SystemExit(f"{trainer} on {backend} failed (exit {done.returncode}):\n{done.stderr[-3000:]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--np", type=int, default=2, help="ranks")
    parser.add_argument("--rounds", type=int, default=2, help="jobs per trainer and backend")
    parser.add_argument("--steps", type=int, default=30, help="steps per job (the first 5 are not timed)")
    parser.add_argument("--trainers", default=",".join(TRAINERS), help="comma-separated subset of " + str(TRAINERS))
    parser.add_argument("--worker", choices=TRAINERS, help=argparse.SUPPRESS)
    parser.add_argument("--backend", choices=BACKENDS + ("nccl",), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker, args.backend, args.steps)
        return
    medians: "dict[tuple[str, str], list[float]]" = {}
    for trainer in args.trainers.split(","):
        for _ in range(args.rounds):
            for backend in BACKENDS:
                medians.setdefault((trainer, backend), []).append(one_job(trainer, backend, args))
    print(f"step time, {args.np} ranks, median of {args.steps - WARMUP} steps per job, {args.rounds} jobs each "
          "(best job; all jobs)")
    print(f"{'trainer':<14}{'mtrain ms':>12}{'gloo ms':>12}{'mtrain/gloo':>13}   all jobs mtrain | gloo (ms)")
    for trainer in args.trainers.split(","):
        ours, gloo = min(medians[(trainer, "mtrain")]), min(medians[(trainer, "gloo")])
        every = " ".join(f"{t * 1e3:.1f}" for t in medians[(trainer, "mtrain")]) + " | " + " ".join(
            f"{t * 1e3:.1f}" for t in medians[(trainer, "gloo")])
        print(f"{trainer:<14}{ours * 1e3:>12.1f}{gloo * 1e3:>12.1f}{ours / gloo:>13.2f}   {every}")


if __name__ == "__main__":
    main()
