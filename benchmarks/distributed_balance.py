"""Uneven ranks, side by side: equal shards vs load-balanced shards, with one rank slowed by real
contention (it shares its CPU core with a busy process).

Two ranks are started by hand (the env:// rendezvous torchrun would set up), each pinned to its
own core with taskset; a spinning process is pinned to rank 1's core, so rank 1 gets about half a
core. The same training runs twice, distributed.balance=off and =auto (auto must notice the
imbalance by itself), and the script prints the aggregate real tokens/s of both, their ratio, and
the largest per-step loss difference (balancing must not change what is learned).

    python benchmarks/distributed_balance.py --steps 150 --out benchmarks/results/distributed-balance-<host>.json
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path[0] = str(Path(__file__).resolve().parents[1])  # the repo root, not benchmarks/ (kernels.py)

import argparse  # noqa: E402
import datetime  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import platform  # noqa: E402
import shutil  # noqa: E402
import socket  # noqa: E402
import subprocess  # noqa: E402
import tempfile  # noqa: E402

RECIPE = (
    'baseline+shapes.mode="bucket"+shapes.max_len=256+shapes.tokens_per_batch={tpb}'
    '+optimizer.impl="foreach"+distributed.balance="{balance}"+distributed.balance_every=5'
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(balance: str, args: argparse.Namespace, out: Path) -> dict:
    port = free_port()
    procs = []
    for rank in range(2):
        env = dict(
            os.environ,
            RANK=str(rank),
            LOCAL_RANK=str(rank),
            WORLD_SIZE="2",
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            OMP_NUM_THREADS="1",
        )
        cmd = [
            "taskset", "-c", str(rank), sys.executable, "-m", "slipstream", "train",
            "--size", args.size, "--steps", str(args.steps), "--eval-every", "0", "--no-progress",
            "--recipe", RECIPE.format(tpb=args.tokens_per_batch, balance=balance), "--json", str(out),
        ]  # fmt: skip
        procs.append(
            subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        )
    for p in procs:
        _, err = p.communicate(timeout=1800)
        if p.returncode != 0:
            raise SystemExit(f"a rank failed ({p.returncode}):\n{err[-3000:]}")
    return json.loads(out.read_text())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="small")
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--tokens-per-batch", type=int, default=4096)
    ap.add_argument("--no-contention", action="store_true", help="leave rank 1's core free (control run)")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    if not shutil.which("taskset") or (os.cpu_count() or 1) < 2:
        raise SystemExit("needs taskset and 2 cores")
    import torch

    tmp = Path(tempfile.mkdtemp(prefix="slipstream-balance-"))
    spinner = None
    if not args.no_contention:
        spinner = subprocess.Popen(["taskset", "-c", "1", sys.executable, "-c", "while True: pass"])
    try:
        results = {b: run(b, args, tmp / f"{b}.json") for b in ("off", "auto")}
    finally:
        if spinner is not None:
            spinner.kill()
            spinner.wait()
    off, on = results["off"], results["auto"]
    worst = max(abs(a - b) / abs(a) for a, b in zip(off["loss"], on["loss"]))
    ratio = on["global_real_tokens_per_s"] / off["global_real_tokens_per_s"]
    last = (on.get("balance_history") or [{}])[-1]
    summary = {
        "benchmark": "distributed_balance",
        "date": datetime.date.today().isoformat(),
        "host": {
            "cpu": _cpu_model(),
            "capability": torch.backends.cpu.get_cpu_capability(),
            "cores": os.cpu_count(),
            "torch": torch.__version__,
            "python": platform.python_version(),
        },
        "setup": {
            "ranks": 2,
            "contention": "none" if args.no_contention else "rank 1 shares its core with a spinning process",
            "size": args.size,
            "steps": args.steps,
            "tokens_per_batch": args.tokens_per_batch,
        },
        "equal_shards_real_tokens_per_s": off["global_real_tokens_per_s"],
        "balanced_real_tokens_per_s": on["global_real_tokens_per_s"],
        "balanced_over_equal": round(ratio, 3),
        # median step time: past warm-up and the first unbalanced windows (same tokens per step)
        "equal_median_step_s": off["step_time_s"],
        "balanced_median_step_s": on["step_time_s"],
        "balanced_over_equal_median_step": round(off["step_time_s"] / on["step_time_s"], 3),
        "balance_turned_on_by_auto": on.get("balance_active"),
        "final_shares": last.get("shares"),
        "s_per_row_by_rank": last.get("s_per_row"),
        "max_relative_loss_difference": worst,
        "balance_history": on.get("balance_history"),
    }
    print(json.dumps({k: v for k, v in summary.items() if k != "balance_history"}, indent=2))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(summary, indent=2) + "\n")
    shutil.rmtree(tmp, ignore_errors=True)


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


if __name__ == "__main__":
    main()
