"""OpenAI-compatible serving, side by side: `slipstream serve` against `transformers serve
--continuous-batching`, same model folder, same prompts, same lengths, one run.

Systems (each is a command and a readiness URL; both serve /v1/completions and
/v1/chat/completions, both stream SSE with a final usage chunk):
  slipstream   — `slipstream serve --model DIR --generate-slots 8` (ready: GET /readyz);
  transformers — `transformers serve --continuous-batching --device cpu --host 127.0.0.1 --port P
                 --cb-num-blocks N DIR` with HF_HUB_OFFLINE=1 (ready: GET /health, which answers
                 only once the model is loaded; the model field it expects is DIR as given, which
                 GET /v1/models lists). `--cb-num-blocks` caps its paged KV cache (N x 256 tokens):
                 left to itself on CPU it sizes the cache from free *host* memory (90% of it: 13.4
                 GiB resident on a 24 GiB machine, and ~90 s to start).

Each system gets one warm-up request, then an SLO sweep (`slipstream.serve.loadgen.sweep`):
Poisson arrivals of streaming requests, rates growing by --factor from --start-rate until p99
end-to-end latency exceeds --slo-ms (or > 1% errors), then --refine bisections; the systems are
measured round by round, alternating the order, and every server but the one measured is paused
(SIGSTOP to its process group). Reported per system: the highest passing rate, output tokens/s and
p99 TTFT at that rate (and p99 end-to-end, inter-token latency). Then the overload phase for
--overload-system (default slipstream): 5x its sustainable rate for --overload-s seconds: whether
it survived, admitted (200) p99, share of 503s, share of refusals carrying Retry-After, RSS of its
process tree at start and end; then SIGTERM with requests in flight: it must answer those and exit
0. Every server is finally stopped with SIGTERM, and how it exited (code, seconds) is recorded.

    python benchmarks/serve_models.py --out /tmp/servebench/llama
    python benchmarks/serve_openai.py --model /tmp/servebench/llama --slo-ms 5000 \\
        --json benchmarks/results/serve-openai-cpu-2core-<date>.json
    python benchmarks/serve_openai.py --model /tmp/servebench/llama --systems transformers \\
        --max-steps 2 --step-s 5 --overload-s 0          # a smoke run of the harness, one system
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shlex
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

# The repository root, not this folder: benchmarks/kernels.py would shadow the `kernels` package
# that transformers probes for.
sys.path[0] = str(Path(__file__).resolve().parent.parent)

from benchmarks.serve_procs import (  # noqa: E402
    REPO,
    kill_group,
    measure_only,
    spawn,
    terminate,
    tree_rss,
    wait_ready,
)

from slipstream.serve import bodies, loadgen  # noqa: E402


@dataclass
class System:
    """A server under test: how to start it and how to know it is ready."""

    name: str
    argv: list[str]
    port: int
    ready_path: str
    env: dict[str, str] = field(default_factory=dict)

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}{path}"


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def systems(args) -> dict[str, System]:
    model = str(Path(args.model).resolve())
    bin_dir = Path(sys.executable).parent
    offline = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    if args.threads:
        offline |= {"OMP_NUM_THREADS": str(args.threads)}
    p1, p2 = free_port(), free_port()
    out = {
        "slipstream": System(
            "slipstream",
            [sys.executable, "-m", "slipstream.serve.cli", "serve", "--model", model]
            + ["--generate-slots", str(args.slots), "--port", str(p1)]
            + (["--threads", str(args.threads)] if args.threads else [])
            + shlex.split(args.slipstream_args),
            p1,
            "/readyz",
            offline,
        ),
        "transformers": System(
            "transformers",
            [str(bin_dir / "transformers"), "serve", "--continuous-batching", "--device", "cpu"]
            + ["--host", "127.0.0.1", "--port", str(p2), "--log-level", "warning"]
            + (["--cb-num-blocks", str(args.peer_cb_num_blocks)] if args.peer_cb_num_blocks else [])
            + shlex.split(args.transformers_args)
            + [model],
            p2,
            "/health",
            offline,
        ),
    }
    return {name: out[name] for name in args.systems.split(",") if name}


def at_max(sweep: loadgen.SweepResult) -> dict | None:
    """The (last) passing step at the sweep's highest passing rate."""
    steps = [s for s in sweep.steps if s["passed"] and s["rate_rps"] == sweep.max_rate_rps]
    return steps[-1] if steps else None


