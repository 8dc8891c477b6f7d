"""Shared fixtures: the tiny GPT with a short max_len, and a real server on a free loopback port."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import torch

from slipstream.serve.model import load_model

REPO = Path(__file__).resolve().parents[2]


READY_TIMEOUT_S = 180.0


@pytest.fixture(scope="session")
def tiny():
    torch.manual_seed(0)
    return load_model(size="tiny", max_len=64)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(
    *extra: str, port: int | None = None, model: str | None = None
) -> tuple[subprocess.Popen, str]:
    """`python -m slipstream.serve.cli serve` on loopback, waited on until /readyz says 200.

    Serves the tiny built-in GPT (max_len 64), or the Hugging Face folder `model`."""
    port = port or free_port()
    which = ["--model", model] if model else ["--size", "tiny", "--max-len", "64"]
    cmd = [
        sys.executable,
        "-m",
        "slipstream.serve.cli",
        "serve",
        *which,
        "--max-batch-size",
        "4",
        "--buckets",
        "2",
        "--threads",
        "1",
        "--port",
        str(port),
        # fp32 weights whatever this host's probe says (`auto` would pick bf16 on an AMX CPU);
        # a test that wants a mode passes its own --quantize, which comes later and wins
        "--quantize",
        "none",
        *extra,
    ]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(
        cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    url = f"http://127.0.0.1:{port}"
    # start-up warms the model and reads the probe: on a loaded 2-core host that took over 60 s
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited early: {proc.stdout.read()}")
        try:
            if httpx.get(url + "/readyz", timeout=1).status_code == 200:
                return proc, url
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    proc.kill()
    raise RuntimeError(f"server did not become ready within {READY_TIMEOUT_S:.0f} s")


@contextlib.contextmanager
def running_server(*extra: str, model: str | None = None):
    """start_server for the length of a `with` block; SIGTERM (then SIGKILL) at its end."""
    proc, url = start_server(*extra, model=model)
    try:
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()


@pytest.fixture(scope="module")
def server():
    with running_server("--generate-slots", "4") as url:
        yield url


CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def save_tiny_hf(folder: Path, family: str = "llama") -> Path:
    """A tiny Hugging Face causal LM with a locally trained tokenizer and a chat template, saved with
    save_pretrained. A wide initialisation makes its next-token distributions peaked, so greedy
    choices are never near-ties that float rounding could flip."""
    from transformers import AutoTokenizer, GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    from user_helpers import train_tokenizer

    train_tokenizer(folder)
    tok = AutoTokenizer.from_pretrained(folder)
    tok.chat_template = CHAT_TEMPLATE
    tok.save_pretrained(folder)
    torch.manual_seed(0)
    ids = {"vocab_size": len(tok), "eos_token_id": tok.eos_token_id, "bos_token_id": tok.bos_token_id}
    if family == "llama":
        cfg = LlamaConfig(
            hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256, initializer_range=0.3, **ids,
        )  # fmt: skip
        model = LlamaForCausalLM(cfg)
    else:
        cfg = GPT2Config(n_embd=64, n_layer=2, n_head=4, n_positions=256, initializer_range=0.3, **ids)
        model = GPT2LMHeadModel(cfg)
    model.save_pretrained(folder)
    return folder


@pytest.fixture(scope="session")
def hf_folders(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hf")
    return {f: save_tiny_hf(root / f"tiny-{f}", f) for f in ("llama", "gpt2")}
