"""Serving benchmark: highest Poisson request rate with p99 <= SLO, side by side, one run.

Systems (same model, same weights, same torch threads, same machine, same payloads: documents of
the gpt-stdlib validation split, truncated to the model's max_len):
  (a) plain     — a plain FastAPI endpoint, one request per forward pass (a `def` handler, so
                  FastAPI's thread pool runs concurrent requests' forwards side by side);
      plain-fast — the same endpoint with slipstream-fast's numerics and compiled forward (bf16
                  weights, `compile_for_serving`): isolates what the serving layer adds;
  (b) litserve  — LitServe with batching on (max_batch_size, batch_timeout), padding each batch
                  to its longest sequence (LitServe has no shape planning);
  (c) slipstream — `slipstream serve`: adaptive batching into planned (batch, length) shapes,
                  fp32 eager (batching alone);
      slipstream-bf16 — the same computing under bf16 autocast, eager;
      slipstream-fast — bf16 weights (`--quantize bf16`) and `--compile` (inductor, frozen
                  weights; CUDA graphs per shape on CUDA): what slipstream serves by default
                  advice. Its validation-loss cost is measured by `slipstream quantize-eval`.

The rate sweeps interleave the systems round by round (A B C, C B A, ...); while one system is
measured, the others are paused (SIGSTOP to their process groups; an idle LitServe polls its
queues at ~10% of a core, which would otherwise be taken from whichever system is measured).
Afterwards, overload:
--overload-system at 5x its sustainable rate for --overload-s seconds (admitted p99, share of
503s, RSS at start and end).

  python benchmarks/serve.py compare --size small --slo-ms 1000 --json benchmarks/results/serve-cpu-2core-2026-12-02.json
  python benchmarks/serve.py plain --port 8101          # one system alone, for poking at it
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import os
import platform
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
from pydantic import BaseModel

# The repository root, not this folder: benchmarks/kernels.py would shadow the `kernels` package
# that transformers probes for.
sys.path[0] = str(Path(__file__).resolve().parent.parent)

from benchmarks.serve_procs import measure_only, spawn, tree_rss  # noqa: E402


def _score_rows(model, rows: list[list[int]], device=None) -> list[dict]:
    """One padded forward over rows; the same per-token log-prob computation slipstream does."""
    import torch

    L = max(len(r) for r in rows)
    x = torch.full((len(rows), L), 258, dtype=torch.long)
    y = torch.full((len(rows), L), -100, dtype=torch.long)
    for i, r in enumerate(rows):
        t = torch.as_tensor(r, dtype=torch.long)
        x[i, : len(r)] = t
        y[i, : len(r) - 1] = t[1:]
    device = device or next(model.parameters()).device
    with torch.inference_mode():
        nll = model(x.to(device), labels=y.to(device), reduction="none").float().cpu()
    out = []
    for i, r in enumerate(rows):
        s = -float(nll[i, : len(r) - 1].sum())
        out.append({"scored_tokens": len(r) - 1, "logprob_sum": s, "loss": -s / (len(r) - 1)})
    return out


def _model(args):
    import torch

    from slipstream.serve.model import load_model

    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    return load_model(
        size=args.size, checkpoint=args.checkpoint, max_len=args.max_len, device=args.device
    ).model


def run_plain(args) -> None:
    import uvicorn
    from fastapi import FastAPI

    model = _model(args)
    device = next(model.parameters()).device
    forward = model
    if args.fast:  # the same numerics and compiled code as slipstream-fast, without its serving layer
        import torch

        from slipstream.serve.compiled import compile_for_serving

        forward = compile_for_serving(model.to(torch.bfloat16), device)
        _score_rows(forward, [list(range(64))], device=device)  # compile before serving
    app = FastAPI()

    @app.post("/v1/score")
    def score(body: Body) -> dict:  # one request per forward pass
        return _score_rows(forward, [body.tokens], device=device)[0]

    uvicorn.run(app, host="127.0.0.1", port=args.port, log_level="warning", access_log=False)


def run_litserve(args) -> None:
    import litserve as ls

    api = ScoreAPI(
        args, max_batch_size=args.max_batch_size, batch_timeout=args.batch_timeout, api_path="/v1/score"
    )
    ls.LitServer(
        api, accelerator="cuda" if args.device == "cuda" else "cpu", workers_per_device=args.workers
    ).run(host="127.0.0.1", port=args.port, generate_client_file=False)


class Body(BaseModel):
    tokens: list[int]


if importlib.util.find_spec("litserve") is not None:  # an optional peer: pip install litserve
    import litserve as ls

    class ScoreAPI(ls.LitAPI):
        """At module level so LitServe's spawned worker process can unpickle it."""

        def __init__(self, args, **kw):
            super().__init__(**kw)
            self.args = args

        def setup(self, device):
            self.model = _model(self.args)

        def decode_request(self, request):
            return request["tokens"]

        def batch(self, inputs):
            return inputs  # rows of different lengths; predict pads them to the longest

        def predict(self, rows):
            return _score_rows(self.model, rows)

        def unbatch(self, output):
            return output

        def encode_response(self, output):
            return output


