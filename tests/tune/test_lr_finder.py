"""Range test: stops on divergence, suggests a learning rate below it, restores everything."""

import math

import pytest
import torch

from slipstream.recipe import RecipeError
from slipstream.tune.lr_finder import lr_find, lr_find_workload, plot_lr_find, range_test


def _regression(seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(256, 8, generator=g)
    y = x @ torch.randn(8, 1, generator=g) + 0.1 * torch.randn(256, 1, generator=g)
    model = torch.nn.Linear(8, 1, bias=False)
    batches = [(x[i : i + 32], y[i : i + 32]) for i in range(0, 256, 32)]
    return model, batches, x, y


def _mse(model, batch):
    xb, yb = batch
    return torch.nn.functional.mse_loss(model(xb), yb)


def test_sgd_sweep_diverges_and_suggests_below_the_stability_limit():
    torch.manual_seed(0)
    model, _, x, y = _regression()
    batches = [(x[:128], y[:128]), (x[128:], y[128:])]  # large batches: a clean curve
    # Plain gradient descent on this quadratic diverges above lr = 2 / L (L = top Hessian eigenvalue).
    L = float(torch.linalg.eigvalsh(2 * x.T @ x / len(x)).max())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    res = lr_find(model, opt, batches, loss_fn=_mse, start_lr=1e-4, end_lr=100.0, num_steps=120)
    assert res.stop_reason in ("diverged", "non-finite loss")
    assert res.lrs[-1] < 100.0  # stopped early
    assert res.lrs[-1] > 2 / L / 3  # not before the loss could blow up
    assert res.rule == "steepest" and res.suggested_lr == res.steepest_lr
    assert 2 / L / 100 < res.suggested_lr < 2 / L


def test_model_optimizer_and_rng_are_restored():
    torch.manual_seed(1)
    model, batches, _, _ = _regression(1)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
    _mse(model, batches[0]).backward()
    opt.step()  # give the optimizer some state to restore
    before = {k: v.clone() for k, v in model.state_dict().items()}
    state = {k: v.clone() for k, v in opt.state[model.weight].items() if torch.is_tensor(v)}
    rng = torch.get_rng_state()
    lr_find(model, opt, batches, loss_fn=_mse, start_lr=1e-5, end_lr=1.0, num_steps=30)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert all(torch.equal(state[k], opt.state[model.weight][k]) for k in state)
    assert opt.param_groups[0]["lr"] == 3e-4
    assert torch.equal(rng, torch.get_rng_state())


def test_flat_loss_falls_back_to_minimum_over_ten(tmp_path):
    res = range_test(lambda lr: 1.0 + 0.0 * lr, start_lr=1e-5, end_lr=1e-1, num_steps=20)
    assert res.rule == "minimum / 10" and res.steepest_lr is None
    assert res.suggested_lr == pytest.approx(res.min_loss_lr / 10)
    out = plot_lr_find(res, tmp_path / "lr.png")
    assert out.stat().st_size > 1000


def test_bad_range_and_nan_start_are_clear_errors():
    with pytest.raises(RecipeError, match="start_lr < end_lr"):
        range_test(lambda lr: 1.0, start_lr=1.0, end_lr=0.1)
    with pytest.raises(RecipeError, match="not finite"):
        range_test(lambda lr: math.nan, start_lr=1e-5, end_lr=1.0, num_steps=10)


def test_workload_range_test_runs_on_gpt_tiny():
    res = lr_find_workload(
        "gpt-stdlib",
        "baseline+shapes.max_len=64+shapes.tokens_per_batch=256",
        size="tiny",
        start_lr=1e-5,
        end_lr=10.0,
        num_steps=20,
    )
    assert res.stop_reason == "diverged" or len(res.lrs) == 40
    assert min(res.smoothed) < res.smoothed[0]  # learning happened somewhere in the sweep
    assert 1e-5 <= res.suggested_lr <= 10.0