def summary(sweep: loadgen.SweepResult) -> dict:
    step = at_max(sweep) or {}
    return {
        "max_rate_rps": sweep.max_rate_rps,
        "p99_at_max_s": sweep.p99_at_max_s,
        "output_tokens_per_s_at_max": step.get("tokens_per_s"),
        "ttft_p99_at_max_s": step.get("ttft_p99_s"),
        "ttft_p50_at_max_s": step.get("ttft_p50_s"),
        "itl_p50_at_max_s": step.get("itl_p50_s"),
        "itl_p99_at_max_s": step.get("itl_p99_s"),
        "steps": sweep.steps,
    }


async def drain_check(url: str, payloads: list[dict], rate: float, proc, load_s: float) -> dict:
    """Requests at `rate` for `load_s` seconds, then SIGTERM to the server 0.5 s after the last
    send, while the last ones are still streaming: every request (all admitted before the signal)
    must be answered 200, and the process must exit by itself."""
    load = asyncio.create_task(loadgen.open_loop(url, payloads, rate, load_s, seed=11, timeout_s=120))
    # 0.5 s: a request sent just before the signal may meet the listening socket closing, or an
    # idle keep-alive connection the server closes as it stops; that is not a failure to drain
    await asyncio.sleep(load_s + 0.5)
    stopped = await asyncio.to_thread(terminate, proc, 120)
    res = await load
    return {**stopped, "requests_sent_before_sigterm": res.to_json()}


def host_info() -> dict:
    import importlib.metadata as md

    from slipstream.doctor import machine_info

    info = machine_info()
    for pkg in ("transformers", "aiohttp", "fastapi", "uvicorn", "openai"):
        try:
            info[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            info[pkg] = None
    try:
        import subprocess

        info["slipstream_commit"] = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=REPO
        ).stdout.strip()
    except OSError:
        info["slipstream_commit"] = None
    return info


