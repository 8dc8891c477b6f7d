"""The machine probe: decisions from figures fed in, the cache and what invalidates it, one real
probe on this host (structure only: speed is never asserted), and `slipstream doctor` on top."""

from __future__ import annotations

import json

import pytest
import torch

from slipstream import decisions, machine
from slipstream.cli import main
from slipstream.decisions import PAYS_RATIO, decide_precision, decide_serve_quantize
from slipstream.machine import Check, MachineProbe
from slipstream.serve.server_cli import resolve_quantize


def fed(
    flops: dict[str, dict[str, float]], device: str = "cpu", notes: dict[str, str] | None = None
) -> MachineProbe:
    """A probe built by hand from a host's published figures (FLOP/s per dtype and size)."""
    return MachineProbe(
        fingerprint={"cpu_model": "test CPU", "cpu_capability": "AVX2", "threads": 1, "torch": "x"},
        key="test",
        device=device,
        matmul_flops_per_s=flops,
        matmul_notes=notes or {},
        copy_bytes_per_s={"host_memcpy": 1e10},
    )


# Host A (AVX2 only): bf16 falls back to a reference loop, 75x slower than fp32.
AVX2 = fed({"fp32": {"1024": 60e9}, "bf16": {"1024": 0.8e9}, "fp16": {"1024": 1.1e9}})
# Host C (AMX-BF16): bf16 4x fp32.
AMX = fed({"fp32": {"1024": 119e9}, "bf16": {"1024": 476e9}, "fp16": {"1024": 118e9}})
# This host (AVX512-BF16/FP16, no AMX): bf16 runs, at 0.55x fp32.
AVX512_NO_AMX = fed({"fp32": {"1024": 119e9}, "bf16": {"1024": 66e9}, "fp16": {"1024": 118e9}})


# ----------------------------------------------------------------------------- decisions


def test_avx2_figures_decide_fp32_and_the_reason_names_both():
    d = decide_precision("cpu", AVX2)
    assert (d.field, d.choice) == ("precision.dtype", "fp32")
    assert "bf16 0.8 GFLOP/s" in d.reason and "fp32 60.0 GFLOP/s" in d.reason and "(0.01x)" in d.reason
    assert not decisions.bf16_pays(p=AVX2)
    assert decide_serve_quantize("cpu", AVX2).choice == "none"


def test_amx_figures_decide_bf16():
    d = decide_precision("cpu", AMX)
    assert d.choice == "bf16" and "(4.00x): used by auto" in d.reason
    assert decisions.bf16_pays(p=AMX)
    assert decide_serve_quantize("cpu", AMX).to_dict() == {
        "field": "serve.quantize",
        "choice": "bf16",
        "reason": d.reason,
    }


def test_bf16_that_runs_but_is_slower_is_not_used():
    d = decide_precision("cpu", AVX512_NO_AMX)
    assert d.choice == "fp32" and "(0.55x): not used" in d.reason
    assert decide_serve_quantize("cpu", AVX512_NO_AMX).choice == "none"


@pytest.mark.parametrize(("ratio", "choice"), [(PAYS_RATIO - 0.05, "fp32"), (PAYS_RATIO, "bf16")])
def test_bf16_must_beat_fp32_by_the_pays_ratio(ratio, choice):
    p = fed({"fp32": {"1024": 100e9}, "bf16": {"1024": 100e9 * ratio}})
    assert decide_precision("cpu", p).choice == choice


def test_a_dtype_too_slow_for_the_large_sizes_is_compared_by_its_best_figure():
    # The probe stops a dtype whose matmul takes > SLOW_CALL_S: on AVX2, bf16 has no 1024 figure.
    # Peaks are compared (one timing on a shared host can be 30% off, the best of several less).
    p = fed(
        {"fp32": {"256": 50e9, "512": 55e9, "1024": 60e9}, "bf16": {"256": 0.8e9, "512": 0.7e9}},
        notes={"bf16": "0.38 s per 512^2 matmul: larger sizes not measured"},
    )
    assert p.speed_vs_fp32("bf16") == (pytest.approx(0.8 / 60), 256)
    d = decide_precision("cpu", p)
    assert d.choice == "fp32"
    assert "bf16 0.8 GFLOP/s vs fp32 60.0 GFLOP/s (at 256^2 vs 1024^2) (0.01x)" in d.reason


def test_cuda_without_native_bf16_picks_fp16_and_cpu_never_does():
    figures = {"fp32": {"1024": 15e12}, "fp16": {"1024": 110e12}}
    gpu = fed(figures, device="cuda", notes={"bf16": "no native bf16 on this GPU (compute capability < 8.0)"})
    d = decide_precision("cuda", gpu)
    assert d.choice == "fp16" and "compute capability < 8.0" not in d.reason and "fp16 110,000.0" in d.reason
    assert "bf16: no native bf16" in decisions.dtype_verdict(gpu, "bf16")[1]
    assert decide_serve_quantize("cuda", gpu).choice == "none"  # serve's auto casts weights to bf16 only
    # The same figures measured on a CPU: fp16 needs loss scaling, auto keeps it for CUDA.
    cpu = fed(figures)
    assert decide_precision("cpu", cpu).choice == "fp32"
    assert "CUDA only" in decisions.dtype_verdict(cpu, "fp16")[1]


