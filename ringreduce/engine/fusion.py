"""Fusion: which ready all-reduces share a ring, how each ring holds them, and the buffers.

``plan_rings`` and ``plan_batch`` are pure functions over sizes and keys (no
arrays, no MPI). ``Plan`` is a batch's plan made from its requests, ``Ring``
one ring of it with its views of the fusion buffer (packing and unpacking),
``PlanCache`` keeps plans of batches seen before, and ``FusionBuffers`` the
engine's reusable fusion buffer per kind of memory. The engine runs the rings.

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

import collections
import dataclasses
import itertools
import operator
from typing import Any, Hashable, Sequence

import numpy as np

from mtrain.ringreduce.core.ops import Kind


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


# Distinct batches whose plan (rings, fusion-buffer views) an engine keeps.
PLAN_CACHE_SIZE = 64

_ARRAY = operator.attrgetter("array")
_IN_PLACE = operator.attrgetter("in_place")
_consume = collections.deque(maxlen=0).extend  # runs an iterator to its end, keeping nothing


class Ring:
    """One ring of a plan: the batch positions it packs into the fusion buffer and those it
    reduces in their own memory, and views of the fusion buffer for each packed op (cut
    once per buffer, so a repeated step packs and unpacks without slicing)."""

    __slots__ = ("packed", "alone", "packs_all", "packed_bytes", "dtype", "pieces", "buffer", "fused", "views")

    def __init__(self, packed: "list[int]", alone: "list[int]", packed_bytes: int, dtype: np.dtype,
                 pieces: "list[tuple[tuple, int]]", batch_size: int) -> None:
        self.packed, self.alone, self.packed_bytes, self.dtype = packed, alone, packed_bytes, dtype
        self.packs_all = packed == list(range(batch_size))  # every op of the batch, in order
        self.pieces = pieces  # (shape, element count) of each packed op, in order
        self.buffer: Any = None
        self.fused: Any = None
        self.views: "list[Any]" = []

    def bind(self, buffer: Any) -> None:
        """Cut this ring's views out of ``buffer`` (a byte array at least packed_bytes long)."""
        fused = buffer[:self.packed_bytes].view(self.dtype)
        views = []
        offset = 0
        for shape, size in self.pieces:
            views.append(fused[offset:offset + size].reshape(shape))
            offset += size
        self.buffer, self.fused, self.views = buffer, fused, views

    def pack(self, batch: "list[Any]", backend: Any, host: bool, buffer: Any) -> "list[Any]":
        """Copy the packed ops' arrays into ``buffer`` (through this ring's views); returns them."""
        if self.buffer is not buffer:
            self.bind(buffer)
        arrays = list(map(_ARRAY, batch))
        if host:  # one call packs every tensor, whatever its shape or strides
            np.concatenate(arrays, axis=None, out=self.fused)
        else:
            for array, view in zip(arrays, self.views):
                backend.copy(view, array)
        return arrays

    def unpack(self, batch: "list[Any]", arrays: "list[Any]", backend: Any, host: bool) -> "list[Any]":
        """The packed ops' results: in-place ops get the reduced values in their own arrays,
        the others a copy of their part of the buffer."""
        views = self.views
        if host and all(map(_IN_PLACE, batch)):
            # ``array[...] = view`` for every op, in one C-level loop: np.copyto's copy at half
            # its call cost (same dtype and shape: the view was cut to the op's own).
            _consume(map(operator.setitem, arrays, itertools.repeat(Ellipsis), views))
            return arrays
        results = []
        for request, array, view in zip(batch, arrays, views):
            if not request.in_place:
                results.append(view.copy())
            elif host:
                array[...] = view
                results.append(array)
            else:
                backend.copy(array, view)
                results.append(array)
        return results


class Plan:
    """How the engine runs one batch of ready ops: the non-all-reduces one by one, then the
    rings ``plan_batch`` plans for the all-reduces. Depends only on the ops' agreed
    signatures (kind, dtype, shape, op, scaling, backend) and the fusion settings."""

    __slots__ = ("signatures", "threshold", "inplace_min", "one_by_one", "rings")

    def __init__(self, ready: "list[Any]", signatures: "list[Any]", threshold: int, inplace_min: int) -> None:
        self.signatures, self.threshold, self.inplace_min = signatures, threshold, inplace_min
        allreduces = [i for i, r in enumerate(ready) if r.kind is Kind.ALLREDUCE]
        self.one_by_one = [i for i, r in enumerate(ready) if r.kind is not Kind.ALLREDUCE]
        # One ring reduces one dtype with one op and one scaling, in one kind of memory.
        keys = [(r.array.dtype, r.op, r.prescale, r.postscale, r.backend.name)
                for r in (ready[i] for i in allreduces)]
        self.rings: "list[Ring]" = []
        for ring in plan_batch(keys, [ready[i].nbytes for i in allreduces], threshold, inplace_min):
            packed = [allreduces[j] for j in ring.packed]
            alone = [allreduces[j] for j in ring.in_place]
            dtype = ready[(packed or alone)[0]].array.dtype
            pieces = [(tuple(ready[i].array.shape), ready[i].array.size) for i in packed]
            self.rings.append(Ring(packed, alone, ring.packed_bytes, dtype, pieces, len(ready)))

    def fits(self, threshold: int, inplace_min: int) -> bool:
        """Planned with these fusion settings."""
        return self.threshold == threshold and self.inplace_min == inplace_min


class PlanCache:
    """Plans of batches seen before, by the identities of their ops' signatures, so a repeated
    step plans nothing. Every rank plans the same batch identically: a plan depends only on
    the agreed signatures, in the agreed order, and the fusion settings."""

    def __init__(self) -> None:
        self._plans: "dict[tuple, Plan]" = {}
        self.built = self.reused = 0

    def plan(self, ready: "list[Any]", threshold: int, inplace_min: int) -> Plan:
        signatures = [r.signature for r in ready]
        # The fusion settings are part of the key: a job that switches between settings (a
        # benchmark, a sweep) keeps one plan per setting instead of replanning at each switch.
        key = (threshold, inplace_min, *map(id, signatures))
        plan = self._plans.get(key)
        # Identical signatures are the same objects (``requests.intern``), so this comparison
        # is one identity check per op; a reused id fails it and replans.
        if plan is None or plan.signatures != signatures or not plan.fits(threshold, inplace_min):
            plan = Plan(ready, signatures, threshold, inplace_min)
            if key not in self._plans and len(self._plans) >= PLAN_CACHE_SIZE:
                del self._plans[next(iter(self._plans))]  # the oldest
            self._plans[key] = plan
            self.built += 1
        else:
            self.reused += 1
        return plan

    def keep(self, plan: "Plan | None", ready: "list[Any]", threshold: int, inplace_min: int) -> Plan:
        """A plan kept with the batch itself (a steady batch's): reused while it fits the fusion
        settings, else planned again (``plan``)."""
        if plan is None or not plan.fits(threshold, inplace_min):
            return self.plan(ready, threshold, inplace_min)
        self.reused += 1
        return plan


class FusionBuffers:
    """One reusable fusion buffer per backend (host memory for host arrays, device memory for
    device arrays; never fused together: a ring's key includes the backend), grown to the
    threshold once, then reused every step."""

    def __init__(self) -> None:
        self._buffers: "dict[Any, Any]" = {}

    def get(self, backend: Any, nbytes: int, threshold: int) -> Any:
        buffer = self._buffers.get(backend)
        if buffer is None or buffer.nbytes < nbytes:
            buffer = backend.empty(max(nbytes, threshold, 1), np.dtype(np.uint8))
            self._buffers[backend] = buffer
        return buffer
