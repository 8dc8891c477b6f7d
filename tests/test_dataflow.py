"""Prefetcher and worker pools: order, backpressure, errors with their traceback, clean shutdown."""

from __future__ import annotations

import multiprocessing
import threading
import time
import traceback

import numpy as np
import pytest
import torch

from slipstream.dataflow import Prefetcher, PrefetchLoader, prefetch
from slipstream.recipe import DataflowConfig, Recipe, RecipeError, RuntimeConfig, ShapesConfig
from slipstream.samples import SampleLoader
from slipstream.session import Session


def _threads() -> set[str]:
    return {t.name for t in threading.enumerate()}


def _wait_gone(prefix: str, timeout: float = 5.0) -> list[str]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        left = [n for n in _threads() if n.startswith(prefix)]
        if not left:
            return []
        time.sleep(0.02)
    return left


def _batches(n: int):
    for i in range(n):
        yield {"x": torch.full((2, 3), float(i))}


class Squares:
    """A map-style dataset with per-epoch samples (get(index, epoch)), as augmentation needs."""

    def __init__(self, n: int = 24, fail_at: int | None = None):
        self.n = n
        self.fail_at = fail_at

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        return self.get(i, 0)

    def get(self, i: int, epoch: int):
        if i == self.fail_at:
            raise_in_sample(i)
        rng = np.random.default_rng([epoch, i])
        return np.array([i * i, rng.random()], dtype=np.float64), i


def raise_in_sample(i: int) -> None:
    raise ValueError(f"sample {i} is corrupt")


# ----------------------------------------------------------------------------- Prefetcher


def test_prefetcher_yields_every_batch_in_order_and_reports_the_wait():
    waits = []
    got = [
        b["x"][0, 0].item() for b in Prefetcher(_batches(7), depth=3, on_batch=lambda b, w: waits.append(w))
    ]
    assert got == [float(i) for i in range(7)]
    assert len(waits) == 7 and all(w >= 0 for w in waits)
    assert _wait_gone("slipstream-prefetch") == []


def test_the_bounded_queue_holds_the_producer_back():
    produced = []

    def source():
        for i in range(100):
            produced.append(i)
            yield i

    with Prefetcher(source(), depth=2) as p:
        assert next(p) == 0
        time.sleep(0.3)  # a producer without backpressure would run through all 100
        # one consumed + two queued + one finished and waiting for a slot
        assert len(produced) <= 4
    assert _wait_gone("slipstream-prefetch") == []


@pytest.mark.parametrize("depth", [0, -1, 1.5])
def test_prefetch_depth_must_be_a_positive_integer(depth):
    with pytest.raises(RecipeError, match="dataflow.prefetch_depth"):
        Prefetcher(_batches(1), depth=depth)
    with pytest.raises(RecipeError, match="dataflow.prefetch_depth=0 is out of range"):
        Recipe().override("dataflow.prefetch_depth=0")


def test_a_producer_exception_reaches_the_loop_with_its_original_traceback():
    def broken_source():
        yield {"x": torch.zeros(1)}
        raise_in_sample(7)

    p = Prefetcher(broken_source(), depth=2)
    assert next(p)["x"].item() == 0
    with pytest.raises(ValueError, match="sample 7 is corrupt") as info:
        next(p)
    frames = [f.name for f in traceback.extract_tb(info.value.__traceback__)]
    assert "raise_in_sample" in frames and "broken_source" in frames  # the producer's own frames
    assert _wait_gone("slipstream-prefetch") == []


def test_break_leaves_no_thread_and_closes_the_source():
    closed = threading.Event()

    def source():
        try:
            yield from range(1000)
        finally:
            closed.set()

    before = _threads()
    for i in prefetch(source(), depth=4):
        if i == 3:
            break
    assert closed.wait(5)
    assert _wait_gone("slipstream-prefetch") == []
    assert _threads() <= before


def test_a_dropped_prefetcher_stops_its_thread():
    p = Prefetcher(_batches(1000), depth=2)
    next(p)
    del p
    assert _wait_gone("slipstream-prefetch") == []


# ----------------------------------------------------------------------------- SampleLoader


def _collect(loader, n=None):
    out = []
    for i, (x, y) in enumerate(loader):
        out.append((x.clone(), y.clone()))
        if n is not None and i + 1 == n:
            break
    return out


@pytest.mark.parametrize("kind", ["thread", "process"])
def test_workers_yield_the_same_batches_as_the_training_thread(kind):
    serial = _collect(SampleLoader(Squares(), 4, seed=3))
    with SampleLoader(Squares(), 4, seed=3, workers=2, worker_kind=kind) as pooled:
        parallel = _collect(pooled)
    assert len(serial) == len(parallel) == 6
    for (a, ya), (b, yb) in zip(serial, parallel):
        assert torch.equal(a, b) and torch.equal(ya, yb)


