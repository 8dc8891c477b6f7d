"""compile.mode=auto and precision.tf32: the decisions, fed figures (no GPU needed)."""

from __future__ import annotations

import pytest
import torch

from slipstream import CompileConfig, PrecisionConfig, Recipe, RecipeError, Session
from slipstream.compile_choice import COMPILE_GAIN, choose_compile, mode_to_try
from slipstream.decisions import decide_tf32
from slipstream.machine import MachineProbe


def test_a_launch_bound_step_tries_cuda_graphs_and_a_busy_one_default():
    assert mode_to_try(0.04) == "reduce-overhead"  # the 88M Llama at CPU-sized batches: GPU 96% idle
    assert mode_to_try(0.95) == "default"
    assert mode_to_try(None) == "default"  # not profiled


def test_compile_is_kept_only_when_it_wins():
    won = choose_compile(10e-3, 0.05, {"reduce-overhead": 4e-3})
    assert won.choice == "reduce-overhead"
    assert "launch-bound" in won.reason and "2.50x" in won.reason
    lost = choose_compile(10e-3, 0.9, {"default": 10e-3 / COMPILE_GAIN * 1.01})  # 0.56x-style loss too
    assert lost.choice == "off" and "kept eager" in lost.reason
    failed = choose_compile(10e-3, 0.5, {"reduce-overhead": "BackendCompilerFailed: boom"})
    assert failed.choice == "off" and "failed: BackendCompilerFailed" in failed.reason


def test_compile_auto_on_cpu_stays_eager_and_says_why():
    session = Session(Recipe(compile=CompileConfig(mode="auto")))
    model = session.prepare_model(torch.nn.Sequential(torch.nn.Embedding(10, 4), torch.nn.Linear(4, 10)))
    assert session.decisions["compile.mode"]["choice"] == "off"
    assert "optimize" in session.decisions["compile.mode"]["reason"]
    assert session.recipe.compile.mode == "off"  # resolved: what ran is what the recipe says
    assert not hasattr(model, "_orig_mod") and model._compiled_call_impl is None


def probe(device: str, flops: dict, notes: dict | None = None) -> MachineProbe:
    return MachineProbe(
        fingerprint={"cpu_model": "test", "cpu_capability": "x", "threads": 1, "torch": "x"},
        key="test",
        device=device,
        matmul_flops_per_s=flops,
        matmul_notes=notes or {},
        copy_bytes_per_s={},
    )


# The H200's probe: fp32 51 TFLOP/s with TF32 off; TF32 would be several times that.
H200 = probe("cuda", {"fp32": {"4096": 51e12}, "tf32": {"4096": 380e12}, "bf16": {"4096": 711e12}})
NO_GAIN = probe("cuda", {"fp32": {"4096": 51e12}, "tf32": {"4096": 52e12}})
OLD_CACHE = probe("cuda", {"fp32": {"4096": 51e12}})


def test_tf32_auto_turns_on_only_where_it_measured_faster_for_fp32_compute():
    assert decide_tf32("auto", "cuda", "fp32", H200).choice == "on"
    assert decide_tf32("auto", "cuda", "fp32", NO_GAIN).choice == "off"
    assert decide_tf32("auto", "cuda", "bf16", H200).choice == "off"  # matmuls are not fp32
    old = decide_tf32("auto", "cuda", "fp32", OLD_CACHE)
    assert old.choice == "off" and "--refresh" in old.reason
    assert decide_tf32("off", "cuda", "fp32", H200).choice == "off"


def test_tf32_on_a_cpu_is_off_under_auto_and_refused_when_asked_for():
    assert decide_tf32("auto", "cpu", "fp32").choice == "off"
    with pytest.raises(RecipeError, match="precision.tf32=on needs a CUDA device"):
        decide_tf32("on", "cpu", "fp32")
    with pytest.raises(RecipeError, match="precision.tf32=on"):
        Session(Recipe(precision=PrecisionConfig(tf32="on")))


def test_a_session_puts_the_tf32_switch_back(monkeypatch):
    from slipstream import decisions as dec

    monkeypatch.setattr(dec, "decide_tf32", lambda *a, **k: dec.Decision("precision.tf32", "on", "fed"))
    before = torch.backends.cuda.matmul.allow_tf32
    session = Session(Recipe(precision=PrecisionConfig(tf32="auto")))
    assert torch.backends.cuda.matmul.allow_tf32 is True
    assert session.decisions["precision.tf32"]["choice"] == "on"
    session.close()
    assert torch.backends.cuda.matmul.allow_tf32 is before