def run(args) -> int:
    logs = Path(args.log_dir)
    logs.mkdir(parents=True, exist_ok=True)
    todo = systems(args)
    if not todo:
        raise SystemExit(f"--systems {args.systems!r}: name slipstream and/or transformers")
    prompts = bodies.load_prompts(args.prompts, args.prompt_chars)
    endpoint = bodies.OPENAI_ENDPOINTS[args.endpoint]
    procs, ready_s, payloads, exits = {}, {}, {}, {}
    result: dict = {
        "benchmark": "serve-openai-max-rate-under-p99-slo",
        "date": time.strftime("%Y-%m-%d"),
        "machine": host_info(),
        "load_generator": "aiohttp, in this process, on the same machine as the servers",
        "model_dir": str(Path(args.model).resolve()),
        "model": _model_card(Path(args.model)),
        "load": {
            "endpoint": endpoint,
            "stream": True,
            "max_tokens": args.max_new_tokens,
            "temperature": 0,
            "prompts": len(prompts),
            "prompt_chars_median": statistics.median(len(p) for p in prompts),
            "prompt_chars_max": max(len(p) for p in prompts),
            "prompt_source": args.prompts or "/usr/share/doc/*/copyright paragraphs",
            "arrivals": "Poisson, open loop, latency from the intended send time",
        },
        "slo": {"metric": "p99 end-to-end latency of 200 answers, errors <= 1%", "p99_s": args.slo_ms / 1000},
        "sweep": {
            "start_rps": args.start_rate,
            "factor": args.factor,
            "refine": args.refine,
            "step_s": args.step_s,
            "max_steps": args.max_steps,
        },
        "systems": {},
    }
    try:
        for name, sys_ in todo.items():
            procs[name] = spawn(sys_.argv, logs / f"{name}.log", sys_.env)
            result["systems"][name] = {"command": shlex.join(sys_.argv), "env": sys_.env}
        for name, sys_ in todo.items():  # started together, waited on one by one
            ready_s[name] = wait_ready(
                sys_.url(sys_.ready_path), procs[name], args.ready_timeout_s, logs / f"{name}.log"
            )
            model = loadgen.served_model(sys_.url(endpoint))
            payloads[name] = bodies.openai_payloads(
                prompts, args.endpoint, model, args.max_new_tokens, stream=True
            )
            result["systems"][name] |= {"ready_s": ready_s[name], "model_field": model}
            print(f"{name}: ready after {ready_s[name]:.1f} s, model {model!r}", flush=True)
        for name, sys_ in todo.items():  # one request each before any measurement
            measure_only(procs, name)
            warm = asyncio.run(
                loadgen.open_loop(sys_.url(endpoint), payloads[name][:1], 1.0, 0.5, timeout_s=300)
            )
            if warm.sent and not warm.ok:
                print(f"{name}: warm-up request failed: {warm.errors_by_status}", flush=True)
            result["systems"][name]["warmup"] = warm.to_json()
            result["systems"][name]["rss_after_warmup_bytes"] = tree_rss(procs[name].pid)
        measure_only(procs, None)
        sweeps = asyncio.run(
            loadgen.sweep(
                {name: s.url(endpoint) for name, s in todo.items()},
                payloads,
                slo_p99_s=args.slo_ms / 1000,
                start_rps=args.start_rate,
                factor=args.factor,
                refine_steps=args.refine,
                step_duration_s=args.step_s,
                max_steps=args.max_steps,
                timeout_s=args.timeout_s,
                pause_s=args.pause_s,
                progress=lambda line: print(line, flush=True),
                before_step=lambda name: measure_only(procs, name),
            )
        )
        measure_only(procs, None)
        for name, sw in sweeps.items():
            result["systems"][name] |= summary(sw)
            s = result["systems"][name]
            print(
                f"{name:>12}: max rate {sw.max_rate_rps} req/s, p99 {_ms(sw.p99_at_max_s)}, "
                f"{_num(s['output_tokens_per_s_at_max'])} output tok/s, TTFT p99 {_ms(s['ttft_p99_at_max_s'])}",
                flush=True,
            )
        ours, peer = result["systems"].get("slipstream", {}), result["systems"].get("transformers", {})
        for key in ("max_rate_rps", "output_tokens_per_s_at_max"):
            if ours.get(key) and peer.get(key):
                result[f"slipstream_vs_transformers_{key}"] = ours[key] / peer[key]
        victim = args.overload_system
        sustain = result["systems"].get(victim, {}).get("max_rate_rps")
        if args.overload_s > 0 and victim in todo and sustain:
            result["overload"] = overload(args, todo[victim], procs, payloads[victim], sustain, endpoint)
        elif args.overload_s > 0:
            result["overload"] = {"skipped": f"{victim!r} not measured or no sustainable rate found"}
        for name in todo:
            if procs[name].poll() is None:
                exits[name] = terminate(procs[name], 60)
                print(f"{name}: SIGTERM -> exit {exits[name]}", flush=True)
            result["systems"][name]["shutdown"] = exits.get(name) or result.get("overload", {}).get("drain")
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                terminate(proc, 30)
            kill_group(proc)
        if args.json:
            from slipstream.files import write_json

            write_json(args.json, result)
            print(f"wrote {args.json}", flush=True)
    return 0


def overload(args, sys_: System, procs: dict, payloads: list[dict], sustain: float, endpoint: str) -> dict:
    proc = procs[sys_.name]
    measure_only(procs, sys_.name)
    rate = args.overload_factor * sustain
    rss0 = tree_rss(proc.pid)
    res = asyncio.run(
        loadgen.open_loop(sys_.url(endpoint), payloads, rate, args.overload_s, seed=7, timeout_s=120)
    )
    alive = proc.poll() is None
    rss1 = tree_rss(proc.pid) if alive else None
    errors = res.errors_by_status
    refused = sum(v for k, v in errors.items() if k.isdigit())
    out = {
        "system": sys_.name,
        "rate_rps": rate,
        "sustainable_rate_rps": sustain,
        "overload_s": args.overload_s,
        "server_alive": alive,
        "exit_code_during": None if alive else proc.returncode,
        "rss_start_bytes": rss0,
        "rss_end_bytes": rss1,
        "admitted": res.ok,
        "admitted_p99_s": res.p99_s,
        "admitted_p99_over_slo": res.p99_s / (args.slo_ms / 1000) if res.p99_s else None,
        "share_503": errors.get("503", 0) / max(res.sent, 1),
        "refusals_with_retry_after_share": res.retry_after / refused if refused else None,
        "other_errors": {k: v for k, v in errors.items() if k != "503"},
        **res.to_json(),
    }
    print(
        f"overload {rate:.2f} req/s for {args.overload_s:.0f} s: ok {res.ok}/{res.sent}, admitted p99 "
        f"{_ms(res.p99_s)}, errors {errors}, Retry-After on {res.retry_after}/{refused} refusals, "
        f"RSS {rss0 / 2**20:.0f} -> {(rss1 or 0) / 2**20:.0f} MiB, alive {alive}",
        flush=True,
    )
    if alive:  # SIGTERM with requests in flight: they finish, then exit 0
        time.sleep(args.pause_s)
        drain = asyncio.run(drain_check(sys_.url(endpoint), payloads, sustain, proc, args.drain_after_s))
        out["drain"] = drain
        during = drain["requests_sent_before_sigterm"]
        print(
            f"SIGTERM after {args.drain_after_s} s of load at {sustain:.2f} req/s: exit {drain['exit_code']} "
            f"in {drain['exit_s']:.1f} s (killed: {drain['killed']}); requests sent before it: ok "
            f"{during['ok']}/{during['sent']}, errors {during['errors_by_status']}",
            flush=True,
        )
    return out


