from itertools import combinations

import numpy as np
import pytest

from slipstream.serve.batching import ShapePlan, partition, plan_shapes


def test_plan_covers_max_len_and_caps_long_rows_by_token_budget():
    rng = np.random.default_rng(0)
    plan = plan_shapes(
        rng.integers(2, 3000, 500), max_len=1024, n_lengths=4, max_batch_size=16, max_batch_tokens=4096
    )
    assert plan.lengths[-1] == 1024 and len(plan.lengths) <= 4
    assert list(plan.lengths) == sorted(plan.lengths)
    assert plan.batch_sizes[1024] == (1, 2, 4)  # 4096 tokens / 1024
    for L, sizes in plan.batch_sizes.items():
        assert max(sizes) * L <= 4096 or max(sizes) == 1
        assert max(sizes) <= 16
    assert plan.length_for(1) == plan.lengths[0] and plan.length_for(1024) == 1024
    with pytest.raises(ValueError):
        plan.length_for(1025)


def _brute(lengths, plan):
    """Every split of the length-sorted requests into contiguous runs (small n only)."""
    n, best = len(lengths), float("inf")
    s = sorted(lengths)
    for k in range(n):
        for cuts in combinations(range(1, n), k):
            bounds, cost = [0, *cuts, n], 0.0
            for i, j in zip(bounds, bounds[1:]):
                L = plan.length_for(s[j - 1])
                b = plan.batch_for(j - i, L)
                cost += float("inf") if b is None else plan.predict(b, L)
            best = min(best, cost)
    return best


@pytest.mark.parametrize("seed", range(6))
def test_partition_is_optimal_under_the_measured_costs(seed):
    rng = np.random.default_rng(seed)
    plan = ShapePlan(lengths=(16, 32, 64), batch_sizes={16: (1, 2, 4), 32: (1, 2, 4), 64: (1, 2)})
    for b, L in plan.shapes:  # an affine cost per shape with a fixed overhead, as measured on CPUs
        plan.latency_s[(b, L)] = 0.002 + 1e-5 * b * L * rng.uniform(0.5, 1.5)
    lengths = rng.integers(1, 65, rng.integers(1, 8)).tolist()
    groups = partition(lengths, plan)
    assert sorted(i for g, _, _ in groups for i in g) == list(range(len(lengths)))
    for idx, b, L in groups:
        assert len(idx) <= b and all(lengths[i] <= L for i in idx)
    assert sum(plan.predict(b, L) for _, b, L in groups) == pytest.approx(_brute(lengths, plan))


def test_partition_keeps_long_rows_from_padding_short_ones():
    plan = ShapePlan(lengths=(16, 256), batch_sizes={16: (1, 2, 4, 8), 256: (1, 2, 4, 8)})
    for b, L in plan.shapes:
        plan.latency_s[(b, L)] = 0.001 + 1e-5 * b * L
    groups = partition([10, 12, 9, 250, 11], plan)
    shapes = sorted((b, L) for _, b, L in groups)
    assert shapes == [(1, 256), (4, 16)]


def test_every_batch_size_plans_each_size_up_to_the_token_cap():
    plan = plan_shapes(
        [10, 50, 120],
        max_len=1024,
        n_lengths=2,
        max_batch_size=6,
        max_batch_tokens=4096,
        every_batch_size=True,
    )
    assert plan.batch_sizes[1024] == (1, 2, 3, 4)  # 4096 tokens / 1024
    assert all(plan.batch_sizes[L] == tuple(range(1, len(plan.batch_sizes[L]) + 1)) for L in plan.lengths)


def test_engine_plans_every_batch_size_only_where_rows_cost_linearly(tiny):
    from slipstream.serve.engine import EngineConfig, ScoreEngine

    cfg = dict(max_batch_size=4, n_lengths=2)
    static_cpu = ScoreEngine(tiny, EngineConfig(static_shapes="on", **cfg))
    eager_cpu = ScoreEngine(tiny, EngineConfig(static_shapes="off", **cfg))
    assert 3 in static_cpu.plan.batch_sizes[static_cpu.plan.lengths[0]]  # no padded rows on CPU
    assert 3 not in eager_cpu.plan.batch_sizes[eager_cpu.plan.lengths[0]]  # shapes only price batches
