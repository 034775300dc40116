"""``DistributedOptimizer``: the wrapped optimizer's ``step()`` applies gradients averaged over
all ranks, each gradient's all-reduce started by a hook as soon as backward has produced it."""
from __future__ import annotations

import contextlib
import warnings
from typing import Any, Dict, List, Tuple

import torch

from mtrain.ringreduce import Adasum, Average, ProcessSet, global_process_set, size
from mtrain.ringreduce.core.requests import UNNAMED_PREFIX

from ..gradient_op import check_gradient_op
from ..handles import FrameworkHandle
from .adasum_optimizer import DistributedAdasumOptimizer
from .bridge import check_tensor
from .compression import Compression
from .inplace import ViewCache, allreduce_in_place
from .mpi_ops import sparse_allreduce_async
from .pass_count import too_many_passes_check

__all__ = ["DistributedOptimizer"]


class _DistributedOptimizer:
    """Mixed in before the wrapped optimizer's own class (see ``DistributedOptimizer``)."""

    def _mtrain_setup(self, named_parameters: Any, compression: type, backward_passes_per_step: int,
                      op: Any, gradient_predivide_factor: float, sparse_as_dense: bool = False,
                      process_set: ProcessSet = global_process_set) -> None:
        self.process_set = process_set
        self._compression = compression
        self.backward_passes_per_step = backward_passes_per_step
        self.op = op
        self.gradient_predivide_factor = gradient_predivide_factor
        self.sparse_as_dense = bool(sparse_as_dense)
        params = [p for group in self.param_groups for p in group["params"]]
        self._parameter_names = _parameter_names(named_parameters, params)
        # Formatted once here, not once per gradient per step.
        self._gradient_names = {p: f"DistributedOptimizer.{name}" for p, name in self._parameter_names.items()}
        self._gradient_views = ViewCache()  # each parameter's gradient as NumPy, while it stays the same
        # A rank outside the set trains locally, reducing nothing (Horovod registers no hooks there:
        # horovod/torch/optimizer.py, _DistributedOptimizer.__init__ and synchronize). None is a set
        # not registered yet: its ops will say so.
        outside = process_set.included() is False
        self._requires_update = [] if outside else [p for p in dict.fromkeys(params) if p.requires_grad]
        # Parameters whose sparse gradient was densified for the reduction (sparse_as_dense): their
        # reduced gradient goes back to sparse before the update, as Horovod's synchronize does.
        self._densified: "set[torch.Tensor]" = set()
        self._allreduce_delay = {p: backward_passes_per_step for p in self._requires_update}
        self._handles: Dict[torch.Tensor, Any] = {}
        self._synchronized = False
        self._should_synchronize = True
        self._hook_handles = []
        for p in self._requires_update:  # none outside the set
            self._hook_handles.append(p.register_hook(self._make_check_hook(p)))
            self._hook_handles.append(p.register_post_accumulate_grad_hook(self._make_hook(p)))

    def _make_check_hook(self, p: torch.Tensor) -> Any:
        # Runs before the gradient is accumulated: an all-reduce may be writing p.grad.
        return too_many_passes_check(self, self._allreduce_delay, self._parameter_names, p,
                                     "step() (or synchronize())")

    def _make_hook(self, p: torch.Tensor) -> Any:
        def hook(_: torch.Tensor) -> None:
            self._synchronized = False
            self._allreduce_delay[p] -= 1
            if self._allreduce_delay[p] == 0:
                self._handles[p] = self._allreduce_grad_async(p)
            else:
                self._handles.setdefault(p, None)
        return hook

    def _allreduce_grad_async(self, p: torch.Tensor) -> Tuple[FrameworkHandle, Any]:
        grad = p.grad
        if grad is None:  # no gradient on this rank this step: take part with zeros
            grad = p.grad = torch.zeros_like(p)
        name = self._gradient_names[p]
        if grad.is_sparse:  # e.g. nn.Embedding(sparse=True)
            if not self.sparse_as_dense:  # as Horovod: gather indices and values, no compression
                return sparse_allreduce_async(grad, name=name, op=self.op, process_set=self.process_set), None
            # Reduced as a dense copy; p.grad stays sparse until synchronize() lands the result, so
            # an optimizer that takes only sparse gradients (torch.optim.SparseAdam) still works.
            grad = grad.to_dense()
            self._densified.add(p)
        compressed, ctx = self._compression.compress(grad)
        pre, post = 1.0, 1.0
        if self.op == Average:  # the runtime scales by postscale / size (one scaling)
            pre, post = 1.0 / self.gradient_predivide_factor, self.gradient_predivide_factor
        handle = self._gradient_views.submit(p, compressed, self.op, name, pre, post, self.process_set)
        if handle is not None:  # this gradient's view from the last step
            return handle, ctx
        handle = allreduce_in_place(check_tensor(compressed), name, self.op, pre, post, self.process_set,
                                     self._gradient_views, p)
        return handle, ctx

    def synchronize(self) -> None:
        """Finish every gradient's all-reduce now (starting those not yet started)."""
        try:
            for p in self._requires_update:
                if self._handles.get(p) is None:
                    self._handles[p] = self._allreduce_grad_async(p)
            for p, (handle, ctx) in self._handles.items():
                reduced = self._compression.decompress(handle.wait(), ctx)
                if p in self._densified:
                    reduced = reduced.to_sparse()
                if reduced.is_sparse:
                    p.grad = reduced
                elif reduced is not p.grad:
                    with torch.no_grad():
                        p.grad.copy_(reduced)
        finally:
            self._handles.clear()
            self._densified.clear()
            for p in self._allreduce_delay:
                self._allreduce_delay[p] = self.backward_passes_per_step
        self._synchronized = True

    @contextlib.contextmanager
    def skip_synchronize(self) -> Any:
        """Within this context ``step()`` does not synchronize (call ``synchronize()`` yourself)."""
        self._should_synchronize = False
        try:
            yield
        finally:
            self._should_synchronize = True

    def step(self, closure: Any = None) -> Any:
        loss = None
        if closure is not None:  # backward inside the closure must finish before we average
            with torch.enable_grad():
                loss = closure()
        # After an explicit synchronize() the gradients are already averaged: no second round
        # (Horovod would reduce them again). The warning opens with Horovod's words
        # (horovod/torch/optimizer.py, step), so filters written for Horovod's match it too.
        if self._should_synchronize:
            if self._synchronized:
                warnings.warn("optimizer.step() called without optimizer.skip_synchronize() after an explicit "
                              "optimizer.synchronize(). The gradients are already averaged, so this step "
                              "applies them as they are; to say that this is intended (and silence this "
                              "warning), call step() inside `with optimizer.skip_synchronize():` whenever "
                              "you call optimizer.synchronize() yourself.", UserWarning, stacklevel=2)
            else:
                self.synchronize()
        self._synchronized = False
        super().step()  # type: ignore[misc]
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        if self._handles:
            raise RuntimeError("optimizer.zero_grad() was called after loss.backward() but before "
                               "optimizer.step() or optimizer.synchronize(): the gradients are still "
                               "being averaged; call step() (or synchronize()) first")
        super().zero_grad(set_to_none)  # type: ignore[misc]
        if set_to_none:  # the gradients are gone: so are their views (which would keep them alive)
            self._gradient_views.clear()

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        self._handles.clear()
        self._densified.clear()
        self._synchronized = False
        for p in self._allreduce_delay:
            self._allreduce_delay[p] = self.backward_passes_per_step
        super().load_state_dict(state_dict)  # type: ignore[misc]

    def set_backward_passes_per_step(self, passes: int) -> None:
        self.backward_passes_per_step = _check_passes(passes)
        for p in self._allreduce_delay:
            self._allreduce_delay[p] = passes


