"""``DistributedOptimizer(op=Adasum)``: each rank steps on its own gradients, and the ranks
combine the steps' deltas with Adasum (horovod/torch/optimizer.py, ``_DistributedAdasumOptimizer``).

Adasum needs the whole magnitude of an update, so it reduces what the optimizer would do to a
parameter, not the gradient. When a parameter's gradient is ready (after
``backward_passes_per_step`` backward passes), the wrapped optimizer steps on that parameter
alone, from a copy of its value (``start``): the parameter then holds ``start + delta``, and
``delta = parameter - start`` is all-reduced with Adasum in place. ``step()`` waits for every
delta and sets each parameter to ``start + Adasum(deltas)``.

Learning rate (docs/adasum_user_guide.rst): not scaled by the number of ranks; a single
worker's best rate, or up to 2-2.5 times it. Device tensors are summed within each host
before Adasum runs across hosts, where Horovod's guide scales the rate by the local size.
"""
from __future__ import annotations

import contextlib
from typing import Any, Dict, Tuple

import torch

from mtrain.ringreduce import Adasum

from ..handles import FrameworkHandle
from .mpi_ops import allreduce_async_, synchronize
from .pass_count import too_many_passes_check

__all__ = ["DistributedAdasumOptimizer"]


class DistributedAdasumOptimizer:
    """Mixed in before the wrapped optimizer's own class (see ``optimizer.DistributedOptimizer``)."""

    def mtrain_adasum_setup(self, parameter_names: Dict[torch.Tensor, str], compression: type,
                            backward_passes_per_step: int) -> None:
        """The wrapper's state, set once by ``optimizer.DistributedOptimizer`` (public for it alone)."""
        self._compression = compression
        self.backward_passes_per_step = backward_passes_per_step
        self._parameter_names = parameter_names
        self._delta_names = {p: f"DistributedAdasumOptimizer.{name}" for p, name in parameter_names.items()}
        params = [p for group in self.param_groups for p in group["params"]]
        self._requires_update = [p for p in dict.fromkeys(params) if p.requires_grad]
        self._allreduce_delay = {p: backward_passes_per_step for p in self._requires_update}
        self._handles: Dict[torch.Tensor, Tuple[Any, Any]] = {}
        self._starting_models = {p: torch.zeros_like(p, requires_grad=False) for p in self._requires_update}
        self._hook_handles = []
        for p in self._requires_update:
            if p.grad is None:  # as Horovod: a gradient to accumulate into from the start
                p.grad = torch.zeros_like(p)
            self._hook_handles.append(p.register_hook(self._make_check_hook(p)))
            self._hook_handles.append(p.register_post_accumulate_grad_hook(self._make_hook(p)))

    def _make_check_hook(self, p: torch.Tensor) -> Any:
        return too_many_passes_check(self, self._allreduce_delay, self._parameter_names, p, "step()")

    def _make_hook(self, p: torch.Tensor) -> Any:
        def hook(_: torch.Tensor) -> None:
            self._allreduce_delay[p] -= 1
            if self._allreduce_delay[p] == 0:
                self._handles[p] = self._allreduce_delta_async(p)
        return hook

    def _allreduce_delta_async(self, p: torch.Tensor) -> Tuple[FrameworkHandle, Any]:
        """Step the wrapped optimizer on ``p`` alone, then start the Adasum of its delta."""
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        start = self._starting_models[p]
        stashed = [group["params"] for group in self.param_groups]
        for group in self.param_groups:
            group["params"] = [p] if any(p is q for q in group["params"]) else []
        try:
            with torch.no_grad():
                start.copy_(p)
            super().step()  # type: ignore[misc]
            with torch.no_grad():
                p.sub_(start)  # p now holds the delta
        finally:
            for group, params in zip(self.param_groups, stashed):
                group["params"] = params
        compressed, ctx = self._compression.compress(p.data)
        return allreduce_async_(compressed, name=self._delta_names[p], op=Adasum), ctx

    def synchronize(self) -> None:
        """Nothing to do before ``step()``: the deltas are combined there (as Horovod's)."""

    @contextlib.contextmanager
    def skip_synchronize(self) -> Any:
        raise AssertionError("Skipping synchronization is not supported when using Adasum optimizer.")
        yield  # pragma: no cover - a generator, for contextmanager

    def step(self, closure: Any = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for p in self._requires_update:  # parameters whose gradients did not all arrive: start now
            if self._handles.get(p) is None:
                self._handles[p] = self._allreduce_delta_async(p)
        try:
            for p, (handle, ctx) in self._handles.items():
                delta = self._compression.decompress(synchronize(handle), ctx)
                start = self._starting_models[p]
                with torch.no_grad():
                    start.add_(delta.to(start.dtype))
                    p.copy_(start)
        finally:
            self._handles.clear()
            for p in self._allreduce_delay:
                self._allreduce_delay[p] = self.backward_passes_per_step
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        if self._handles:
            raise RuntimeError("optimizer.zero_grad() was called after loss.backward() but before "
                               "optimizer.step(): the deltas are still being combined; call step() first")
        super().zero_grad(set_to_none)  # type: ignore[misc]

    def set_backward_passes_per_step(self, passes: int) -> None:
        self.backward_passes_per_step = passes
        for p in self._allreduce_delay:
            self._allreduce_delay[p] = passes
