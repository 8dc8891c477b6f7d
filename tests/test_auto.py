"""Every `auto` decided by measurement, with its reason recorded: precision from the machine probe
(figures fed in, never this host's speed), shapes.mode from a timed trial on the model itself."""

from __future__ import annotations

import time

import pytest
import torch
from torch import nn

import slipstream
from slipstream import Session
from slipstream.presets import get_preset
from slipstream.recipe import PrecisionConfig, Recipe, RuntimeConfig, ShapesConfig


def _recipe(**shapes) -> Recipe:
    return Recipe(
        shapes=ShapesConfig(**shapes) if shapes else ShapesConfig(),
        precision=PrecisionConfig(dtype="auto"),
        runtime=RuntimeConfig(device="cpu"),
    )


def test_auto_precision_is_fp32_where_bf16_is_slow_and_says_why(machine_like):
    machine_like(bf16=0.0133)  # AVX2-only: 0.8 vs 60 GFLOP/s
    session = Session(_recipe())
    assert session.precision == "fp32"
    why = session.decisions["precision.dtype"]
    assert why["choice"] == "fp32" and "GFLOP/s" in why["reason"] and "not used" in why["reason"]
    assert session.metrics().extra["decisions"]["precision.dtype"]["choice"] == "fp32"


def test_auto_precision_is_bf16_where_it_measured_faster(machine_like):
    machine_like(bf16=4.0)
    session = Session(_recipe())
    assert session.precision == "bf16" and "used by auto" in session.decisions["precision.dtype"]["reason"]


def test_fast_path_presets_take_the_probe_not_a_hard_coded_dtype(machine_like):
    assert get_preset("full").precision.dtype == "auto"
    auto = get_preset("auto")
    assert (auto.shapes.mode, auto.precision.dtype, auto.kernels.ops) == ("auto", "auto", "auto")
    machine_like(bf16=0.5)
    assert Session(get_preset("full").override("runtime.device=cpu")).precision == "fp32"


def test_peers_take_the_probes_verdict(machine_like):
    from slipstream.bench.peers import DIYPeer
    from slipstream.workloads import get_workload

    data = get_workload("gpt-stdlib").load_data()
    ref = get_preset("baseline").override("shapes.max_len=128", "shapes.tokens_per_batch=256")
    machine_like(bf16=0.0133)
    peer = DIYPeer("gpt-stdlib", "tiny", data, ref, 1)
    assert peer.precision == "fp32" and "not used" in peer.info()["precision_reason"]
    machine_like(bf16=4.0)
    assert DIYPeer("gpt-stdlib", "tiny", data, ref, 1).precision == "bf16"


# ----------------------------------------------------------------------------- shapes.mode=auto


class SlowWhenPacked(nn.Module):
    """A model whose document-masked path costs `pack_ms` extra per call (or the unmasked one does)."""

    def __init__(self, pack_ms: float = 0.0, bucket_ms: float = 0.0):
        super().__init__()
        self.emb = nn.Embedding(64, 8)
        self.pack_s, self.bucket_s = pack_ms / 1e3, bucket_ms / 1e3

    def forward(self, input_ids, labels, position_ids=None, document_ids=None):
        time.sleep(self.pack_s if document_ids is not None else self.bucket_s)
        logits = self.emb(input_ids) @ self.emb.weight.T
        return nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)


def _docs(n: int = 60) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [
        torch.randint(1, 64, (int(torch.randint(3, 60, (1,), generator=g)),), generator=g).tolist()
        for _ in range(n)
    ]


@pytest.mark.parametrize("pack_ms,bucket_ms,expected", [(40, 0, "bucket"), (0, 40, "pack")])
def test_auto_shape_mode_is_timed_on_the_model(pack_ms, bucket_ms, expected, machine_like, monkeypatch):
    machine_like(bf16=0.5)
    session = Session(_recipe(mode="auto", max_len=64, tokens_per_batch=256, buckets=2))
    model = session.prepare_model(SlowWhenPacked(pack_ms, bucket_ms))
    loader = session.prepare_loader(_docs())
    assert loader.policy.name == expected
    why = session.decisions["shapes.mode"]["reason"]
    assert why.startswith("measured on this model") and "real tok/s" in why
    # decided once: a second loader reuses the decision instead of timing again
    from slipstream import trial

    calls = []
    monkeypatch.setattr(trial, "time_loaders", lambda *a, **k: calls.append(a))
    assert session.prepare_loader(_docs(), tokens_per_batch=128).policy.name == expected
    assert calls == [] and model is session.model


