"""`slipstream loadtest` against an OpenAI-compatible server: a fake one in a thread, whose answers
are known (chunk count, sleeps, usage, refusals), so every figure the load generator reports can
be checked against what the server did."""

from __future__ import annotations

import asyncio
import json
import threading
from collections import Counter

import pytest
from aiohttp import web

from slipstream.recipe import RecipeError
from slipstream.serve import bodies, cli, loadgen

from .conftest import free_port

TTFT_S = 0.08  # the fake's sleep before the first text chunk
ITL_S = 0.02  # and between text chunks
USAGE_PER_CHUNK = 2  # usage.completion_tokens = 2 x text chunks (a chunk may carry several tokens)
MODEL = "fake-model"


class FakeOpenAI:
    """/v1/completions and /v1/chat/completions. The prompt's first word picks the behaviour:
    `busy` 503 + Retry-After, `limit` 429 (no Retry-After), `hang` answers after 2 s, `cut` closes
    the connection mid-stream, `oops` sends an error event in a 200 stream; anything else gets
    max_tokens text chunks (chat: after a role-only chunk), a finish chunk with empty text, the
    usage chunk when asked for, and [DONE]."""

    def __init__(self):
        self.bodies: list[dict] = []
        self.models_calls = 0

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/v1/completions", self.complete)
        app.router.add_post("/v1/chat/completions", self.complete)
        app.router.add_get("/v1/models", self.models)
        return app

    async def models(self, request):
        self.models_calls += 1
        return web.json_response({"object": "list", "data": [{"id": MODEL}, {"id": "other"}]})

    def kinds(self) -> Counter:
        return Counter(_prompt(b).split()[0] for b in self.bodies)

    async def complete(self, request):
        body = await request.json()
        self.bodies.append(body)
        kind = _prompt(body).split()[0]
        chat = "messages" in body
        n = body["max_tokens"]
        if kind == "busy":
            return web.json_response({"error": "busy"}, status=503, headers={"Retry-After": "1"})
        if kind == "limit":
            return web.json_response({"error": "slow down"}, status=429)
        if kind == "hang":
            await asyncio.sleep(2)
        if not body.get("stream"):
            await asyncio.sleep(TTFT_S + ITL_S * (n - 1))
            return web.json_response({"choices": [{"text": "w" * n}], "usage": {"completion_tokens": 3 * n}})
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)

        async def send(obj):
            await resp.write(b"data: " + json.dumps(obj).encode() + b"\n\n")

        def choice(text):
            return {"delta": {"content": text}} if chat else {"text": text}

        if chat:
            await send({"choices": [{"delta": {"role": "assistant"}, "index": 0}]})
        await asyncio.sleep(TTFT_S)
        for i in range(n):
            if i:
                await asyncio.sleep(ITL_S)
            await send({"choices": [{"index": 0, **choice(f" w{i}")}]})
            if kind == "cut" and i == 1:
                request.transport.close()
                return resp
            if kind == "oops" and i == 1:
                await send({"error": {"message": "engine failed"}})
                break
        await send({"choices": [{"index": 0, "finish_reason": "length", **choice("")}]})
        if (body.get("stream_options") or {}).get("include_usage"):
            await send({"choices": [], "usage": {"completion_tokens": USAGE_PER_CHUNK * n}})
        await resp.write(b"data: [DONE]\n\n")
        return resp


def _prompt(body: dict) -> str:
    return body["prompt"] if "prompt" in body else body["messages"][-1]["content"]


@pytest.fixture(scope="module")
def fake():
    srv = FakeOpenAI()
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    runner = web.AppRunner(srv.app(), access_log=None)
    port = free_port()

    def run(coro):
        return asyncio.run_coroutine_threadsafe(coro, loop).result(timeout=10)

    run(runner.setup())
    run(web.TCPSite(runner, "127.0.0.1", port).start())
    yield srv, f"http://127.0.0.1:{port}"
    run(runner.cleanup())
    loop.call_soon_threadsafe(loop.stop)
    thread.join(timeout=5)