def _wait_ready(url: str, proc: subprocess.Popen, timeout_s: float = 180) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{url}: server exited with {proc.returncode}")
        try:
            if httpx.post(url, json={"tokens": [256, 100, 101]}, timeout=5).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"{url}: not ready after {timeout_s} s")


def compare(args) -> int:
    from slipstream.doctor import machine_info
    from slipstream.serve import bodies, loadgen

    if args.overload_s > 0 and args.overload_system not in args.systems.split(","):
        raise SystemExit(f"--overload-system {args.overload_system} is not among --systems {args.systems}")
    logs = Path(args.log_dir)
    logs.mkdir(parents=True, exist_ok=True)
    common = [
        "--size",
        args.size,
        "--threads",
        str(args.threads),
        "--max-len",
        str(args.max_len),
        "--device",
        args.device,
    ]
    if args.checkpoint:
        common += ["--checkpoint", args.checkpoint]
    py = sys.executable
    ports = {
        "plain": 18601,
        "plain-fast": 18606,
        "litserve": 18602,
        "slipstream": 18603,
        "slipstream-bf16": 18604,
        "slipstream-fast": 18605,
    }
    ss_flags = [
        "--max-batch-size",
        str(args.max_batch_size),
        "--latency-budget-ms",
        str(args.slo_ms * 0.6),
        "--workers",
        str(args.workers),
        "--timeout-ms",
        str(args.slo_ms * 2),
    ]
    argv = {
        "plain": [py, __file__, "plain", "--port", str(ports["plain"]), *common],
        "plain-fast": [py, __file__, "plain", "--fast", "--port", str(ports["plain-fast"]), *common],
        "litserve": [
            py,
            __file__,
            "litserve",
            "--port",
            str(ports["litserve"]),
            "--max-batch-size",
            str(args.max_batch_size),
            "--batch-timeout",
            str(args.batch_timeout),
            *common,
        ],
        "slipstream": [
            py,
            "-m",
            "slipstream.serve.cli",
            "serve",
            "--port",
            str(ports["slipstream"]),
            "--quantize",
            "none",  # the fp32 eager server: `auto` would pick bf16 weights where bf16 pays
            "--json",
            str(logs / "slipstream-stats.json"),
            *ss_flags,
            *common,
        ],
        # The same server computing under bf16 autocast: a precision change, reported apart from the
        # batching comparison, with its validation-loss delta measured by `slipstream quantize-eval`.
        "slipstream-bf16": [
            py,
            "-m",
            "slipstream.serve.cli",
            "serve",
            "--port",
            str(ports["slipstream-bf16"]),
            "--dtype",
            "bf16",
            *ss_flags,
            *common,
        ],
        "slipstream-fast": [
            py,
            "-m",
            "slipstream.serve.cli",
            "serve",
            "--port",
            str(ports["slipstream-fast"]),
            "--quantize",
            "bf16",
            "--compile",
            "--json",
            str(logs / "slipstream-fast-stats.json"),
            *ss_flags,
            *common,
        ],
    }
    systems = [s for s in args.systems.split(",") if s]
    procs = {}
    try:
        for name in systems:
            procs[name] = spawn(argv[name], logs / f"{name}.log")
        urls = {name: f"http://127.0.0.1:{ports[name]}/v1/score" for name in systems}
        for name in systems:
            _wait_ready(urls[name], procs[name])
        payloads = bodies.validation_payloads(max_tokens=args.max_len)
        lengths = [len(p["tokens"]) for p in payloads]
        print(
            f"{len(payloads)} payloads, median {sorted(lengths)[len(lengths) // 2]} tokens; SLO p99 <= {args.slo_ms} ms",
            flush=True,
        )

        sweeps = (
            {}
            if args.overload_rate
            else asyncio.run(
                loadgen.sweep(
                    urls,
                    payloads,
                    slo_p99_s=args.slo_ms / 1000,
                    start_rps=args.start_rate,
                    factor=args.factor,
                    refine_steps=args.refine,
                    step_duration_s=args.step_s,
                    max_steps=args.max_steps,
                    progress=lambda line: print(line, flush=True),
                    before_step=lambda name: measure_only(procs, name),
                )
            )
        )
        for proc in procs.values():
            os.killpg(proc.pid, signal.SIGCONT)
        result = {
            "benchmark": "serve-score-max-rate-under-p99-slo",
            "date": time.strftime("%Y-%m-%d"),
            "machine": machine_info(),
            "load_generator": "in this process, on the same machine as the servers",
            "model": {
                "workload": "gpt-stdlib",
                "size": args.size,
                "max_len": args.max_len,
                "checkpoint": args.checkpoint,
                "threads": args.threads,
            },
            "payloads": {
                "count": len(payloads),
                "median_tokens": sorted(lengths)[len(lengths) // 2],
                "max_tokens": max(lengths),
            },
            "slo_p99_s": args.slo_ms / 1000,
            "systems": {},
        }
        for name, sw in sweeps.items():
            result["systems"][name] = {
                "max_rate_rps": sw.max_rate_rps,
                "p99_at_max_s": sw.p99_at_max_s,
                "steps": sw.steps,
            }
            print(f"{name:>11}: max rate {sw.max_rate_rps} req/s, p99 {sw.p99_at_max_s}", flush=True)
        base = result["systems"].get("plain", {}).get("max_rate_rps")
        lit = result["systems"].get("litserve", {}).get("max_rate_rps")
        for name in systems:
            r = result["systems"].get(name, {}).get("max_rate_rps")
            if base and r:
                result["systems"][name]["rate_vs_plain"] = r / base
            if lit and r and name.startswith("slipstream"):
                result["systems"][name]["rate_vs_litserve"] = r / lit
        victim = args.overload_system
        sustain = (
            (args.overload_rate / 5)
            if args.overload_rate
            else result["systems"].get(victim, {}).get("max_rate_rps")
        )
        if args.overload_s > 0 and sustain:
            pid = procs[victim].pid
            rss0 = tree_rss(pid)
            res = asyncio.run(
                loadgen.open_loop(urls[victim], payloads, 5 * sustain, args.overload_s, seed=7, timeout_s=60)
            )
            rss1 = tree_rss(pid)
            result["overload"] = {
                "system": victim,
                "rate_rps": 5 * sustain,
                "duration_s": args.overload_s,
                "rss_start_bytes": rss0,
                "rss_end_bytes": rss1,
                "server_alive": procs[victim].poll() is None,
                "admitted_p99_s": res.p99_s,
                "admitted_p99_over_slo": (res.p99_s / (args.slo_ms / 1000)) if res.p99_s else None,
                "share_503": res.errors_by_status.get("503", 0) / max(res.sent, 1),
                **res.to_json(),
            }
            o = result["overload"]
            print(
                f"overload {o['rate_rps']:.1f} req/s for {args.overload_s} s: ok {res.ok}/{res.sent}, admitted p99 {res.p99_s}, "
                f"errors {res.errors_by_status}, RSS {rss0 / 2**20:.0f} -> {rss1 / 2**20:.0f} MiB, alive {o['server_alive']}",
                flush=True,
            )
        for name in ("slipstream", "slipstream-fast"):  # batching statistics each writes at exit
            if name in procs:
                procs[name].send_signal(15)
                procs[name].wait(timeout=60)
                stats = logs / f"{name}-stats.json"
                if stats.exists():
                    result[f"{name.replace('-', '_')}_batching"] = json.loads(stats.read_text())
        if args.json:
            from slipstream.files import write_json

            write_json(args.json, result)
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGCONT)
                os.killpg(proc.pid, 15)
        for proc in procs.values():
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, 9)
    return 0


