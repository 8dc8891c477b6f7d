"""Pipeline bubble: measured idle fraction per schedule against (p-1)/(m+p-1) (issue 15).

    python benchmarks/pipeline_bubble.py                      # p=2, m in 2,4,8, all three schedules
    python benchmarks/pipeline_bubble.py --steps 12 --microbatches 2,4,8,16

Two gloo processes (1 torch thread each) train a GPT split into 2 stages through PipelineRunner.
Per rank and step: busy = time inside the stage's forward/backward calls and the loss (what
`PipelineRunner.timing` counts), wall = the whole schedule step; bubble = 1 - busy/wall, averaged
over the ranks; the figure is the median over the steps after --warmup. What the measured bubble
holds beyond the theory is P2P transfer time and stage imbalance (the last stage also runs the head
and the loss). The micro-batch size stays fixed (--rows rows), so the global batch grows with m.

Theory with p ranks, m micro-batches and v stages per rank (interleaved):
(p-1) / (v*m + p-1), the idle share of the wall time when every stage takes the same time per
micro-batch (v=1 for GPipe and 1F1B: 1F1B saves memory, not bubble).

Results go to benchmarks/results/pipeline_bubble.json with the host (lscpu model, CPU capability,
load average: on a shared machine other jobs inflate the bubble, since a waiting rank's peer is slower).
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path[0] = str(Path(__file__).resolve().parents[1])  # the repo root, not benchmarks/ (kernels.py)

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import tempfile  # noqa: E402

import torch  # noqa: E402

WORLD = 2
SCHEDULES = {"gpipe": 1, "1f1b": 1, "interleaved-1f1b": 2}  # schedule -> stages per rank


def theory(p: int, m: int, v: int = 1) -> float:
    return (p - 1) / (v * m + p - 1)


def _lscpu_model() -> str | None:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    for line in out.splitlines():
        if line.startswith("Model name:"):
            return line.split(":", 1)[1].strip()
    return None


def host() -> dict[str, object]:
    return {
        "cpu": _lscpu_model(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "load_average_1m": os.getloadavg()[0],
    }


def _worker(rank: int, init_file: str, args: argparse.Namespace, out: str) -> None:
    import torch.distributed as dist

    from slipstream.distributed.pipeline import PipelineRunner, split_gpt
    from slipstream.workloads.gpt import build_gpt

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    rows = []
    for schedule in args.schedules:
        virtual = SCHEDULES[schedule]
        for m in args.microbatches:
            torch.manual_seed(0)
            model = build_gpt(
                "tiny", max_len=args.seq, d_model=args.d_model, n_layers=args.layers, n_heads=args.heads
            )
            runner = PipelineRunner(
                split_gpt(model, WORLD, rank, virtual=virtual), rank, WORLD, schedule=schedule, microbatches=m
            )
            g = torch.Generator().manual_seed(0)
            ids = torch.randint(0, 264, (m * args.rows, args.seq + 1), generator=g)
            batch = {"input_ids": ids[:, :-1].contiguous(), "labels": ids[:, 1:].contiguous()}
            bubbles, walls, per_rank = [], [], []
            for step in range(args.warmup + args.steps):
                dist.barrier()  # both ranks start the step together: the wall is the step's alone
                runner.step(batch)
                for p in runner.parameters():
                    p.grad = None
                t = torch.zeros(WORLD, 2)
                t[rank] = torch.tensor([runner.timing.bubble, runner.timing.wall_s])
                dist.all_reduce(t)  # every rank's figures on every rank
                if step >= args.warmup:
                    bubbles.append(float(t[:, 0].mean()))
                    walls.append(float(t[:, 1].mean()))
                    per_rank.append(t[:, 0].tolist())
            rows.append(
                {
                    "schedule": schedule,
                    "p": WORLD,
                    "m": m,
                    "virtual": virtual,
                    "bubble_measured": round(statistics.median(bubbles), 4),
                    "bubble_min": round(min(bubbles), 4),
                    "bubble_max": round(max(bubbles), 4),
                    "bubble_theory": round(theory(WORLD, m, virtual), 4),
                    "bubble_per_rank": [round(statistics.median(r), 4) for r in zip(*per_rank)],
                    "step_s": round(statistics.median(walls), 4),
                }
            )
            if rank == 0:
                r = rows[-1]
                print(
                    f"{schedule:17s} m={m:2d}  bubble {r['bubble_measured']:.3f} "
                    f"({r['bubble_min']:.3f}..{r['bubble_max']:.3f}) ranks {r['bubble_per_rank']}  theory {r['bubble_theory']:.3f}  "
                    f"step {r['step_s'] * 1000:.0f} ms",
                    flush=True,
                )
    dist.destroy_process_group()
    if rank == 0:
        Path(out).write_text(json.dumps(rows))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--microbatches", default="2,4,8", help="comma-separated micro-batch counts")
    ap.add_argument(
        "--schedules", default=",".join(SCHEDULES), help="comma-separated, of " + ", ".join(SCHEDULES)
    )
    ap.add_argument("--steps", type=int, default=8, help="timed steps per configuration")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps first (stage setup, allocator)")
    ap.add_argument("--rows", type=int, default=4, help="rows per micro-batch")
    ap.add_argument("--seq", type=int, default=128, help="tokens per row")
    ap.add_argument("--d-model", type=int, default=128)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--out", default="benchmarks/results/pipeline_bubble.json")
    args = ap.parse_args()
    args.microbatches = [int(m) for m in args.microbatches.split(",")]
    args.schedules = args.schedules.split(",")
    unknown = set(args.schedules) - set(SCHEDULES)
    if unknown:
        ap.error(f"unknown schedules {sorted(unknown)}; choose from {', '.join(SCHEDULES)}")
    os.environ["OMP_NUM_THREADS"] = "1"

    import torch.multiprocessing as mp

    info = host()
    with tempfile.TemporaryDirectory() as tmp:
        rows_file = os.path.join(tmp, "rows.json")
        mp.spawn(_worker, args=(os.path.join(tmp, "init"), args, rows_file), nprocs=WORLD)
        rows = json.loads(Path(rows_file).read_text())
    result = {
        "benchmark": "pipeline_bubble",
        "command": "python " + " ".join(sys.argv),
        "host": info,
        "load_average_1m_after": os.getloadavg()[0],
        "settings": {
            "ranks": WORLD,
            "torch_threads_per_rank": 1,
            "backend": "gloo",
            "rows_per_microbatch": args.rows,
            "seq": args.seq,
            "d_model": args.d_model,
            "layers": args.layers,
            "heads": args.heads,
            "steps": args.steps,
            "warmup": args.warmup,
        },
        "bubble": "1 - busy/wall per rank (busy: stage forward/backward and loss), mean over ranks, "
        "median over steps; theory (p-1)/(v*m+p-1)",
        "rows": rows,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp_out = out.with_suffix(".tmp")
    tmp_out.write_text(json.dumps(result, indent=2) + "\n")
    tmp_out.replace(out)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