def test_streamed_completions_measure_ttft_inter_token_latency_and_usage_tokens(fake):
    srv, base = fake
    srv.bodies.clear()
    n = 5
    payloads = bodies.openai_payloads(["ok one", "ok two"], "completions", MODEL, n, stream=True)
    res = asyncio.run(loadgen.open_loop(base + "/v1/completions", payloads, 20, 1.0, seed=3))
    assert res.sent == len(srv.bodies) >= 10 and res.ok == res.sent and not res.errors_by_status
    # tokens from the usage chunk (2 per text chunk here), not from counting chunks
    assert res.output_tokens == res.ok * n * USAGE_PER_CHUNK
    assert res.tokens_per_s == pytest.approx(res.output_tokens / res.duration_s)
    # TTFT from the intended send time to the first text chunk; each whole answer takes longer than
    # its own first token, so every quantile of TTFT sits below the same quantile of latency. (A
    # cross-quantile check, TTFT p99 < latency p50, fails on one late send on a busy host.)
    assert TTFT_S <= res.ttft_p50_s <= res.ttft_p90_s <= res.ttft_p99_s
    assert res.ttft_p50_s < res.p50_s and res.ttft_p90_s < res.p90_s and res.ttft_p99_s < res.p99_s
    assert res.p50_s >= TTFT_S + (n - 1) * ITL_S
    # gaps between text chunks of one answer: ~ITL_S, not TTFT_S, not 0
    assert 0.8 * ITL_S <= res.itl_p50_s <= res.itl_p90_s <= res.itl_p99_s
    assert res.itl_p50_s < TTFT_S


def test_chat_stream_without_usage_counts_text_chunks_not_role_or_finish_chunks(fake):
    srv, base = fake
    srv.bodies.clear()
    n = 4
    body = {"model": MODEL, "messages": [{"role": "user", "content": "ok"}], "max_tokens": n, "stream": True}
    res = asyncio.run(loadgen.open_loop(base + "/v1/chat/completions", [body], 10, 0.6, seed=1))
    assert res.ok == res.sent > 0
    assert res.output_tokens == res.ok * n  # no usage chunk: the text chunks, not the role or finish ones
    assert res.ttft_p50_s >= TTFT_S  # the role-only chunk (sent at once) is not the first token


def test_non_streamed_answers_take_tokens_from_usage_and_have_no_ttft(fake):
    srv, base = fake
    payloads = bodies.openai_payloads(["ok"], "completions", MODEL, 3, stream=False)
    assert "stream_options" not in payloads[0] and payloads[0]["stream"] is False
    res = asyncio.run(loadgen.open_loop(base + "/v1/completions", payloads, 10, 0.5, seed=2))
    assert res.ok == res.sent > 0 and res.output_tokens == res.ok * 9
    assert res.ttft_p50_s is None and res.itl_p50_s is None and res.p50_s >= TTFT_S


def test_refusals_and_broken_answers_are_counted_by_kind(fake):
    srv, base = fake
    srv.bodies.clear()
    n = 3
    prompts = ["ok", "busy", "limit", "cut", "oops", "hang"]
    payloads = bodies.openai_payloads(prompts, "completions", MODEL, n, stream=True)
    res = asyncio.run(loadgen.open_loop(base + "/v1/completions", payloads, 40, 1.0, seed=5, timeout_s=0.5))
    seen = srv.kinds()
    assert res.sent == sum(seen.values()) and all(seen[k] > 0 for k in prompts)
    assert res.errors_by_status == {
        "503": seen["busy"],
        "429": seen["limit"],
        "incomplete": seen["cut"],
        "stream-error": seen["oops"],
        "timeout": seen["hang"],
    }
    assert res.retry_after == seen["busy"]  # only the 503s carried Retry-After
    # only complete answers count: their tokens and their latencies
    assert res.ok == seen["ok"] and res.output_tokens == seen["ok"] * n * USAGE_PER_CHUNK
    assert res.p99_s < 0.5
    assert not res.passes(slo_p99_s=10.0)  # > 1% errors fails whatever the latency


def test_sweep_judges_openai_streams_on_end_to_end_p99(fake):
    srv, base = fake
    payloads = bodies.openai_payloads(["ok"], "chat", MODEL, 5, stream=True)
    url = base + "/v1/chat/completions"
    kw = dict(start_rps=20, factor=2, step_duration_s=0.5, max_steps=2, pause_s=0.05)
    res = asyncio.run(loadgen.sweep({"fake": url}, payloads, slo_p99_s=5.0, **kw))["fake"]
    assert res.max_rate_rps == 40 and [s["rate_rps"] for s in res.steps] == [20, 40]
    assert all(s["itl_p50_s"] and s["output_tokens"] == s["ok"] * 10 > 0 for s in res.steps)
    # an SLO above every TTFT but below the end-to-end latency (~0.16 s) fails every step
    strict = asyncio.run(loadgen.sweep({"fake": url}, payloads, slo_p99_s=0.12, **kw))["fake"]
    assert strict.max_rate_rps is None and [s["rate_rps"] for s in strict.steps] == [20, 10]
    assert all(s["sent"] > 0 and s["ttft_p99_s"] < 0.12 < s["p99_s"] for s in strict.steps)


