"""optimize's precision stage tries TF32 as a candidate the parity guard must pass (issue 23)."""

from __future__ import annotations

from test_optimize import fake_bench

from slipstream.optimize import search


def _run(monkeypatch, machine_like, tf32_val_loss, tf32=7.4):
    machine_like(bf16=0.5, fp16=0.5, tf32=tf32)  # an H200-like probe: TF32 7.4x plain fp32
    calls = []
    figures = {"base": (100.0, 1.0, 3.0), "precision.tf32=on": (180.0, 1.0, tf32_val_loss)}
    monkeypatch.setattr(search, "run_bench", fake_bench(figures, calls))
    res = search.optimize("gpt-stdlib", size="tiny", budget_s=100, stages=("precision",), noise_seeds=4)
    verdicts = {c.overrides[0]: c.verdict for c in res.candidates}
    return res, verdicts, calls


def test_tf32_is_kept_when_faster_and_at_parity(monkeypatch, machine_like):
    res, verdicts, calls = _run(monkeypatch, machine_like, tf32_val_loss=3.0001)
    assert calls[1] == ["baseline", "baseline+precision.tf32=on"]  # bf16/fp16 too slow here: not tried
    assert verdicts["precision.tf32=on"].startswith("kept") and res.best_overrides == ["precision.tf32=on"]


def test_tf32_is_refused_when_parity_fails(monkeypatch, machine_like):
    res, verdicts, _ = _run(monkeypatch, machine_like, tf32_val_loss=3.06)  # 2% off: far outside the band
    assert verdicts["precision.tf32=on"].startswith("rejected: parity gap")
    assert res.best_spec == "baseline"


def test_tf32_is_not_tried_where_the_probe_has_no_tf32_row(monkeypatch, machine_like):
    res, verdicts, calls = _run(monkeypatch, machine_like, tf32_val_loss=3.0, tf32=None)
    assert "not tried" in verdicts["precision.tf32=on"] and len(calls) == 1
