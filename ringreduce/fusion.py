"""Fusion planning: which ready all-reduces share a ring, and how each ring holds them.

Pure functions over sizes and keys (no arrays, no MPI); ``engine.py`` copies
tensors into the fusion buffer and runs the rings these plans describe.

* All-reduces are fused only with others of the same key (dtype, op, scaling,
  backend): one ring reduces one dtype with one op.
* Within a group, tensors smaller than ``min(threshold, inplace_min)`` are
  packed, in order, into fusion buffers of at most ``threshold`` bytes.
  Larger ones are reduced in their own memory: copying them in and out would
  cost more than the per-ring overhead fusing saves.
* Every fusion buffer but the last gets its own ring; the last one and the
  large tensors share one ring (``ring.Layout``: one logical buffer).
* A last fusion buffer holding a single tensor is not worth a copy: that
  tensor joins the large ones.
* ``threshold == 0`` turns fusion off: one ring per tensor.
"""
from __future__ import annotations

import dataclasses
from typing import Hashable, Sequence


@dataclasses.dataclass(frozen=True)
class RingPlan:
    """One ring: ``packed`` (indices) copied into the fusion buffer in this order, then
    ``in_place`` reduced in their own memory."""

    packed: "tuple[int, ...]"
    in_place: "tuple[int, ...]"
    packed_bytes: int = 0


def group_by_key(keys: Sequence[Hashable]) -> "list[list[int]]":
    """Indices with equal keys, one list per key in order of first appearance."""
    groups: "dict[Hashable, list[int]]" = {}
    for index, key in enumerate(keys):
        groups.setdefault(key, []).append(index)
    return list(groups.values())


def plan_rings(nbytes: Sequence[int], threshold: int, inplace_min: int) -> "list[RingPlan]":
    """The rings for one group of fusable all-reduces of ``nbytes[i]`` bytes each."""
    if threshold == 0:
        return [RingPlan((), (index,)) for index in range(len(nbytes))]
    alone = min(threshold, inplace_min)
    large = [index for index, size in enumerate(nbytes) if size >= alone]
    batches: "list[list[int]]" = [[]]
    batch_bytes = [0]
    for index, size in enumerate(nbytes):
        if size >= alone:
            continue
        if batches[-1] and batch_bytes[-1] + size > threshold:
            batches.append([])
            batch_bytes.append(0)
        batches[-1].append(index)
        batch_bytes[-1] += size
    if len(batches[-1]) == 1:
        large.append(batches.pop()[0])
        batch_bytes.pop()
    plans = [RingPlan(tuple(batch), (), size) for batch, size in zip(batches, batch_bytes) if batch]
    if large:
        last = plans.pop() if plans else RingPlan((), ())
        plans.append(RingPlan(last.packed, tuple(large), last.packed_bytes))
    return plans


def plan_batch(keys: Sequence[Hashable], nbytes: Sequence[int], threshold: int,
               inplace_min: int) -> "list[RingPlan]":
    """Every ring for one batch of all-reduces: grouped by key (``group_by_key``), each group
    planned by ``plan_rings``; the indices in the plans are positions in ``keys``/``nbytes``.

    The engine computes this once per distinct batch (same keys and sizes in the same order)
    and reuses it for every later step that brings the same batch."""
    plans: "list[RingPlan]" = []
    for group in group_by_key(keys):
        for plan in plan_rings([nbytes[i] for i in group], threshold, inplace_min):
            plans.append(RingPlan(tuple(group[i] for i in plan.packed), tuple(group[i] for i in plan.in_place),
                                  plan.packed_bytes))
    return plans
