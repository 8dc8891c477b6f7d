import asyncio
import time

import numpy as np
import pytest

from slipstream.serve.engine import EngineConfig, ScoreEngine, ServeError

from .oracles import score_all, score_reference


def _engine(tiny, **kw):
    cfg = EngineConfig(
        **{"max_batch_size": 4, "n_lengths": 2, "warmup_reps": 2, "latency_budget_s": 30.0, **kw}
    )
    return ScoreEngine(tiny, cfg, expected_lengths=np.arange(2, 65))


@pytest.mark.parametrize("static", ["on", "off"])
def test_batched_padded_scores_equal_one_unpadded_forward_each(tiny, static):
    eng = _engine(tiny, static_shapes=static)
    eng.warmup()
    # Batching is decided from the warm-up's timings, which are noise at this size on a busy CPU
    # (it ran every request alone 2 times in 10): price a batch like one row, as on a GPU, so the
    # engine batches and the padded path is what gets checked.
    eng.plan.latency_s.update({(b, L): 1e-3 * L for b, L in eng.plan.latency_s})
    rng = np.random.default_rng(0)
    seqs = [rng.integers(0, 258, rng.integers(2, 65)).tolist() for _ in range(13)]
    results = score_all(eng, seqs, warmup=False)
    assert eng.stats.batches < len(seqs)  # some requests shared a forward pass
    real = sum(len(s) for s in seqs)
    planned = sum(n * int(k.split("x")[0]) * int(k.split("x")[1]) for k, n in eng.stats.shapes_run.items())
    if static == "on":  # every forward ran its planned shape
        assert eng.stats.padded_tokens == planned - real > 0
    else:  # each batch padded only to its own longest row and real size
        assert eng.stats.padded_tokens < planned - real
    assert eng.stats.real_tokens == real
    for s, r in zip(seqs, results):
        ref = score_reference(tiny, s)
        assert r["scored_tokens"] == len(s) - 1
        np.testing.assert_allclose(r["token_logprobs"], ref["token_logprobs"], atol=2e-5)
        assert r["loss"] == pytest.approx(ref["loss"], abs=1e-5)
    # Every forward ran a planned shape, each warmed before ready.
    planned = {f"{b}x{L}" for b, L in eng.plan.shapes}
    assert set(eng.stats.shapes_run) <= planned
    assert set(eng.plan.latency_s) == set(eng.plan.shapes)


def test_bad_inputs_are_refused_with_statuses(tiny):
    eng = _engine(tiny)

    async def run():
        await eng.start(warmup=False)
        out = {}
        for name, toks, kw in [
            ("short", [1], {}),
            ("long", [1] * 65, {}),
            ("vocab", [1, 264], {}),
            ("negative", [-1, 2], {}),
            ("timeout", [1, 2], {"timeout_s": float("nan")}),
        ]:
            with pytest.raises(ServeError) as err:
                await eng.score(toks, **kw)
            out[name] = err.value.status
        await eng.drain(1)
        return out

    assert asyncio.run(run()) == {"short": 422, "long": 413, "vocab": 422, "negative": 422, "timeout": 422}


def test_expired_requests_get_504_without_compute(tiny):
    eng = _engine(tiny, latency_budget_s=0.01)  # no batch window: the first request runs alone

    async def run():
        await eng.start(warmup=False)
        slow = eng._forward

        def stall(*a):  # the first batch holds the compute thread
            time.sleep(0.3)
            return slow(*a)

        eng._forward = stall
        first = asyncio.create_task(eng.score([1, 2, 3]))
        await asyncio.sleep(0.05)
        late = [asyncio.create_task(eng.score([1, 2, 3, 4], timeout_s=0.1)) for _ in range(3)]
        res = await asyncio.gather(first, *late, return_exceptions=True)
        await eng.drain(2)
        return res

    res = asyncio.run(run())
    assert isinstance(res[0], dict)
    assert [r.status for r in res[1:]] == [504, 504, 504]
    assert eng.stats.expired == 3 and eng.stats.requests == 1  # the expired ones never ran


def test_full_queue_and_predicted_wait_shed_with_503_and_retry_after(tiny):
    eng = _engine(tiny, max_queue=3, latency_budget_s=10.0)

    async def run():
        await eng.start(warmup=False)
        gate = asyncio.Event()
        slow = eng._forward

        def stall(*a):
            time.sleep(0.3)
            return slow(*a)

        eng._forward = stall
        tasks = [asyncio.create_task(eng.score([1, 2, 3])) for _ in range(12)]
        res = await asyncio.gather(*tasks, return_exceptions=True)
        gate.set()
        await eng.drain(5)
        return res

    res = asyncio.run(run())
    refused = [r for r in res if isinstance(r, ServeError)]
    served = [r for r in res if isinstance(r, dict)]
    assert refused and served and len(refused) + len(served) == 12
    assert all(r.status == 503 and r.retry_after_s >= 1 for r in refused)

    # Shedding by predicted wait: with a tiny budget and a measured cost, a deep queue is refused.
    eng2 = _engine(tiny, latency_budget_s=1e-4)

    async def run2():
        await eng2.start(warmup=False)
        eng2.plan.latency_s = {s: 0.05 for s in eng2.plan.shapes}
        eng2._queued_s = 10.0
        with pytest.raises(ServeError) as err:
            await eng2.score([1, 2, 3])
        eng2._queued_s = 0.0
        await eng2.drain(1)
        return err.value

    err = asyncio.run(run2())
    assert err.status == 503 and "predicted" in err.message