def _check_passes(passes: Any) -> int:
    if not isinstance(passes, int) or isinstance(passes, bool) or passes < 1:
        raise ValueError(f"backward_passes_per_step must be a positive integer, got {passes!r}")
    return passes


def _parameter_names(named_parameters: Any, params: List[torch.Tensor]) -> Dict[torch.Tensor, str]:
    """Each optimized parameter's name; errors name duplicates and unnamed parameters."""
    if named_parameters is None:
        return {p: f"{UNNAMED_PREFIX}{i}" for i, p in enumerate(params)}
    named = list(named_parameters)
    if any(not (isinstance(item, tuple) and len(item) == 2) for item in named):
        raise ValueError("named_parameters should be a sequence of (name, parameter) tuples, "
                         "usually model.named_parameters()")
    seen, duplicates = set(), []
    for name, _ in named:
        if name in seen and name not in duplicates:
            duplicates.append(name)
        seen.add(name)
    if duplicates:
        raise ValueError(f"parameter names in named_parameters must be unique; duplicates: "
                         f"{', '.join(map(str, duplicates))}")
    names = {p: name for name, p in named}
    unnamed = [i for i, p in enumerate(params) if p not in names]
    if unnamed:
        shapes = ", ".join(f"#{i} {tuple(params[i].shape)}" for i in unnamed)
        raise ValueError(f"named_parameters misses {len(unnamed)} of the optimizer's parameters "
                         f"(index in param_groups and shape: {shapes}); pass the named_parameters() "
                         "of the model the optimizer was built from")
    return names


