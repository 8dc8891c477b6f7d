"""Serving soak: a long run at 80% of the sustainable rate, watching the server for leaks.

Starts `slipstream serve` (built-in GPT, scoring and generation), finds the highest open-loop
scoring rate whose p99 stays under the SLO (`loadtest --sweep`'s method) with the generation load
of the soak running underneath, so the rate is sustainable under the soak's own mix. Before the
soak, a confirmation run at the soak rate must keep p99 under the SLO with no request refused;
otherwise the rate is lowered 15% and confirmed again (short sweep steps overestimate: a backlog
that would grow without end does not reach the p99 in a few seconds). It then offers that rate
for `--minutes`, sampling the server process's RSS, open file descriptors and threads every 10 s.
A leak shows as growth between the first and the last minutes (after warm-up); the JSON keeps
every sample, the sweep's steps and the confirmation runs.

    python benchmarks/serve_soak.py --minutes 10 --out benchmarks/results/serve-soak-<host>.json
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path[0] = str(Path(__file__).resolve().parents[1])  # the repo root, not benchmarks/ (kernels.py)

import argparse  # noqa: E402
import asyncio  # noqa: E402
import contextlib  # noqa: E402
import datetime  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import signal  # noqa: E402
import socket  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402

import httpx  # noqa: E402

LOG = "/tmp/slipstream-serve-soak.log"
GENERATE_RPS = 0.5
CONFIRM_S = 30.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(port: int, threads: int) -> subprocess.Popen:
    cmd = [
        sys.executable, "-m", "slipstream", "serve", "--size", "tiny", "--max-len", "256",
        "--threads", str(threads), "--port", str(port), "--quantize", "none", "--generate-slots", "4",
    ]  # fmt: skip
    # stderr to a file, not a pipe nobody reads while the soak runs: a full pipe would stall the server.
    log = open(LOG, "w")  # noqa: SIM115 (the server holds it until it exits)
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=log, text=True)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"server exited: {Path(LOG).read_text()[-2000:]}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=1).status_code == 200:
                return proc
        except httpx.TransportError:
            pass
        time.sleep(0.3)
    proc.kill()
    raise SystemExit("server not ready in 120 s")


def mappings(pid: int) -> dict[str, int]:
    """Resident KiB per mapping of the process (`/proc/PID/smaps`), keyed by start address and what
    backs it, so two readings show which region grew: the main heap, an anonymous mmap (a glibc
    arena, a large tensor, a thread stack) or a file."""
    regions: dict[str, int] = {}
    key = None
    for line in Path(f"/proc/{pid}/smaps").read_text().splitlines():
        head = line.split()
        if "-" in head[0] and not head[0].endswith(":"):
            key = f"{head[0].split('-')[0]} {head[5] if len(head) > 5 else '[anon]'}"
        elif head[0] == "Rss:" and key is not None:
            regions[key] = regions.get(key, 0) + int(head[1])
    return regions


def by_kind(regions: dict[str, int]) -> dict[str, float]:
    kinds = {"heap_mib": 0, "anon_mib": 0, "file_mib": 0, "other_mib": 0}
    for key, kib in regions.items():
        backing = key.split(" ", 1)[1]
        kind = (
            "heap_mib" if backing == "[heap]" else "anon_mib" if backing == "[anon]"
            else "file_mib" if backing.startswith("/") else "other_mib"
        )  # fmt: skip
        kinds[kind] += kib
    return {k: round(v / 1024, 2) for k, v in kinds.items()}


def sample(pid: int) -> dict:
    status = Path(f"/proc/{pid}/status").read_text()
    rss_kib = int(next(line.split()[1] for line in status.splitlines() if line.startswith("VmRSS:")))
    return {
        "rss_mib": round(rss_kib / 1024, 1),
        "fds": len(os.listdir(f"/proc/{pid}/fd")),
        "threads": len(os.listdir(f"/proc/{pid}/task")),
        **by_kind(mappings(pid)),
    }


def region_growth(before: dict[str, int], after: dict[str, int], top: int = 8) -> list[dict]:
    """The mappings whose resident size changed most between two readings."""
    keys = set(before) | set(after)
    diffs = sorted(keys, key=lambda k: -abs(after.get(k, 0) - before.get(k, 0)))[:top]
    return [
        {"region": k, "kib_before": before.get(k, 0), "kib_after": after.get(k, 0),
         "kib_diff": after.get(k, 0) - before.get(k, 0)}
        for k in diffs
    ]  # fmt: skip


def confirm(rate: float, mixed, confirmations: list[dict], args: argparse.Namespace) -> float:
    """The first rate, from `rate` down in 15% steps, that holds the SLO for CONFIRM_S with every
    request answered."""
    for attempt in range(5):
        scored, generated = asyncio.run(mixed(rate, CONFIRM_S, seed=10 + 2 * attempt))
        held = (
            scored.p99_s is not None
            and scored.p99_s <= args.slo_ms / 1e3
            and scored.ok == scored.sent
            and generated.ok == generated.sent
        )
        confirmations.append(
            {"rate_rps": rate, "p99_s": scored.p99_s, "sent": scored.sent, "ok": scored.ok,
             "generate_ok": generated.ok, "generate_sent": generated.sent, "held": held}
        )  # fmt: skip
        print(
            f"confirm {rate:.1f} req/s for {CONFIRM_S:.0f} s: p99 {scored.p99_s}, ok {scored.ok}/{scored.sent}"
        )
        if held:
            return rate
        rate *= 0.85
    raise SystemExit(f"no rate held for {CONFIRM_S:.0f} s; see {LOG}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--slo-ms", type=float, default=1000.0)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument(
        "--fraction",
        type=float,
        default=0.8,
        help="share of the swept sustainable rate to offer (default 0.8)",
    )
    ap.add_argument("--sweep-step-s", type=float, default=15.0, help="seconds per sweep step (default 15)")
    ap.add_argument(
        "--rate", type=float, default=None, help="soak at this scoring rate: no sweep, no confirmation"
    )
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()

    from slipstream.doctor import machine_info
    from slipstream.files import write_json
    from slipstream.serve.bodies import validation_payloads
    from slipstream.serve.loadgen import open_loop, sweep

    port = free_port()
    base = f"http://127.0.0.1:{port}"
    server = start_server(port, args.threads)
    payloads = validation_payloads(max_tokens=256, n=200)
    gen_payloads = validation_payloads(max_tokens=256, n=20, endpoint="generate", max_new_tokens=16)
    try:

        async def sweep_under_generation():
            # The generation load of the soak runs underneath the sweep, then is stopped.
            background = asyncio.create_task(
                open_loop(base + "/v1/generate", gen_payloads, GENERATE_RPS, 3600, seed=3)
            )
            try:
                return await sweep(
                    {"slipstream": base + "/v1/score"},
                    payloads,
                    slo_p99_s=args.slo_ms / 1e3,
                    start_rps=20,
                    step_duration_s=args.sweep_step_s,
                    refine_steps=2,
                )
            finally:
                background.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await background

        async def mixed(score_rps: float, duration: float, seed: int):
            return await asyncio.gather(
                open_loop(base + "/v1/score", payloads, score_rps, duration, seed=seed),
                open_loop(base + "/v1/generate", gen_payloads, GENERATE_RPS, duration, seed=seed + 1),
            )

        found, confirmations = None, []
        if args.rate is not None:  # a rate found before: soak at it, no sweep, no confirmation
            rate = args.rate
        else:
            found = asyncio.run(sweep_under_generation())["slipstream"]
            if found.max_rate_rps is None:
                raise SystemExit("no rate met the SLO; raise --slo-ms")
            rate = args.fraction * found.max_rate_rps
            print(
                f"swept {found.max_rate_rps:.1f} req/s at p99 <= {args.slo_ms:.0f} ms (generation underneath)"
            )
            rate = confirm(rate, mixed, confirmations, args)
            print(f"soaking at {rate:.1f} req/s ({rate / found.max_rate_rps:.0%} of the swept rate)")

        samples: list[dict] = []
        stop = threading.Event()
        t0 = time.monotonic()

        regions_at: dict[str, dict[str, int]] = {}

        def watch() -> None:
            while not stop.is_set():
                t = time.monotonic() - t0
                samples.append({"t_s": round(t, 1), **sample(server.pid)})
                if "minute_2" not in regions_at and t >= 60:
                    regions_at["minute_2"] = mappings(server.pid)
                stop.wait(10)

        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        duration = args.minutes * 60

        async def soak():
            return await asyncio.gather(
                open_loop(base + "/v1/score", payloads, rate, duration, seed=1),
                open_loop(base + "/v1/generate", gen_payloads, GENERATE_RPS, duration, seed=2),
            )

        scored, generated = asyncio.run(soak())
        stop.set()
        watcher.join()
        samples.append({"t_s": round(time.monotonic() - t0, 1), **sample(server.pid)})
        regions_at["end"] = mappings(server.pid)
    finally:
        server.send_signal(signal.SIGTERM)
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            server.kill()

    first = [s for s in samples if 60 <= s["t_s"] < 120] or samples[:6]
    last = samples[-6:]

    def med(rows: list[dict], key: str) -> float:
        return statistics.median(r[key] for r in rows)

    summary = {
        "benchmark": "serve_soak",
        "date": datetime.date.today().isoformat(),
        "host": machine_info(),
        "server": f"slipstream serve --size tiny --max-len 256 --threads {args.threads} --generate-slots 4",
        "sustainable_rate_rps": found.max_rate_rps if found else None,
        "sweep_steps": found.steps if found else None,
        "sweep_step_s": args.sweep_step_s if found else None,
        "confirmations": confirmations,
        "soak_rate_rps": rate,
        "soak_fraction_of_swept": rate / found.max_rate_rps if found else None,
        "rate_given": args.rate is not None,
        "malloc_arena_max": os.environ.get("MALLOC_ARENA_MAX"),
        "pythonmalloc": os.environ.get("PYTHONMALLOC"),
        "generate_rps": GENERATE_RPS,
        "minutes": args.minutes,
        "score": {k: v for k, v in scored.to_json().items() if k not in ("url",)},
        "generate": {k: v for k, v in generated.to_json().items() if k not in ("url",)},
        "exit_code": server.returncode,
        "start_minute_2": {k: med(first, k) for k in ("rss_mib", "fds", "threads")},
        "end_last_minute": {k: med(last, k) for k in ("rss_mib", "fds", "threads")},
        "kinds_minute_2": {k: med(first, k) for k in ("heap_mib", "anon_mib", "file_mib", "other_mib")},
        "kinds_last_minute": {k: med(last, k) for k in ("heap_mib", "anon_mib", "file_mib", "other_mib")},
        "region_growth": region_growth(regions_at.get("minute_2", {}), regions_at.get("end", {})),
        "samples": samples,
    }
    print(json.dumps({k: v for k, v in summary.items() if k != "samples"}, indent=2, default=str))
    if args.out:
        write_json(args.out, summary)


if __name__ == "__main__":
    main()
