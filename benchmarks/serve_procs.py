"""Server processes for the serving benchmarks (benchmarks/serve.py, benchmarks/serve_openai.py):
start one in its own process group, wait until a URL answers 200, pause every server but the one
measured, read the resident memory of a server and its children, stop them all."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]


def spawn(argv: list[str], log: Path, env: dict[str, str] | None = None) -> subprocess.Popen:
    """`argv` in a new session (so its process group, children included, can be paused and
    signalled as one), stdout and stderr to `log`."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    return subprocess.Popen(
        argv, cwd=REPO, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True
    )


def wait_ready(url: str, proc: subprocess.Popen, timeout_s: float = 180, log: Path | None = None) -> float:
    """Polls GET `url` until it answers 200; returns the seconds waited. Raises if the process
    exits first or the time runs out (with the tail of `log`)."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        if proc.poll() is not None:
            raise RuntimeError(f"{url}: server exited with {proc.returncode}{_tail(log)}")
        try:
            if httpx.get(url, timeout=5).status_code == 200:
                return time.monotonic() - t0
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"{url}: not ready after {timeout_s} s{_tail(log)}")


def _tail(log: Path | None, n: int = 15) -> str:
    if log is None or not log.exists():
        return ""
    return "; log tail:\n" + "\n".join(log.read_text(errors="replace").splitlines()[-n:])


def measure_only(procs: dict[str, subprocess.Popen], name: str | None) -> None:
    """Resume `name` and pause (SIGSTOP) every other server's process group: an idle server's
    background threads would otherwise take CPU from the one measured. None resumes all."""
    for other, proc in procs.items():
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGCONT if name in (None, other) else signal.SIGSTOP)


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def tree_rss(pid: int) -> int:
    """RSS of a process and its descendants (LitServe and `transformers serve` run the model in a
    child process)."""
    total = rss_bytes(pid)
    for child in Path(f"/proc/{pid}/task/{pid}/children").read_text().split():
        try:
            total += tree_rss(int(child))
        except (FileNotFoundError, ProcessLookupError):
            pass
    return total


def terminate(proc: subprocess.Popen, timeout_s: float = 30) -> dict:
    """SIGTERM to the server's own process (its group resumed first; the server stops its
    children itself, as under a process manager that signals the main process); waits
    `timeout_s`, then SIGKILL to the group. Returns {exit_code, exit_s, killed}. A uvicorn server
    that shut down gracefully re-raises the signal, so its exit code is -15, not 0."""
    if proc.poll() is not None:
        return {"exit_code": proc.returncode, "exit_s": 0.0, "killed": False}
    os.killpg(proc.pid, signal.SIGCONT)
    t0 = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=timeout_s)
        return {"exit_code": proc.returncode, "exit_s": time.monotonic() - t0, "killed": False}
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        return {"exit_code": proc.returncode, "exit_s": time.monotonic() - t0, "killed": True}


def kill_group(proc: subprocess.Popen) -> None:
    """The process group's leftovers (children a server left behind), after `terminate`."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