def _model_card(folder: Path) -> dict:
    cfg = json.loads((folder / "config.json").read_text()) if (folder / "config.json").exists() else {}
    train = folder / "train.json"
    t = json.loads(train.read_text()) if train.exists() else {}
    return {
        "architectures": cfg.get("architectures"),
        "hidden_size": cfg.get("hidden_size"),
        "num_hidden_layers": cfg.get("num_hidden_layers"),
        "vocab_size": cfg.get("vocab_size"),
        "parameters": t.get("parameters"),
        "trained_steps": t.get("steps"),
        "loss_last10": t.get("loss_last10"),
        "built_by": "benchmarks/serve_models.py" if t else None,
    }


def _ms(v) -> str:
    return "-" if v is None else f"{v * 1000:.0f} ms"


def _num(v) -> str:
    return "-" if v is None else f"{v:.1f}"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="save_pretrained folder (benchmarks/serve_models.py)")
    p.add_argument(
        "--systems", default="slipstream,transformers", help="comma-separated: slipstream, transformers"
    )
    p.add_argument("--endpoint", choices=tuple(bodies.OPENAI_ENDPOINTS), default="completions")
    p.add_argument("--max-new-tokens", type=int, default=64, help="max_tokens of every request")
    p.add_argument(
        "--prompts", default=None, help="loadtest's --prompts (default: Debian copyright paragraphs)"
    )
    p.add_argument("--prompt-chars", type=int, default=256)
    p.add_argument("--slo-ms", type=float, default=5000.0, help="SLO: p99 end-to-end latency, milliseconds")
    p.add_argument("--start-rate", type=float, default=0.5)
    p.add_argument("--factor", type=float, default=1.5)
    p.add_argument("--refine", type=int, default=2)
    p.add_argument("--step-s", type=float, default=20.0, help="seconds per sweep step")
    p.add_argument("--max-steps", type=int, default=14, help="sweep rounds at most")
    p.add_argument("--pause-s", type=float, default=2.0, help="idle seconds between steps")
    p.add_argument("--timeout-s", type=float, default=60.0, help="per-request timeout")
    p.add_argument("--overload-system", default="slipstream")
    p.add_argument("--overload-s", type=float, default=60.0, help="0 skips the overload phase")
    p.add_argument("--overload-factor", type=float, default=5.0)
    p.add_argument("--drain-after-s", type=float, default=3.0, help="SIGTERM after this much load")
    p.add_argument("--slots", type=int, default=8, help="slipstream --generate-slots")
    p.add_argument(
        "--peer-cb-num-blocks",
        type=int,
        default=64,
        help="transformers --cb-num-blocks (256-token pages; 0 = its default: 90%% of free host memory)",
    )
    p.add_argument("--threads", type=int, default=0, help="torch threads for both (0 = each one's default)")
    p.add_argument("--slipstream-args", default="", help="more `slipstream serve` flags, one string")
    p.add_argument("--transformers-args", default="", help="more `transformers serve` flags, one string")
    p.add_argument("--ready-timeout-s", type=float, default=900.0)
    p.add_argument("--log-dir", default="/tmp/slipstream-serve-openai")
    p.add_argument("--json", default=None)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
