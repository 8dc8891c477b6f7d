"""Shared fixtures: the tiny GPT with a short max_len, and a real server on a free loopback port."""

from __future__ import annotations

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


@pytest.fixture(scope="session")
def tiny():
    torch.manual_seed(0)
    return load_model(size="tiny", max_len=64)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(*extra: str, port: int | None = None) -> tuple[subprocess.Popen, str]:
    """`python -m slipstream.serve.cli serve` on loopback, waited on until /readyz says 200."""
    port = port or free_port()
    cmd = [
        sys.executable,
        "-m",
        "slipstream.serve.cli",
        "serve",
        "--size",
        "tiny",
        "--max-len",
        "64",
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
    deadline = time.monotonic() + 60
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
    raise RuntimeError("server did not become ready within 60 s")


@pytest.fixture(scope="module")
def server():
    proc, url = start_server("--generate-slots", "4")
    yield url
    proc.terminate()
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()
