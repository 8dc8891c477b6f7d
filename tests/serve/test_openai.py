"""The OpenAI-compatible endpoints, driven by the official `openai` Python client against a real
`slipstream serve --model DIR` process: completions and chat, streaming and not, greedy text equal
to model.generate's, stop strings, n, logprobs, usage, and refusals that name the field."""

import httpx
import pytest
import torch

from .conftest import running_server

openai = pytest.importorskip("openai")
pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def hf_server(hf_folders):
    with running_server("--generate-slots", "4", model=str(hf_folders["llama"])) as url:
        yield url


@pytest.fixture(scope="module")
def client(hf_server):
    return openai.OpenAI(base_url=hf_server + "/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def reference(hf_folders):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = hf_folders["llama"]
    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    tok = AutoTokenizer.from_pretrained(folder)

    def greedy_text(ids: list[int], n: int) -> str:
        x = torch.tensor([ids])
        out = model.generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=n)
        return tok.decode(out[0, len(ids) :], skip_special_tokens=True)

    return tok, greedy_text


MODEL = "tiny-llama"  # the folder's name


def test_models_lists_the_folder_name(client):
    assert [m.id for m in client.models.list().data] == [MODEL]


def test_completion_greedy_text_equals_generate_streaming_or_not(client, reference):
    tok, greedy_text = reference
    prompt = "the quick brown fox jumps"
    want = greedy_text(tok(prompt)["input_ids"], 20)
    got = client.completions.create(model=MODEL, prompt=prompt, max_tokens=20, temperature=0)
    assert got.choices[0].text == want
    assert got.usage.prompt_tokens == len(tok(prompt)["input_ids"])
    assert 1 <= got.usage.completion_tokens <= 20
    assert got.choices[0].finish_reason in ("stop", "length")
    chunks = list(
        client.completions.create(
            model=MODEL,
            prompt=prompt,
            max_tokens=20,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == want
    assert chunks[-1].usage.completion_tokens == got.usage.completion_tokens
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == got.choices[0].finish_reason


def test_chat_uses_the_tokenizers_template_streaming_or_not(client, reference):
    tok, greedy_text = reference
    messages = [{"role": "user", "content": "alpha beta"}]
    ids = tok(
        tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False),
        add_special_tokens=False,
    )
    want = greedy_text(ids["input_ids"], 16)
    got = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=16, temperature=0)
    assert got.choices[0].message.role == "assistant"
    assert got.choices[0].message.content == want
    stream = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=16, temperature=0, stream=True
    )
    assert "".join(c.choices[0].delta.content or "" for c in stream) == want


def test_seeded_sampling_reproducible_and_n_choices(client):
    args = {"model": MODEL, "prompt": "lazy dog", "max_tokens": 12, "temperature": 1.0, "top_p": 0.95}
    a = client.completions.create(seed=5, n=2, **args)
    b = client.completions.create(seed=5, n=2, **args)
    assert [c.text for c in a.choices] == [c.text for c in b.choices]
    assert [c.index for c in a.choices] == [0, 1]


def test_stop_string_cuts_the_text_and_logprobs_align(client):
    full = client.completions.create(model=MODEL, prompt="the", max_tokens=24, temperature=0).choices[0].text
    stop = full[len(full) // 2 : len(full) // 2 + 2]
    if not stop.strip():
        pytest.skip("greedy text has no usable middle")
    cut = client.completions.create(model=MODEL, prompt="the", max_tokens=24, temperature=0, stop=[stop])
    assert cut.choices[0].text == full[: full.index(stop)]
    assert cut.choices[0].finish_reason == "stop"
    lp = client.completions.create(model=MODEL, prompt="the", max_tokens=5, temperature=0, logprobs=3)
    probs = lp.choices[0].logprobs
    assert len(probs.token_logprobs) == lp.usage.completion_tokens
    assert all(len(t) == 3 for t in probs.top_logprobs)
    for chosen, top in zip(probs.token_logprobs, probs.top_logprobs):  # greedy picks the most likely
        assert chosen == pytest.approx(max(top.values()), abs=1e-5)


def test_unsupported_fields_are_refused_by_name(client, hf_server):
    with pytest.raises(openai.BadRequestError, match="logit_bias"):
        client.completions.create(model=MODEL, prompt="x", logit_bias={"5": 3})
    with pytest.raises(openai.BadRequestError, match="frobnicate"):
        client.completions.create(model=MODEL, prompt="x", extra_body={"frobnicate": 1})
    with pytest.raises(openai.BadRequestError, match="tools"):
        client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "x"}],
            tools=[{"type": "function", "function": {"name": "f", "parameters": {}}}],
        )
    with pytest.raises(openai.NotFoundError, match=MODEL):
        client.completions.create(model="gpt-4o", prompt="x")
    with pytest.raises(openai.BadRequestError, match="context"):
        client.completions.create(model=MODEL, prompt="x", max_tokens=10_000)
    r = httpx.post(hf_server + "/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": -1})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
