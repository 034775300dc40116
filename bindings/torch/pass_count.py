"""The check both torch ``DistributedOptimizer`` forms hook in before a gradient accumulates: no
more backward passes than ``backward_passes_per_step`` before ``step()`` (Horovod's optimizers
refuse the same, "Gradients were computed more than backward_passes_per_step times before call
to step()")."""
from __future__ import annotations

from typing import Any, Callable, Dict

import torch

__all__ = ["too_many_passes_check"]


def too_many_passes_check(optimizer: Any, delay: Dict[torch.Tensor, int], names: Dict[torch.Tensor, str],
                          p: torch.Tensor, how_to_step: str) -> Callable[[torch.Tensor], None]:
    """A ``register_hook`` hook for ``p``: RuntimeError once ``delay[p]`` (the passes still
    expected before the next step) has run out; ``how_to_step`` says what the program must call."""
    def check(grad: torch.Tensor) -> None:
        if delay[p] <= 0:
            raise RuntimeError(
                f"gradient of {names[p]!r} computed more than backward_passes_per_step="
                f"{optimizer.backward_passes_per_step} times before optimizer.step(); call {how_to_step} after "
                "each group of backward passes, or raise backward_passes_per_step")
    return check
