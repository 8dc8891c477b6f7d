"""A real server process on a loopback port: load generator runs, and SIGTERM drains in-flight work."""

import asyncio
import json
import signal
import subprocess

import httpx
import pytest

from slipstream.recipe import RecipeError
from slipstream.serve import loadgen

from .conftest import start_server


def test_open_and_closed_loop_against_a_live_server(server):
    payloads = [{"tokens": [256, *range(n)]} for n in (3, 20, 50)]
    res = asyncio.run(loadgen.open_loop(server + "/v1/score", payloads, rate_rps=30, duration_s=1.5, seed=1))
    assert res.sent >= 20 and res.ok == res.sent and not res.errors_by_status
    assert 0 < res.p50_s <= res.p99_s <= res.max_s
    closed = asyncio.run(loadgen.closed_loop(server + "/v1/score", payloads, concurrency=3, duration_s=1.0))
    assert closed.ok == closed.sent > 3 and closed.concurrency == 3
    bad = asyncio.run(loadgen.open_loop(server + "/v1/score", [{"tokens": [1]}], rate_rps=20, duration_s=0.5))
    assert bad.ok == 0 and bad.errors_by_status == {"422": bad.sent}
    gen = [{"tokens": [256, 1, 2], "max_new_tokens": 5, "stop_at_eos": False, "stream": True}]
    streamed = asyncio.run(
        loadgen.open_loop(server + "/v1/generate", gen, rate_rps=5, duration_s=1.0, stream=True)
    )
    assert streamed.ok == streamed.sent > 0 and streamed.ttft_p50_s is not None and streamed.tokens_per_s > 0


def test_sweep_finds_a_passing_rate_and_stops(server):
    payloads = [{"tokens": [256, *range(30)]}]
    res = asyncio.run(
        loadgen.sweep(
            {"s": server + "/v1/score"},
            payloads,
            slo_p99_s=5.0,
            start_rps=5,
            factor=2,
            step_duration_s=0.5,
            max_steps=3,
            pause_s=0.1,
        )
    )["s"]
    assert res.max_rate_rps == 20 and [s["rate_rps"] for s in res.steps] == [5, 10, 20]
    strict = asyncio.run(
        loadgen.sweep(
            {"s": server + "/v1/score"},
            payloads,
            slo_p99_s=1e-6,
            start_rps=5,
            factor=2,
            step_duration_s=0.3,
            max_steps=3,
            pause_s=0.1,
        )
    )["s"]
    assert strict.max_rate_rps is None and [s["rate_rps"] for s in strict.steps] == [5, 2.5, 1.25]


def test_load_tests_refuse_non_loopback_targets():
    with pytest.raises(RecipeError, match="only this machine"):
        asyncio.run(loadgen.open_loop("http://example.com/v1/score", [{"tokens": [1, 2]}], 1, 1))


def test_sigterm_finishes_every_admitted_request_and_exits_0():
    proc, url = start_server("--generate-slots", "2", "--drain-timeout", "30")
    n_requests, new_tokens = 6, 40
    body = {"tokens": [256, 1, 2, 3], "max_new_tokens": new_tokens, "stop_at_eos": False, "stream": True}

    async def main():
        first_tokens = asyncio.Semaphore(0)

        async def one(client):
            tokens, done = 0, None
            async with client.stream("POST", url + "/v1/generate", json=body) as resp:
                assert resp.status_code == 200
                async for line in resp.aiter_lines():
                    if line.startswith("data:"):
                        event = json.loads(line[5:])
                        if "token" in event:
                            tokens += 1
                            if tokens == 1:
                                first_tokens.release()
                        else:
                            done = event
            return tokens, done

        async def score(client):
            r = await client.post(url + "/v1/score", json={"tokens": [256, *range(40)]})
            return r.status_code

        async with httpx.AsyncClient(timeout=60) as client:
            gens = [asyncio.create_task(one(client)) for _ in range(n_requests)]
            await first_tokens.acquire()  # generation is under way (2 slots busy, 4 requests queued)
            scores = [asyncio.create_task(score(client)) for _ in range(8)]
            await asyncio.sleep(0.05)
            proc.send_signal(signal.SIGTERM)
            return await asyncio.gather(*gens), await asyncio.gather(*scores)

    try:
        gens, scores = asyncio.run(main())
        rc = proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert gens == [(new_tokens, {"done": True, "finish_reason": "length"})] * n_requests
    assert scores == [200] * 8
    assert rc == 0, proc.stdout.read()
    assert "drained" in proc.stdout.read()
    with pytest.raises(httpx.TransportError):
        httpx.get(url + "/healthz", timeout=2)


def test_bad_serve_flags_fail_with_one_line_and_exit_2(tmp_path):
    import sys

    out = subprocess.run(
        [sys.executable, "-m", "slipstream.serve.cli", "serve", "--checkpoint", str(tmp_path / "none.pt")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert (
        out.returncode == 2 and "does not exist" in out.stderr and len(out.stderr.strip().splitlines()) == 1
    )
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "slipstream.serve.cli",
            "loadtest",
            "--url",
            "http://10.0.0.1:80/v1/score",
            "--rate",
            "1",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2 and "only this machine" in out.stderr
