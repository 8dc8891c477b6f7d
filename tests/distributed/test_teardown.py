"""Leaving the process group (issue 25: a pipeline run ended with a rank killed by SIGABRT in 1 of
5 runs on a 2-core host): ranks that finished wait for each other before tearing gloo down; a rank
that failed does not wait for peers that may be dead."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from slipstream.distributed import env


def _record(monkeypatch, barrier_raises: bool = False) -> list[str]:
    calls: list[str] = []

    def barrier():
        calls.append("barrier")
        if barrier_raises:
            raise RuntimeError("[gloo] Connection closed by peer")

    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "barrier", barrier)
    monkeypatch.setattr(dist, "destroy_process_group", lambda: calls.append("destroy"))
    return calls


def test_a_finished_rank_waits_for_the_others_before_destroying_the_group(monkeypatch):
    calls = _record(monkeypatch)
    env.destroy_process_group(barrier=True)
    assert calls == ["barrier", "destroy"]


def test_a_failed_rank_destroys_at_once_and_a_dead_peer_at_the_barrier_still_lets_it_leave(monkeypatch):
    calls = _record(monkeypatch)
    env.destroy_process_group()
    assert calls == ["destroy"]
    calls = _record(monkeypatch, barrier_raises=True)
    env.destroy_process_group(barrier=True)
    assert calls == ["barrier", "destroy"]


def test_train_leaves_with_the_barrier_only_when_the_run_finished(monkeypatch):
    import importlib

    from slipstream.distributed.env import DistEnv

    train_module = importlib.import_module("slipstream.train")  # the module, not the function

    seen: list[bool] = []
    monkeypatch.setattr(DistEnv, "from_environ", classmethod(lambda cls: DistEnv(rank=0, world_size=2)))
    monkeypatch.setattr("slipstream.session.init_process_group", lambda *a: None)  # no peers here
    monkeypatch.setattr(train_module, "destroy_process_group", lambda barrier=False: seen.append(barrier))
    monkeypatch.setattr(train_module, "_train", lambda *a, **k: "result")
    assert train_module.train("gpt-stdlib", "baseline", 1, size="tiny", eval_every=0) == "result"

    def fails(*a, **k):
        raise ValueError("bad batch")

    monkeypatch.setattr(train_module, "_train", fails)
    with pytest.raises(ValueError, match="bad batch"):
        train_module.train("gpt-stdlib", "baseline", 1, size="tiny", eval_every=0)
    assert seen == [True, False]
