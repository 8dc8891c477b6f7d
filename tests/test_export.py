"""Export: what `slipstream train --export` writes loads back elsewhere and computes the same thing."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from slipstream.cli import main
from slipstream.export import MARKER, export_model, load_export
from slipstream.recipe import RecipeError
from slipstream.workloads.gpt import build_gpt
from slipstream.workloads.user import build_user_model
from user_helpers import GPT2_FACTORY, train_tokenizer, write_module, write_text

INPUT = torch.tensor([[5, 17, 42, 3, 99, 7]])


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SLIPSTREAM_CACHE", str(tmp_path / "cache"))
    monkeypatch.chdir(tmp_path)


def hf_logits(model) -> torch.Tensor:
    model.eval()
    with torch.no_grad():
        return model(input_ids=INPUT).logits


def test_train_export_writes_a_trained_hf_model_and_tokenizer(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = train_tokenizer(tmp_path / "tok")
    mod = write_module(tmp_path, GPT2_FACTORY.format(vocab=320))
    write_text(tmp_path / "n.txt", n=40)
    argv = ["train", "--model", f"{mod}:build", "--data", "n.txt", "--tokenizer", str(tok)]
    argv += [
        "--set",
        "shapes.max_len=64",
        "--set",
        "shapes.tokens_per_batch=512",
        "--set",
        "optimizer.lr=0.01",
    ]
    assert main([*argv, "--steps", "3", "--eval-every", "0", "--no-progress", "--export", "out"]) == 0
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "out", local_files_only=True)
    fresh = build_user_model(f"{mod}:build")
    assert type(loaded).__name__ == "GPT2LMHeadModel"
    assert not torch.allclose(hf_logits(loaded), hf_logits(fresh))  # the trained weights, not the init
    saved_tok = AutoTokenizer.from_pretrained(tmp_path / "out", local_files_only=True)
    assert (
        saved_tok("the quick fox")["input_ids"]
        == AutoTokenizer.from_pretrained(tok)("the quick fox")["input_ids"]
    )
    assert json.loads((tmp_path / "out" / MARKER).read_text())["kind"] == "huggingface"


def test_an_exported_hf_model_gives_the_same_logits(tmp_path):
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=64,
    )
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():  # any change from init: export must carry the current weights
        for p in model.parameters():
            p.add_(0.01 * torch.randn_like(p))
    export_model(torch.compile(model), tmp_path / "out")  # the compile wrapper is unwrapped
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "out", local_files_only=True)
    torch.testing.assert_close(hf_logits(loaded), hf_logits(model))


TIED = """
from torch import nn


class Tied(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(50, 8)
        self.out = nn.Linear(8, 50, bias=False)
        self.out.weight = self.emb.weight

    def forward(self, input_ids):
        return self.out(self.emb(input_ids))


def build():
    return Tied()
"""


def test_a_plain_module_round_trips_through_its_factory(tmp_path):
    factory = f"{write_module(tmp_path, TIED)}:build"
    model = build_user_model(factory)
    with torch.no_grad():
        model.emb.weight.mul_(3)
    export_model(torch.compile(model), tmp_path / "out", factory=factory)
    loaded = load_export(tmp_path / "out")
    assert loaded.out.weight is loaded.emb.weight  # still tied after loading
    torch.testing.assert_close(loaded(INPUT % 50), model(INPUT % 50))


def test_the_builtin_gpt_round_trips_through_its_config(tmp_path):
    model = build_gpt("tiny", max_len=32, vocab_size=128)
    export_model(model, tmp_path / "out")
    loaded = load_export(tmp_path / "out")
    labels = torch.roll(INPUT, -1, 1)
    torch.testing.assert_close(loaded(input_ids=INPUT, labels=labels), model(input_ids=INPUT, labels=labels))


def test_export_never_overwrites_a_folder_it_did_not_write(tmp_path):
    model = nn.Linear(3, 3)
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep me")
    with pytest.raises(RecipeError, match="not an earlier export"):
        export_model(model, tmp_path / "mine")
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep me"
    export_model(model, tmp_path / "out")
    export_model(model, tmp_path / "out")  # an earlier export is replaced
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []
    with pytest.raises(RecipeError, match="no factory recorded"):
        load_export(tmp_path / "out")
