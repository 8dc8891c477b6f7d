"""The Hugging Face Trainer peers (hf-trainer, hf-trainer-flat) on a tiny GPT-2 built from a config."""

import importlib.util
import math
import uuid

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from transformers import GPT2Config, GPT2LMHeadModel

from slipstream.bench import run_bench
from slipstream.bench.hf_peers import HFTrainerFlatPeer, HFTrainerPeer, pad_batch, token_counts
from slipstream.bench.peer_base import PeerUnavailable
from slipstream.presets import resolve_recipe
from slipstream.shapes.loader import IGNORE_INDEX
from slipstream.workloads.registry import WORKLOADS, Workload, WorkloadData, register_workload

BOS, EOS, VOCAB = 256, 257, 264
PAD = EOS  # pad == eos, as in most HF tokenizers: real EOS tokens must still be predicted
MAX_LEN = 256
REFERENCE = f"baseline+shapes.max_len={MAX_LEN}+shapes.tokens_per_batch=1024"


def _gpt2(size: str, max_len: int) -> GPT2LMHeadModel:
    cfg = GPT2Config(
        n_layer=2,
        n_embd=64,
        n_head=2,
        vocab_size=VOCAB,
        n_positions=max_len,
        bos_token_id=BOS,
        eos_token_id=EOS,
    )
    return GPT2LMHeadModel(cfg)


class _BuiltinConvention(nn.Module):
    """GPT-2 behind slipstream's built-in batch convention (pre-shifted labels, mean loss): a model
    that is not a Hugging Face PreTrainedModel."""

    def __init__(self, size: str, max_len: int):
        super().__init__()
        self.net = _gpt2(size, max_len)

    def forward(self, input_ids, labels, **_):
        logits = self.net(input_ids=input_ids).logits
        return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=IGNORE_INDEX)


def _docs(n: int, rng: np.random.Generator) -> list[np.ndarray]:
    # A skewed byte distribution, so a few steps visibly lower the loss.
    probs = 1.0 / np.arange(1, 257)
    probs /= probs.sum()
    out = []
    for length in rng.integers(8, 201, size=n):
        body = rng.choice(256, size=length - 2, p=probs)
        out.append(np.concatenate([[BOS], body, [EOS]]).astype(np.int64))
    return out


def _data() -> WorkloadData:
    rng = np.random.default_rng(0)
    train, val = _docs(300, rng), _docs(40, rng)
    lengths = lambda docs: np.array([len(d) for d in docs])  # noqa: E731
    return WorkloadData(train, val, lengths(train), lengths(val), PAD, VOCAB)


@pytest.fixture(scope="module")
def workloads():
    """(HF workload, the same model behind the built-in convention), removed afterwards."""
    tag = uuid.uuid4().hex[:8]
    hf = register_workload(Workload(f"test-hf-gpt2-{tag}", "tiny HF GPT-2", ("tiny",), _gpt2, _data))
    plain = register_workload(
        Workload(
            f"test-plain-gpt2-{tag}", "tiny GPT-2, built-in convention", ("tiny",), _BuiltinConvention, _data
        )
    )
    yield hf.name, plain.name
    del WORKLOADS[hf.name], WORKLOADS[plain.name]


@pytest.fixture(scope="module")
def bench(workloads):
    hf, _ = workloads
    return run_bench(
        hf,
        [REFERENCE],
        peers=["hf-trainer", "hf-trainer-flat"],
        rounds=2,
        round_tokens=1500,
        warmup_steps=1,
        val_batches=2,
        noise_seeds=0,
        memory="skip",
    ).to_dict()


def test_both_trainer_peers_run_at_the_matched_real_token_budget(bench):
    by_name = {c["name"]: c for c in bench["contenders"]}
    assert not bench["skipped"]
    per_step = bench["method"]["real_tokens_per_step"]
    for name in ("hf-trainer", "hf-trainer-flat"):
        c = by_name[name]
        assert c["kind"] == "peer" and c["real_tokens_per_s"] > 0
        assert math.isfinite(c["val_loss"]) and 0 < c["val_loss"] < math.log(VOCAB) + 0.5
        # every round runs until its 1500 real tokens, overshooting by at most one step
        assert 2 * 1500 <= c["real_tokens"] < 2 * (1500 + 4 * per_step)
        # documents per step chosen so a step carries the matched real tokens on average
        per_doc = np.mean([min(len(d), MAX_LEN) - 1 for d in _data().train])
        assert c["info"]["per_device_train_batch_size"] == round(per_step / per_doc)
        assert len(c["loss_curve"]) == c["steps"] and all(math.isfinite(x) for _, x in c["loss_curve"])
    # random batches average out (group_by_length runs each megabatch longest first: not in a short run)
    flat = by_name["hf-trainer-flat"]
    assert 0.7 * per_step < flat["real_tokens"] / flat["steps"] < 1.3 * per_step
    assert flat["padding_waste"] == 0  # padding-free
    assert by_name["hf-trainer"]["padding_waste"] > 0  # padded to the longest of varied lengths
    assert by_name["hf-trainer"]["info"]["train_sampling_strategy"] == "group_by_length"