def test_serve_quantize_auto_reads_the_probe_and_explicit_modes_are_kept():
    assert resolve_quantize("auto", "fp32", "cpu", AMX).choice == "bf16"
    avx2 = resolve_quantize("auto", "fp32", "cpu", AVX2)
    assert avx2.choice == "none" and "0.8 GFLOP/s" in avx2.reason
    assert resolve_quantize("auto", "bf16", "cpu", AMX).choice == "none"  # --dtype bf16 autocasts
    assert resolve_quantize("bf16", "fp32", "cpu", AVX2).choice == "bf16"
    assert resolve_quantize("int8-dynamic", "fp32", "cpu", AMX).choice == "int8-dynamic"


def test_describe_prints_a_verdict_per_dtype_and_the_copy_bandwidth():
    p = fed(AVX2.matmul_flops_per_s)
    p.checks["compile"] = Check(True, "compiled and ran a function in 20.00 s (first compile)", 20.0)
    text = "\n".join(decisions.describe(p))
    assert "bf16 0.8 GFLOP/s vs fp32 60.0 GFLOP/s at 1024^2 (0.01x): not used" in text
    assert "copy host_memcpy: 10.0 GB/s" in text and "compile: ok" in text
    assert "load average" not in text
    p.load_average_1m = 2.7  # a probe taken while other jobs ran says so, and how to redo it
    assert (
        "load average was 2.7" in "\n".join(decisions.describe(p))
        and "--refresh" in decisions.describe(p)[-1]
    )


# ----------------------------------------------------------------------------- the cache


@pytest.fixture
def measured(monkeypatch) -> list[str]:
    """Fake measurements (AVX2-like figures) that count how often the probe measures; no memo."""
    calls: list[str] = []

    def matmul(device, dtypes, sizes=machine.MATMUL_SIZES):
        calls.append(device.type)
        return {k: dict(v) for k, v in AVX2.matmul_flops_per_s.items()}, {}

    monkeypatch.setattr(machine, "_MEMO", {})
    monkeypatch.setattr(machine, "measure_matmul", matmul)
    monkeypatch.setattr(machine, "measure_copy", lambda device: {"host_memcpy": 1e10})
    monkeypatch.setattr(machine, "check_triton", lambda device: Check(False, "no GPU (test)"))
    return calls


def new_process(monkeypatch) -> None:
    """Forget the in-process memo, as a new Python process would."""
    monkeypatch.setattr(machine, "_MEMO", {})


def test_second_probe_reads_the_cache_file(tmp_path, monkeypatch, measured):
    first = machine.probe("cpu", folder=tmp_path)
    assert measured == ["cpu"] and not first.cached
    path = machine.cache_path(first.key, tmp_path)
    saved = json.loads(path.read_text())
    assert saved["matmul_flops_per_s"]["bf16"] == {"1024": 0.8e9} and saved["cached"] is False
    assert machine.probe("cpu", folder=tmp_path) is first  # memo within a process
    new_process(monkeypatch)
    second = machine.probe("cpu", folder=tmp_path)
    assert measured == ["cpu"] and second.cached
    assert {**second.to_dict(), "cached": False} == first.to_dict()


def _other_cpu(monkeypatch):
    model, flags = machine._cpu_identity()
    monkeypatch.setattr(machine, "_cpu_identity", lambda: ("Other CPU " + model, flags))


def _other_flags(monkeypatch):
    model, flags = machine._cpu_identity()
    monkeypatch.setattr(machine, "_cpu_identity", lambda: (model, flags + " amx_bf16_test"))


def _other_torch(monkeypatch):
    monkeypatch.setattr(torch, "__version__", "0.0.1+other")


def _avx2_env(monkeypatch):
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2_TEST")


@pytest.mark.parametrize("change", [_other_cpu, _other_flags, _other_torch, _avx2_env])
def test_a_changed_fingerprint_measures_again(tmp_path, monkeypatch, measured, change):
    before = machine.probe("cpu", folder=tmp_path)
    new_process(monkeypatch)
    change(monkeypatch)
    after = machine.probe("cpu", folder=tmp_path)
    assert measured == ["cpu", "cpu"] and not after.cached
    assert after.key != before.key and after.fingerprint != before.fingerprint
    assert len(list((tmp_path / "machine").glob("probe-*.json"))) == 2