def generation(args) -> int:
    """Continuous vs static batching, in process, same Poisson arrivals, interleaved repetitions."""
    import statistics

    import numpy as np
    import torch

    from slipstream.serve.generate import Generator, GeneratorConfig
    from slipstream.serve.model import load_model
    from slipstream.workloads.corpus import load_stdlib_corpus

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    loaded = load_model(size=args.size, checkpoint=args.checkpoint, max_len=args.max_len, device=args.device)
    val = load_stdlib_corpus().validation
    rng = np.random.default_rng(0)
    n = args.gen_requests
    prompts = [np.asarray(val[i])[: args.prompt_tokens].tolist() for i in range(n)]
    new_tokens = rng.integers(args.min_new, args.max_new + 1, n).tolist()
    arrivals = np.cumsum(rng.exponential(1 / args.gen_rate, n)).tolist()
    gens = {
        p: Generator(loaded, GeneratorConfig(slots=args.slots, policy=p)) for p in ("continuous", "static")
    }

    async def run(gen: Generator) -> dict:
        await gen.start(warmup=False)
        start = time.perf_counter()
        ttft, done_at = [], []

        async def one(i):
            await asyncio.sleep(max(0.0, start + arrivals[i] - time.perf_counter()))
            t0 = start + arrivals[i]  # measured from the intended arrival
            stream = await gen.submit(prompts[i], max_new_tokens=new_tokens[i], stop_at_eos=False)
            k = 0
            async for _ in stream:
                if k == 0:
                    ttft.append(time.perf_counter() - t0)
                k += 1
            done_at.append(time.perf_counter())
            return k

        counts = await asyncio.gather(*[one(i) for i in range(n)])
        elapsed = max(done_at) - start
        gen.ready = False  # reuse: stop the loop, keep the executor
        gen._task.cancel()
        return {
            "tokens": sum(counts),
            "elapsed_s": elapsed,
            "tokens_per_s": sum(counts) / elapsed,
            "ttft_p50_s": float(np.percentile(ttft, 50)),
            "ttft_p99_s": float(np.percentile(ttft, 99)),
        }

    gens["continuous"].warmup()
    runs = {p: [] for p in gens}
    for rep in range(args.gen_reps):
        order = ["continuous", "static"] if rep % 2 == 0 else ["static", "continuous"]
        for p in order:
            gens[p].stats.ttft_s.clear()
            r = asyncio.run(run(gens[p]))
            runs[p].append(r)
            print(
                f"rep {rep} {p:>10}: {r['tokens_per_s']:.1f} tok/s, TTFT p50 {r['ttft_p50_s'] * 1000:.0f} ms, p99 {r['ttft_p99_s'] * 1000:.0f} ms",
                flush=True,
            )
    summary = {
        p: {k: statistics.median(r[k] for r in rs) for k in ("tokens_per_s", "ttft_p50_s", "ttft_p99_s")}
        for p, rs in runs.items()
    }
    result = {
        "benchmark": "serve-generate-continuous-vs-static",
        "date": time.strftime("%Y-%m-%d"),
        "machine": {
            "cpu_count": os.cpu_count(),
            "platform": platform.platform(),
            "torch": torch.__version__,
            "note": "2 shared cores; other jobs ran concurrently",
        },
        "model": {
            "size": args.size,
            "max_len": loaded.max_len,
            "threads": args.threads,
            "checkpoint": args.checkpoint,
        },
        "load": {
            "requests": n,
            "poisson_rate_rps": args.gen_rate,
            "prompt_tokens": args.prompt_tokens,
            "new_tokens_uniform": [args.min_new, args.max_new],
            "slots": args.slots,
            "reps": args.gen_reps,
        },
        "median": summary,
        "continuous_vs_static_tokens_per_s": summary["continuous"]["tokens_per_s"]
        / summary["static"]["tokens_per_s"],
        "static_vs_continuous_ttft_p99": summary["static"]["ttft_p99_s"]
        / summary["continuous"]["ttft_p99_s"],
        "runs": runs,
    }
    print(
        json.dumps(
            {
                k: result[k]
                for k in ("median", "continuous_vs_static_tokens_per_s", "static_vs_continuous_ttft_p99")
            },
            indent=1,
        )
    )
    if args.json:
        from slipstream.files import write_json

        write_json(args.json, result)
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("mode", choices=("compare", "generate", "plain", "litserve"))
    p.add_argument("--size", default="small")
    p.add_argument("--device", default="cpu", help="cpu or cuda (the same for every system)")
    p.add_argument("--checkpoint", default=None)
    p.add_argument("--max-len", type=int, default=1024)
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads per worker")
    p.add_argument(
        "--workers", type=int, default=2, help="slipstream compute workers / LitServe workers_per_device"
    )
    p.add_argument("--port", type=int, default=8101)
    p.add_argument("--fast", action="store_true", help="plain: bf16 weights + compile_for_serving")
    p.add_argument("--max-batch-size", type=int, default=16)
    p.add_argument("--batch-timeout", type=float, default=0.01, help="LitServe's batch window, seconds")
    p.add_argument("--systems", default="plain,litserve,slipstream,slipstream-fast")
    p.add_argument("--overload-system", default="slipstream-fast", help="the system overloaded at 5x")
    p.add_argument(
        "--overload-rate",
        type=float,
        default=None,
        help="skip the sweeps; overload --overload-system at this rate (e.g. 5x a rate a sweep found)",
    )
    p.add_argument("--slo-ms", type=float, default=1000.0)
    p.add_argument("--start-rate", type=float, default=2.0)
    p.add_argument("--factor", type=float, default=1.5)
    p.add_argument("--refine", type=int, default=2)
    p.add_argument("--step-s", type=float, default=10.0)
    p.add_argument("--max-steps", type=int, default=14)
    p.add_argument("--overload-s", type=float, default=60.0)
    p.add_argument("--log-dir", default="/tmp/slipstream-serve-bench")
    p.add_argument("--json", default=None)
    p.add_argument("--slots", type=int, default=8, help="generate: KV-cache slots")
    p.add_argument("--gen-requests", type=int, default=40)
    p.add_argument("--gen-rate", type=float, default=3.0, help="generate: Poisson arrivals per second")
    p.add_argument("--gen-reps", type=int, default=2)
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--min-new", type=int, default=8)
    p.add_argument("--max-new", type=int, default=128)
    args = p.parse_args(argv)
    if args.mode == "plain":
        run_plain(args)
    elif args.mode == "litserve":
        run_litserve(args)
    elif args.mode == "generate":
        return generation(args)
    else:
        return compare(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
