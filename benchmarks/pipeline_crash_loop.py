"""Pipeline runs, repeated: how often a 2-rank pipeline run ends with a rank killed (issue 25).

    python benchmarks/pipeline_crash_loop.py --runs 20 --out benchmarks/results/pipeline-crash-loop-<host>.json

Runs `slipstream train --size tiny --steps 30 --nproc 2 --set distributed.strategy=pipeline
--set distributed.batches_per_step=2` (the command of issue 25) `--runs` times, one after the
other, and records per run the exit code, the wall time, whether torchrun reported a signal
("Signal 6 (SIGABRT) received" and the like) and, for a failed run, the last lines of its log.
The result file carries the host (doctor.machine_info) and the slipstream commit.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path[0] = str(Path(__file__).resolve().parents[1])  # the repo root, not benchmarks/ (kernels.py)

import argparse  # noqa: E402
import json  # noqa: E402
import re  # noqa: E402
import subprocess  # noqa: E402
import time  # noqa: E402

COMMAND = [
    "train",
    "--size",
    "tiny",
    "--steps",
    "30",
    "--nproc",
    "2",
    "--set",
    "distributed.strategy=pipeline",
    "--set",
    "distributed.batches_per_step=2",
]
SIGNAL = re.compile(r"Signal (\d+) \((\w+)\) received")


def run_once(timeout_s: float, extra: list[str]) -> dict[str, object]:
    cmd = [sys.executable, "-m", "slipstream", *COMMAND, *extra]
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
        rc, out = proc.returncode, proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as err:
        rc = None
        out = "".join(
            s if isinstance(s, str) else s.decode(errors="replace") for s in (err.stdout, err.stderr) if s
        )
    wall = time.perf_counter() - t0
    signals = sorted({m.group(2) for m in SIGNAL.finditer(out)})
    row: dict[str, object] = {"rc": rc, "wall_s": round(wall, 2), "signals": signals}
    if rc != 0:
        row["log_tail"] = out.splitlines()[-60:]
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=20)
    ap.add_argument("--timeout-s", type=float, default=300.0, help="a run past this counts as a hang")
    ap.add_argument("--out", default=None, help="write the result JSON here")
    ap.add_argument("extra", nargs="*", help="more `slipstream train` flags (after --)")
    args = ap.parse_args()

    from slipstream.doctor import machine_info

    host = machine_info()
    commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    runs = []
    for i in range(args.runs):
        row = run_once(args.timeout_s, args.extra)
        runs.append(row)
        print(f"run {i + 1}/{args.runs}: rc={row['rc']} {row['wall_s']} s {row['signals'] or ''}", flush=True)
    failed = [r for r in runs if r["rc"] != 0]
    result = {
        "command": "slipstream " + " ".join(COMMAND + args.extra),
        "runs": len(runs),
        "failed_runs": len(failed),
        "signals_seen": sorted({s for r in runs for s in r["signals"]}),  # type: ignore[union-attr]
        "commit": commit,
        "host": host,
        "results": runs,
    }
    print(f"{len(failed)} of {len(runs)} runs failed", flush=True)
    if args.out:
        from slipstream.files import write_json

        write_json(args.out, result)
    else:
        print(json.dumps(result, indent=1))
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
