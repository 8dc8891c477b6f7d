"""benchmarks/gpu_suite.py --cpu-smoke: every section's code path runs on CPU, so the GPU suite cannot
rot between the (rare) runs on a GPU. Figures here check the plumbing, never the hardware."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SECTIONS = [
    "probe", "kernels", "cudagraphs", "prefetch", "precision", "mfu", "kernel_choice", "llama", "serve", "tests",
]  # fmt: skip


def test_cpu_smoke_runs_every_section_and_writes_one_json(tmp_path):
    proc = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "gpu_suite.py"), "--cpu-smoke", "--out", str(tmp_path)],
        cwd=tmp_path,  # not the repo root: the script must find slipstream and benchmarks/ itself
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    (path,) = tmp_path.glob("gpu-suite-cpu-*.json")
    assert json.loads(proc.stdout.strip().splitlines()[-1])["out"] == str(path)
    result = json.loads(path.read_text())
    assert result["schema"] == "slipstream.gpu_suite/1" and result["mode"] == "cpu-smoke"
    assert {"device", "driver", "torch", "date"} <= set(result["machine"])
    sections = result["sections"]
    assert list(sections) == SECTIONS
    for name, s in sections.items():
        assert s["status"] in ("ok", "skipped"), (name, s)
        assert s["seconds"] >= 0
    assert sections["probe"]["peak_tflops"]["fp32"] > 0 and sections["probe"]["device_copy_GBps"] > 0
    kernels = sections["kernels"]
    assert kernels["failed"] == [] and {r["variant"] for r in kernels["rows"]} >= {"eager", "compile"}
    assert len({r["op"] for r in kernels["rows"]}) >= 7
    graphs = sections["cudagraphs"]
    assert graphs["stats"]["cudagraph_captures"] == len(graphs["rows"]) == 2
    assert all(r["loss_gap_after_warmup"] < 1e-5 for r in graphs["rows"])
    assert 0.0 <= sections["prefetch"]["copy_hidden_share"] <= 1.0
    precision = sections["precision"]["rows"]
    assert precision["fp32"]["status"] == "ok" and precision["fp32"]["last_loss"] > 0
    assert precision["fp8"]["status"] == "skipped" and "CUDA" in precision["fp8"]["reason"]
    mfu = sections["mfu"]["rows"]
    assert [r["recipe"].split("+")[0] for r in mfu] == ["baseline"] * 3 + ["auto"]  # 3 batch sizes, then auto
    assert all(0 < r["mfu_6n"] and r["params"] > 0 for r in mfu), mfu
    assert "shapes.mode" in mfu[-1]["decisions"] and "compile.mode" in mfu[-1]["decisions"]
    choice = sections["kernel_choice"]["rows"]
    assert {r["op"] for r in choice} == {
        "layer_norm",
        "gelu_tanh",
        "cross_entropy",
        "linear_cross_entropy",
        "rms_norm",
        "swiglu",
    }
    assert all("keep" in r["ms"] and "CUDA" in r["not_timed"]["triton"] for r in choice)
    llama = sections["llama"]
    assert "not searched" in llama["batch_search"]["reason"]
    assert llama["bench"]["status"] == "skipped"  # smoke: the commands are built, not run
    assert "--set shapes.tokens_per_batch=1024" in llama["commands"]["bench"]
    assert "hf-trainer-flat" in llama["commands"]["bench"] and "--budget 3m" in llama["commands"]["optimize"]
    serve = sections["serve"]
    assert serve["eager"]["status"] == "ok" and serve["eager"]["requests_per_s"] > 0
    assert serve["compiled"]["status"] == "skipped" and "needs CUDA" in serve["compiled"]["reason"]
    tests = sections["tests"]
    assert (
        tests["status"] == "skipped" and tests["counts"]["collected"] >= 4 and "needs CUDA" in tests["reason"]
    )
