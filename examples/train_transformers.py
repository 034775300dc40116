"""A Transformers `Trainer` under `mtrain run`, its gradients on mtrain's torch.distributed backend.

    mtrain run -np 2 python examples/train_transformers.py

A small BERT built from its config (nothing is downloaded) learns whether a sequence of tokens
holds more even than odd tokens. One line makes the default process group on the "mtrain"
backend before `TrainingArguments`; Transformers (through Accelerate) trains on that group.
Leave `ddp_backend` unset: Accelerate takes only gloo or MPI there on CPU (docs/trainers.md).
Needs: pip install transformers accelerate
"""
import argparse
import os
import tempfile

import torch
import torch.distributed as dist

os.environ.setdefault("HF_HUB_OFFLINE", "1")
from transformers import BertConfig, BertForSequenceClassification, Trainer, TrainingArguments  # noqa: E402


class EvenOdd(torch.utils.data.Dataset):
    def __init__(self, count: int, seed: int) -> None:
        self.ids = torch.randint(1, 32, (count, 16), generator=torch.Generator().manual_seed(seed))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, index: int) -> dict:
        tokens = self.ids[index]
        return {"input_ids": tokens, "labels": int((tokens % 2 == 0).sum() > 8)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--batch-size", type=int, default=16, help="per rank")
    parser.add_argument("--backend", default="mtrain", help="torch.distributed backend (gloo to compare)")
    args = parser.parse_args()
    dist.init_process_group(args.backend)
    config = BertConfig(vocab_size=32, hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=128, max_position_embeddings=16, num_labels=2)
    torch.manual_seed(0)
    training = TrainingArguments(output_dir=tempfile.mkdtemp(), per_device_train_batch_size=args.batch_size,
                                 max_steps=args.steps, learning_rate=2e-3, use_cpu=True, report_to=[],
                                 save_strategy="no", logging_steps=50, disable_tqdm=True, seed=0)
    trainer = Trainer(model=BertForSequenceClassification(config), args=training,
                      train_dataset=EvenOdd(4096, 0), eval_dataset=EvenOdd(512, 1),
                      compute_metrics=lambda p: {"accuracy": float((p.predictions.argmax(-1) == p.label_ids).mean())})
    trainer.train()
    metrics = trainer.evaluate()
    if trainer.is_world_process_zero():
        print(f"{training.world_size} ranks on {dist.get_backend()}: test accuracy {metrics['eval_accuracy']:.3f}")


if __name__ == "__main__":
    main()
