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