def test_each_epoch_reshuffles_and_reaugments():
    loader = SampleLoader(Squares(), 4, seed=0)
    e0, e1 = _collect(loader), _collect(loader)
    assert loader.epoch == 2
    ids0 = sorted(int(y) for _, ys in e0 for y in ys)
    assert ids0 == list(range(24))  # every sample once per epoch
    assert not torch.equal(e0[0][1], e1[0][1]) or not torch.equal(e0[0][0], e1[0][0])


@pytest.mark.parametrize("kind", ["thread", "process"])
def test_break_and_errors_leave_no_worker_thread_or_process(kind):
    before = _threads()
    loader = SampleLoader(Squares(), 4, workers=2, worker_kind=kind)
    with PrefetchLoader(loader, depth=2) as wrapped:
        next(iter(wrapped))
    assert _wait_gone("slipstream-") == [] and multiprocessing.active_children() == []
    for i, _ in enumerate(PrefetchLoader(loader, depth=2).forever()):
        if i == 2:
            break
    assert _wait_gone("slipstream-") == [], "a prefetch or worker thread outlived the loop"
    assert multiprocessing.active_children() == []
    assert {n for n in _threads() if n.startswith("slipstream")} <= before

    failing = SampleLoader(Squares(fail_at=9), 4, workers=2, worker_kind=kind, shuffle=False)
    with pytest.raises(ValueError, match="sample 9 is corrupt"):
        for _ in PrefetchLoader(failing, depth=2).forever():
            pass
    assert _wait_gone("slipstream-") == []
    deadline = time.monotonic() + 5
    while multiprocessing.active_children() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert multiprocessing.active_children() == []


def test_a_collate_function_that_raises_is_reported_to_the_loop():
    def bad_collate(samples):
        raise TypeError("cannot stack samples of different shapes")

    loader = SampleLoader(Squares(), 4, collate=bad_collate, workers=1)
    with pytest.raises(TypeError, match="cannot stack") as info:
        next(iter(PrefetchLoader(loader, depth=2)))
    assert "bad_collate" in [f.name for f in traceback.extract_tb(info.value.__traceback__)]
    loader.close()
    assert _wait_gone("slipstream-") == []


def test_sample_loader_rejects_bad_settings():
    with pytest.raises(RecipeError, match="dataflow.workers"):
        SampleLoader(Squares(), 4, workers=-1)
    with pytest.raises(RecipeError, match="fewer than batch_size"):
        SampleLoader(Squares(3), 4)


# ----------------------------------------------------------------------------- through the Session


def _sequences(n: int = 64, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(1, 50, size=int(rng.integers(5, 40))) for _ in range(n)]


def _session(prefetch: bool) -> Session:
    return Session(
        Recipe(
            shapes=ShapesConfig(mode="pad_batch", max_len=32, tokens_per_batch=128),
            runtime=RuntimeConfig(device="cpu"),
            dataflow=DataflowConfig(prefetch=prefetch, prefetch_depth=3),
        )
    )


def test_session_prefetch_gives_the_same_batches_and_resumable_state():
    seqs = _sequences()
    plain = [b["input_ids"] for b in _session(False).prepare_loader(seqs)]
    session = _session(True)
    loader = session.prepare_loader(seqs)
    assert isinstance(loader, PrefetchLoader)
    got = []
    for i, b in enumerate(loader.forever()):
        got.append(b["input_ids"])
        session.tracker.end_step()
        if i == 2:
            break
    # The producer ran ahead, but the state is that of the last batch the loop received.
    assert loader.state_dict()["position"] == 3
    assert all(torch.equal(a, b) for a, b in zip(plain, got))
    m = session.metrics()
    assert m.steps == 3 and m.extra["prefetch_depth"] == 3
    assert m.extra["data_wait_s_per_step"] == pytest.approx(m.data_wait_s / 3)
    loader.close()
    assert _wait_gone("slipstream-prefetch") == []


@pytest.mark.gpu
def test_side_stream_prefetch_to_cuda_matches_the_host_batches():
    src = [{"x": torch.randn(64, 1024)} for _ in range(6)]
    got = list(Prefetcher(iter(src), depth=2, device="cuda"))
    assert all(g["x"].is_cuda for g in got)
    for a, b in zip(src, got):
        torch.testing.assert_close(a["x"], b["x"].cpu(), rtol=0, atol=0)
