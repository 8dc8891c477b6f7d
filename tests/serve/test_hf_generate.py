"""Hugging Face causal LMs through the one decode path: greedy tokens equal model.generate, alone and
inside a full continuous batch; seeded sampling reproducible; score and int8 on HF models."""

import asyncio

import numpy as np
import pytest
import torch

from slipstream.serve.engine import EngineConfig, ScoreEngine
from slipstream.serve.generate import Generator, GeneratorConfig
from slipstream.serve.model import load_hf_model
from user_helpers import paragraphs

from .oracles import score_reference

pytest.importorskip("transformers")


def _generate(loaded, prompts, slots, **params):
    async def main():
        gen = Generator(loaded, GeneratorConfig(slots=slots))
        await gen.start(warmup=False)

        async def one(p):
            stream = await gen.submit(p, **params)
            return [t async for t in stream]

        try:
            return await asyncio.gather(*[one(p) for p in prompts])
        finally:
            await gen.drain(5)

    return asyncio.run(main())


def _reference(loaded, prompt, n):
    ids = torch.tensor([prompt])
    out = loaded.model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        do_sample=False,
        max_new_tokens=n,
        pad_token_id=loaded.pad_id,
    )
    return out[0, len(prompt) :].tolist()


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_greedy_tokens_equal_model_generate_alone_and_in_a_full_batch(hf_folders, family):
    loaded = load_hf_model(hf_folders[family])
    prompts = [loaded.codec.encode(p[: 20 + 7 * i]) for i, p in enumerate(paragraphs(20, seed=3))]
    want = [_reference(loaded, p, 24) for p in prompts]
    alone = [_generate(loaded, [p], slots=1, max_new_tokens=24)[0] for p in prompts]
    crowd = _generate(loaded, prompts, slots=8, max_new_tokens=24)  # 20 requests, 8 slots
    assert alone == want
    assert crowd == want


def test_seeded_sampling_is_reproducible_whatever_the_batch(hf_folders):
    loaded = load_hf_model(hf_folders["llama"])
    prompt = loaded.codec.encode("the quick brown fox")
    params = {"max_new_tokens": 16, "temperature": 1.0, "top_p": 0.9, "stop_at_eos": False}
    a = _generate(loaded, [prompt], slots=2, seed=11, **params)[0]
    others = [loaded.codec.encode(t) for t in ("alpha", "beta gamma", "sleep")]
    crowd = _generate(loaded, [*others, prompt], slots=4, seed=11, **params)[-1]
    b = _generate(loaded, [prompt], slots=2, seed=12, **params)[0]
    assert a == crowd
    assert a != b


def test_score_engine_on_a_hf_model_matches_the_plain_forward(hf_folders):
    loaded = load_hf_model(hf_folders["gpt2"])
    engine = ScoreEngine(loaded, EngineConfig(max_batch_size=4, n_lengths=2, warmup_reps=2))
    rng = np.random.default_rng(0)
    seqs = [rng.integers(0, loaded.vocab_size, n).tolist() for n in (5, 30, 12)]

    async def main():
        await engine.start(warmup=False)
        try:
            return await asyncio.gather(*[engine.score(s) for s in seqs])
        finally:
            await engine.drain(5)

    for got, s in zip(asyncio.run(main()), seqs):
        ref = score_reference(loaded, s)
        assert got["scored_tokens"] == len(s) - 1
        assert got["logprob_sum"] == pytest.approx(ref["logprob_sum"], rel=1e-4, abs=1e-3)


def test_int8_quantizes_a_hf_models_body_but_not_its_head(hf_folders):
    pytest.importorskip("torchao")
    from slipstream.serve.quantize import quantize_model

    loaded = load_hf_model(hf_folders["llama"])
    head = loaded.model.get_output_embeddings().weight
    q_proj = loaded.model.model.layers[0].self_attn.q_proj.weight
    quantize_model(loaded.model, "int8-weight-only")
    assert type(loaded.model.model.layers[0].self_attn.q_proj.weight) is not type(q_proj)
    assert type(loaded.model.get_output_embeddings().weight) is type(head)


def test_a_folder_without_a_model_or_tokenizer_is_refused_with_the_fix(tmp_path, hf_folders):
    from slipstream.recipe import RecipeError

    with pytest.raises(RecipeError, match="save_pretrained"):
        load_hf_model(tmp_path)
    import shutil

    no_tok = tmp_path / "m"
    shutil.copytree(hf_folders["gpt2"], no_tok)
    for f in no_tok.glob("tokenizer*"):
        f.unlink()
    with pytest.raises(RecipeError, match="tokenizer"):
        load_hf_model(no_tok)


def test_quantize_eval_measures_a_hf_folder_on_the_users_text(hf_folders, tmp_path):
    from slipstream.serve.quantize import quantize_eval

    data = tmp_path / "notes.txt"
    data.write_text("\n\n".join(paragraphs(60, seed=5)) + "\n")
    res = quantize_eval(
        "", None, None, ["none", "bf16"], model_dir=str(hf_folders["llama"]), data=str(data),
        shapes=((1, 32),), reps=1,
    )  # fmt: skip
    rows = {r["mode"]: r for r in res["results"]}
    assert res["validation_docs"] > 0 and res["data"] == str(data)
    assert rows["none"]["loss_delta_vs_fp32_nats"] == 0
    assert rows["bf16"]["validation_loss_nats"] != rows["none"]["validation_loss_nats"]
    assert abs(rows["bf16"]["loss_delta_vs_fp32_nats"]) < 0.1
    assert "latency_1x32_median_s" in rows["bf16"]


def test_compiled_decode_gives_the_eager_tokens(hf_folders):
    """--compile-decode: every key bucket compiled at warm-up, then the same greedy tokens."""
    loaded = load_hf_model(hf_folders["llama"], max_len=128)  # one key bucket: one compile
    prompts = [loaded.codec.encode(p[:40]) for p in paragraphs(6, seed=9)]

    async def main(compile):
        gen = Generator(loaded, GeneratorConfig(slots=4, compile=compile))
        await gen.start(warmup=True)

        async def one(p):
            stream = await gen.submit(p, max_new_tokens=20, stop_at_eos=False)
            return [t async for t in stream]

        try:
            return await asyncio.gather(*[one(p) for p in prompts])
        finally:
            await gen.drain(5)

    assert asyncio.run(main(True)) == asyncio.run(main(False))
