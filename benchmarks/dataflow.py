"""Acceptance figures for slipstream.dataflow (issue 4) on the data-bound vision-synthetic workload.

    python benchmarks/dataflow.py                                  # defaults: small CNN, 1 torch thread
    python benchmarks/dataflow.py --workers 1 --rounds 5 --out benchmarks/results/dataflow-cpu-2core-2026-12-02.json

Per round, interleaved (A B C ... A B C ...; round 0 is warm-up and excluded), each for --steps steps:
- compute:  the training step alone, on batches prepared beforehand (compute-only step time);
- data:     preparing one batch (decode + augment + collate) on one thread, no model (data time);
- none:     SampleLoader without workers or prefetch: the step waits for every batch;
- thread:   `workers` threads + prefetch thread (depth 2);
- process:  `workers` DataLoader processes (persistent) + prefetch thread (depth 2).
Reported: samples/s per mode (median over rounds, with min..max), speed-up over `none`, and the
pipelined step time against the bound max(compute step, data time / workers), and how many CPU
seconds per wall second the process got (a saturated shared machine gives it ~1 whatever it asks).

    python benchmarks/dataflow.py --sleep-step-ms 45 ...   # device-bound step: the CPU stays free

`--sleep-step-ms` replaces the CNN step by a sleep, which is what the host sees of a GPU step: it
measures the pipeline's overlap where compute does not compete with decode for the same cores.

torch runs with --threads intra-op threads (default 1): on a 2-core machine the step gets one core
and the data pipeline the other. Two OpenMP threads on a core that a worker also needs stall the
whole step (measured: several times slower), which is why the split is the right setting here.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import numpy as np
import torch


def machine() -> dict[str, object]:
    from slipstream.doctor import machine_info

    return machine_info()


def _step(model, opt, batch, sleep_s: float = 0.0) -> None:
    if sleep_s:  # a device-bound step: the host only waits (as it does for a GPU), its CPU is free
        time.sleep(sleep_s)
        return
    loss = model(**batch)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def run(
    size: str, workers: int, rounds: int, steps: int, depth: int, modes: list[str], sleep_s: float = 0.0
) -> dict[str, object]:
    from slipstream.dataflow import PrefetchLoader
    from slipstream.samples import SampleLoader
    from slipstream.workloads.vision import BATCH_SIZE, build_cnn, collate_images, load_vision_data

    t0 = time.perf_counter()
    data = load_vision_data()
    gen_s = time.perf_counter() - t0
    torch.manual_seed(0)
    model = build_cnn(size)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ds = data.train

    ready = [b for _, b in zip(range(4), SampleLoader(ds, BATCH_SIZE, collate=collate_images))]
    serial_data = iter(SampleLoader(ds, BATCH_SIZE, collate=collate_images, seed=1).forever())
    loaders = {
        "none": SampleLoader(ds, BATCH_SIZE, collate=collate_images),
        "thread": PrefetchLoader(
            SampleLoader(ds, BATCH_SIZE, collate=collate_images, workers=workers, worker_kind="thread"), depth
        ),
        "process": PrefetchLoader(
            SampleLoader(ds, BATCH_SIZE, collate=collate_images, workers=workers, worker_kind="process"),
            depth,
        ),
    }
    iters = {k: iter(v.forever()) for k, v in loaders.items() if k in modes}
    step_times: dict[str, list[float]] = {m: [] for m in ["compute", "data", *iters]}
    cpu_share: dict[str, list[float]] = {m: [] for m in step_times}
    try:
        for r in range(rounds + 1):
            for mode in step_times:
                times = []
                c0, w0 = time.process_time(), time.perf_counter()
                for i in range(steps):
                    t = time.perf_counter()
                    if mode == "compute":
                        _step(model, opt, ready[i % len(ready)], sleep_s)
                    elif mode == "data":
                        next(serial_data)
                    else:
                        _step(model, opt, next(iters[mode]), sleep_s)
                    times.append(time.perf_counter() - t)
                if r > 0:  # round 0: warm-up (allocator, pools, process start-up)
                    step_times[mode].append(statistics.median(times))
                    # CPU seconds this process got per wall second (threads of this process only)
                    cpu_share[mode].append((time.process_time() - c0) / (time.perf_counter() - w0))
            print(
                f"round {r}: " + ", ".join(f"{m} {v[-1] * 1e3:.0f} ms" for m, v in step_times.items() if v),
                flush=True,
            )
    finally:
        for it in iters.values():
            it.close()
        for loader in loaders.values():
            loader.close()
    med = {m: float(np.median(v)) for m, v in step_times.items()}
    out: dict[str, object] = {
        "size": size,
        "batch_size": BATCH_SIZE,
        "workers": workers,
        "prefetch_depth": depth,
        "rounds": rounds,
        "steps_per_round": steps,
        "torch_threads": torch.get_num_threads(),
        "image_generation_s": gen_s,
        "simulated_device_step_s": sleep_s,
        "compute_step_s": med["compute"],
        "data_batch_s": med["data"],
        "data_batch_per_worker_s": med["data"] / max(workers, 1),
    }
    bound = max(med["compute"], med["data"] / max(workers, 1))
    out["pipelined_bound_s"] = bound
    for mode in iters:
        per_round = [BATCH_SIZE / t for t in step_times[mode]]
        out[f"{mode}_step_s"] = med[mode]
        out[f"{mode}_samples_per_s_median"] = float(np.median(per_round))
        out[f"{mode}_samples_per_s_min"] = float(min(per_round))
        out[f"{mode}_samples_per_s_max"] = float(max(per_round))
        out[f"{mode}_step_s_rounds"] = step_times[mode]
    out["compute_step_s_rounds"] = step_times["compute"]
    out["process_cpu_s_per_wall_s_median"] = {m: float(np.median(v)) for m, v in cpu_share.items()}
    out["data_batch_s_rounds"] = step_times["data"]
    for mode in ("thread", "process"):
        if mode in iters and "none" in iters:
            ratios = [a / b for a, b in zip(step_times["none"], step_times[mode])]
            out[f"{mode}_speedup_over_none_median"] = float(np.median(ratios))
            out[f"{mode}_speedup_over_none_min"] = float(min(ratios))
            out[f"{mode}_speedup_over_none_max"] = float(max(ratios))
            out[f"{mode}_step_over_bound"] = med[mode] / bound
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="small")
    ap.add_argument("--workers", type=int, default=1)
    ap.add_argument("--depth", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads for the step")
    ap.add_argument("--modes", default="none,thread,process")
    ap.add_argument(
        "--sleep-step-ms",
        type=float,
        default=0.0,
        help="replace the CNN step by a sleep of this length: a device-bound step that leaves the CPU free",
    )
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    res = run(
        args.size,
        args.workers,
        args.rounds,
        args.steps,
        args.depth,
        args.modes.split(","),
        args.sleep_step_ms / 1e3,
    )
    print(
        f"compute-only step {res['compute_step_s'] * 1e3:.1f} ms, data {res['data_batch_s'] * 1e3:.1f} ms/batch "
        f"on one thread -> bound max(compute, data/{args.workers}) = {res['pipelined_bound_s'] * 1e3:.1f} ms"
    )
    for mode in ("none", "thread", "process"):
        if f"{mode}_step_s" in res:
            line = f"{mode:8s} step {res[f'{mode}_step_s'] * 1e3:.1f} ms, {res[f'{mode}_samples_per_s_median']:.0f} samples/s"
            if f"{mode}_speedup_over_none_median" in res:
                line += (
                    f", {res[f'{mode}_speedup_over_none_median']:.2f}x over none "
                    f"(min {res[f'{mode}_speedup_over_none_min']:.2f}, max {res[f'{mode}_speedup_over_none_max']:.2f}), "
                    f"step / bound {res[f'{mode}_step_over_bound']:.2f}"
                )
            print(line)
    print("CPU seconds per wall second of this process:", res["process_cpu_s_per_wall_s_median"])
    if args.out:
        result = {
            "benchmark": "dataflow",
            "machine": machine(),
            "command": vars(args) | {"out": str(args.out)},
        }
        result["result"] = res
        from slipstream.files import write_json

        write_json(args.out, result)
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
