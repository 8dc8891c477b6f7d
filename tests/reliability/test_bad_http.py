"""The bad-input catalogue, HTTP: every endpoint of a running `slipstream serve` (tiny GPT, 64-token
context, generation on, a bearer token) answers bad requests with a 4xx, never a 5xx, in its error
shape — `{"error": "..."}`, or OpenAI's `{"error": {"message", "type", "param", "code"}}` on the
OpenAI endpoints — with a one-line message naming the problem; and the server stays up."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from serve.conftest import running_server

TOKEN = "s3cret"
AUTH = {"authorization": f"Bearer {TOKEN}"}
MODEL = "slipstream-gpt"
S, G, C, CH = "/v1/score", "/v1/generate", "/v1/completions", "/v1/chat/completions"
OPENAI = (C, CH, "/v1/models")
USER = [{"role": "user", "content": "hi"}]


@dataclass(frozen=True)
class HttpCase:
    id: str
    method: str
    path: str
    body: Any
    """dict: sent as JSON; bytes: sent as they are (content-type JSON); None: no body."""
    status: int
    needles: tuple[str, ...] = ()
    auth: dict[str, str] | None = None
    """Headers standing in for the right bearer token (None: the right one)."""


def _oa(**fields) -> dict:
    return {"model": MODEL, **fields}


HTTP_CASES = [
    # /v1/score
    HttpCase("score-malformed-json", "POST", S, b"{not json", 422, ("JSON decode error",)),
    HttpCase("score-empty-body", "POST", S, b"", 422, ("Field required",)),
    HttpCase("score-array-body", "POST", S, b"[]", 422, ("valid dictionary",)),
    HttpCase("score-tokens-wrong-type", "POST", S, {"tokens": "abc"}, 422, ("body.tokens", "valid list")),
    HttpCase(
        "score-negative-token", "POST", S, {"tokens": [1, -1, 3]}, 422, ("token ids must lie in [0, 264)",)
    ),
    HttpCase("score-huge-token", "POST", S, {"tokens": [1, 2**40]}, 422, ("token ids must lie in",)),
    HttpCase("score-one-token", "POST", S, {"tokens": [5]}, 422, ("at least 2 tokens",)),
    HttpCase("score-both-inputs", "POST", S, {"text": "a", "tokens": [1, 2]}, 422, ("exactly one of",)),
    HttpCase(
        "score-unknown-field", "POST", S, {"text": "ab", "model": "x"}, 422, ("body.model", "Extra inputs")
    ),
    HttpCase(
        "score-negative-timeout",
        "POST",
        S,
        {"text": "ab", "timeout_s": -1},
        422,
        ("timeout_s", "greater than 0"),
    ),
    HttpCase(
        "score-huge-timeout", "POST", S, {"text": "ab", "timeout_s": 1e9}, 422, ("less than or equal to 600",)
    ),
    HttpCase("score-nan-timeout", "POST", S, b'{"text": "ab", "timeout_s": NaN}', 422, ("timeout_s",)),
    HttpCase(
        "score-too-long", "POST", S, {"text": "x" * 5000}, 413, ("exceeds the model's max_len 64", "split it")
    ),
    HttpCase("score-giant-body", "POST", S, b"x" * (2 << 20), 413, ("request body over", "send less")),
    HttpCase("score-lone-surrogate", "POST", S, b'{"text": "\\ud800"}', 422, ("body.text", "lone surrogate")),
    HttpCase("score-no-token", "POST", S, {"text": "ab"}, 401, ("bearer token",), auth={}),
    HttpCase(
        "score-wrong-token",
        "POST",
        S,
        {"text": "ab"},
        401,
        ("bearer token",),
        auth={"authorization": "Bearer x"},
    ),
    HttpCase("score-wrong-method", "GET", S, None, 405, ("GET is not allowed on /v1/score", "use POST")),
    # /v1/generate
    HttpCase("generate-malformed-json", "POST", G, b"{", 422, ("JSON decode error",)),
    HttpCase(
        "generate-negative-limit", "POST", G, {"prompt": "a", "max_new_tokens": -1}, 422, ("max_new_tokens",)
    ),
    HttpCase(
        "generate-huge-limit",
        "POST",
        G,
        {"prompt": "a", "max_new_tokens": 10**9},
        422,
        ("less than or equal to 4096",),
    ),
    HttpCase("generate-top-k-0", "POST", G, {"prompt": "a", "top_k": 0}, 422, ("top_k",)),
    HttpCase(
        "generate-negative-temperature", "POST", G, {"prompt": "a", "temperature": -1}, 422, ("temperature",)
    ),
    HttpCase("generate-negative-seed", "POST", G, {"prompt": "a", "seed": -1}, 422, ("seed",)),
    HttpCase("generate-prompt-wrong-type", "POST", G, {"prompt": 5}, 422, ("body.prompt", "valid string")),
    HttpCase("generate-too-long", "POST", G, {"prompt": "x" * 500}, 413, ("exceeds the model's max_len 64",)),
    HttpCase("generate-token-out-of-vocab", "POST", G, {"tokens": [999999]}, 422, ("token ids must lie in",)),
    HttpCase(
        "generate-lone-surrogate", "POST", G, b'{"prompt": "\\ud800"}', 422, ("body.prompt", "lone surrogate")
    ),
    # /v1/completions
    HttpCase("completions-malformed-json", "POST", C, b"{", 400, ("JSON decode error",)),
    HttpCase("completions-no-model", "POST", C, {"prompt": "a"}, 400, ("body.model", "Field required")),
    HttpCase(
        "completions-unknown-model",
        "POST",
        C,
        {"model": "nosuch", "prompt": "a"},
        404,
        ("'nosuch' is not served", MODEL),
    ),
    HttpCase(
        "completions-negative-max-tokens", "POST", C, _oa(prompt="a", max_tokens=-1), 400, ("max_tokens",)
    ),
    HttpCase(
        "completions-huge-max-tokens",
        "POST",
        C,
        _oa(prompt="a", max_tokens=10**9),
        400,
        ("exceeds the model's context",),
    ),
    HttpCase("completions-n-0", "POST", C, _oa(prompt="a", n=0), 400, ("body.n",)),
    HttpCase("completions-n-huge", "POST", C, _oa(prompt="a", n=1000), 400, ("less than or equal to 8",)),
    HttpCase("completions-logprobs-huge", "POST", C, _oa(prompt="a", logprobs=1000), 400, ("logprobs",)),
    HttpCase(
        "completions-too-many-stops",
        "POST",
        C,
        _oa(prompt="a", stop=["a"] * 100),
        400,
        ("'stop' takes at most 4",),
    ),
    HttpCase("completions-negative-token", "POST", C, _oa(prompt=[1, -5]), 400, ("token ids must lie in",)),
    HttpCase("completions-prompt-null", "POST", C, _oa(prompt=None), 400, ("body.prompt",)),
    HttpCase(
        "completions-prompt-too-long", "POST", C, _oa(prompt="x" * 500), 400, ("the model's context is 64",)
    ),
    HttpCase(
        "completions-unsupported-field",
        "POST",
        C,
        _oa(prompt="a", echo=True),
        400,
        ("'echo' is not supported",),
    ),
    HttpCase(
        "completions-temperature-wrong-type",
        "POST",
        C,
        _oa(prompt="a", temperature="hot"),
        400,
        ("temperature",),
    ),
    HttpCase(
        "completions-lone-surrogate",
        "POST",
        C,
        b'{"model": "slipstream-gpt", "prompt": "\\ud800"}',
        400,
        ("body.prompt", "lone surrogate"),
    ),
    # /v1/chat/completions
    HttpCase("chat-malformed-json", "POST", CH, b"{", 400, ("JSON decode error",)),
    HttpCase(
        "chat-unknown-model", "POST", CH, {"model": "nosuch", "messages": USER}, 404, ("is not served here",)
    ),
    HttpCase("chat-no-messages", "POST", CH, _oa(messages=[]), 400, ("at least 1 item",)),
    HttpCase(
        "chat-messages-wrong-type", "POST", CH, _oa(messages="hi"), 400, ("body.messages", "valid list")
    ),
    HttpCase(
        "chat-unknown-role", "POST", CH, _oa(messages=[{"role": "wizard", "content": "a"}]), 400, ("role",)
    ),
    HttpCase(
        "chat-content-wrong-type",
        "POST",
        CH,
        _oa(messages=[{"role": "user", "content": 5}]),
        400,
        ("content",),
    ),
    HttpCase("chat-negative-max-tokens", "POST", CH, _oa(messages=USER, max_tokens=-3), 400, ("max_tokens",)),
    HttpCase(
        "chat-no-template", "POST", CH, _oa(messages=USER), 400, ("no chat template", "use /v1/completions")
    ),
    HttpCase(
        "chat-lone-surrogate",
        "POST",
        CH,
        b'{"model": "slipstream-gpt", "messages": [{"role": "user", "content": "\\ud800"}]}',
        400,
        ("lone surrogate",),
    ),
    # /v1/models and unknown routes
    HttpCase("models-wrong-method", "POST", "/v1/models", {}, 405, ("use GET",)),
    HttpCase("models-no-token", "GET", "/v1/models", None, 401, ("bearer token",), auth={}),
    HttpCase("unknown-path", "GET", "/v1/nosuch", None, 404, ("no endpoint /v1/nosuch", "/docs")),
]


@pytest.fixture(scope="module")
def url():
    with running_server("--generate-slots", "2", "--token", TOKEN) as u:
        yield u


def _send(url: str, case: HttpCase) -> httpx.Response:
    headers = dict(AUTH if case.auth is None else case.auth)
    kw: dict[str, Any] = {}
    if isinstance(case.body, bytes):
        kw["content"] = case.body
        headers["content-type"] = "application/json"
    elif case.body is not None:
        kw["json"] = case.body
    return httpx.request(case.method, url + case.path, headers=headers, timeout=60, **kw)


@pytest.mark.parametrize("case", HTTP_CASES, ids=[c.id for c in HTTP_CASES])
def test_bad_request_gets_a_4xx_in_the_error_shape(url, case):
    r = _send(url, case)
    assert r.status_code == case.status, r.text
    body = r.json()
    if case.path in OPENAI:
        assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
        message = body["error"]["message"]
        assert body["error"]["type"].endswith("_error")
    else:
        assert set(body) == {"error"} and isinstance(body["error"], str), body
        message = body["error"]
    assert "\n" not in message and "Traceback" not in message, message
    for needle in case.needles:
        assert needle in message, f"{needle!r} not in {message!r}"


def test_a_giant_chunked_body_is_refused_without_content_length(url):
    """No Content-Length to check up front: the body is counted as it arrives."""

    def chunks():
        for _ in range(64):
            yield b"x" * 65536  # 4 MiB in all, over the 1 MiB limit

    r = httpx.post(
        url + S, content=chunks(), headers={**AUTH, "content-type": "application/json"}, timeout=60
    )
    assert r.status_code == 413 and "request body over" in r.json()["error"]


def test_the_server_survives_the_catalogue(url):
    """After every bad request above (module order: this runs last), the server still answers."""
    assert httpx.get(url + "/healthz", timeout=10).status_code == 200
    r = httpx.post(url + S, json={"text": "def f(x):\n    return x\n"}, headers=AUTH, timeout=60)
    assert r.status_code == 200 and r.json()["scored_tokens"] > 0


def test_the_http_catalogue_covers_every_endpoint():
    paths = {c.path for c in HTTP_CASES}
    assert {S, G, C, CH, "/v1/models"} <= paths
    assert {c.status for c in HTTP_CASES} <= set(range(400, 500))
