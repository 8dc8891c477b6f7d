"""Schedules: the curves torch's own schedulers draw, exact state restore, clear errors."""

import math

import pytest
import torch

from slipstream.recipe import OptimizerConfig, Recipe, RecipeError
from slipstream.schedules import build_scheduler, lr_curve


def _opt(lr=1e-3):
    return torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=lr)


def _run(sched, opt, steps):
    lrs = []
    for _ in range(steps):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return lrs


@pytest.mark.parametrize("warmup", [0, 7])
def test_cosine_matches_cosine_annealing_after_warmup(warmup):
    T, lr, r = 60, 2e-3, 0.1
    cfg = OptimizerConfig(lr=lr, warmup_steps=warmup, schedule="cosine", final_lr_ratio=r)
    ours = lr_curve(cfg, T)
    opt = _opt(lr)
    ref = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=T - 1 - warmup, eta_min=r * lr)
    expected = [lr * (i + 1) / warmup for i in range(warmup)] + _run(ref, opt, T - warmup)
    assert ours == pytest.approx(expected, rel=1e-9)
    assert ours[-1] == pytest.approx(r * lr)


def test_linear_matches_linear_lr():
    T, lr, r, w = 40, 1e-2, 0.0, 5
    cfg = OptimizerConfig(lr=lr, warmup_steps=w, schedule="linear", final_lr_ratio=r)
    opt = _opt(lr)
    ref = torch.optim.lr_scheduler.LinearLR(opt, start_factor=1.0, end_factor=r, total_iters=T - 1 - w)
    expected = [lr * (i + 1) / w for i in range(w)] + _run(ref, opt, T - w)
    assert lr_curve(cfg, T) == pytest.approx(expected, rel=1e-9, abs=1e-15)


@pytest.mark.parametrize("warmup", [0, 12])
def test_one_cycle_matches_torch_one_cycle(warmup):
    T, lr, r = 50, 3e-3, 0.02
    cfg = OptimizerConfig(lr=lr, warmup_steps=warmup, schedule="one-cycle", final_lr_ratio=r)
    w = warmup or round(0.3 * T)
    opt = _opt(lr)
    ref = torch.optim.lr_scheduler.OneCycleLR(
        opt,
        max_lr=lr,
        total_steps=T,
        pct_start=w / T,
        anneal_strategy="cos",
        cycle_momentum=False,
        div_factor=25.0,
        final_div_factor=1 / (25 * r),
    )
    assert lr_curve(cfg, T) == pytest.approx(_run(ref, opt, T), rel=1e-9)


def test_constant_with_warmup_is_the_old_session_ramp_then_flat():
    cfg = OptimizerConfig(lr=1.0, warmup_steps=4)
    assert lr_curve(cfg, 8) == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0, 1.0, 1.0]
    # constant needs no run length
    opt = _opt(1.0)
    assert _run(build_scheduler(opt, cfg), opt, 6)[-1] == 1.0


def test_scheduler_state_restores_mid_run():
    cfg = OptimizerConfig(lr=1e-3, warmup_steps=3, schedule="cosine")
    opt_a = _opt(1e-3)
    a = build_scheduler(opt_a, cfg, 30)
    _run(a, opt_a, 11)
    state_opt, state_sched = opt_a.state_dict(), a.state_dict()
    rest_a = _run(a, opt_a, 19)
    opt_b = _opt(1e-3)
    b = build_scheduler(opt_b, cfg, 30)
    opt_b.load_state_dict(state_opt)
    b.load_state_dict(state_sched)
    assert _run(b, opt_b, 19) == rest_a


def test_past_the_end_the_lr_holds():
    cfg = OptimizerConfig(lr=1.0, schedule="cosine", final_lr_ratio=0.2)
    opt = _opt(1.0)
    lrs = _run(build_scheduler(opt, cfg, 10), opt, 15)
    assert lrs[9:] == pytest.approx([0.2] * 6)
    assert all(a >= b for a, b in zip(lrs, lrs[1:]))


def test_decaying_schedule_without_run_length_names_the_fix():
    with pytest.raises(RecipeError, match="total_steps"):
        build_scheduler(_opt(), OptimizerConfig(schedule="cosine"))
    with pytest.raises(RecipeError, match="warmup_steps"):
        build_scheduler(_opt(), OptimizerConfig(schedule="linear", warmup_steps=10), 10)


def test_recipe_fields_validate():
    assert Recipe().override("optimizer.schedule=one-cycle").optimizer.schedule == "one-cycle"
    with pytest.raises(RecipeError, match="optimizer.schedule"):
        Recipe().override("optimizer.schedule=exp")
    with pytest.raises(RecipeError, match="optimizer.final_lr_ratio"):
        Recipe().override("optimizer.final_lr_ratio=1.5")
    assert math.isclose(Recipe().optimizer.final_lr_ratio, 0.1)
