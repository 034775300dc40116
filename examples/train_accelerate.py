"""Hugging Face Accelerate under `mtrain run`, its gradients on mtrain's torch.distributed backend.

    mtrain run -np 2 python examples/train_accelerate.py

No `accelerate launch`: `mtrain run` starts the ranks and gives them torchrun's variables. One
line makes the default process group on the "mtrain" backend (registered by `import torch`
inside the job); Accelerate then uses that group. `cpu=True` is Accelerate's switch for
training on several CPU processes (docs/trainers.md). Learns scikit-learn's handwritten digits.
Needs: pip install accelerate scikit-learn
"""
import argparse

import torch
import torch.distributed as dist
from accelerate import Accelerator
from sklearn.datasets import load_digits


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--batch-size", type=int, default=32, help="per rank")
    parser.add_argument("--backend", default="mtrain", help="torch.distributed backend (gloo to compare)")
    args = parser.parse_args()
    dist.init_process_group(args.backend)  # before Accelerator(): it keeps a group that exists
    accelerator = Accelerator(cpu=True)
    digits = load_digits()
    data = torch.utils.data.TensorDataset(torch.tensor(digits.images / 16.0, dtype=torch.float32).flatten(1),
                                          torch.tensor(digits.target))
    train, test = torch.utils.data.random_split(data, [0.8, 0.2], generator=torch.Generator().manual_seed(0))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    loader = torch.utils.data.DataLoader(train, batch_size=args.batch_size, shuffle=True)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    for _ in range(args.epochs):
        for images, labels in loader:
            optimizer.zero_grad()
            accelerator.backward(torch.nn.functional.cross_entropy(model(images), labels))
            optimizer.step()
    images, labels = test[:]
    accuracy = (accelerator.unwrap_model(model)(images).argmax(1) == labels).float().mean()
    accelerator.print(f"{accelerator.num_processes} ranks on {dist.get_backend()}: test accuracy {accuracy:.3f}")


if __name__ == "__main__":
    main()
