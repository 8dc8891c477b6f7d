"""Precision policy, fp16 loss scaling with overflow accounting, and the parity guard."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from slipstream import precision
from slipstream.precision import DEFAULT_PARITY_TOLERANCE, LossScaler, parity, resolve_precision
from slipstream.recipe import OptimizerConfig, PrecisionConfig, Recipe, RecipeError, RuntimeConfig
from slipstream.session import Session

CPU = torch.device("cpu")


class TinyRegressor(nn.Module):
    """forward(**batch) -> mean loss, like every slipstream workload."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(16, 32)
        self.fc2 = nn.Linear(32, 1)
        self.seen_dtypes: list[torch.dtype] = []

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.fc1(x)
        self.seen_dtypes.append(h.dtype)
        out = self.fc2(torch.tanh(h)).float().squeeze(-1)
        return ((out - y) ** 2).mean()


def _batches(n: int, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(16, generator=g)
    out = []
    for _ in range(n):
        x = torch.randn(32, 16, generator=g)
        out.append({"x": x, "y": torch.sin(x @ w)})
    return out


def _train(recipe: Recipe, steps: int = 40, lr_scale: float = 1.0) -> list[float]:
    session = Session(recipe)
    model = session.prepare_model(TinyRegressor())
    opt = session.prepare_optimizer(torch.optim.SGD(model.parameters(), lr=0.05 * lr_scale))
    losses = []
    for batch in _batches(steps):
        with session.autocast():
            loss = model(**batch)
        session.backward(loss)
        session.step(opt)
        losses.append(float(loss.detach()))
    return losses


def _recipe(dtype: str, **optimizer) -> Recipe:
    return Recipe(
        precision=PrecisionConfig(dtype=dtype),
        runtime=RuntimeConfig(device="cpu", seed=0),
        optimizer=OptimizerConfig(**optimizer) if optimizer else OptimizerConfig(),
    )


# ----------------------------------------------------------------------------- policy


def test_auto_picks_bf16_where_it_measured_faster_and_records_the_choice(machine_like):
    machine_like(bf16=4.0)  # an AMX CPU's figures; tests/test_auto.py covers the AVX2 ones
    session = Session(_recipe("auto"))
    assert session.precision == "bf16"
    assert session.metrics().extra["precision_auto_choice"] == "bf16"
    model = session.prepare_model(TinyRegressor())
    with session.autocast():
        model(**_batches(1)[0])
    assert model.seen_dtypes == [torch.bfloat16]


def test_fp16_on_a_cpu_without_fp16_matmuls_names_the_field_and_the_fix(monkeypatch):
    monkeypatch.setattr(precision, "cpu_supports_fp16", lambda: False)
    with pytest.raises(RecipeError, match=r"precision.dtype=fp16.*use precision.dtype=bf16"):
        resolve_precision(PrecisionConfig(dtype="fp16"), CPU)


def test_fp8_needs_cuda_and_compute_capability_8_9(monkeypatch):
    with pytest.raises(RecipeError, match=r"fp8 needs a CUDA GPU of compute capability >= 8.9"):
        resolve_precision(PrecisionConfig(dtype="fp8"), CPU)
    monkeypatch.setattr(precision, "cuda_capability", lambda device: (8, 0))
    with pytest.raises(RecipeError, match=r"compute capability >= 8.9 \(this GPU has 8.0\)"):
        resolve_precision(PrecisionConfig(dtype="fp8"), torch.device("cuda"))


def test_fp8_without_torchao_says_how_to_install(monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_torchao(name, *args, **kwargs):
        if name.startswith("torchao"):
            raise ImportError("No module named 'torchao'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_torchao)
    with pytest.raises(RecipeError, match="pip install torchao"):
        precision.apply_fp8(TinyRegressor())


# ----------------------------------------------------------------------------- fp16 + loss scaling


def test_injected_overflow_skips_exactly_that_step_and_backs_the_scale_off(monkeypatch):
    # torch 2.13 runs fp16 autocast and GradScaler("cpu") on CPU; pretend this CPU has fp16 matmuls
    # so the test exercises the real fp16 path on any machine.
    monkeypatch.setattr(precision, "cpu_supports_fp16", lambda: True)
    session = Session(_recipe("fp16"))
    model = session.prepare_model(TinyRegressor())
    opt = session.prepare_optimizer(torch.optim.SGD(model.parameters(), lr=0.05))
    inject_at = 3
    stepped, scales, losses = [], [], []
    batch = _batches(1)[0]  # one batch repeated: the loss must fall whenever a step is taken
    for i in range(1, 9):
        with session.autocast():
            loss = model(**batch)
        session.backward(loss)
        before = [p.detach().clone() for p in model.parameters()]
        if i == inject_at:
            model.fc1.weight.grad[0, 0] = math.inf  # an overflow in one gradient element
        scale_before = session.scaler.loss_scale
        stepped.append(session.step(opt))
        scales.append((scale_before, session.scaler.loss_scale))
        losses.append(float(loss.detach()))
        unchanged = all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
        assert unchanged == (i == inject_at), f"step {i}: parameters {'un' if unchanged else ''}changed"
    assert model.seen_dtypes[0] == torch.float16
    assert stepped == [i != inject_at for i in range(1, 9)]
    assert scales[inject_at - 1] == (65536.0, 32768.0)
    assert all(a == b for a, b in scales[inject_at:])  # no further back-off: training continued cleanly
    assert all(math.isfinite(x) for x in losses)
    assert losses[-1] < losses[0]
    m = session.metrics()
    assert m.skipped_steps == 1
    assert m.extra["loss_scale"] == 32768.0


def test_fp16_unscales_before_clipping(monkeypatch):
    """Clipping must see the true gradient norm: a scaled norm (x65536) would shrink the update."""
    monkeypatch.setattr(precision, "cpu_supports_fp16", lambda: True)

    def first_update(dtype: str) -> torch.Tensor:
        session = Session(_recipe(dtype, grad_clip=1e3))
        model = session.prepare_model(TinyRegressor())
        opt = session.prepare_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
        before = model.fc2.weight.detach().clone()
        with session.autocast():
            loss = model(**_batches(1)[0])
        session.backward(loss)
        session.step(opt)
        return model.fc2.weight.detach() - before

    fp16, fp32 = first_update("fp16"), first_update("fp32")
    torch.testing.assert_close(fp16, fp32, rtol=2e-2, atol=1e-4)


def test_loss_scaler_state_round_trips():
    scaler = LossScaler(
        CPU, PrecisionConfig(dtype="fp16", loss_scale_init=1024.0, loss_scale_growth_interval=5)
    )
    scaler.skipped_steps = 3
    other = LossScaler(CPU, PrecisionConfig(dtype="fp16"))
    other.load_state_dict(scaler.state_dict())
    assert other.loss_scale == 1024.0 and other.skipped_steps == 3
    assert other.scaler.get_growth_interval() == 5


# ----------------------------------------------------------------------------- parity guard


def test_parity_of_identical_curves_passes_with_zero_gap():
    curve = [3.0 - 0.01 * i for i in range(100)]
    result = parity(curve, curve)
    assert result.passed and result.gap == 0.0 and result.tolerance == DEFAULT_PARITY_TOLERANCE


def test_parity_measures_the_relative_gap_of_the_final_window():
    ref = [2.0] * 50
    result = parity([2.1] * 50, ref, tolerance=0.04)
    assert not result.passed
    assert result.gap == pytest.approx(0.05)
    assert "outside tolerance" in result.reason
    assert parity([2.02] * 50, ref, tolerance=0.04).passed


def test_parity_tolerance_is_the_seed_noise_band_when_re_runs_are_given():
    ref = [2.0] * 30
    seeds = [[2.04] * 30, [1.98] * 30]  # re-seeded references land 3% apart
    result = parity([2.05] * 30, ref, noise_curves=seeds)
    assert result.tolerance == pytest.approx(0.06 / 2.00666, rel=1e-3) and result.passed
    assert not parity([2.1] * 30, ref, noise_curves=seeds).passed
    # re-runs that land together leave the floor, not zero
    assert parity([2.0005] * 30, ref, noise_curves=[ref]).passed
    assert not parity([2.01] * 30, ref, noise_curves=[ref]).passed


def test_parity_fails_a_curve_with_nan_and_names_the_step():
    result = parity([1.0, 1.0, math.nan, 1.0], [1.0] * 4)
    assert not result.passed and math.isinf(result.gap)
    assert "step 3" in result.reason


def test_parity_rejects_bad_input():
    with pytest.raises(ValueError, match="non-empty"):
        parity([], [1.0])
    with pytest.raises(ValueError, match="tolerance"):
        parity([1.0], [1.0], tolerance=0)
    with pytest.raises(ValueError, match="reference"):
        parity([1.0], [math.inf])


def test_parity_passes_bf16_and_fails_a_run_that_learns_differently():
    reference = _train(_recipe("fp32"))
    assert parity(_train(_recipe("bf16")), reference).passed
    diverged = parity(_train(_recipe("fp32"), lr_scale=0.1), reference)
    assert not diverged.passed, diverged.reason
