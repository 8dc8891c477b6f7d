import json

import numpy as np
import pytest
from fastapi.testclient import TestClient

from slipstream.serve.app import create_app
from slipstream.serve.engine import EngineConfig, ScoreEngine
from slipstream.serve.generate import Generator, GeneratorConfig
from slipstream.serve.text import ByteCodec

from .oracles import generate_reference, score_reference


@pytest.fixture(scope="module")
def client(tiny):
    engine = ScoreEngine(
        tiny, EngineConfig(max_batch_size=4, n_lengths=2, warmup_reps=2, latency_budget_s=30)
    )
    gen = Generator(tiny, GeneratorConfig(slots=2))
    app = create_app(engine, gen, token="s3cret", max_body_bytes=4000)
    with TestClient(app, headers={"Authorization": "Bearer s3cret"}) as c:
        yield c


def test_ready_health_metrics_openapi(client):
    assert client.get("/healthz").json() == {"status": "ok"}
    ready = client.get("/readyz")
    assert ready.status_code == 200 and ready.json()["shapes"] > 1
    client.post("/v1/score", json={"tokens": [256, 1, 2, 3]})
    text = client.get("/metrics").text
    for name in (
        "slipstream_queue_depth",
        "slipstream_batch_size_bucket",
        "slipstream_compute_seconds_bucket",
        "slipstream_queue_seconds_bucket",
        'slipstream_requests_total{endpoint="score",status="200"}',
    ):
        assert name in text
    paths = client.get("/openapi.json").json()["paths"]
    assert {"/v1/score", "/v1/generate", "/healthz", "/readyz", "/metrics"} <= set(paths)


def test_score_text_and_tokens_match_the_reference(client, tiny):
    text = "def f(x):\n    return x\n"
    r = client.post("/v1/score", json={"text": text, "token_logprobs": True})
    assert r.status_code == 200
    ref = score_reference(tiny, ByteCodec().encode(text))
    body = r.json()
    assert body["scored_tokens"] == len(text.encode())
    np.testing.assert_allclose(body["token_logprobs"], ref["token_logprobs"], atol=2e-5)
    r2 = client.post("/v1/score", json={"tokens": ByteCodec().encode(text)})
    assert r2.json()["loss"] == pytest.approx(ref["loss"], abs=1e-5) and "token_logprobs" not in r2.json()


@pytest.mark.parametrize(
    ("body", "status"),
    [
        ({}, 422),
        ({"text": "ab", "tokens": [1, 2]}, 422),
        ({"tokens": [1, 2], "extra": 1}, 422),
        ({"tokens": "abc"}, 422),
        ({"tokens": [1, 2], "timeout_s": -1}, 422),
        ({"tokens": [1]}, 422),
        ({"tokens": [1, 300]}, 422),
        ({"tokens": [1] * 65}, 413),
        ({"text": "x" * 5000}, 413),
    ],
)
def test_bad_score_requests_get_4xx_with_a_message(client, body, status):
    r = client.post("/v1/score", json=body)
    assert r.status_code == status, r.text
    assert r.json().get("error") or r.json().get("detail")


def test_body_that_is_not_json_and_missing_token(client, tiny):
    r = client.post("/v1/score", content=b"\xff\xfe not json", headers={"content-type": "application/json"})
    assert r.status_code in (400, 422)
    r = client.post("/v1/score", json={"tokens": [1, 2]}, headers={"Authorization": "Bearer wrong"})
    assert r.status_code == 401 and "bearer" in r.json()["error"]


def test_generate_plain_and_streamed(client, tiny):
    prompt = [256, *b"def "]
    want = generate_reference(tiny.model, prompt, 8)
    r = client.post("/v1/generate", json={"tokens": prompt, "max_new_tokens": 8, "stop_at_eos": False})
    assert r.status_code == 200 and r.json()["tokens"] == want and r.json()["finish_reason"] == "length"
    with client.stream(
        "POST",
        "/v1/generate",
        json={"tokens": prompt, "max_new_tokens": 8, "stop_at_eos": False, "stream": True},
    ) as s:
        assert s.headers["content-type"].startswith("text/event-stream")
        events = [json.loads(line[5:]) for line in s.iter_lines() if line.startswith("data:")]
    assert [e["token"] for e in events[:-1]] == want
    assert events[-1] == {"done": True, "finish_reason": "length"}
    r = client.post("/v1/generate", json={"prompt": "x" * 60, "max_new_tokens": 10})
    assert r.status_code == 413


def test_overload_is_refused_before_the_body_is_parsed(client):
    """With the predicted wait over the budget, even an unparseable body gets 503 + Retry-After
    (the refusal came first, at no parsing cost); a wrong token still gets 401; and once the
    queue is predicted to drain, requests are scored again."""
    engine = client.app.state.engine
    engine._queued_s = 1000.0  # as if 1000 s of work were queued
    try:
        r = client.post("/v1/score", content=b"\xff not json", headers={"content-type": "application/json"})
        assert r.status_code == 503 and "predicted queue wait" in r.json()["error"]
        assert int(r.headers["retry-after"]) >= 1
        r = client.post("/v1/score", json={"tokens": [1, 2]}, headers={"Authorization": "Bearer wrong"})
        assert r.status_code == 401
    finally:
        engine._queued_s = 0.0
    assert client.post("/v1/score", json={"tokens": [1, 2, 3]}).status_code == 200