_CLASSES: Dict[type, type] = {}


def DistributedOptimizer(optimizer: torch.optim.Optimizer, named_parameters: Any = None,
                         compression: type = Compression.none, backward_passes_per_step: int = 1,
                         op: Any = Average, gradient_predivide_factor: float = 1.0,
                         num_groups: int = 0, groups: Any = None,
                         sparse_as_dense: bool = False,
                         process_set: ProcessSet = global_process_set) -> torch.optim.Optimizer:
    """Wrap ``optimizer`` so that ``step()`` applies gradients averaged over all ranks.

    Each gradient's all-reduce starts as soon as backward has produced it.
    The result is an instance of the optimizer's own class (``isinstance`` holds)
    sharing its hyperparameters and state. ``num_groups``/``groups`` are
    accepted for Horovod compatibility; the runtime fuses small gradients itself.
    Sparse gradients (``nn.Embedding(sparse=True)``) are reduced as Horovod does:
    by ``sparse_allreduce_async`` (all-gather of indices and values), or, when
    ``sparse_as_dense=True``, all-reduced densified and made sparse again before the
    update (so ``torch.optim.SparseAdam`` works). On a rank outside ``process_set``
    the optimizer steps on its local gradients, reducing nothing (as Horovod's).
    ``op=Adasum`` (on more than one rank) steps each rank on its own gradients and combines the
    steps' deltas with Adasum (``adasum_optimizer``), as Horovod's; its learning rate is not
    scaled by the number of ranks.
    """
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"DistributedOptimizer wraps a torch.optim.Optimizer, got {type(optimizer).__name__}")
    if isinstance(optimizer, (_DistributedOptimizer, DistributedAdasumOptimizer)):
        raise ValueError("this optimizer is already a DistributedOptimizer; wrap the plain optimizer once")
    op = check_gradient_op(op, gradient_predivide_factor, adasum=True)
    _check_passes(backward_passes_per_step)
    if op == Adasum and size() > 1:  # one rank: Horovod's plain optimizer, with op=Adasum (an identity)
        return _adasum_optimizer(optimizer, named_parameters, compression, backward_passes_per_step, process_set)
    wrapped = _wrapped_copy(optimizer, _DistributedOptimizer, _CLASSES)
    if not isinstance(process_set, ProcessSet):
        raise TypeError(f"process_set must be an mtrain ProcessSet, got {type(process_set).__name__}")
    wrapped._mtrain_setup(named_parameters, compression, backward_passes_per_step, op,
                          gradient_predivide_factor, sparse_as_dense, process_set)
    return wrapped


_ADASUM_CLASSES: Dict[type, type] = {}


def _wrapped_copy(optimizer: torch.optim.Optimizer, mixin: type, classes: Dict[type, type]) -> Any:
    """``optimizer``'s state in an instance of its class with ``mixin`` in front (one such class
    per optimizer class, kept in ``classes``), as Horovod's wrappers subclass the optimizer's."""
    base = type(optimizer)
    cls = classes.get(base)
    if cls is None:
        cls = type(base.__name__, (mixin, base), {"__module__": base.__module__})
        classes[base] = cls
    wrapped = cls.__new__(cls)
    wrapped.__dict__.update(optimizer.__dict__)
    # An LR scheduler built on the original patches an instance-level ``step`` that would
    # bypass the averaging; schedulers must be built on the wrapped optimizer (as with Horovod).
    wrapped.__dict__.pop("step", None)
    return wrapped


def _adasum_optimizer(optimizer: torch.optim.Optimizer, named_parameters: Any, compression: type,
                      backward_passes_per_step: int, process_set: ProcessSet) -> torch.optim.Optimizer:
    """``optimizer`` combining its steps' deltas with Adasum (``adasum_optimizer``), as Horovod's
    DistributedOptimizer does for op=Adasum on more than one rank."""
    if process_set.process_set_id != 0:
        raise NotImplementedError("Adasum does not support non-global process sets yet. Use op=Average on this "
                                  "process set, or Adasum on the global one")
    wrapped = _wrapped_copy(optimizer, DistributedAdasumOptimizer, _ADASUM_CLASSES)
    params = [p for group in wrapped.param_groups for p in group["params"]]
    wrapped.mtrain_adasum_setup(_parameter_names(named_parameters, params), compression, backward_passes_per_step)
    return wrapped
