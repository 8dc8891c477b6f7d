"""apply_kernels swaps modules on one instance, keeps parameters, and says what it did."""

from __future__ import annotations

import copy
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from slipstream.kernels import KERNEL_OPS, KernelChooser, apply_kernels, injected_timer, resolve_backend
from slipstream.kernels import nn as knn


class LossHead(nn.Module):
    """Stands in for the built-in GPT's head: the contract is the marker and the call signature."""

    slipstream_kernel = "linear_cross_entropy"

    def forward(self, hidden, weight, labels, reduction="mean"):
        return F.cross_entropy(hidden @ weight.t(), labels, ignore_index=-100, reduction=reduction)


class Gate(nn.Module):
    slipstream_kernel = "swiglu"

    def forward(self, gate, up):
        return F.silu(gate) * up


class Block(nn.Module):
    def __init__(self, d, shared_norm):
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.rms = nn.RMSNorm(d, eps=1e-6)
        self.shared = shared_norm  # the same module object in every block
        self.up = nn.Linear(d, 4 * d)
        self.act = nn.GELU(approximate="tanh")
        self.exact = nn.GELU()  # approximate='none': not ours to swap
        self.gate = Gate()
        self.down = nn.Linear(2 * d, d)

    def forward(self, x):
        h = self.act(self.up(self.ln(x))) + self.exact(x).repeat(1, 1, 4)
        g, u = h.chunk(2, dim=-1)
        return self.shared(x + self.down(self.gate(g, u)) + self.rms(x))


class TinyLM(nn.Module):
    def __init__(self, vocab=41, d=16):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        shared = nn.LayerNorm(d)
        self.blocks = nn.ModuleList([Block(d, shared) for _ in range(2)])
        self.loss_head = LossHead()
        self.ce = nn.CrossEntropyLoss()

    def forward(self, ids, labels):
        x = self.emb(ids)
        for b in self.blocks:
            x = b(x)
        return self.loss_head(x.reshape(-1, x.shape[-1]), self.emb.weight, labels.reshape(-1))


def batch():
    ids = torch.randint(0, 41, (2, 7))
    labels = torch.randint(0, 41, (2, 7))
    labels[0, :3] = -100
    return ids, labels


def loss_and_grads(model, ids, labels):
    model.zero_grad(set_to_none=True)
    loss = model(ids, labels)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def test_auto_swaps_only_the_ops_whose_timed_candidate_won():
    # layer_norm's only CPU candidate is the model's own module; the chunked loss head is faster here
    timer = injected_timer(
        {
            "linear_cross_entropy": {"keep": 2.0e-3, "torch": 1.0e-3},
            "layer_norm": {"keep": 1.0e-3},
            "rms_norm": {"keep": 1.0e-3},
            "gelu_tanh": {"keep": 1.0e-3},
            "swiglu": {"keep": 1.0e-3},
            "cross_entropy": {"keep": 1.0e-3},
        }
    )
    model = TinyLM()
    report = apply_kernels(model, "auto", "cpu", chooser=KernelChooser(timer=timer))
    assert report.swapped == {"linear_cross_entropy": 1}
    assert report.backends == {"linear_cross_entropy": "torch"}
    assert isinstance(model.loss_head, knn.LinearCrossEntropy) and model.loss_head.backend == "torch"
    assert type(model.blocks[0].ln) is nn.LayerNorm  # nothing beat torch's own module
    assert "kept the model's own module" in report.skipped["layer_norm"]
    assert set(report.timings) == set(KERNEL_OPS)  # TinyLM holds a module for every op


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_named_ops_swap_everything_and_keep_parameters(backend):
    model = TinyLM()
    ids, labels = batch()
    before_params = {n: p for n, p in model.named_parameters()}
    before_keys = list(model.state_dict())
    expect_loss, expect_grads = loss_and_grads(copy.deepcopy(model), ids, labels)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)  # built before the swap

    report = apply_kernels(model, list(KERNEL_OPS), "cpu", backend=backend)

    assert report.backend == backend
    # 2 blocks: own LayerNorm each + one shared LayerNorm counted once
    assert report.swapped == {
        "linear_cross_entropy": 1,
        "cross_entropy": 1,
        "rms_norm": 2,
        "layer_norm": 3,
        "swiglu": 2,
        "gelu_tanh": 2,
    }
    assert report.skipped == {}
    assert type(model.blocks[0].exact) is nn.GELU
    assert model.blocks[0].shared is model.blocks[1].shared  # sharing preserved
    assert isinstance(model.blocks[0].ln, nn.LayerNorm)  # still a LayerNorm to isinstance checks
    assert {n: p for n, p in model.named_parameters()} == before_params  # the same Parameter objects
    assert list(model.state_dict()) == before_keys

    loss, grads = loss_and_grads(model, ids, labels)
    torch.testing.assert_close(loss, expect_loss)
    for name, g in expect_grads.items():
        torch.testing.assert_close(grads[name], g, msg=f"gradient of {name}")
    w = model.blocks[0].ln.weight.detach().clone()
    opt.step()
    assert not torch.equal(model.blocks[0].ln.weight, w)  # the old optimizer still drives the params


def test_off_unknown_and_idempotent():
    model = TinyLM()
    assert apply_kernels(model, "off", "cpu").swapped == {}
    assert type(model.loss_head) is LossHead
    with pytest.raises(ValueError, match="valid are .*layer_norm"):
        apply_kernels(model, ["layer_norm", "flash_softmax"], "cpu")
    apply_kernels(model, ["layer_norm"], "cpu")
    again = apply_kernels(model, ["layer_norm"], "cpu")
    assert again.swapped == {} and "no nn.LayerNorm" in again.skipped["layer_norm"]


def test_marked_module_with_parameters_is_left_alone():
    class HeadWithBias(LossHead):
        def __init__(self):
            super().__init__()
            self.bias = nn.Parameter(torch.zeros(3))

    model = nn.Sequential(HeadWithBias())
    report = apply_kernels(model, ["linear_cross_entropy"], "cpu")
    assert report.swapped == {} and "without parameters" in report.skipped["linear_cross_entropy"]


def test_forcing_triton_on_cpu_without_interpreter_is_a_clear_error(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(RuntimeError, match="needs a CUDA device.*TRITON_INTERPRET=1"):
        resolve_backend("triton", "cpu")
    with pytest.raises(RuntimeError, match="needs a CUDA device"):
        apply_kernels(TinyLM(), ["layer_norm"], "cpu", backend="triton")
    assert resolve_backend("auto", "cpu") == "torch"
    with pytest.raises(ValueError, match="backend must be one of"):
        resolve_backend("cuda", "cpu")


def test_import_does_not_import_triton():
    """TRITON_INTERPRET is read when kernels are built, so importing must not build (or import) them."""
    code = "import sys, slipstream.kernels; assert 'triton' not in sys.modules, 'triton imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_works_without_triton_installed():
    """Triton is an optional extra: the CPU path runs without it and forcing it says how to install it."""
    code = "\n".join(
        [
            "import sys; sys.modules['triton'] = None",  # as if `slipstream[kernels]` were not installed
            "import torch, slipstream.kernels as K",
            "x = torch.randn(8, 4, requires_grad=True); w = torch.randn(10, 4); t = torch.randint(0, 10, (8,))",
            "K.fused_linear_cross_entropy(x, w, t).backward(); assert x.grad is not None",
            "try: K.rms_norm(x, None, backend='triton')",
            "except RuntimeError as e: assert 'pip install' in str(e), e",
            "else: raise SystemExit('forcing triton without triton did not fail')",
        ]
    )
    subprocess.run([sys.executable, "-c", code], check=True)