def test_labels_keep_real_eos_when_pad_is_eos():
    batch = pad_batch([{"input_ids": [BOS, 5, EOS]}, {"input_ids": [BOS, EOS]}], pad_id=EOS)
    assert batch["labels"].tolist() == [[BOS, 5, EOS], [BOS, EOS, IGNORE_INDEX]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1], [1, 1, 0]]
    assert token_counts(batch) == (3, 1)  # predicted positions 2 + 1; one padding position


@pytest.mark.parametrize("cls", [HFTrainerPeer, HFTrainerFlatPeer])
def test_trainer_peer_learns_and_stops_at_the_budget(workloads, cls):
    hf, _ = workloads
    peer = cls(hf, "tiny", _data(), resolve_recipe(REFERENCE), 2, 600.0)
    before = peer.validation_loss()
    first = peer.run_round(None, max_steps=1)
    second = peer.run_round(2000)
    assert first.steps == 1 and len(first.losses) == 1
    assert 2000 <= second.real_tokens and second.steps == len(second.losses)
    assert second.steps <= 2000 // 600 + 3  # ~600 real tokens per step: stopped at the budget
    assert peer.validation_loss() < before - 0.05  # it trained on the right labels
    peer.close()
    assert not peer._thread.is_alive()  # the Trainer's run ended with the benchmark


def test_flattened_batch_gives_the_padded_batch_loss(workloads):
    """Documents flattened into one row must not attend to each other (the Trainer turns the
    model's cache off; with it on, transformers ignores the restarting position_ids)."""
    hf, _ = workloads
    peer = HFTrainerFlatPeer(hf, "tiny", _data(), resolve_recipe(REFERENCE), 2, 600.0)
    docs = [{"input_ids": d} for d in _data().validation[:5]]
    with torch.no_grad():
        peer.model.eval()
        flat = peer.model(**peer.collator(docs)).loss
        padded = peer.model(**pad_batch(docs, PAD)).loss
    assert flat.item() == pytest.approx(padded.item(), rel=1e-4)
    assert token_counts(peer.collator(docs)) == (sum(len(d["input_ids"]) - 1 for d in docs), 0)
    peer.close()


def test_non_hf_model_makes_the_peers_unavailable_with_the_reason(workloads):
    _, plain = workloads
    result = run_bench(
        plain,
        [REFERENCE],
        peers=["hf-trainer", "hf-trainer-flat"],
        rounds=1,
        round_tokens=200,
        warmup_steps=1,
        val_batches=1,
        noise_seeds=0,
        memory="skip",
    )
    for name in ("hf-trainer", "hf-trainer-flat"):
        assert "_BuiltinConvention, not a Hugging Face PreTrainedModel" in result.skipped[name]
    assert [c.name for c in result.contenders] == [REFERENCE]


def test_missing_transformers_makes_the_peers_unavailable(workloads, monkeypatch):
    hf, _ = workloads
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda n, *a: None if n == "transformers" else real(n, *a)
    )
    with pytest.raises(PeerUnavailable, match="transformers is not installed"):
        HFTrainerPeer(hf, "tiny", _data(), resolve_recipe(REFERENCE), 2)


def test_a_failing_step_raises_in_the_benchmark_instead_of_hanging(workloads):
    hf, _ = workloads
    peer = HFTrainerPeer(hf, "tiny", _data(), resolve_recipe(REFERENCE), 2, 600.0)

    def boom(module, args):
        raise RuntimeError("out of memory (simulated)")

    peer.model.register_forward_pre_hook(boom)
    with pytest.raises(RuntimeError, match="simulated"):
        peer.run_round(1000)
    with pytest.raises(RuntimeError, match="thread has stopped"):
        peer.run_round(1000)
