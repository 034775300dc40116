"""PyTorch elastic state and sampler (``hvd.elastic`` in ``mtrain.torch``, Horovod's names), on
the framework-free ``mtrain.elastic`` (as Horovod's ``horovod/torch/elastic`` is on
``horovod.common.elastic``).

    state = hvd.elastic.TorchState(model=model, optimizer=optimizer, sampler=sampler, epoch=0, batch=0)

Keyword arguments that are a ``torch.nn.Module``, an optimizer, an LR scheduler or an
``ElasticSampler`` are kept through their ``state_dict()``; the rest are plain attributes.
"""
from __future__ import annotations

import copy
import math
import random
from typing import Any, Iterable, Iterator

import torch

import mtrain.ringreduce as rr

from mtrain.elastic import HorovodInternalError, HostsUpdatedInterrupt, ObjectState, State, run

from .functions import broadcast_optimizer_state, broadcast_parameters

__all__ = ["ElasticSampler", "HorovodInternalError", "HostsUpdatedInterrupt", "ObjectState", "State",
           "TorchState", "run"]


class ElasticSampler(torch.utils.data.Sampler):
    """Partitions a dataset's not yet processed indices among the current ranks.

    Like ``DistributedSampler``, with a record of what was processed this epoch: after a
    reset (a new generation) only the rest of the epoch is partitioned among the new ranks.

    1. pass it to ``TorchState(..., sampler=sampler)``;
    2. call ``record_batch(batch_idx, batch_size)`` (or ``record_indices``) after a batch;
    3. call ``set_epoch(epoch)`` at the *end* of each epoch (it clears the record).

    ``seed`` must be the same on every rank; the order is shuffled by ``seed + epoch``.
    """

    def __init__(self, dataset: Any, shuffle: bool = True, seed: int = 0) -> None:
        self.dataset = dataset
        self.shuffle = shuffle
        self.seed = seed
        self.epoch = 0
        self.processed_indices: "set[int]" = set()
        self.num_replicas = 1
        self.rank = 0
        self.remaining_indices: "list[int]" = []
        self.indices: "list[int]" = []
        self.num_samples = 0
        self.total_size = 0
        self.reset()

    def set_epoch(self, epoch: int) -> None:
        """Start epoch `epoch` (a new order when shuffling) with nothing processed yet."""
        self.epoch = epoch
        self.processed_indices = set()
        self.reset()

    def get_indices(self, batch_idx: int, batch_size: int) -> "list[int]":
        """The indices this rank's batch `batch_idx` holds (batches of `batch_size` over this rank's share)."""
        start = batch_idx * batch_size
        return self.indices[start:min(start + batch_size, len(self.indices))]

    def record_batch(self, batch_idx: int, batch_size: int) -> None:
        """Record this rank's batch `batch_idx` as processed."""
        self.record_indices(self.get_indices(batch_idx, batch_size))

    def record_indices(self, indices: Iterable[int]) -> None:
        """Record dataset indices as processed (the state's commit gathers every rank's)."""
        self.processed_indices.update(int(index) for index in indices)

    def state_dict(self) -> "dict[str, Any]":
        return {"epoch": self.epoch, "processed_indices": set(self.processed_indices)}

    def load_state_dict(self, state_dict: "dict[str, Any]") -> None:
        self.epoch = state_dict["epoch"]
        self.processed_indices = set(state_dict["processed_indices"])
        self.reset()

    def reset(self) -> None:
        """Partition the epoch's unprocessed indices among the ranks there are now."""
        self.num_replicas = rr.size() if rr.is_initialized() else 1
        self.rank = rr.rank() if rr.is_initialized() else 0
        order = list(range(len(self.dataset)))
        if self.shuffle:
            random.Random(self.seed + self.epoch).shuffle(order)  # the same order on every rank
        self.remaining_indices = [index for index in order if index not in self.processed_indices]
        self.num_samples = math.ceil(len(self.remaining_indices) / self.num_replicas)
        self.total_size = self.num_samples * self.num_replicas
        # Pad with the first remaining indices so every rank gets as many (as DistributedSampler).
        padded = list(self.remaining_indices)
        while padded and len(padded) < self.total_size:
            padded += padded[:self.total_size - len(padded)]
        self.indices = padded[self.rank:self.total_size:self.num_replicas]

    def __iter__(self) -> Iterator[int]:
        return iter(list(self.indices))

    def __len__(self) -> int:
        return self.num_samples


