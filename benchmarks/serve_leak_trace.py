"""Where a serving soak's RSS growth comes from: Python allocations traced in the server itself.

Runs `slipstream serve` (the soak's flags) in this process with `tracemalloc` on, drives it from a
child process with the soak's mix (Poisson scoring at `--rate` plus 0.5 req/s generation), takes
a snapshot after `--warmup-s` of load and another `--seconds` later, and reports what grew between
them: the top allocation sites by growth, with their tracebacks, beside the RSS growth over the
same window. Python objects that outlive their requests show up here; growth that does not (RSS
rising while traced memory stays flat) is below Python: the C allocator, torch, or the kernel.

    python benchmarks/serve_leak_trace.py --rate 80 --seconds 300 --out benchmarks/results/serve-leak-trace-<host>.json
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path[0] = str(Path(__file__).resolve().parents[1])  # the repo root, not benchmarks/

import argparse  # noqa: E402
import asyncio  # noqa: E402
import datetime  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import signal  # noqa: E402
import socket  # noqa: E402
import subprocess  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
import tracemalloc  # noqa: E402
import urllib.request  # noqa: E402

GENERATE_RPS = 0.5


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def drive(base: str, rate: float, seconds: float) -> None:
    """The load (run in a child process, so the server's trace sees only the server)."""
    from slipstream.serve.bodies import validation_payloads
    from slipstream.serve.loadgen import open_loop

    score = validation_payloads(max_tokens=256, n=200)
    gen = validation_payloads(max_tokens=256, n=20, endpoint="generate", max_new_tokens=16)

    async def both():
        return await asyncio.gather(
            open_loop(base + "/v1/score", score, rate, seconds, seed=1),
            open_loop(base + "/v1/generate", gen, GENERATE_RPS, seconds, seed=2),
        )

    scored, generated = asyncio.run(both())
    print(json.dumps({"score": scored.to_json(), "generate": generated.to_json()}))


def watch(base: str, args: argparse.Namespace, report: dict) -> None:
    """In the server process: wait for /readyz, start the load, snapshot twice, stop the server."""
    while True:
        try:
            with urllib.request.urlopen(base + "/readyz", timeout=1) as resp:
                if resp.status == 200:
                    break
        except OSError:
            time.sleep(0.3)
    total = args.warmup_s + args.seconds + 5
    cmd = [sys.executable, __file__, "--drive", base, "--rate", str(args.rate), "--seconds", str(total)]
    driver = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    tracemalloc.start(args.frames)
    time.sleep(args.warmup_s)
    first, rss0, t0 = tracemalloc.take_snapshot(), rss_mib(), time.monotonic()
    time.sleep(args.seconds)
    last, rss1, t1 = tracemalloc.take_snapshot(), rss_mib(), time.monotonic()
    traced = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    out, _ = driver.communicate(timeout=120)
    report["load"] = json.loads(out.strip().splitlines()[-1]) if out.strip() else None
    keep = [tracemalloc.Filter(False, tracemalloc.__file__)]
    stats = last.filter_traces(keep).compare_to(first.filter_traces(keep), "traceback")
    grown = sorted(stats, key=lambda s: s.size_diff, reverse=True)[: args.top]
    report.update(
        window_s=round(t1 - t0, 1),
        rss_mib_start=round(rss0, 2),
        rss_mib_end=round(rss1, 2),
        rss_growth_mib=round(rss1 - rss0, 2),
        traced_growth_mib=round(sum(s.size_diff for s in stats) / 2**20, 3),
        traced_mib_end=round(traced / 2**20, 2),
        top_growth=[
            {
                "size_diff_bytes": s.size_diff,
                "count_diff": s.count_diff,
                "traceback": [f"{f.filename}:{f.lineno}" for f in s.traceback][-args.frames :],
            }
            for s in grown
        ],
    )
    os.kill(os.getpid(), signal.SIGTERM)  # drain and exit, as the soak's server does


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rate", type=float, default=80.0, help="scoring requests per second")
    ap.add_argument("--seconds", type=float, default=300.0, help="window between the two snapshots")
    ap.add_argument("--warmup-s", type=float, default=60.0, help="load before the first snapshot")
    ap.add_argument("--frames", type=int, default=12, help="traceback depth per allocation")
    ap.add_argument("--top", type=int, default=15)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--drive", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.drive:
        drive(args.drive, args.rate, args.seconds)
        return

    from slipstream.doctor import machine_info
    from slipstream.files import write_json
    from slipstream.serve.cli import main as serve_main

    port = free_port()
    base = f"http://127.0.0.1:{port}"
    report: dict = {
        "benchmark": "serve_leak_trace",
        "date": datetime.date.today().isoformat(),
        "host": machine_info(),
        "server": f"slipstream serve --size tiny --max-len 256 --threads {args.threads} --generate-slots 4",
        "rate_rps": args.rate,
        "generate_rps": GENERATE_RPS,
    }
    threading.Thread(target=watch, args=(base, args, report), daemon=True).start()
    serve_args = ["serve", "--size", "tiny", "--max-len", "256", "--threads", str(args.threads)]
    serve_args += ["--port", str(port), "--quantize", "none", "--generate-slots", "4"]
    rc = serve_main(serve_args)
    report["exit_code"] = rc
    print(json.dumps({k: v for k, v in report.items() if k != "top_growth"}, indent=2, default=str))
    for s in report.get("top_growth", [])[:8]:
        print(
            f"{s['size_diff_bytes']:>10,} B  {s['count_diff']:>+8,}  {' <- '.join(reversed(s['traceback'][-4:]))}"
        )
    if args.out:
        write_json(args.out, report)


if __name__ == "__main__":
    main()
