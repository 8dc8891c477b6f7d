"""Schema-guided fuzzing of the HTTP endpoints with hypothesis: no input may produce a 500 (or
crash the server). 503/504 are legitimate answers (e.g. `timeout_s: 1e-25` is answered 504)."""

import json

from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from slipstream.serve.app import create_app
from slipstream.serve.engine import EngineConfig, ScoreEngine
from slipstream.serve.generate import Generator, GeneratorConfig

_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=40),
)
_json = st.recursive(
    _scalars,
    lambda inner: st.lists(inner, max_size=6) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=20,
)
_tokens = st.lists(st.integers(min_value=-5, max_value=300), max_size=80)
_score_fields = {
    "tokens": st.one_of(_tokens, _json),
    "text": st.one_of(st.text(max_size=100), _json),
    "token_logprobs": st.one_of(st.booleans(), _json),
    "timeout_s": st.one_of(st.floats(), _json),
}
_gen_fields = {
    "prompt": st.one_of(st.text(max_size=30), _json),
    "tokens": st.one_of(_tokens, _json),
    "max_new_tokens": st.one_of(st.integers(-3, 80), _json),
    "temperature": st.one_of(st.floats(), _json),
    "top_k": st.one_of(st.integers(-3, 400), _json),
    "seed": st.one_of(st.integers(-5, 2**40), _json),
    "stop_at_eos": _json,
    "stream": st.booleans(),
    "timeout_s": st.one_of(st.floats(), _json),
}


def _bodies(fields):
    known = st.fixed_dictionaries({}, optional=fields)
    return st.one_of(
        known,
        known.flatmap(
            lambda d: st.dictionaries(st.text(max_size=6), _json, max_size=2).map(lambda x: {**d, **x})
        ),
        _json,
    )


CASES = {"n": 0}


def _client(tiny):
    engine = ScoreEngine(
        tiny, EngineConfig(max_batch_size=4, n_lengths=2, warmup_reps=2, latency_budget_s=30)
    )
    return TestClient(
        create_app(engine, Generator(tiny, GeneratorConfig(slots=2)), max_body_bytes=20000, warmup=False)
    )


def test_fuzz_score_generate_and_raw_bodies_never_500(tiny):
    with _client(tiny) as client:

        @settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
        @given(path=st.sampled_from(["/v1/score", "/v1/generate"]), data=st.data())
        def json_bodies(path, data):
            body = data.draw(_bodies(_score_fields if path == "/v1/score" else _gen_fields))
            r = client.post(
                path, content=json.dumps(body, allow_nan=True), headers={"content-type": "application/json"}
            )
            CASES["n"] += 1
            assert r.status_code < 500 or r.status_code in (503, 504), (path, body, r.text)
            assert r.status_code == 200 or "error" in r.json() or "detail" in r.json()

        @settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
        @given(
            path=st.sampled_from(["/v1/score", "/v1/generate", "/healthz", "/metrics", "/nope"]),
            raw=st.binary(max_size=300),
            method=st.sampled_from(["POST", "GET", "PUT"]),
        )
        def raw_bodies(path, raw, method):
            r = client.request(method, path, content=raw, headers={"content-type": "application/json"})
            CASES["n"] += 1
            assert r.status_code < 500, (path, raw, r.text)

        json_bodies()
        raw_bodies()
        assert client.get("/healthz").status_code == 200  # still serving
    print(f"fuzz cases run: {CASES['n']}")
    assert CASES["n"] >= 200


