"""Scaling beyond this machine, on paper: projected DDP / FSDP / pipeline efficiency for 2..1024 ranks.

    python benchmarks/scaling_projection.py                      # measure the built-in GPT here, then project
    python benchmarks/scaling_projection.py --size gpt2-124m --batch 4 --seq-len 512
    python benchmarks/scaling_projection.py --step-s 0.31 --params 124000000 --activation-bytes 3.1e6 \\
        --layers 12 --micro-batches 8                            # your own measured numbers, no measuring

Measuring: the built-in GPT (slipstream.workloads "gpt-stdlib") on a fixed random batch, forward and
backward timed separately over a few steps after warm-up (medians); parameters counted with tied
weights once; the activation at a block boundary is the hidden state leaving block 0 (B x T x d x
bytes), divided by the micro-batches. The cost model and every assumption: slipstream.distributed
.projection and docs/scaling.md. Writes JSON (host, inputs, assumptions, networks, table) to
benchmarks/results/scaling_projection.json unless --json says elsewhere.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path[0] = str(Path(__file__).resolve().parents[1])  # the repo root, not benchmarks/ (kernels.py)

import argparse  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402

from slipstream.distributed.projection import (  # noqa: E402
    Assumptions,
    Link,
    Network,
    StepProfile,
    derive_assumptions,
    format_table,
    project,
)

RESULTS = Path(__file__).resolve().parent / "results"
RANKS = [2**k for k in range(1, 11)]  # 2 .. 1024

ETHERNET_LATENCY_S = 10e-6
NVLINK_LATENCY_S = 2e-6
NVLINK_BYTES_PER_S = 450e9


def networks(ethernet_latency_s: float, nvlink_latency_s: float) -> list[Network]:
    eth = "line rate (Gb/s / 8), no protocol overhead; latency assumed (RDMA-class, not measured)"
    nvlink = Link(
        "NVLink",
        NVLINK_BYTES_PER_S,
        nvlink_latency_s,
        "H100 SXM NVLink 4: 900 GB/s total bidirectional per GPU (NVIDIA H100 datasheet) = 450 GB/s "
        "per direction; latency assumed",
    )
    gbe = {g: Link(f"{g}GbE", g * 1e9 / 8, ethernet_latency_s, eth) for g in (25, 100, 400)}
    return [
        *(Network(link.name, link) for link in gbe.values()),
        Network("NVLink", nvlink),  # flat: as if every rank shared one NVLink domain (an upper bound)
        Network("NVLink8+400GbE", gbe[400], intra=nvlink, ranks_per_node=8),
    ]


def measure(size: str, batch: int, seq_len: int, micro_batches: int, steps: int, warmup: int) -> dict:
    """Median forward and backward seconds of the built-in GPT on one fixed batch, its parameter
    count, layers, and the hidden-state bytes leaving a block per micro-batch."""
    from slipstream.workloads.registry import get_workload

    if batch % micro_batches:
        raise SystemExit(f"--batch {batch} must be a multiple of --micro-batches {micro_batches}")
    torch.manual_seed(0)
    model = get_workload("gpt-stdlib").model(size, seq_len)
    model.train()
    cfg = model.config
    g = torch.Generator().manual_seed(0)
    input_ids = torch.randint(0, cfg.vocab_size, (batch, seq_len), generator=g)
    labels = torch.randint(0, cfg.vocab_size, (batch, seq_len), generator=g)

    boundary: dict[str, int] = {}

    def record(_module, _inputs, output):
        boundary["bytes"] = output.numel() * output.element_size()

    hook = model.blocks[0].register_forward_hook(record)
    forward, backward = [], []
    for i in range(warmup + steps):
        model.zero_grad(set_to_none=True)
        t0 = time.perf_counter()
        loss = model(input_ids, labels=labels)
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        if i >= warmup:
            forward.append(t1 - t0)
            backward.append(t2 - t1)
    hook.remove()
    step = [f + b for f, b in zip(forward, backward)]
    return {
        "workload": "gpt-stdlib",
        "size": size,
        "batch": batch,
        "seq_len": seq_len,
        "d_model": cfg.d_model,
        "dtype": "float32",
        "steps": steps,
        "warmup": warmup,
        "step_s": statistics.median(step),
        "step_s_min": min(step),
        "step_s_all": step,
        "forward_s": statistics.median(forward),
        "backward_s": statistics.median(backward),
        "params": model.num_parameters(),
        "layers": cfg.n_layers,
        "boundary_bytes_per_batch": boundary["bytes"],
        "activation_bytes": boundary["bytes"] / micro_batches,
        "torch_threads": torch.get_num_threads(),
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    given = p.add_argument_group("your own numbers (skip measuring when --step-s is given)")
    given.add_argument("--step-s", type=float, help="forward+backward seconds of one step on one rank")
    given.add_argument("--params", type=float, help="parameter count")
    given.add_argument(
        "--activation-bytes", type=float, help="bytes crossing a stage boundary per micro-batch"
    )
    given.add_argument("--layers", type=int, help="blocks the pipeline can cut between (default: no limit)")
    given.add_argument("--backward-fraction", type=float, help="share of the step in backward (default 2/3)")
    m = p.add_argument_group("measuring the built-in GPT")
    m.add_argument("--size", default="small", help="tiny | small | gpt2-124m")
    m.add_argument("--batch", type=int, default=8, help="rows per rank per step (fixed: weak scaling)")
    m.add_argument("--seq-len", type=int, default=256)
    m.add_argument("--steps", type=int, default=5, help="timed steps (median)")
    m.add_argument("--warmup", type=int, default=2)
    a = p.add_argument_group("assumptions")
    a.add_argument("--micro-batches", type=int, default=8, help="pipeline micro-batches per step")
    a.add_argument("--param-bytes", type=int, default=4, help="bytes per parameter FSDP all-gathers")
    a.add_argument("--grad-bytes", type=int, default=4, help="bytes per gradient element communicated")
    a.add_argument("--ddp-overlap", type=float, help="default: from torch DDP's 1 MiB + 25 MiB buckets")
    a.add_argument("--fsdp-units", type=int, help="FSDP shard units (default layers + 1)")
    a.add_argument("--fsdp-overlap", type=float, help="default 1 - 1/units (prefetch hides all but one)")
    a.add_argument("--ethernet-latency-us", type=float, default=ETHERNET_LATENCY_S * 1e6)
    a.add_argument("--nvlink-latency-us", type=float, default=NVLINK_LATENCY_S * 1e6)
    p.add_argument("--json", default=str(RESULTS / "scaling_projection.json"), help="'' to skip")
    args = p.parse_args(argv)

    measured = None
    if args.step_s is not None:
        if args.params is None or args.activation_bytes is None:
            p.error("--step-s needs --params and --activation-bytes")
        step_s, params, act, layers = args.step_s, int(args.params), args.activation_bytes, args.layers
        backward_fraction = 2 / 3 if args.backward_fraction is None else args.backward_fraction
    else:
        measured = measure(args.size, args.batch, args.seq_len, args.micro_batches, args.steps, args.warmup)
        step_s, params, act = measured["step_s"], measured["params"], measured["activation_bytes"]
        layers = measured["layers"] if args.layers is None else args.layers
        backward_fraction = measured["backward_s"] / step_s
        if args.backward_fraction is not None:
            backward_fraction = args.backward_fraction

    profile = StepProfile(
        step_s=step_s,
        params=params,
        activation_bytes=act,
        micro_batches=args.micro_batches,
        layers=layers,
        param_bytes=args.param_bytes,
        grad_bytes=args.grad_bytes,
        backward_fraction=backward_fraction,
    )
    derived = derive_assumptions(profile, args.fsdp_units)
    assumptions = Assumptions(
        ddp_overlap=derived.ddp_overlap if args.ddp_overlap is None else args.ddp_overlap,
        ddp_buckets=derived.ddp_buckets,
        fsdp_overlap=derived.fsdp_overlap if args.fsdp_overlap is None else args.fsdp_overlap,
        fsdp_units=derived.fsdp_units,
    )
    nets = networks(args.ethernet_latency_us * 1e-6, args.nvlink_latency_us * 1e-6)
    rows = project(profile, nets, RANKS, assumptions)

    print(
        f"inputs: step {step_s * 1e3:.1f} ms ({backward_fraction:.0%} backward), {params / 1e6:.2f} M params "
        f"x {args.grad_bytes} B grads, {act / 1e6:.3f} MB activation per micro-batch, "
        f"m={args.micro_batches}, layers={layers}" + (" (measured here)" if measured else " (given)")
    )
    print(
        f"assumptions: DDP {assumptions.ddp_buckets} buckets, {assumptions.ddp_overlap:.0%} overlappable; "
        f"FSDP {assumptions.fsdp_units} units, {assumptions.fsdp_overlap:.0%} prefetch-hidden; "
        f"latency {args.ethernet_latency_us:g} us Ethernet, {args.nvlink_latency_us:g} us NVLink; "
        f"NVLink {NVLINK_BYTES_PER_S / 1e9:.0f} GB/s per direction"
    )
    print("efficiency = ideal / projected step time (DDP, FSDP: weak scaling; pipe: ranks = stages)\n")
    print(format_table(rows, nets))

    if args.json:
        from slipstream.doctor import machine_info
        from slipstream.files import write_json

        payload = {
            "note": (
                "measured on a machine shared with other jobs: step_s (the median) is under contention, "
                "slower and noisier than a quiet run (compare step_s_min and step_s_all); rerun on a "
                "quiet host for the real figure"
                if measured
                else "inputs given on the command line, not measured"
            ),
            "command": "python benchmarks/scaling_projection.py "
            + " ".join(sys.argv[1:] if argv is None else argv),
            "machine": machine_info(),
            "measured": measured,
            "inputs": {
                "step_s": step_s,
                "params": params,
                "activation_bytes": act,
                "micro_batches": args.micro_batches,
                "layers": layers,
                "param_bytes": args.param_bytes,
                "grad_bytes": args.grad_bytes,
                "backward_fraction": backward_fraction,
            },
            "assumptions": vars(assumptions),
            "networks": [
                {
                    "name": net.name,
                    "bandwidth_bytes_per_s": net.link.bandwidth_bytes_per_s,
                    "latency_s": net.link.latency_s,
                    "source": net.link.source,
                    **(
                        {
                            "intra_bandwidth_bytes_per_s": net.intra.bandwidth_bytes_per_s,
                            "intra_latency_s": net.intra.latency_s,
                            "intra_source": net.intra.source,
                            "ranks_per_node": net.ranks_per_node,
                        }
                        if net.intra
                        else {}
                    ),
                }
                for net in nets
            ],
            "efficiency": rows,
        }
        write_json(args.json, payload)
        print(f"\nwrote {args.json}")


if __name__ == "__main__":
    main()