def test_the_trial_leaves_gradients_and_rng_untouched(machine_like):
    machine_like(bf16=0.5)
    session = Session(_recipe(mode="auto", max_len=64, tokens_per_batch=256, buckets=2))
    model = session.prepare_model(SlowWhenPacked())
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    session.prepare_loader(_docs())
    assert torch.equal(torch.rand(3), expected)
    assert all(p.grad is None for p in model.parameters())


def test_auto_shape_mode_without_document_ids_is_bucket_with_the_reason(machine_like):
    machine_like(bf16=0.5)

    class Plain(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(2, 2)

        def forward(self, input_ids, labels):
            return self.lin.weight.sum()

    session = Session(_recipe(mode="auto", max_len=64, tokens_per_batch=256))
    session.prepare_model(Plain())
    assert session.prepare_loader(_docs()).policy.name == "bucket"
    assert "takes no document_ids" in session.decisions["shapes.mode"]["reason"]


def test_auto_recipe_trains_end_to_end_and_reports_its_decisions(machine_like):
    machine_like(bf16=0.0133)
    result = slipstream.train(
        "gpt-stdlib",
        "auto+shapes.max_len=128+shapes.tokens_per_batch=512",
        3,
        size="tiny",
        eval_every=0,
        progress=False,
    )
    decisions = result.metrics.extra["decisions"]
    assert decisions["precision.dtype"]["choice"] == "fp32"
    assert decisions["shapes.mode"]["choice"] in ("bucket", "pack")
    assert "kernels.ops" in decisions and len(result.loss) == 3


def test_a_resumed_run_keeps_its_auto_decisions(tmp_path, machine_like, monkeypatch):
    from slipstream import trial

    machine_like(bf16=4.0)
    spec = "auto+shapes.max_len=128+shapes.tokens_per_batch=512"
    first = slipstream.train(
        "gpt-stdlib", spec, 2, size="tiny", eval_every=0, progress=False,
        checkpoint_dir=tmp_path, checkpoint_every=2,
    )  # fmt: skip
    chosen = first.metrics.extra["decisions"]
    # the machine now measures otherwise, and a new trial would fail: the resumed run must not ask
    machine_like(bf16=0.01)
    monkeypatch.setattr(trial, "time_loaders", lambda *a, **k: pytest.fail("timed again on resume"))
    resumed = slipstream.train(
        "gpt-stdlib", spec, 3, size="tiny", eval_every=0, progress=False,
        checkpoint_dir=tmp_path, checkpoint_every=2, resume=True,
    )  # fmt: skip
    again = resumed.metrics.extra["decisions"]
    assert again["precision.dtype"]["choice"] == chosen["precision.dtype"]["choice"] == "bf16"
    assert again["precision.dtype"]["reason"].startswith("kept from the resumed run")
    assert again["shapes.mode"] == chosen["shapes.mode"]


def test_optimizer_impl_auto_is_timed_on_copies_and_leaves_the_model_alone(machine_like):
    machine_like(bf16=0.5)
    session = Session(Recipe(runtime=RuntimeConfig(device="cpu")))
    model = session.prepare_model(nn.Sequential(nn.Linear(16, 32), nn.Linear(32, 4)))
    before = [p.detach().clone() for p in model.parameters()]
    optimizer = session.build_optimizer(model)
    why = session.decisions["optimizer.impl"]
    assert why["choice"] in ("fused", "for-loop", "foreach") and " ms" in why["reason"]
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert all(p.grad is None for p in model.parameters())
    fused = optimizer.defaults.get("fused") or False
    assert fused == (why["choice"] == "fused")
    assert session.metrics().extra["optimizer_impl"] == why["choice"]


def test_the_fastest_optimizer_impl_wins_and_a_slow_one_is_not_repeated(monkeypatch):
    from slipstream import trial

    calls: dict[str, int] = {}
    cost = {"fused": 0.01, "for-loop": 0.2, "foreach": 0.02}

    class Fake:
        def __init__(self, impl):
            self.impl = impl

        def step(self):
            calls[self.impl] = calls.get(self.impl, 0) + 1
            time.sleep(cost[self.impl])

    params = [torch.zeros(3, requires_grad=True)]
    out = trial.time_optimizer_impls(params, lambda copies, impl: Fake(impl), steps=3)
    assert min(out, key=out.get) == "fused"
    assert calls == {"fused": 4, "for-loop": 1, "foreach": 4}  # for-loop: warm-up alone was 20x slower
    assert params[0].grad is None
