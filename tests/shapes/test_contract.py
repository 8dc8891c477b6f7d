"""One contract every registered shape policy meets."""

import numpy as np
import pytest

from slipstream.recipe import ShapesConfig
from slipstream.shapes import SHAPE_POLICIES, ShapedLoader


@pytest.fixture(scope="module")
def data():
    rng = np.random.default_rng(2)
    return [rng.integers(0, 250, n) for n in rng.integers(2, 70, 300)]


@pytest.mark.parametrize("mode", sorted(SHAPE_POLICIES))
def test_policy_contract(data, mode):
    cfg = ShapesConfig(mode=mode, max_len=64, tokens_per_batch=256, buckets=3)
    loader = ShapedLoader(data, cfg, seed=0)
    plans = loader.plans()
    seen = []
    for p in plans:
        B, T = p.shape
        assert B * T <= cfg.tokens_per_batch and T <= cfg.max_len
        for row in p.rows:
            assert sum(len(s) for s in row) <= T
            seen += [s.item for s in row]
    assert sorted(seen) == list(range(len(loader.item_seq)))  # every item exactly once per epoch
    assert ShapedLoader(data, cfg, seed=0).plans() == plans  # deterministic in (seed, epoch)
    assert 0.0 <= loader.padding_waste() < 1.0
