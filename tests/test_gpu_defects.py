"""The GPU defects of issue 16, each checked on CPU: torch.cuda's functions are faked where the
logic under test only decides *whether and how* to call them. docs/gpu.md lists them."""

from __future__ import annotations

import copy
import os

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from slipstream.kernels import fused_linear_cross_entropy
from slipstream.metrics import MetricsTracker
from slipstream.precision import apply_fp8
from slipstream.runtime import seed_everything

# ----------------------------------------------------------------------------- step times wait for the device


def test_step_time_synchronises_cuda_and_not_cpu(monkeypatch):
    synced: list[torch.device] = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: synced.append(device))
    cuda = MetricsTracker(torch.device("cuda"), "bf16")
    cuda.on_batch(object(), 0.0)
    cuda.end_step()
    assert synced == [torch.device("cuda")] and len(cuda.records) == 1
    cpu = MetricsTracker(torch.device("cpu"), "fp32")
    cpu.on_batch(object(), 0.0)
    cpu.end_step()
    assert synced == [torch.device("cuda")]  # no sync on CPU (nor a CUDA call at all)


# ----------------------------------------------------------------------------- deterministic cuBLAS


@pytest.fixture
def restore_determinism():
    before = torch.are_deterministic_algorithms_enabled(), torch.backends.cudnn.benchmark
    yield
    torch.use_deterministic_algorithms(before[0])
    torch.backends.cudnn.benchmark = before[1]


@pytest.mark.parametrize("cuda", [True, False])
def test_deterministic_sets_the_cublas_workspace_on_cuda_only(monkeypatch, restore_determinism, cuda):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    seed_everything(0, deterministic=True)
    assert os.environ.get("CUBLAS_WORKSPACE_CONFIG") == (":4096:8" if cuda else None)
    assert torch.are_deterministic_algorithms_enabled()


def test_deterministic_keeps_a_users_cublas_workspace(monkeypatch, restore_determinism):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":16:8")
    seed_everything(0, deterministic=True)
    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":16:8"
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG")
    seed_everything(0, deterministic=False)  # not asked for: nothing set
    assert "CUBLAS_WORKSPACE_CONFIG" not in os.environ


def test_a_deterministic_session_puts_the_process_back_when_closed(monkeypatch, restore_determinism):
    from slipstream import Recipe, Session

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    torch.use_deterministic_algorithms(False)
    with Session(Recipe().override("runtime.deterministic=true", 'runtime.device="cpu"')):
        assert torch.are_deterministic_algorithms_enabled()
        assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
    assert not torch.are_deterministic_algorithms_enabled()
    assert "CUBLAS_WORKSPACE_CONFIG" not in os.environ


# ----------------------------------------------------------------------------- fp8: batch x length not a multiple of 16


def test_fp8_pads_the_weight_gradients_inner_dim_to_16(monkeypatch):
    """3 x 5 = 15 tokens: the weight gradient's matmul contracts over them, and torch._scaled_mm
    needs a multiple of 16. torchao's emulation runs the same padding logic on CPU."""
    pytest.importorskip("torchao.float8")
    import torchao.float8.float8_ops as ops

    padded: list[tuple[tuple[int, ...], tuple[int, ...]]] = []
    pad = ops.pad_tensor_for_matmul

    def spy(t, dims):
        out = pad(t, dims)
        padded.append((tuple(t.shape), tuple(out.shape)))
        return out

    monkeypatch.setattr(ops, "pad_tensor_for_matmul", spy)
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    torch.manual_seed(0)
    fp8 = nn.Sequential(nn.Linear(32, 48), nn.GELU(), nn.Linear(48, 32))
    unpadded = copy.deepcopy(fp8)
    assert apply_fp8(fp8, emulate=True) == {"fp8_linears": 2}
    assert all(m.config.pad_inner_dim for m in fp8.modules() if type(m).__name__ == "Float8Linear")
    x = torch.randn(3, 5, 32)
    fp8(x).sum().backward()
    assert ((32, 15), (32, 16)) in padded and ((15, 48), (16, 48)) in padded  # grad_weight, layer 1
    # torchao's default leaves 15 as it is (fine in emulation, an error in torch._scaled_mm on a GPU);
    # the zero padding changes no gradient
    convert_to_float8_training(unpadded, config=Float8LinearConfig(emulate=True))
    unpadded(x).sum().backward()
    for a, b in zip(fp8.parameters(), unpadded.parameters()):
        torch.testing.assert_close(a.grad, b.grad)


