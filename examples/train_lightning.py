"""PyTorch Lightning under `mtrain run`, its gradients on mtrain's torch.distributed backend.

    mtrain run -np 2 python examples/train_lightning.py

Nothing mtrain-specific but the backend's name: `mtrain run` tells Lightning the job's ranks,
hosts and devices, and `import torch` registers the backend "mtrain" inside the job
(docs/trainers.md). Learns scikit-learn's handwritten digits (no download).
Needs: pip install lightning scikit-learn
"""
import argparse

import lightning as L
import torch
from lightning.pytorch.strategies import DDPStrategy
from sklearn.datasets import load_digits


class Digits(L.LightningModule):
    def __init__(self, lr: float) -> None:
        super().__init__()
        self.lr = lr
        self.net = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(64, 128), torch.nn.ReLU(),
                                       torch.nn.Linear(128, 10))

    def training_step(self, batch, index):
        images, labels = batch
        return torch.nn.functional.cross_entropy(self.net(images), labels)

    def validation_step(self, batch, index):
        images, labels = batch
        accuracy = (self.net(images).argmax(1) == labels).float().mean()
        self.log("accuracy", accuracy, sync_dist=True)  # averaged over the ranks' shards

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--batch-size", type=int, default=32, help="per rank")
    parser.add_argument("--backend", default="mtrain", help="torch.distributed backend (gloo to compare)")
    args = parser.parse_args()
    digits = load_digits()
    images = torch.tensor(digits.images / 16.0, dtype=torch.float32)
    data = torch.utils.data.TensorDataset(images, torch.tensor(digits.target))
    train, test = torch.utils.data.random_split(data, [0.8, 0.2], generator=torch.Generator().manual_seed(0))
    trainer = L.Trainer(accelerator="cpu", strategy=DDPStrategy(process_group_backend=args.backend),
                        max_epochs=args.epochs, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False)
    model = Digits(lr=0.05)
    trainer.fit(model, torch.utils.data.DataLoader(train, batch_size=args.batch_size, shuffle=True),
                torch.utils.data.DataLoader(test, batch_size=256))
    if trainer.is_global_zero:
        print(f"{trainer.world_size} ranks on {torch.distributed.get_backend()}: "
              f"test accuracy {trainer.callback_metrics['accuracy']:.3f}")


if __name__ == "__main__":
    main()
