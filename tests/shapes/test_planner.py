import time

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from slipstream.recipe import RecipeError
from slipstream.shapes.planner import brute_force_padding, plan_buckets


@settings(max_examples=200, deadline=None)
@given(
    # a third of the examples hold max_len itself, so rounding past the row length is exercised
    lengths=st.lists(st.integers(1, 64), min_size=1, max_size=40).map(
        lambda xs: xs + [64] * (len(xs) % 3 == 0)
    ),
    k=st.integers(1, 6),
    multiple_of=st.sampled_from([1, 2, 3, 8]),
)
def test_planner_equals_brute_force(lengths, k, multiple_of):
    lengths = np.array(lengths)
    plan = plan_buckets(lengths, k, max_len=64, multiple_of=multiple_of)
    assert plan.padded_tokens == brute_force_padding(lengths, k, multiple_of, max_len=64)
    assert len(plan.edges) <= k and list(plan.edges) == sorted(set(plan.edges))
    assert all(e % multiple_of == 0 or e == 64 for e in plan.edges)
    assert sum(plan.counts) == len(lengths)
    # the reported padding is what assigning every item to its bucket really costs
    edges = np.array(plan.edges)
    assert int((edges[plan.assign(lengths)] - lengths).sum()) == plan.padded_tokens


def test_expected_waste_and_counts():
    lengths = np.array([10] * 5 + [20] * 5 + [100])
    plan = plan_buckets(lengths, 2, max_len=128, multiple_of=1)
    assert plan.edges == (20, 100) and plan.counts == (10, 1)
    assert plan.padded_tokens == 50 and plan.real_tokens == 250
    assert plan.expected_waste == pytest.approx(50 / 300)


def test_k_larger_than_distinct_lengths_gives_one_bucket_each():
    plan = plan_buckets(np.array([5, 5, 9, 9, 17]), 10, max_len=32, multiple_of=1)
    assert plan.edges == (5, 9, 17) and plan.padded_tokens == 0


def test_rounding_is_capped_at_max_len():
    plan = plan_buckets(np.array([3, 30]), 2, max_len=30, multiple_of=8)
    assert plan.edges == (8, 30)  # 30 would round to 32, beyond a 30-token row


def test_auto_trades_padding_against_shape_cost():
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 1024, 10_000)
    free_shapes = plan_buckets(lengths, "auto", max_len=1024, shape_cost_tokens=0)
    assert free_shapes.k == 32  # shapes cost nothing: take every bucket allowed
    costly = plan_buckets(lengths, "auto", max_len=1024, shape_cost_tokens=10**9)
    assert costly.k == 1
    mid = plan_buckets(lengths, "auto", max_len=1024, shape_cost_tokens=100_000)
    assert 1 < mid.k < 32
    # the chosen k minimises padding + k * cost among the alternatives
    cost = lambda p: p.padded_tokens + p.k * 100_000  # noqa: E731
    assert all(cost(mid) <= cost(plan_buckets(lengths, k, max_len=1024)) for k in (1, 2, 4, 8, 16, 32))


def test_million_lengths_under_a_second():
    rng = np.random.default_rng(0)
    lengths = rng.lognormal(6, 1.2, 1_000_000).astype(np.int64).clip(1, 32768)
    plan_buckets(lengths[:1000], 8, max_len=32768, multiple_of=1)  # warm numpy paths
    t0 = time.perf_counter()
    plan = plan_buckets(lengths, 8, max_len=32768, multiple_of=1)
    assert time.perf_counter() - t0 < 1.0
    assert plan.k == 8 and sum(plan.counts) == 1_000_000


def test_bad_input():
    with pytest.raises(RecipeError, match="empty dataset"):
        plan_buckets(np.array([], dtype=np.int64), 4, max_len=16)
    with pytest.raises(RecipeError, match="lengths >= 1"):
        plan_buckets(np.array([0, 3]), 4, max_len=16)
    with pytest.raises(RecipeError, match="exceeds shapes.max_len=16"):
        plan_buckets(np.array([3, 17]), 4, max_len=16)
    with pytest.raises(RecipeError, match="shapes.buckets=0"):
        plan_buckets(np.array([3]), 0, max_len=16)
