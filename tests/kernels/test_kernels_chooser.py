"""kernels.ops=auto decides each op by timing: fed timings here, so every rule can be checked on CPU."""

from __future__ import annotations

import pytest
import torch
from test_kernels_swap import TinyLM
from torch import nn

from slipstream.kernels import KernelChooser, apply_kernels, injected_timer
from slipstream.kernels.chooser import KEEP, MIN_GAIN, OpWidths, candidates, choose_op, measure, model_widths

WIDTHS = OpWidths(rows=64, hidden=16, vocab=41, ffn=64, norm=16)


def test_a_slower_kernel_is_not_swapped():
    timer = injected_timer({"linear_cross_entropy": {"keep": 1.0e-3, "torch": 1.5e-3}})
    verdict = choose_op("linear_cross_entropy", WIDTHS, "cpu", timer=timer)
    assert verdict.choice == KEEP
    assert verdict.seconds == {"keep": 1.0e-3, "torch": 1.5e-3}
    assert "1.000 ms" in verdict.reason and "1.500 ms" in verdict.reason


def test_a_tie_keeps_the_models_own_module():
    just_under = 1.0e-3 / MIN_GAIN * 1.001
    timer = injected_timer({"linear_cross_entropy": {"keep": 1.0e-3, "torch": just_under}})
    assert choose_op("linear_cross_entropy", WIDTHS, "cpu", timer=timer).choice == KEEP
    timer = injected_timer({"linear_cross_entropy": {"keep": 1.0e-3, "torch": 0.5e-3}})
    assert choose_op("linear_cross_entropy", WIDTHS, "cpu", timer=timer).choice == "torch"


def test_the_fastest_of_several_winners_is_taken(monkeypatch):
    # On CUDA the candidates are ours, Liger's, inductor's; the decision is pure arithmetic on timings.
    monkeypatch.setattr(
        "slipstream.kernels.chooser.candidates",
        lambda op, device, compiled: (["triton", "liger", "compile"], {}),
    )
    table = {"rms_norm": {"keep": 4.0, "triton": 3.0, "liger": 2.0, "compile": 2.5}}
    verdict = choose_op("rms_norm", WIDTHS, "cpu", timer=injected_timer(table))
    assert verdict.choice == "liger"


def test_a_candidate_that_fails_is_not_installed_and_says_why():
    def timer(op, candidate, run, device):
        if candidate == "torch":
            raise RuntimeError("out of memory")
        return 1.0

    verdict = choose_op("linear_cross_entropy", WIDTHS, "cpu", timer=timer)
    assert verdict.choice == KEEP
    assert "out of memory" in verdict.not_timed["torch"]


def test_cpu_candidates_are_only_what_differs_from_torch():
    timed, skipped = candidates("layer_norm", torch.device("cpu"), compiled_model=False)
    assert timed == []  # our CPU path for a norm is torch's own op: nothing to time against it
    assert "CUDA" in skipped["triton"] and "CUDA" in skipped["liger"] and "CPU" in skipped["compile"]
    timed, _ = candidates("linear_cross_entropy", torch.device("cpu"), compiled_model=False)
    assert timed == ["torch"]  # the chunked path never builds the logits
    _, skipped = candidates("gelu_tanh", torch.device("cpu"), compiled_model=True)
    assert "no such op" in skipped["liger"] and "compiled" in skipped["compile"]


def test_the_real_timer_runs_forward_and_backward_on_every_input():
    calls = []
    inputs = [torch.randn(8, 4, requires_grad=True)]

    def run():
        calls.append(1)
        inputs[0].grad = None
        (inputs[0] * 2).sum().backward()

    seconds = measure("gelu_tanh", "keep", run, torch.device("cpu"), reps=3, budget_s=10.0)
    assert seconds > 0 and len(calls) == 5  # 2 warm-up + 3 timed
    # and the chooser's own runner really produces gradients through the candidate
    verdict = choose_op("linear_cross_entropy", WIDTHS, "cpu", timer=_grad_checking_timer)
    assert set(verdict.seconds) == {"keep", "torch"}


def _grad_checking_timer(op, candidate, run, device):
    run()
    return 1.0


def test_widths_come_from_the_model():
    w = model_widths(TinyLM(vocab=41, d=16), rows=512)
    assert (w.rows, w.vocab, w.hidden, w.norm) == (512, 41, 16, 16)
    assert w.ffn == 64  # the widest Linear that is not the head


def test_resumed_choices_are_installed_without_timing():
    def timer(*args):
        raise AssertionError("a resumed run must not time again")

    model = TinyLM()
    chooser = KernelChooser(timer=timer, fixed={"linear_cross_entropy": "torch"})
    report = apply_kernels(model, "auto", "cpu", chooser=chooser)
    assert report.backends == {"linear_cross_entropy": "torch"}
    assert type(model.blocks[0].ln) is nn.LayerNorm


@pytest.mark.parametrize("compiled", [False, True])
def test_the_session_records_each_ops_verdict(compiled):
    from slipstream import CompileConfig, KernelsConfig, Recipe, Session, ShapesConfig

    recipe = Recipe(
        kernels=KernelsConfig(ops="auto"),
        shapes=ShapesConfig(tokens_per_batch=256, max_len=32),
        compile=CompileConfig(mode="default" if compiled else "off"),
    )
    session = Session(recipe)
    chooser = session._kernel_chooser()
    assert (chooser.rows, chooser.dtype, chooser.compiled_model) == (256, torch.float32, compiled)
    if compiled:
        return  # compiling is not what this test is about
    session.prepare_model(TinyLM())
    d = session.decisions
    assert "fwd+bwd at 256x16 @ 41x16 float32" in d["kernels.linear_cross_entropy"]["reason"]
    assert d["kernels.layer_norm"]["choice"] == KEEP
    assert d["kernels.ops"]["choice"] in ("none", "linear_cross_entropy=torch")


def test_the_chooser_times_at_a_searched_size_already_adopted():
    """bench adopts its reference's searched tokens per batch before the model is prepared: the
    kernels are then timed at that size, not at the recipe's default."""
    from slipstream import KernelsConfig, Recipe, Session
    from slipstream.bench.reference_batch import adopt
    from slipstream.decisions import Decision

    session = Session(Recipe(kernels=KernelsConfig(ops="auto")))
    assert session._kernel_chooser().rows == 8192
    adopt(session, Decision("shapes.tokens_per_batch", "65536", "the knee"))
    assert session._kernel_chooser().rows == 65536
