"""The programs tests/bindings/test_trainers.py and tests/cluster/test_trainers_cluster.py run under
``mtrain run``: Lightning, Accelerate and a Transformers ``Trainer``, written as a user would, on a
tiny model. Each prints one ``RESULT {json}`` line per rank.

    python trainer_jobs.py lightning BACKEND     # DDPStrategy(process_group_backend=BACKEND), defaults else
    python trainer_jobs.py accelerate BACKEND    # init_process_group(BACKEND), then Accelerator(cpu=True)
    python trainer_jobs.py transformers BACKEND BATCH   # Trainer (plain SGD, no clipping) on a tiny BERT

No line imports mtrain: under ``mtrain run`` the backend name comes from torch's autoload of
``mtrain.autoload`` and Lightning's devices from the job (docs/trainers.md). Lightning and
Accelerate also train a single-process reference in plain torch on the same data with the
global batch (per-rank batch × ranks) and report how far the trained weights are from it.
"""
from __future__ import annotations

import json
import os
import sys
import tempfile

import torch
import torch.distributed as dist

SAMPLES, FEATURES, BATCH, EPOCHS, LR = 64, 8, 4, 2, 0.1


def data() -> "tuple[torch.Tensor, torch.Tensor]":
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(SAMPLES, FEATURES, generator=generator)
    return x, (x @ torch.linspace(-1, 1, FEATURES)).unsqueeze(1) + 0.1 * torch.randn(SAMPLES, 1, generator=generator)


def make_net() -> torch.nn.Module:
    torch.manual_seed(1)
    return torch.nn.Sequential(torch.nn.Linear(FEATURES, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))


def reference(global_batch: int, shuffled: bool = False) -> "list[torch.Tensor]":
    """One process, plain torch: the weights the job must end with. ``shuffled``: in the order
    torch's DistributedSampler (seed 0) deals an epoch out, which Lightning uses for training."""
    net, (x, y) = make_net(), data()
    opt = torch.optim.SGD(net.parameters(), lr=LR)
    for epoch in range(EPOCHS):
        order = torch.randperm(SAMPLES, generator=torch.Generator().manual_seed(epoch)) if shuffled \
            else torch.arange(SAMPLES)
        for start in range(0, SAMPLES, global_batch):
            batch = order[start:start + global_batch]  # the union of the ranks' batches of this step
            opt.zero_grad()
            torch.nn.functional.mse_loss(net(x[batch]), y[batch]).backward()
            opt.step()
    return [p.detach() for p in net.parameters()]


def distance(params, expected) -> float:
    return max(float((p.detach() - q).abs().max()) for p, q in zip(params, expected))


def moved(params) -> float:
    return max(float((p.detach() - q.detach()).abs().max()) for p, q in zip(params, make_net().parameters()))


def report(**fields) -> None:
    print("RESULT " + json.dumps(fields), flush=True)


def lightning(backend: str) -> None:
    import lightning as L
    from lightning.pytorch.strategies import DDPStrategy

    class Regression(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = make_net()

        def training_step(self, batch, index):
            x, y = batch
            return torch.nn.functional.mse_loss(self.net(x), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=LR)

    model = Regression()
    # The user's line as the issue has it: no devices=, no num_nodes=, no plugins=.
    trainer = L.Trainer(accelerator="cpu", strategy=DDPStrategy(process_group_backend=backend), max_epochs=EPOCHS,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(*data()), batch_size=BATCH)
    trainer.fit(model, loader)
    params = list(model.net.parameters())
    report(rank=trainer.global_rank, world=trainer.world_size, backend=dist.get_backend(),
           environment=type(trainer.strategy.cluster_environment).__name__, node_rank=trainer.node_rank,
           distance=distance(params, reference(BATCH * trainer.world_size, shuffled=True)), moved=moved(params))


def accelerate(backend: str) -> None:
    # Accelerate keeps a default group that exists; on CPU it makes one only on gloo or MPI.
    dist.init_process_group(backend)
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True)
    net = make_net()
    opt = torch.optim.SGD(net.parameters(), lr=LR)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(*data()), batch_size=BATCH)
    net, opt, loader = accelerator.prepare(net, opt, loader)
    for _ in range(EPOCHS):
        for x, y in loader:
            opt.zero_grad()
            accelerator.backward(torch.nn.functional.mse_loss(net(x), y))
            opt.step()
    params = list(accelerator.unwrap_model(net).parameters())
    report(rank=accelerator.process_index, world=accelerator.num_processes, backend=dist.get_backend(),
           distributed_type=str(accelerator.distributed_type), wrapped=type(net).__name__,
           distance=distance(params, reference(BATCH * accelerator.num_processes)), moved=moved(params))


def transformers(backend: str, batch: int) -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    ddp_backend = None
    if backend == "nccl":
        ddp_backend = "nccl"  # the user's mistake on a CPU-only host: Transformers' own error must end the job
    elif backend != "none":
        dist.init_process_group(backend)  # Transformers (through Accelerate) trains on the group that exists
    from transformers import BertConfig, BertForSequenceClassification, Trainer, TrainingArguments

    config = BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=64, max_position_embeddings=16, hidden_dropout_prob=0.0,
                        attention_probs_dropout_prob=0.0, num_labels=2)
    generator = torch.Generator().manual_seed(0)
    ids, labels = torch.randint(0, 64, (SAMPLES, 12), generator=generator), torch.randint(0, 2, (SAMPLES,),
                                                                                          generator=generator)

    class Tokens(torch.utils.data.Dataset):
        def __len__(self) -> int:
            return SAMPLES

        def __getitem__(self, index: int) -> dict:
            return {"input_ids": ids[index], "labels": labels[index]}

    torch.manual_seed(1)
    model = BertForSequenceClassification(config)
    # average_tokens_across_devices=False: Transformers then logs the mean loss of the global batch (with
    # True it logs that loss times the number of ranks), which a single-process run must equal.
    # Plain SGD at a constant rate, no clipping: each step moves the weights by the gradient itself, so a
    # gradient that is the ranks' sum (or one rank's own) takes other steps than the global batch's mean
    # (AdamW and clipping would scale most of that difference away).
    args = TrainingArguments(output_dir=tempfile.mkdtemp(), per_device_train_batch_size=batch, max_steps=6,
                             use_cpu=True, logging_steps=1, report_to=[], seed=0, save_strategy="no",
                             optim="sgd", learning_rate=LR, lr_scheduler_type="constant",
                             max_grad_norm=0.0, disable_tqdm=True, ddp_backend=ddp_backend,
                             average_tokens_across_devices=False)
    trainer = Trainer(model=model, args=args, train_dataset=Tokens())
    trainer.train()
    report(rank=args.process_index, world=args.world_size,
           backend=dist.get_backend() if dist.is_initialized() else None, losses=[entry["loss"] for entry in trainer.state.log_history if "loss" in entry])


if __name__ == "__main__":
    kind, backend = sys.argv[1], sys.argv[2]
    if kind == "lightning":
        lightning(backend)
    elif kind == "accelerate":
        accelerate(backend)
    else:
        transformers(backend, int(sys.argv[3]))
