"""`slipstream serve` serves the weights in the dtype they were saved in unless asked otherwise
(issue 25: `--quantize auto` was the default, cast fp32 weights to bf16 on AMX hosts, and greedy
completions then disagreed with transformers' generate on 4 of 12 prompts)."""

from __future__ import annotations

import pytest
import torch

from slipstream.cli import build_parser
from slipstream.machine import MachineProbe
from slipstream.serve.model import load_hf_model, load_model
from slipstream.serve.server_cli import apply_quantize

from .test_hf_generate import _generate, _reference

# Host E of issue 25 (AMX-BF16): the probe measures bf16 matmuls 4x fp32, so `auto` casts.
AMX = MachineProbe(
    fingerprint={"cpu_model": "AMX CPU", "cpu_capability": "AVX512", "threads": 2, "torch": "x"},
    key="test",
    device="cpu",
    matmul_flops_per_s={"fp32": {"1024": 119e9}, "bf16": {"1024": 476e9}},
    matmul_notes={},
    copy_bytes_per_s={"host_memcpy": 1e10},
)


def serve_args(*flags: str):
    return build_parser().parse_args(["serve", "--port", "0", *flags])


def dtype_of(loaded) -> torch.dtype:
    return next(loaded.model.parameters()).dtype


def test_default_serves_fp32_weights_as_saved_where_bf16_pays_and_says_how_to_price_bf16(hf_folders, capsys):
    folder = hf_folders["llama"]
    args = serve_args("--model", str(folder))
    loaded = load_hf_model(folder)
    served = apply_quantize(args, loaded, torch.device("cpu"), AMX)
    assert served.decision.choice == "none" and dtype_of(loaded) == torch.float32
    assert served.to_dict()["served_dtype"] == "fp32"
    err = capsys.readouterr().err
    assert "serving weights in fp32 (saved: fp32, from config.json dtype float32)" in err
    assert f"slipstream quantize-eval --model {folder} --modes none,bf16" in err
    # what the user checks: served greedy tokens equal generate on the model as saved
    reference = load_hf_model(folder)
    prompts = [reference.codec.encode(t) for t in ("the quick brown", "alpha beta", "a lazy dog while")]
    want = [_reference(reference, p, 12) for p in prompts]
    assert _generate(loaded, prompts, slots=4, max_new_tokens=12) == want


def test_a_model_saved_in_bf16_is_served_in_bf16(hf_folders, tmp_path, capsys):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = tmp_path / "bf16"
    src = hf_folders["gpt2"]
    AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).to(torch.bfloat16).save_pretrained(folder)
    AutoTokenizer.from_pretrained(src).save_pretrained(folder)
    loaded = load_hf_model(folder)
    assert (loaded.saved_dtype, dtype_of(loaded)) == ("bf16", torch.bfloat16)
    served = apply_quantize(serve_args("--model", str(folder)), loaded, torch.device("cpu"), AMX)
    assert served.dtype == "bf16" and dtype_of(loaded) == torch.bfloat16
    err = capsys.readouterr().err
    assert "config.json dtype bfloat16" in err and "--modes none,int8-weight-only,int8-dynamic" in err
    # auto casts fp32 weights only: a bf16 model stays as saved
    again = apply_quantize(serve_args("--model", str(folder), "--quantize", "auto"), loaded, "cpu", AMX)
    assert again.decision.choice == "none" and "saved in bf16" in again.decision.reason


def test_auto_is_explicit_and_logs_what_its_cast_measured(capsys):
    torch.manual_seed(0)
    loaded = load_model(size="tiny", max_len=64)
    served = apply_quantize(
        serve_args("--size", "tiny", "--quantize", "auto"), loaded, torch.device("cpu"), AMX
    )
    assert served.decision.choice == "bf16" and dtype_of(loaded) == torch.bfloat16
    quality = served.to_dict()["quality"]
    assert quality["positions"] > 100 and 0.0 <= quality["top1_agreement"] <= 1.0
    assert quality["loss_delta_nats"] == pytest.approx(
        quality["loss_served_nats"] - quality["loss_saved_nats"]
    )
    err = capsys.readouterr().err
    assert "--quantize auto -> bf16: bf16 476.0 GFLOP/s vs fp32 119.0 GFLOP/s" in err
    assert "validation loss" in err and "greedy next token unchanged at" in err
    assert "slipstream quantize-eval --workload gpt-stdlib --size tiny --modes none,bf16 --data FILE" in err


def test_a_checkpoint_is_served_in_the_dtype_of_its_tensors(tmp_path):
    from safetensors.torch import save_file

    torch.manual_seed(0)
    gpt = load_model(size="tiny", max_len=64).model
    state = {k: v for k, v in gpt.state_dict().items() if k != "lm_head.weight"}  # tied to wte
    save_file(state, tmp_path / "fp32.safetensors")
    save_file({k: v.to(torch.bfloat16) for k, v in state.items()}, tmp_path / "bf16.safetensors")
    for name, want in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        path = str(tmp_path / f"{name}.safetensors")
        loaded = load_model(size="tiny", checkpoint=path)
        served = apply_quantize(serve_args("--size", "tiny", "--checkpoint", path), loaded, "cpu", AMX)
        assert (served.saved_dtype, served.dtype, dtype_of(loaded)) == (name, name, want)
        assert served.saved_dtype_source == f"the tensors in {name}.safetensors"
