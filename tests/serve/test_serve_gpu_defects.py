"""Serving defects of issue 16 checked on CPU: CUDA-graph replays on one thread, the warm-up median
without the graph-recording run, Python 3.10's asyncio.TimeoutError, the bearer token compared in
constant time. The CUDA-only conditions are switched on by faking the two predicates that read them."""

from __future__ import annotations

import asyncio
import hmac
import threading
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from fastapi.testclient import TestClient

from slipstream.serve import engine as engine_mod
from slipstream.serve import loadgen
from slipstream.serve.app import bearer_matches, create_app
from slipstream.serve.engine import (
    EngineConfig,
    ScoreEngine,
    replays_on_one_thread,
    unsteady_warmup_runs,
)

from .oracles import score_all, score_reference

CUDA, CPU = torch.device("cuda"), torch.device("cpu")


def _engine(tiny, **kw) -> ScoreEngine:
    cfg = EngineConfig(
        **{"max_batch_size": 4, "n_lengths": 2, "warmup_reps": 2, "latency_budget_s": 30.0, **kw}
    )
    return ScoreEngine(tiny, cfg, expected_lengths=np.arange(2, 65))


def test_only_compiled_cuda_replays_graphs():
    compiled = EngineConfig(compile=True)
    assert replays_on_one_thread(compiled, CUDA) and unsteady_warmup_runs(compiled, CUDA) == 2
    for cfg, dev in ((compiled, CPU), (EngineConfig(), CUDA), (EngineConfig(), CPU)):
        assert not replays_on_one_thread(cfg, dev) and unsteady_warmup_runs(cfg, dev) == 1


def test_compiled_cuda_forwards_replay_on_one_thread_whatever_the_workers(tiny, monkeypatch):
    """Two workers: batches are padded on both, but every forward (a graph replay on CUDA, whose
    static output the next replay rewrites) runs, and is copied out, on the one graph thread."""
    monkeypatch.setattr(engine_mod, "replays_on_one_thread", lambda config, device: True)
    threads: list[str] = []
    eng = _engine(tiny, workers=2)
    model = eng._model

    def spy(*args, **kwargs):  # the forward the engine calls (the compiled callable when compiling)
        threads.append(threading.current_thread().name)
        return model(*args, **kwargs)

    eng._model = spy
    rng = np.random.default_rng(1)
    seqs = [rng.integers(0, 258, rng.integers(2, 65)).tolist() for _ in range(9)]

    results = score_all(eng, seqs)
    assert threads and set(threads) == {"slipstream-graphs_0"}  # warm-up included
    for s, r in zip(seqs, results):
        np.testing.assert_allclose(r["token_logprobs"], score_reference(tiny, s)["token_logprobs"], atol=2e-5)


def test_warmup_latency_leaves_out_the_graph_recording_run(tiny, monkeypatch):
    clock = [0.0]
    monkeypatch.setattr(engine_mod, "time", SimpleNamespace(perf_counter=lambda: clock[0]))
    monkeypatch.setattr(engine_mod, "unsteady_warmup_runs", lambda config, device: 2)
    eng = _engine(tiny, warmup_reps=3)
    durations: dict[tuple[int, int], list[float]] = {}

    def forward(rows, b, L):  # compile 5 s, record the CUDA graph 1 s, then replays of 10 ms
        runs = durations.setdefault((b, L), [])
        runs.append((5.0, 1.0)[len(runs)] if len(runs) < 2 else 0.01)
        clock[0] += runs[-1]

    monkeypatch.setattr(eng, "_forward", forward)
    latency = eng.warmup()
    assert all(len(d) == 3 for d in durations.values())  # at least one steady run per shape
    assert latency and all(t == pytest.approx(0.01) for t in latency.values())  # 0.505 with the recording run


# ----------------------------------------------------------------------------- Python 3.10


class _Py310Timeout(Exception):
    """What asyncio.TimeoutError is before Python 3.11: not the builtin TimeoutError."""


@pytest.fixture
def python_310_timeouts(monkeypatch):
    assert not issubclass(_Py310Timeout, TimeoutError)
    monkeypatch.setattr(asyncio, "TimeoutError", _Py310Timeout)

    async def wait_for(aw, timeout):
        aw.close()  # never awaited: the window timed out
        raise _Py310Timeout

    monkeypatch.setattr(asyncio, "wait_for", wait_for)


def test_batcher_window_timeout_is_caught_on_python_310(tiny, python_310_timeouts):
    eng = _engine(tiny)

    async def run():
        eng._available = asyncio.Event()
        return await eng._wait_pending(0.01)

    assert asyncio.run(run()) is False  # before the fix: _Py310Timeout escaped and the batcher died


def test_loadgen_counts_a_timeout_on_python_310(python_310_timeouts):
    class TimesOut:
        def post(self, *args, **kwargs):
            return self

        async def __aenter__(self):
            raise asyncio.TimeoutError  # what aiohttp raises: asyncio's class

        async def __aexit__(self, *exc):
            return False

    rec = loadgen._Record()
    asyncio.run(loadgen._send(TimesOut(), "http://x/v1/score", b"{}", 0.0, rec, stream=False))
    assert rec.statuses == {"timeout": 1}


# ----------------------------------------------------------------------------- bearer token


def test_bearer_token_is_compared_in_constant_time(tiny, monkeypatch):
    compared: list[bytes] = []
    digest = hmac.compare_digest

    def spy(a, b):
        compared.append(a)
        return digest(a, b)

    monkeypatch.setattr(hmac, "compare_digest", spy)
    assert bearer_matches("Bearer s3cret", "s3cret") and bearer_matches(b"Bearer s3cret", "s3cret")
    assert not bearer_matches("Bearer s3cre", "s3cret") and not bearer_matches(None, "s3cret")
    assert bearer_matches("Bearer pässwort".encode().decode("latin-1"), "pässwort")  # raw UTF-8 bytes
    compared.clear()
    app = create_app(_engine(tiny), None, token="s3cret")
    with TestClient(app) as client:
        body = {"tokens": [1, 2, 3]}
        assert (
            client.post("/v1/score", json=body, headers={"Authorization": "Bearer s3cret"}).status_code == 200
        )
        assert (
            client.post("/v1/score", json=body, headers={"Authorization": "Bearer s3creT"}).status_code == 401
        )
        assert client.post("/v1/score", json=body).status_code == 401
    # each request is checked twice (the shedding middleware, then the route), always by compare_digest
    assert compared.count(b"Bearer s3cret") == 2 and compared.count(b"Bearer s3creT") == 2
    assert compared.count(b"") == 2