# ----------------------------------------------------------------------------- the MFU peak on a GPU


def test_cuda_probe_measures_large_matmuls_and_mfu_takes_the_best(monkeypatch, tmp_path):
    from slipstream import machine
    from slipstream.bench.mfu import peak_flops_from_probe

    asked: list[tuple[str, tuple[int, ...]]] = []

    def matmul(device, dtypes, sizes=machine.MATMUL_SIZES):
        asked.append((device.type, tuple(sizes)))
        # H100-like: tensor cores far from their peak at 1024^2
        return {
            "fp32": {str(n): 50e12 for n in sizes},
            "bf16": {str(n): (300e12 if n <= 1024 else 700e12 + n * 1e9) for n in sizes},
        }, {"fp16": "not measured (test)"}

    gpu = type("Props", (), {"name": "Fake H200", "major": 9, "minor": 0})()
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device=None: gpu)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(machine, "_MEMO", {})
    monkeypatch.setattr(machine, "measure_matmul", matmul)
    monkeypatch.setattr(machine, "measure_copy", lambda device: {"host_memcpy": 1e10})
    monkeypatch.setenv("SLIPSTREAM_CACHE", str(tmp_path))
    p = machine.probe("cuda")
    assert asked == [("cuda", machine.CUDA_MATMUL_SIZES)] and max(machine.CUDA_MATMUL_SIZES) >= 8192
    assert p.fingerprint["matmul_sizes"] == list(machine.CUDA_MATMUL_SIZES)  # older GPU probes are stale
    peak = peak_flops_from_probe(torch.device("cuda"))
    assert peak["bf16"] == 700e12 + 8192e9  # the best size, not 1024^2's 300e12
    assert peak["fp16"] == 50e12  # unmeasured: fp32's figure
    assert machine.matmul_sizes(torch.device("cpu")) == machine.MATMUL_SIZES == (256, 512, 1024)


# ----------------------------------------------------------------------------- bf16 by emulation is not bf16


def test_bf16_emulated_by_the_gpu_counts_as_unsupported(monkeypatch):
    """torch.cuda.is_bf16_supported() says True on a V100 or T4 (emulated, slow) unless asked
    including_emulation=False; every caller asks that way."""
    from slipstream import machine
    from slipstream.precision import _checked_dtype
    from slipstream.recipe import PrecisionConfig, RecipeError

    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: including_emulation)
    why = machine._dtype_runs(torch.bfloat16, torch.device("cuda"))
    assert why is not None and "no native bf16" in why
    with pytest.raises(RecipeError, match="bf16 is not supported by this GPU"):
        _checked_dtype(PrecisionConfig(dtype="bf16"), torch.device("cuda"))


# ----------------------------------------------------------------------------- fused cross-entropy: no host sync off the CPU


