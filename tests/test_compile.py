"""torch.compile scopes, activation checkpointing, CUDA graphs per shape, optimizer implementation."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from slipstream.compile import CUDAGraphModel, apply_activation_checkpointing, apply_compile, apply_cudagraphs
from slipstream.metrics import MetricsTracker
from slipstream.recipe import CompileConfig, OptimizerConfig, Recipe, RecipeError, RuntimeConfig
from slipstream.session import Session, build_optimizer, resolve_optimizer_impl


class Block(nn.Module):
    calls = 0

    def __init__(self, d: int):
        super().__init__()
        self.fc = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        Block.calls += 1
        return x + torch.tanh(self.fc(x))


class Stack(nn.Module):
    def __init__(self, d: int = 16, n: int = 2):
        super().__init__()
        self.blocks = nn.ModuleList(Block(d) for _ in range(n))
        self.head = nn.Linear(d, 1)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return ((self.head(x).squeeze(-1) - y) ** 2).mean()


def _batch(n: int = 8, d: int = 16, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"x": torch.randn(n, d, generator=g), "y": torch.randn(n, generator=g)}


def _grads(model: nn.Module, batch) -> list[torch.Tensor]:
    model.zero_grad(set_to_none=True)
    model(**batch).backward()
    return [p.grad.clone() for p in model.parameters()]


# ----------------------------------------------------------------------------- activation checkpointing


def test_activation_checkpointing_recomputes_blocks_with_identical_gradients():
    torch.manual_seed(0)
    plain = Stack()
    ckpt = copy.deepcopy(plain)
    keys = list(ckpt.state_dict())
    assert apply_activation_checkpointing(ckpt, "blocks") == 2
    assert list(ckpt.state_dict()) == keys
    batch = _batch()
    Block.calls = 0
    expected = _grads(plain, batch)
    assert Block.calls == 2
    Block.calls = 0
    got = _grads(ckpt, batch)
    assert Block.calls == 4  # each block's forward runs again during backward
    for a, b in zip(expected, got):
        torch.testing.assert_close(a, b)
    Block.calls = 0
    with torch.no_grad():
        ckpt(**batch)
    assert Block.calls == 2  # no recomputation without grad


def test_activation_checkpointing_survives_deepcopy_and_needs_blocks():
    model = Stack()
    apply_activation_checkpointing(model, "blocks")
    clone = copy.deepcopy(model)
    with torch.no_grad():
        clone.blocks[0].fc.weight.zero_()
    # the copy's forward must use the copy's weights, not the original's
    assert not torch.equal(model(**_batch()), clone(**_batch()))
    with pytest.raises(
        RecipeError, match="compile.activation_checkpointing=blocks needs a model with a `blocks`"
    ):
        apply_activation_checkpointing(nn.Linear(2, 2), "blocks")


# ----------------------------------------------------------------------------- CUDA graphs (dispatch on CPU)


def _stub_capture(log: list):
    def capture(fn, sample_args):
        log.append(tuple(a.shape for a in sample_args))
        return fn  # "replaying" runs the function eagerly: the dispatch is what is under test

    return capture


def test_cuda_graphs_capture_once_per_shape_and_fall_back_past_the_budget():
    log: list = []
    model = CUDAGraphModel(Stack(), max_shapes=2, capture=_stub_capture(log))
    for n in (8, 8, 4, 8, 4, 6, 6):
        loss = model(**_batch(n))
        loss.backward()
    assert log == [((8, 16), (8,)), ((4, 16), (4,))]  # one capture per shape, sorted input names
    assert model.stats() == {"cudagraph_captures": 2, "cudagraph_replays": 3, "cudagraph_eager_fallbacks": 2}
    model.eval()
    with torch.no_grad():
        model(**_batch(3))
    assert model.stats()["cudagraph_captures"] == 2  # evaluation runs eager, uncounted
    assert list(model._orig_mod.state_dict()) == list(Stack().state_dict())


def test_cuda_graphs_need_cuda_and_no_torch_compile():
    if torch.cuda.is_available():
        pytest.skip("checks the error without CUDA; this machine has CUDA")
    with pytest.raises(RecipeError, match="compile.cudagraphs=true needs CUDA"):
        CUDAGraphModel(Stack())
    with pytest.raises(RecipeError, match="compile.cudagraphs=true needs CUDA"):
        Session(
            Recipe(compile=CompileConfig(cudagraphs=True), runtime=RuntimeConfig(device="cpu"))
        ).prepare_model(Stack())
    with pytest.raises(RecipeError, match="use compile.mode=reduce-overhead"):
        apply_cudagraphs(Stack(), CompileConfig(mode="default", cudagraphs=True), torch.device("cuda"))


def _train_side_by_side(eager: nn.Module, graphed: CUDAGraphModel, device: str) -> dict[str, int]:
    """Six SGD steps of each model on bucket shapes 8, 16, 8, 16, 8, 32; the losses and the updated
    weights must agree. The check after each step runs under no_grad, where the wrapper runs eager and
    counts nothing: checking in training mode would itself replay (or fall back) and be counted."""
    opt_e = torch.optim.SGD(eager.parameters(), lr=0.1)
    opt_g = torch.optim.SGD(graphed.parameters(), lr=0.1)
    for step, n in enumerate((8, 16, 8, 16, 8, 32)):
        batch = {k: v.to(device) for k, v in _batch(n, seed=step).items()}
        losses = []
        for model, opt in ((eager, opt_e), (graphed, opt_g)):
            loss = model(**batch)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(loss.detach())
        torch.testing.assert_close(losses[1], losses[0], rtol=1e-5, atol=1e-6)
        before = graphed.stats()
        with torch.no_grad():
            torch.testing.assert_close(graphed(**batch), eager(**batch), rtol=1e-5, atol=1e-6)
        assert graphed.stats() == before
    return graphed.stats()


def test_cuda_graph_counters_count_training_steps_only():
    """The CPU twin of the GPU test below (stub capture): its asserted counters hold (issue 16)."""
    torch.manual_seed(0)
    eager = Stack()
    graphed = CUDAGraphModel(copy.deepcopy(eager), max_shapes=2, capture=_stub_capture([]))
    stats = _train_side_by_side(eager, graphed, "cpu")
    assert stats == {"cudagraph_captures": 2, "cudagraph_replays": 3, "cudagraph_eager_fallbacks": 1}


@pytest.mark.gpu
def test_cuda_graph_replay_matches_eager_per_bucket_shape():
    torch.manual_seed(0)
    eager = Stack().cuda()
    graphed = CUDAGraphModel(copy.deepcopy(eager), max_shapes=2)
    assert _train_side_by_side(eager, graphed, "cuda") == {
        "cudagraph_captures": 2,
        "cudagraph_replays": 3,
        "cudagraph_eager_fallbacks": 1,
    }


# ----------------------------------------------------------------------------- optimizer implementation


def test_optimizer_impl_auto_picks_fused_on_cuda_only():
    cfg = OptimizerConfig(impl="auto")
    assert resolve_optimizer_impl(cfg, torch.device("cuda")) == "fused"
    assert resolve_optimizer_impl(cfg, torch.device("cpu")) == "auto"
    assert resolve_optimizer_impl(OptimizerConfig(impl="foreach"), torch.device("cuda")) == "foreach"
    opt = build_optimizer(Stack(), OptimizerConfig(impl="foreach"), torch.device("cpu"))
    assert opt.defaults["foreach"] is True


@pytest.mark.gpu
def test_fused_adamw_on_cuda():
    session = Session(Recipe(runtime=RuntimeConfig(device="cuda")))
    opt = session.build_optimizer(session.prepare_model(Stack()))
    assert opt.defaults["fused"] is True
    assert session.metrics().extra["optimizer_impl"] == "fused"


# ----------------------------------------------------------------------------- torch.compile


def test_regional_compile_keeps_state_dict_keys_matches_eager_and_counts_recompiles():
    # aot_eager traces forward and backward through dynamo and AOTAutograd as inductor does, but
    # skips code generation: the plumbing is under test here, compile speed is in the benchmarks.
    torch._dynamo.reset()
    torch.manual_seed(0)
    eager = Stack()
    compiled = copy.deepcopy(eager)
    keys = list(compiled.state_dict())
    cfg = CompileConfig(mode="default", scope="blocks")
    assert apply_compile(compiled, cfg, backend="aot_eager") is compiled
    assert list(compiled.state_dict()) == keys
    tracker = MetricsTracker(torch.device("cpu"), "fp32")
    for n in (8, 8, 5):  # a new batch size after the first step: dynamo compiles again
        batch = _batch(n)
        loss = compiled(**batch)
        torch.testing.assert_close(loss, eager(**batch), rtol=1e-5, atol=1e-6)
        loss.backward()
        tracker.end_step()
    assert all(p.grad is not None for p in compiled.parameters())
    assert tracker.summary().recompiles >= 1
    with pytest.raises(RecipeError, match="compile.scope=blocks needs a model with a `blocks`"):
        apply_compile(nn.Linear(2, 2), CompileConfig(mode="default", scope="blocks"))
