"""What `slipstream profile` costs: profiled vs unprofiled step time, full and light mode (issue 6).

    python benchmarks/profile_overhead.py --out benchmarks/results/profile-overhead-cpu-2core-2026-12-02.json
    python benchmarks/profile_overhead.py --cycles 12

Interleaved at the step level, so drift (and other load on the machine) hits both sides alike: the
profiler that `slipstream profile` builds (`capture.make_profiler`, full or light) runs a schedule
of wait 1 / warm-up 1 / active 1 repeated, so the steps go A W B A W B ... with A unprofiled and B
profiled, the discarded warm-up step W between them. Each cycle gives one paired ratio B / A; the
median over cycles is reported with its spread (p25..p75). The profiler's processing of each
recorded step (on_trace_ready) happens at the step boundary and is timed apart, as in a capture.
The first two cycles are warm-up and excluded.

Cases: the built-in GPT (gpt-stdlib tiny, 8 x 256 tokens, fp32, through Session: many small ops,
the profiler's worst case) and the tiny MLP of tests/profile/scripts/clean.py (bf16 autocast,
fused AdamW; about a millisecond of pure op dispatch per step).
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
SKIP_CYCLES = 2


def machine() -> dict[str, object]:
    from slipstream.doctor import machine_info

    return machine_info()


def gpt_step() -> Callable[[], None]:
    from slipstream import Session, get_preset
    from slipstream.workloads import get_workload

    session = Session(get_preset("baseline"))
    model = session.prepare_model(get_workload("gpt-stdlib").model("tiny", 256))
    opt = session.build_optimizer(model)
    tokens = torch.randint(1, 256, (8, 257), device=session.device)
    batch = {"input_ids": tokens[:, :-1], "labels": tokens[:, 1:]}

    def step() -> None:
        with session.autocast():
            loss = model(**batch)
        session.backward(loss)
        session.step(opt)

    return step


def mlp_step() -> Callable[[], None]:
    sys.path.insert(0, str(ROOT / "tests/profile/scripts"))
    from _common import autocast, batch, make_model, make_optimizer

    model, x_y = make_model(), batch()
    opt = make_optimizer(model)

    def step() -> None:
        x, y = x_y
        with autocast():
            loss = torch.nn.functional.mse_loss(model(x).float(), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


CASES = {"gpt-stdlib-tiny": gpt_step, "mlp-script": mlp_step}


def measure(step: Callable[[], None], light: bool, cycles: int) -> dict[str, object]:
    from slipstream.profile.steps import make_profiler

    prof = make_profiler(
        light=light,
        device="cuda" if torch.cuda.is_available() else "cpu",
        schedule=torch.profiler.schedule(wait=1, warmup=1, active=1, repeat=cycles),
        on_trace_ready=lambda p: p.events(),  # build the events, as a capture does
    )
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    times: list[float] = []
    boundary_s = 0.0
    prof.start()
    for _ in range(3 * cycles):
        t0 = time.perf_counter()
        step()
        sync()
        times.append(time.perf_counter() - t0)
        t1 = time.perf_counter()
        prof.step()
        gc.collect()  # the garbage of processing a recorded step is collected here, not in the next step
        boundary_s += time.perf_counter() - t1
    prof.stop()
    pairs = [(times[3 * c], times[3 * c + 2]) for c in range(SKIP_CYCLES, cycles)]
    ratios = sorted(b / a for a, b in pairs)
    q = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else [ratios[0]] * 3
    return {
        "overhead_ratio_median": statistics.median(ratios),
        "overhead_ratio_p25": q[0],
        "overhead_ratio_p75": q[2],
        "unprofiled_step_s_median": statistics.median(a for a, _ in pairs),
        "profiled_step_s_median": statistics.median(b for _, b in pairs),
        "pairs": len(pairs),
        "postprocess_s_per_cycle": boundary_s / cycles,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cycles", type=int, default=12, help="A W B cycles per case and mode (default: 12)")
    p.add_argument("--cases", default=",".join(CASES))
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default: 1)")
    p.add_argument("--out", help="write the results JSON here")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)  # spinning OpenMP threads on a shared 2-core box drown the signal

    results: dict[str, object] = {}
    for case in args.cases.split(","):
        step = CASES[case]()
        for _ in range(3):
            step()  # warm-up outside any profiler
        results[case] = {}
        for mode in ("full", "light"):
            r = measure(step, mode == "light", args.cycles)
            results[case][mode] = r
            print(
                f"{case:16} {mode:5}  unprofiled {r['unprofiled_step_s_median'] * 1e3:8.2f} ms  "
                f"profiled {r['profiled_step_s_median'] * 1e3:8.2f} ms  overhead "
                f"{r['overhead_ratio_median']:.3f}x (p25..p75 {r['overhead_ratio_p25']:.3f}..{r['overhead_ratio_p75']:.3f}, "
                f"{r['pairs']} pairs)  processing {r['postprocess_s_per_cycle'] * 1e3:.0f} ms/step",
                flush=True,
            )
    doc = {
        "benchmark": "profile.overhead",
        "machine": machine(),
        "method": "step-level interleaving under slipstream's profiler settings: schedule wait 1 / warmup 1 / "
        "active 1 repeated; paired ratio profiled/unprofiled step per cycle, median and p25..p75; "
        f"first {SKIP_CYCLES} cycles excluded",
        "cycles": args.cycles,
        "note": "a shared 2-core machine (see load_average_1min): per-step times vary several-fold "
        "between neighbouring steps, so the spread is wide",
        "results": results,
    }
    if args.out:
        from slipstream.files import write_json

        write_json(args.out, doc)
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