def test_sweep_sends_each_target_its_own_payloads(fake):
    srv, base = fake
    srv.bodies.clear()
    targets = {"a": base + "/v1/completions", "b": base + "/v1/chat/completions"}
    payloads = {
        "a": bodies.openai_payloads(["ok"], "completions", "model-a", 2, stream=True),
        "b": bodies.openai_payloads(["ok"], "chat", "model-b", 2, stream=True),
    }
    res = asyncio.run(
        loadgen.sweep(
            targets, payloads, slo_p99_s=5.0, start_rps=20, step_duration_s=0.4, max_steps=1, pause_s=0
        )
    )
    assert res["a"].steps[0]["ok"] > 0 and res["b"].steps[0]["ok"] > 0
    models = {("messages" in b, b["model"]) for b in srv.bodies}
    assert models == {(False, "model-a"), (True, "model-b")}


def test_cli_asks_the_server_for_its_model_and_sends_openai_bodies(fake, tmp_path):
    srv, base = fake
    srv.bodies.clear()
    calls = srv.models_calls
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("ok first paragraph\nstill the first\n\n  \nok second one, rather longer than ten\n")
    out = tmp_path / "r.json"
    argv = ["loadtest", "--url", base + "/v1/chat/completions", "--endpoint", "chat", "--stream"]
    argv += ["--rate", "10", "--duration", "0.5", "--prompts", str(prompts), "--prompt-chars", "24"]
    argv += ["--max-new-tokens", "3", "--json", str(out)]
    assert cli.main(argv) == 0
    assert srv.models_calls == calls + 1
    assert srv.bodies and all(b["model"] == MODEL for b in srv.bodies)
    b = srv.bodies[0]
    assert b["max_tokens"] == 3 and b["temperature"] == 0 and b["stream"] is True
    assert b["stream_options"] == {"include_usage": True}
    assert {_prompt(b) for b in srv.bodies} <= {"ok first paragraph\nstill", "ok second one, rather lon"[:24]}
    data = json.loads(out.read_text())
    assert data["ok"] == data["sent"] > 0 and data["output_tokens"] == data["ok"] * 6
    assert data["itl_p50_s"] > 0 and data["ttft_p99_s"] >= TTFT_S


def test_cli_refuses_a_non_openai_url_for_openai_endpoints(fake, capsys):
    _, base = fake
    code = cli.main(["loadtest", "--url", base + "/v1/score", "--endpoint", "completions", "--rate", "1"])
    assert code == 2 and "needs an OpenAI URL" in capsys.readouterr().err


def test_a_run_in_which_no_request_succeeds_exits_1_with_its_json_written(fake, tmp_path, capsys):
    _, base = fake
    prompts = tmp_path / "busy.txt"
    prompts.write_text("busy one\n\nbusy two\n")
    out = tmp_path / "r.json"
    argv = ["loadtest", "--url", base + "/v1/completions", "--endpoint", "completions", "--model-name", MODEL]
    argv += ["--rate", "20", "--duration", "0.3", "--prompts", str(prompts), "--json", str(out)]
    assert cli.main(argv) == 1
    assert "none of" in capsys.readouterr().err
    data = json.loads(out.read_text())
    assert data["ok"] == 0 and data["errors_by_status"]["503"] == data["sent"] > 0


def test_prompts_from_jsonl_text_and_the_default_corpus(tmp_path):
    jl = tmp_path / "p.jsonl"
    jl.write_text('{"prompt": "abcdef"}\n\n{"text": "xyz", "other": 1}\n')
    assert bodies.load_prompts(jl, chars=4) == ["abcd", "xyz"]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "a"}\n{"body": "b"}\n')
    with pytest.raises(RecipeError, match=r"bad.jsonl:2: .*\"prompt\" or \"text\""):
        bodies.load_prompts(bad)
    with pytest.raises(RecipeError, match="no such file"):
        bodies.load_prompts(tmp_path / "missing.txt")
    default = bodies.load_prompts(chars=50)
    assert len(default) > 100 and max(map(len, default)) == 50 and all(p.strip() for p in default)


def test_models_url_and_payload_shapes():
    assert loadgen.models_url("http://127.0.0.1:1/v1/chat/completions") == "http://127.0.0.1:1/v1/models"
    assert loadgen.models_url("http://127.0.0.1:1/x/v1/completions") == "http://127.0.0.1:1/x/v1/models"
    assert loadgen.is_openai("http://h/v1/chat/completions") and not loadgen.is_openai("http://h/v1/generate")
    chat = bodies.openai_payloads(["hi"], "chat", "m", 7, stream=False)[0]
    assert chat == {
        "model": "m",
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 7,
        "temperature": 0,
        "stream": False,
    }
    with pytest.raises(RecipeError, match="choose from completions, chat"):
        bodies.openai_payloads(["hi"], "score", "m", 7)
