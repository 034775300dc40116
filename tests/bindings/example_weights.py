"""Runs one of the example training scripts (examples/*.py) unchanged and reports the weights it
trained, for tests/bindings/test_trainers.py:

    mtrain run -np 2 python example_weights.py examples/train_lightning.py --epochs 3 ...

The example runs as ``__main__`` with the arguments after its path, torch's generator seeded (0)
first. Every torch optimizer it makes is recorded (with its parameters' values at that moment);
when the example returns, this rank prints one ``WEIGHTS {json}`` line: a SHA-256 of its trained
parameters' bytes (ranks that hold the same weights print the same one), 16 fixed random
projections of them (to compare with another run's to a tolerance), and how far training moved
them from where the optimizer found them.
"""
from __future__ import annotations

import hashlib
import json
import os
import runpy
import sys

import torch

_optimizers: "list[tuple[torch.optim.Optimizer, list[torch.Tensor]]]" = []
_init = torch.optim.Optimizer.__init__


def _recorded_init(self, params, defaults) -> None:
    _init(self, params, defaults)
    _optimizers.append((self, [p.detach().clone() for group in self.param_groups for p in group["params"]]))


def trained() -> "tuple[list[torch.Tensor], list[torch.Tensor]]":
    """The parameters of every optimizer the example made (each once), and their values when it was made."""
    params, starts, seen = [], [], set()
    for optimizer, values in _optimizers:
        for p, start in zip((p for group in optimizer.param_groups for p in group["params"]), values):
            if id(p) not in seen:
                seen.add(id(p))
                params.append(p.detach())
                starts.append(start)
    return params, starts


def main() -> None:
    example, args = sys.argv[1], sys.argv[2:]
    torch.optim.Optimizer.__init__ = _recorded_init
    # (Lightning's example leaves its model's start to torch's default generator: seeded here, so two runs of
    # one example start alike and can be compared.)
    torch.manual_seed(0)
    sys.argv = [example, *args]
    runpy.run_path(example, run_name="__main__")
    params, starts = trained()
    assert params, f"{example} made no torch optimizer"
    flat = torch.cat([p.reshape(-1).to(torch.float64) for p in params])
    projections = torch.randn(16, flat.numel(), generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    print("WEIGHTS " + json.dumps({
        "rank": int(os.environ["RANK"]), "count": flat.numel(),
        "sha256": hashlib.sha256(b"".join(p.contiguous().numpy().tobytes() for p in params)).hexdigest(),
        "projections": (projections @ flat).tolist(),
        "moved": max(float((p - s).abs().max()) for p, s in zip(params, starts))}), flush=True)


if __name__ == "__main__":
    main()