def test_fused_cross_entropy_torch_path_never_syncs_off_the_cpu():
    """On the meta device any host sync (bool(), .item(), nonzero()) raises: this is how a GPU's
    torch path runs inside CUDA-graph capture. Forward and backward, every reduction. (The public
    function's autocast guard knows no meta device, so the op is called below it.)"""
    from slipstream.kernels.fused_linear_cross_entropy import _apply

    for reduction in ("mean", "sum", "none"):
        x = torch.empty(24, 16, device="meta", requires_grad=True)
        w = torch.empty(40, 16, device="meta", requires_grad=True)
        t = torch.empty(24, dtype=torch.long, device="meta")
        _apply(x, w, None, t, -100, reduction, "torch", 8).sum().backward()
        assert x.grad.shape == x.shape and w.grad.shape == w.shape


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_fused_cross_entropy_every_row_path_matches_torch(monkeypatch, reduction):
    """The path GPUs take without Triton (every row computed, ignored ones masked), run on CPU."""
    import importlib

    flce = importlib.import_module("slipstream.kernels.fused_linear_cross_entropy")

    monkeypatch.setattr(flce, "_skips_ignored_rows", lambda device: False)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(30, 16, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.randn(40, 16, generator=g, dtype=torch.float64, requires_grad=True)
    t = torch.randint(0, 40, (30,), generator=g)
    t[::3] = -100  # padding rows; a whole chunk of them too
    t[8:16] = -100
    up = torch.randn(30, generator=g, dtype=torch.float64) if reduction == "none" else torch.tensor(1.7)
    got = fused_linear_cross_entropy(x, w, t, reduction=reduction, backend="torch", chunk_rows=8)
    (got * up).sum().backward()
    gx, gw = x.grad, w.grad
    x.grad = w.grad = None
    want = F.cross_entropy(x @ w.T, t, reduction=reduction)
    (want * up).sum().backward()
    for a, b in ((got.double(), want), (gx, x.grad), (gw, w.grad)):  # the loss is computed in fp32
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------------------------- Python 3.10 (requires-python >= 3.10)


def test_no_builtin_timeouterror_catches_an_asyncio_timeout():
    """Before 3.11 asyncio.wait_for and aiohttp raise asyncio.TimeoutError, which `except TimeoutError`
    misses (checked on 3.10.13: only the asyncio class catches it). A module that uses asyncio catches
    asyncio.TimeoutError (the same class from 3.11 on); tests/serve/test_serve_gpu_defects.py runs both
    handlers with a 3.10-style class."""
    import ast
    from pathlib import Path

    src = Path(__file__).resolve().parents[1] / "src" / "slipstream"
    offenders = []
    for path in sorted(src.rglob("*.py")):
        text = path.read_text()
        if "asyncio" not in text:
            continue
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ExceptHandler) and node.type is not None:
                names = node.type.elts if isinstance(node.type, ast.Tuple) else [node.type]
                if any(isinstance(n, ast.Name) and n.id == "TimeoutError" for n in names):
                    offenders.append(f"{path.relative_to(src)}:{node.lineno}")
    assert offenders == []


# ----------------------------------------------------------------------------- bench: peak memory on CUDA


def test_bench_reports_each_recipes_cuda_peak_as_if_alone(monkeypatch):
    """Two recipes share the process (on a fake CUDA device: the allocator's counters are faked):
    each one's peak is what it keeps (weights at build, optimizer state at warm-up) plus its rounds'
    most above their start, with the allocator's peak reset before every round."""
    from slipstream.bench import runner
    from slipstream.bench.runner import RecipeContender, custom_factory, run_bench

    alloc = {"now": 0, "peak": 0}
    resets: list[str] = []
    weights, activations = {"a": 1000, "b": 3000}, {"a": 500, "b": 200}

    class OnCuda(RecipeContender):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.device = torch.device("cuda")  # the figures below are this fake device's
            self.key = self.name[0]
            self.warmed = False
            alloc["now"] += weights[self.key]

        def run_round(self, *args, **kwargs):
            stats = super().run_round(*args, **kwargs)
            if not self.warmed:  # optimizer state, kept from the first step on
                self.warmed = True
                alloc["now"] += 2 * weights[self.key]
            alloc["peak"] = max(alloc["peak"], alloc["now"] + activations[self.key])
            return stats

    def reset(device=None):
        resets.append(str(device))
        alloc["peak"] = alloc["now"]

    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: alloc["now"])
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: alloc["peak"])
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", reset)
    monkeypatch.setattr(runner, "resolve_device", lambda choice: torch.device("cuda"))
    monkeypatch.setattr(
        runner, "peak_flops_from_probe", lambda device: dict.fromkeys(("fp32", "bf16", "fp16"), 1e12)
    )
    small = "+shapes.max_len=512+shapes.tokens_per_batch=1024"
    names = ["a@baseline" + small, "b@pad-batch" + small]
    res = run_bench(
        "gpt-stdlib", names, size="tiny", rounds=2, round_tokens=300, warmup_steps=1, val_batches=1,
        noise_seeds=0, min_dtype_speed=None, custom={n: custom_factory(OnCuda) for n in names},
    )  # fmt: skip
    peaks = {c.name[0]: c.peak_memory_bytes for c in res.contenders}
    assert peaks == {"a": 3 * 1000 + 500, "b": 3 * 3000 + 200}  # not b's 9000 kept bytes inside a's
    assert len(resets) == 4 and set(resets) == {"cuda"}  # before each of 2 rounds x 2 contenders
    assert all("cuda_max_allocated" in c.peak_memory_note for c in res.contenders)