def test_a_failing_batch_fails_only_its_requests(tiny):
    eng = _engine(tiny)
    calls = {"n": 0}

    async def run():
        await eng.start(warmup=False)
        real = eng._forward

        def flaky(rows, b, L):
            calls["n"] += 1
            if calls["n"] == 1:
                raise RuntimeError("injected fault")
            return real(rows, b, L)

        eng._forward = flaky
        bad = await asyncio.gather(eng.score([1, 2, 3]), return_exceptions=True)
        good = await eng.score([1, 2, 3])
        await eng.drain(2)
        return bad[0], good

    bad, good = asyncio.run(run())
    assert isinstance(bad, ServeError) and bad.status == 500 and "injected" in bad.message
    assert good["scored_tokens"] == 2 and eng.stats.failed_batches == 1


def test_drain_finishes_queued_work_then_refuses(tiny):
    eng = _engine(tiny)

    async def run():
        await eng.start(warmup=False)
        tasks = [asyncio.create_task(eng.score([5] * n)) for n in range(2, 30)]
        await asyncio.sleep(0)
        done = await eng.drain(10)
        res = await asyncio.gather(*tasks, return_exceptions=True)
        with pytest.raises(ServeError) as err:
            await eng.score([1, 2])
        return done, res, err.value.status

    done, res, status = asyncio.run(run())
    assert done and all(isinstance(r, dict) for r in res) and status == 503


@pytest.mark.parametrize(
    ("cost", "gap_s", "expect_batched"),
    [("flat", 0.05, True), ("linear", 0.05, False), ("flat", 1.0, False)],
    ids=["gpu-like-busy", "cpu-like-busy", "gpu-like-idle"],
)
def test_batch_window_waits_only_when_batching_is_measured_to_pay(tiny, cost, gap_s, expect_batched):
    """Waits for a batch-mate only when a bigger batch is measured cheaper per request and the
    load is high enough (one request's cost / gap >= 0.5) for the throughput to matter."""
    eng = _engine(tiny, latency_budget_s=2.0)

    async def run():
        await eng.start(warmup=False)
        for b, L in eng.plan.shapes:  # flat: a GPU-like forward; linear: a compute-bound CPU
            eng.plan.latency_s[(b, L)] = 0.04 if cost == "flat" else 0.04 * b
        eng._gap_s = gap_s  # the measured mean gap between arrivals
        first = asyncio.create_task(eng.score([1, 2, 3]))
        await asyncio.sleep(0.04)  # within the window (2 expected gaps)
        second = asyncio.create_task(eng.score([1, 2, 3, 4]))
        await asyncio.gather(first, second)
        await eng.drain(2)

    asyncio.run(run())
    assert (eng.stats.batches == 1) is expect_batched
    if not expect_batched:
        assert eng.stats.batches == 2


def test_compiled_engine_scores_like_eager_and_compiles_nothing_after_warmup(tiny):
    """The compiled forward (frozen weights, one shape-generic graph) gives the eager scores, and
    serving varied lengths after warm-up builds no new graph: every shape it runs was warmed."""
    from slipstream.metrics import dynamo_graph_count

    eng = _engine(tiny, compile=True)
    assert eng.static_shapes  # auto: compiled code only ever sees planned shapes
    rng = np.random.default_rng(1)
    seqs = [rng.integers(0, 258, rng.integers(2, 65)).tolist() for _ in range(11)]
    lines = []

    async def run():
        await eng.start(progress=lines.append)
        warmed = dynamo_graph_count()
        try:
            alone = [await eng.score(s, token_logprobs=True) for s in seqs[:2]]  # batch of one
            out = await asyncio.gather(*[eng.score(s, token_logprobs=True) for s in seqs[2:]])
        finally:
            await eng.drain(5)
        return warmed, alone + out

    warmed, results = asyncio.run(run())
    assert warmed >= 1
    assert dynamo_graph_count() == warmed
    assert len(lines) == len(eng.plan.shapes) and "warm-up 1/" in lines[0]
    assert len(eng.stats.shapes_run) >= 2
    for s, r in zip(seqs, results):
        ref = score_reference(tiny, s)
        np.testing.assert_allclose(r["token_logprobs"], ref["token_logprobs"], atol=1e-4)


def test_compile_with_unpadded_shapes_is_refused(tiny):
    from slipstream.recipe import RecipeError

    with pytest.raises(RecipeError, match="static_shapes"):
        _engine(tiny, compile=True, static_shapes="off")