_text_or_json = st.one_of(st.text(max_size=30), _json)
_common = {
    "model": st.one_of(st.just("tiny-gpt2"), _json),
    "max_tokens": st.one_of(st.integers(-3, 300), _json),
    "temperature": st.one_of(st.floats(), _json),
    "top_p": st.one_of(st.floats(), _json),
    "n": st.one_of(st.integers(-1, 10), _json),
    "stop": st.one_of(st.text(max_size=4), st.lists(st.text(max_size=4), max_size=6), _json),
    "seed": st.one_of(st.integers(-(2**40), 2**40), _json),
    "stream": st.booleans(),
    "stream_options": st.one_of(st.just({"include_usage": True}), _json),
    "presence_penalty": st.one_of(st.floats(), _json),
    "logit_bias": _json,
    "user": _json,
    "timeout_s": st.one_of(st.floats(), _json),
    "ignore_eos": _json,
}
_completion_fields = {
    **_common,
    "prompt": st.one_of(_text_or_json, st.lists(st.integers(-5, 400), max_size=40)),
    "logprobs": st.one_of(st.integers(-2, 30), _json),
    "echo": _json,
    "best_of": _json,
    "suffix": _json,
}
_message = st.fixed_dictionaries(
    {"role": st.one_of(st.sampled_from(["user", "system", "assistant", "tool"]), _json)},
    optional={"content": st.one_of(_text_or_json, st.lists(_json, max_size=3)), "name": _json},
)
_chat_fields = {
    **_common,
    "messages": st.one_of(st.lists(_message, max_size=4), _json),
    "max_completion_tokens": st.one_of(st.integers(-3, 300), _json),
    "logprobs": _json,
    "top_logprobs": st.one_of(st.integers(-2, 30), _json),
    "response_format": _json,
    "tools": _json,
}
_plausible = {  # in range, so that some requests are valid and reach the generator
    "temperature": st.floats(0, 2),
    "top_p": st.floats(0.01, 1),
    "n": st.integers(1, 3),
    "stop": st.lists(st.text(min_size=1, max_size=3), max_size=4),
    "seed": st.integers(0, 2**40),
    "stream": st.booleans(),
}
_valid_completion = st.fixed_dictionaries(
    {"model": st.just("tiny-gpt2"), "prompt": st.text(max_size=40), "max_tokens": st.integers(1, 8)},
    optional={**_plausible, "logprobs": st.integers(0, 5)},
)
_valid_chat = st.fixed_dictionaries(
    {
        "model": st.just("tiny-gpt2"),
        "messages": st.lists(
            st.fixed_dictionaries(
                {"role": st.sampled_from(["user", "system", "assistant"]), "content": st.text(max_size=30)}
            ),
            min_size=1,
            max_size=3,
        ),
        "max_tokens": st.integers(1, 8),
    },
    optional={**_plausible, "logprobs": st.booleans()},
)
OPENAI_CASES = {"n": 0, "statuses": {}}


def test_fuzz_openai_endpoints_never_500(hf_folders):
    from slipstream.serve.model import load_hf_model

    loaded = load_hf_model(hf_folders["gpt2"], max_len=96)
    engine = ScoreEngine(loaded, EngineConfig(max_batch_size=2, n_lengths=1, latency_budget_s=30))
    app = create_app(engine, Generator(loaded, GeneratorConfig(slots=2)), max_body_bytes=20000, warmup=False)
    with TestClient(app) as client:

        @settings(max_examples=250, deadline=None, suppress_health_check=list(HealthCheck))
        @given(path=st.sampled_from(["/v1/completions", "/v1/chat/completions"]), data=st.data())
        def bodies(path, data):
            chat = "chat" in path
            body = data.draw(
                st.one_of(
                    _bodies(_chat_fields if chat else _completion_fields),
                    _valid_chat if chat else _valid_completion,
                )
            )
            r = client.post(
                path, content=json.dumps(body, allow_nan=True), headers={"content-type": "application/json"}
            )
            OPENAI_CASES["n"] += 1
            OPENAI_CASES["statuses"][r.status_code] = OPENAI_CASES["statuses"].get(r.status_code, 0) + 1
            assert r.status_code < 500 or r.status_code in (503, 504), (path, body, r.text)
            if r.status_code != 200:
                assert set(r.json()["error"]) >= {"message", "type"}, r.text

        bodies()
        ok = client.post("/v1/completions", json={"model": "tiny-gpt2", "prompt": "the", "max_tokens": 3})
        assert ok.status_code == 200  # still serving
    print(f"OpenAI fuzz cases: {OPENAI_CASES['n']}, statuses {sorted(OPENAI_CASES['statuses'].items())}")
    assert OPENAI_CASES["n"] >= 250
    assert OPENAI_CASES["statuses"].get(200, 0) > 0  # the strategies also reach valid requests