class _Handler:
    """Keeps one framework object through its ``state_dict()``."""

    def __init__(self, value: Any) -> None:
        self.value = value
        self.saved = copy.deepcopy(value.state_dict())

    def save(self) -> None:
        self.saved = copy.deepcopy(self.value.state_dict())

    def restore(self) -> None:
        self.value.load_state_dict(copy.deepcopy(self.saved))

    def sync(self) -> None:
        self.value.load_state_dict(rr.broadcast_object(self.value.state_dict(), root_rank=0))

    def set_value(self, value: Any) -> None:
        self.value = value
        self.save()


class _ModelHandler(_Handler):
    def sync(self) -> None:
        broadcast_parameters(self.value.state_dict(), root_rank=0)


class _OptimizerHandler(_Handler):
    def sync(self) -> None:
        broadcast_optimizer_state(self.value, root_rank=0)


class _SamplerHandler(_Handler):
    def save(self) -> None:
        # Each rank recorded its own indices: the commit keeps all of them.  Collective.
        self.gather_processed()
        super().save()

    def gather_processed(self) -> None:
        everyone = rr.allgather_object(self.value.processed_indices, name="mtrain.elastic.sampler")
        self.value.processed_indices = set().union(*everyone)


def _handler_for(value: Any) -> "_Handler | None":
    if isinstance(value, torch.nn.Module):
        return _ModelHandler(value)
    if isinstance(value, torch.optim.Optimizer):
        return _OptimizerHandler(value)
    if isinstance(value, ElasticSampler):
        return _SamplerHandler(value)
    if isinstance(value, torch.optim.lr_scheduler.LRScheduler):
        return _Handler(value)
    return None


class TorchState(ObjectState):
    """A PyTorch training state: models, optimizers, schedulers, samplers and plain attributes."""

    def __init__(self, model: "torch.nn.Module | None" = None, optimizer: "torch.optim.Optimizer | None" = None,
                 **kwargs: Any) -> None:
        kwargs.update(model=model, optimizer=optimizer)
        handlers, plain = {}, {}
        for name, value in kwargs.items():
            handler = _handler_for(value)
            if handler is None:
                plain[name] = value
            else:
                handlers[name] = handler
        object.__setattr__(self, "_handlers", handlers)
        for name, handler in handlers.items():
            object.__setattr__(self, name, handler.value)
        super().__init__(**plain)

    def __setattr__(self, name: str, value: Any) -> None:
        handlers = self.__dict__.get("_handlers", {})
        if name in handlers:
            handlers[name].set_value(value)  # a new model/optimizer/sampler: keep it from now on
        super().__setattr__(name, value)

    def save(self) -> None:
        for handler in self._handlers.values():
            handler.save()
        super().save()

    def restore(self) -> None:
        for handler in self._handlers.values():
            handler.restore()
        super().restore()

    def sync(self) -> None:
        for handler in self._handlers.values():
            handler.sync()
        super().sync()

    def committed_values(self) -> Any:
        values = super().committed_values()
        values["handlers"] = {name: handler.saved for name, handler in self._handlers.items()}
        return values

    def load_committed(self, values: Any) -> None:
        for name, saved in values.get("handlers", {}).items():
            if name in self._handlers:
                self._handlers[name].saved = saved
        super().load_committed(values)  # restores every handler too