@pytest.mark.parametrize("content", ["{truncated", "[]", '{"checks": 3}', "null", "version-0", "other-key"])
def test_a_corrupt_or_stale_cache_file_is_measured_again(tmp_path, monkeypatch, measured, content):
    path = machine.cache_path(machine.probe("cpu", folder=tmp_path).key, tmp_path)
    data = json.loads(path.read_text())
    if content == "version-0":
        content = json.dumps({**data, "version": 0})
    elif content == "other-key":
        content = json.dumps({**data, "key": "0123456789abcdef"})
    path.write_text(content)
    new_process(monkeypatch)
    again = machine.probe("cpu", folder=tmp_path)
    assert measured == ["cpu", "cpu"] and not again.cached
    assert json.loads(path.read_text())["key"] == again.key  # rewritten whole


def test_refresh_measures_again_and_rewrites_the_cache(tmp_path, monkeypatch, measured):
    first = machine.probe("cpu", folder=tmp_path)
    fresh = machine.probe("cpu", folder=tmp_path, refresh=True)
    assert measured == ["cpu", "cpu"] and fresh is not first
    new_process(monkeypatch)
    assert machine.probe("cpu", folder=tmp_path).measured_at == fresh.measured_at
    assert measured == ["cpu", "cpu"]


def test_checks_run_once_and_are_cached_beside_the_figures(tmp_path, monkeypatch, measured):
    compiles = []
    monkeypatch.setattr(
        machine, "check_compile", lambda: compiles.append(1) or Check(True, "compiled (test)", 0.5)
    )
    machine.probe("cpu", folder=tmp_path)
    assert compiles == []  # checks are opt-in
    machine.probe("cpu", folder=tmp_path, checks=("compile",))
    new_process(monkeypatch)
    p = machine.probe("cpu", folder=tmp_path, checks=("compile",))
    assert compiles == [1] and measured == ["cpu"] and p.checks["compile"].ok
    with pytest.raises(ValueError, match="unknown probe check 'gpu'"):
        machine.probe("cpu", folder=tmp_path, checks=("gpu",))


# ----------------------------------------------------------------------------- the real probe, once


def test_real_probe_on_this_host_has_figures_and_a_decision(tmp_path, monkeypatch):
    """Structure only: this host's speed decides the choice, so the test never asserts which."""
    monkeypatch.setattr(machine, "_MEMO", {})
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the suite shares 2 cores; one thread keeps the probe out of the way
    try:
        p = machine.probe("cpu", folder=tmp_path)
    finally:
        torch.set_num_threads(threads)
    assert p.flops("fp32") > 0 and p.copy_bytes_per_s["host_memcpy"] > 0
    for dtype in ("bf16", "fp16"):  # measured at one size at least, or said why not
        assert p.matmul_flops_per_s.get(dtype) or dtype in p.matmul_notes
    assert set(p.matmul_flops_per_s["fp32"]) == {str(n) for n in machine.MATMUL_SIZES}
    assert p.fingerprint["threads"] == 1 and p.fingerprint["torch"] == torch.__version__
    d = decide_precision("cpu", p)
    assert d.choice in ("fp32", "bf16") and "GFLOP/s" in d.reason
    assert machine.cache_path(p.key, tmp_path).is_file()
    print("\n".join(decisions.describe(p)), f"\nprobe took {p.probe_s:.2f} s", sep="\n")


# ----------------------------------------------------------------------------- slipstream doctor


def test_doctor_reports_the_probe_and_the_decisions(tmp_path, monkeypatch, capsys, measured):
    monkeypatch.setenv("SLIPSTREAM_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "doctor.json"
    assert main(["doctor", "--no-compile", "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["probe"]["matmul_flops_per_s"]["bf16"] == {"1024": 0.8e9}
    assert doc["probe"]["fingerprint"]["cpu_model"] == doc["cpu"]
    precision = doc["decisions"]["precision.dtype"]
    assert precision["choice"] == "fp32" and "bf16 0.8 GFLOP/s vs fp32 60.0 GFLOP/s" in precision["reason"]
    assert doc["decisions"]["serve.quantize"]["choice"] == "none"
    assert doc["dtypes"]["bf16"]["pays"] is False and doc["dtypes"]["bf16"]["peak_n"] == 1024
    assert doc["probe_source"] == "measured" and "compile" not in doc["checks"]
    assert doc["checks"]["triton"] == {"ok": False, "detail": "no GPU (test)", "seconds": 0.0}
    printed = capsys.readouterr().out
    assert "bf16 0.8 GFLOP/s vs fp32 60.0 GFLOP/s at 1024^2 (0.01x): not used" in printed
    assert "auto precision.dtype -> fp32" in printed and "probe measured now" in printed

    new_process(monkeypatch)
    assert main(["doctor", "--no-compile"]) == 0
    assert "probe read from cache" in capsys.readouterr().out and measured == ["cpu"]

    monkeypatch.setattr(machine, "check_compile", lambda: Check(True, "compiled (test)", 0.5))
    assert main(["doctor", "--refresh", "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert measured == ["cpu", "cpu"] and doc["probe_source"] == "measured"
    assert doc["checks"]["compile"]["ok"] is True
