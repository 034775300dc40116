"""Fusion planning (ringreduce/engine/fusion.py): pure functions, no MPI."""
import random

import pytest

from mtrain.ringreduce.engine.fusion import RingPlan, group_by_key, plan_batch, plan_rings


def test_group_by_key_keeps_first_appearance_order():
    keys = [("f4", "sum"), ("f8", "sum"), ("f4", "sum"), ("f4", "max"), ("f8", "sum"), ("f4", "max")]
    assert group_by_key(keys) == [[0, 2], [1, 4], [3, 5]]
    assert group_by_key([]) == []


def test_fusion_off_gives_one_ring_per_tensor_in_order():
    assert plan_rings([5, 0, 7_000_000], threshold=0, inplace_min=100) == [
        RingPlan((), (0,)), RingPlan((), (1,)), RingPlan((), (2,))]


def test_small_tensors_share_one_fusion_buffer():
    assert plan_rings([4, 12, 0, 36], threshold=1000, inplace_min=500) == [RingPlan((0, 1, 2, 3), (), 52)]


def test_a_new_buffer_starts_when_the_next_tensor_would_overflow():
    # 40+50 fits 100; +20 would not; 20+30+50 fills the second exactly; 7 starts a third,
    # which shares its ring with nothing large.
    plans = plan_rings([40, 50, 20, 30, 50, 7, 1], threshold=100, inplace_min=100)
    assert plans == [RingPlan((0, 1), (), 90), RingPlan((2, 3, 4), (), 100), RingPlan((5, 6), (), 8)]


def test_large_tensors_are_reduced_in_place_in_the_last_buffers_ring():
    plans = plan_rings([10, 600, 20, 30, 2000, 40, 5], threshold=60, inplace_min=500)
    assert plans == [RingPlan((0, 2, 3), (), 60), RingPlan((5, 6), (1, 4), 45)]


def test_a_lone_tensor_in_the_last_buffer_joins_the_large_ones():
    # 40 alone in the last buffer is not worth a copy; the ring before it takes the large ones.
    plans = plan_rings([10, 600, 20, 30, 2000, 40], threshold=60, inplace_min=500)
    assert plans == [RingPlan((0, 2, 3), (1, 4, 5), 60)]


def test_inplace_limit_above_the_threshold_falls_back_to_the_threshold():
    # inplace_min 10_000 but threshold 64: a 64-byte tensor could never share a buffer anyway.
    assert plan_rings([8, 64, 8], threshold=64, inplace_min=10_000) == [RingPlan((0, 2), (1,), 16)]


def test_only_large_tensors_make_one_in_place_ring():
    assert plan_rings([900, 800], threshold=100, inplace_min=500) == [RingPlan((), (0, 1), 0)]
    assert plan_rings([], threshold=100, inplace_min=500) == []


@pytest.mark.parametrize("seed", range(20))
def test_every_tensor_is_reduced_exactly_once_within_the_limits(seed):
    rng = random.Random(seed)
    sizes = [rng.choice([0, 1, 3, 17, 255, 1024, 4097, 70_000]) for _ in range(rng.randint(0, 60))]
    threshold, inplace_min = rng.choice([(4096, 2048), (8192, 1 << 20), (100, 50), (1 << 20, 4096)])
    plans = plan_rings(sizes, threshold, inplace_min)
    seen = [i for plan in plans for i in plan.packed + plan.in_place]
    assert sorted(seen) == list(range(len(sizes))), "a tensor is missing or reduced twice"
    alone = min(threshold, inplace_min)
    for k, plan in enumerate(plans):
        assert plan.packed_bytes == sum(sizes[i] for i in plan.packed) <= threshold
        assert list(plan.packed) == sorted(plan.packed), "packing must keep submission order"
        assert all(sizes[i] < alone for i in plan.packed)
        assert len(plan.packed) != 1 or k < len(plans) - 1, "a lone tensor was copied for nothing"
        if k < len(plans) - 1:
            assert not plan.in_place, "only the last ring reduces tensors in place"
    # Small tensors are packed, except a lone one in the last buffer.
    packed = {i for plan in plans for i in plan.packed}
    small_in_place = [i for i in plans[-1].in_place if sizes[i] < alone] if plans else []
    assert len(small_in_place) <= 1
    assert packed | set(small_in_place) == {i for i, n in enumerate(sizes) if n < alone}


def test_plan_batch_groups_by_key_and_maps_indices_back_to_the_batch():
    keys = ["f32", "f64", "f32", "f64", "f32", "i8"]
    nbytes = [40, 8, 40, 2000, 4000, 3]
    plans = plan_batch(keys, nbytes, threshold=100, inplace_min=1000)
    # f32: 0 and 2 packed, 4 alone in the same ring; f64: 1 is a lone packed tensor, so it
    # joins the large 3; i8: a single small tensor, reduced in place.
    assert plans == [RingPlan((0, 2), (4,), 80), RingPlan((), (3, 1), 0), RingPlan((), (5,), 0)]
    assert plan_batch([], [], threshold=100, inplace_min=1000) == []
    assert plan_batch(["a", "a"], [5, 6], threshold=0, inplace_min=1000) == [RingPlan((), (0,)), RingPlan((), (1,))]
