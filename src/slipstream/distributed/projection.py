"""Scaling on paper: projected step time and efficiency of DDP, FSDP and pipeline parallelism from
one rank's measured step, the model's sizes and a network's bandwidth and latency.

A first-order cost model (alpha-beta: a message of b bytes costs `latency + b / bandwidth`), meant to
say which strategy stops scaling where, not to predict a cluster to the percent. Every assumption is
a field or a line below; docs/scaling.md states them all with a worked table.

DDP and FSDP are projected under weak scaling: every rank keeps the measured per-rank batch, so the
ideal step time stays the measured one and efficiency = measured step time / projected step time.
The pipeline splits the measured model into p stages over the same batch of m micro-batches, so
its ideal step time is the measured one / p and efficiency = (measured / p) / projected (speedup / p).

- DDP: ring all-reduce of the gradients, 2(N-1)/N * bytes / bw + 2(N-1) * latency per bucket. A
  fraction `ddp_overlap` of it runs while backward still computes and hides behind it (never more
  than backward lasts); the rest waits after backward.
- FSDP (full shard, params resharded after forward): all-gather the parameters in forward, again in
  backward, and reduce-scatter the gradients, each (N-1)/N * bytes / bw + (N-1) * latency per shard
  unit. Prefetch hides a fraction `fsdp_overlap` of each phase's communication behind that phase's
  compute.
- Pipeline (GPipe / 1F1B schedule): (m + p - 1) slots, each one stage's compute for one micro-batch
  plus the activation sent forward and its gradient sent back over one stage boundary, not overlapped;
  with free communication the idle fraction is the bubble (p-1)/(m+p-1). A stage holds whole blocks,
  so p beyond the number of blocks is not possible (None), and the stage with ceil(layers / p) blocks
  paces the others.

Not modelled: stragglers and step-time jitter, congestion and oversubscribed switches, the slowdown
of compute that shares memory bandwidth and SMs with communication, tree or NVLS collectives, memory
limits (FSDP exists to fit what DDP cannot), optimizer-step time, and the embedding / head imbalance
of pipeline stages.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

Strategy = Literal["ddp", "fsdp", "pipeline"]
STRATEGIES: tuple[Strategy, ...] = ("ddp", "fsdp", "pipeline")

MIB = 1024 * 1024
DDP_BUCKET_BYTES = 25 * MIB
"""torch DDP's default bucket_cap_mb (25 MiB)."""
DDP_FIRST_BUCKET_BYTES = MIB
"""torch.distributed._DEFAULT_FIRST_BUCKET_BYTES: DDP's first bucket is capped at 1 MiB by default."""


@dataclass(frozen=True)
class StepProfile:
    """One rank's measured step and the model's sizes: the inputs the projection scales."""

    step_s: float
    """Forward + backward seconds of one step on one rank (measured; per-rank batch fixed)."""
    params: int
    """Parameter count (tied weights once): the elements all-reduced, gathered and scattered."""
    activation_bytes: float
    """Bytes of the hidden state crossing a stage boundary per micro-batch (B/m x T x d x bytes);
    its gradient of the same size crosses back in backward."""
    micro_batches: int = 8
    """m: micro-batches the step's batch splits into for the pipeline."""
    layers: int | None = None
    """Blocks the pipeline can cut between (a stage holds whole blocks); None: no limit."""
    param_bytes: int = 4
    """Bytes per parameter element FSDP all-gathers (4 fp32, 2 with bf16 mixed-precision params)."""
    grad_bytes: int = 4
    """Bytes per gradient element DDP all-reduces and FSDP reduce-scatters."""
    backward_fraction: float = 2 / 3
    """Share of step_s spent in backward (about 2/3: backward does twice forward's matmul FLOPs)."""

    def __post_init__(self) -> None:
        if self.step_s <= 0 or self.params <= 0 or self.activation_bytes < 0:
            raise ValueError("step_s and params must be positive and activation_bytes non-negative")
        if self.micro_batches < 1:
            raise ValueError(f"micro_batches={self.micro_batches} must be at least 1")
        if not 0 <= self.backward_fraction <= 1:
            raise ValueError(f"backward_fraction={self.backward_fraction} must lie in [0, 1]")

    @property
    def forward_s(self) -> float:
        return (1 - self.backward_fraction) * self.step_s

    @property
    def backward_s(self) -> float:
        return self.backward_fraction * self.step_s


@dataclass(frozen=True)
class Link:
    """One rank's connection: a message of b bytes costs latency_s + b / bandwidth_bytes_per_s."""

    name: str
    bandwidth_bytes_per_s: float
    """Per direction, per rank (a ring sends and receives at once, each at this rate)."""
    latency_s: float
    """Per message (one step of a ring, one point-to-point send)."""
    source: str = ""
    """Where the figures come from."""


@dataclass(frozen=True)
class Network:
    """Flat: every rank on `link`. Hierarchical (`intra` set): ranks sit in nodes of
    `ranks_per_node` joined by `intra`, and each rank has its own `link` to the other nodes."""

    name: str
    link: Link
    intra: Link | None = None
    ranks_per_node: int = 8


@dataclass(frozen=True)
class Assumptions:
    """How much communication hides behind compute, and how many collectives pay latency."""

    ddp_overlap: float = 0.0
    """Fraction of the gradient all-reduce issued while backward still runs (hidden up to
    backward's length). DDP all-reduces each bucket as soon as it is full, so all but the last
    bucket can overlap: `ddp_buckets()` derives it from torch's bucket sizes."""
    ddp_buckets: int = 1
    """All-reduces per step (DDP buckets); each pays the ring's latency."""
    fsdp_overlap: float = 0.0
    """Fraction of each phase's collectives hidden behind that phase's compute by prefetching the
    next unit's all-gather; with k shard units the first unit's all-gather (1/k) cannot hide."""
    fsdp_units: int = 1
    """Shard units (FSDP2 `fully_shard` per block + the root): collectives per pass, each pays latency."""

    def __post_init__(self) -> None:
        for name in ("ddp_overlap", "fsdp_overlap"):
            if not 0 <= getattr(self, name) <= 1:
                raise ValueError(f"{name}={getattr(self, name)} must lie in [0, 1]")
        if self.ddp_buckets < 1 or self.fsdp_units < 1:
            raise ValueError("ddp_buckets and fsdp_units must be at least 1")


def ddp_buckets(
    grad_bytes: float,
    bucket_bytes: float = DDP_BUCKET_BYTES,
    first_bucket_bytes: float = DDP_FIRST_BUCKET_BYTES,
) -> tuple[int, float]:
    """(bucket count, overlappable fraction) of DDP's gradient all-reduce with torch's default
    buckets: a 1 MiB first bucket (the last layers' gradients, ready first), then 25 MiB ones. The
    last bucket to fill holds the first layers' gradients, ready only when backward ends, so its
    share cannot overlap. Approximate: DDP never splits a parameter across buckets."""
    if grad_bytes <= first_bucket_bytes:
        return 1, 0.0
    rest = grad_bytes - first_bucket_bytes
    count = 1 + math.ceil(rest / bucket_bytes)
    last = rest - (count - 2) * bucket_bytes
    return count, 1 - last / grad_bytes


def derive_assumptions(profile: StepProfile, fsdp_units: int | None = None) -> Assumptions:
    """The default assumptions for a model: DDP's overlap from torch's bucket sizes; FSDP with one
    unit per block plus the root (`layers + 1`), everything but one unit's collective hidden."""
    count, overlap = ddp_buckets(profile.params * profile.grad_bytes)
    units = fsdp_units or ((profile.layers or 0) + 1)
    return Assumptions(ddp_overlap=overlap, ddp_buckets=count, fsdp_overlap=1 - 1 / units, fsdp_units=units)


def ring_s(nbytes: float, ranks: int, link: Link, passes: int = 1, messages: int = 1) -> float:
    """Seconds for a ring collective over `ranks`: passes=1 all-gather / reduce-scatter (`nbytes`
    the full, unsharded size), passes=2 all-reduce; `messages` collectives of these bytes in total."""
    if ranks <= 1:
        return 0.0
    steps = ranks - 1
    return passes * (steps / ranks * nbytes / link.bandwidth_bytes_per_s + messages * steps * link.latency_s)


def collective_s(nbytes: float, ranks: int, network: Network, passes: int = 1, messages: int = 1) -> float:
    """A ring collective on a flat network, or hierarchically: inside each node over `intra`, then
    across nodes over `link` on the node's 1/g share (each of the g ranks drives its own NIC)."""
    if network.intra is None:
        return ring_s(nbytes, ranks, network.link, passes, messages)
    g = min(ranks, network.ranks_per_node)
    nodes = math.ceil(ranks / g)
    return ring_s(nbytes, g, network.intra, passes, messages) + ring_s(
        nbytes / g, nodes, network.link, passes, messages
    )


def overlapped_s(compute_s: float, comm_s: float, hidden: float) -> float:
    """A phase whose communication partly runs during its compute: the `hidden` share overlaps
    (and stretches the phase if it outlasts the compute), the rest runs after."""
    return max(compute_s, hidden * comm_s) + (1 - hidden) * comm_s


def ddp_step_s(profile: StepProfile, ranks: int, network: Network, assumptions: Assumptions) -> float:
    allreduce = collective_s(
        profile.params * profile.grad_bytes, ranks, network, passes=2, messages=assumptions.ddp_buckets
    )
    return profile.forward_s + overlapped_s(profile.backward_s, allreduce, assumptions.ddp_overlap)


def fsdp_step_s(profile: StepProfile, ranks: int, network: Network, assumptions: Assumptions) -> float:
    units = assumptions.fsdp_units
    gather = collective_s(profile.params * profile.param_bytes, ranks, network, messages=units)
    scatter = collective_s(profile.params * profile.grad_bytes, ranks, network, messages=units)
    forward = overlapped_s(profile.forward_s, gather, assumptions.fsdp_overlap)
    backward = overlapped_s(profile.backward_s, gather + scatter, assumptions.fsdp_overlap)
    return forward + backward


def boundary_link(stages: int, network: Network) -> Link:
    """The link a pipeline's slowest stage boundary crosses: between nodes once stages span nodes."""
    if network.intra is not None and stages <= network.ranks_per_node:
        return network.intra
    return network.link


def pipeline_step_s(profile: StepProfile, stages: int, network: Network) -> float | None:
    """Projected step of the measured model cut into `stages`; None when that is not possible
    (more stages than blocks)."""
    if profile.layers is not None and stages > profile.layers:
        return None
    if stages == 1:
        return profile.step_s
    m = profile.micro_batches
    share = math.ceil(profile.layers / stages) / profile.layers if profile.layers else 1 / stages
    link = boundary_link(stages, network)
    send = profile.activation_bytes / link.bandwidth_bytes_per_s + link.latency_s
    slot = profile.step_s * share / m + 2 * send  # forward activation out, its gradient back
    return (m + stages - 1) * slot


def bubble(stages: int, micro_batches: int) -> float:
    """Idle fraction of a GPipe / 1F1B pipeline with free communication and even stages."""
    return (stages - 1) / (micro_batches + stages - 1)


def efficiency(
    profile: StepProfile, ranks: int, network: Network, assumptions: Assumptions | None = None
) -> dict[Strategy, float | None]:
    """Ideal step time / projected step time per strategy at `ranks` (pipeline: `ranks` stages;
    None where not possible)."""
    a = assumptions or Assumptions()
    pipe = pipeline_step_s(profile, ranks, network)
    return {
        "ddp": profile.step_s / ddp_step_s(profile, ranks, network, a),
        "fsdp": profile.step_s / fsdp_step_s(profile, ranks, network, a),
        "pipeline": None if pipe is None else profile.step_s / ranks / pipe,
    }


def project(
    profile: StepProfile,
    networks: list[Network],
    ranks: list[int],
    assumptions: Assumptions | None = None,
) -> list[dict]:
    """The table: one row per rank count, `{"ranks": N, network name: {strategy: efficiency}}`."""
    return [
        {"ranks": n, **{net.name: efficiency(profile, n, net, assumptions) for net in networks}}
        for n in ranks
    ]


def format_table(rows: list[dict], networks: list[Network]) -> str:
    """Fixed-width text: efficiencies in percent, `n/a` where a strategy is not possible."""
    labels = {"ddp": "DDP", "fsdp": "FSDP", "pipeline": "pipe"}
    width = 3 * 7  # three cells of " 100.0%"
    head = "ranks" + "".join(f" |{net.name:^{width}}" for net in networks)
    sub = "     " + "".join(" |" + "".join(f"{labels[s]:>7}" for s in STRATEGIES) for _ in networks)
    lines = [head.rstrip(), sub, "-" * len(head)]
    for row in rows:
        cells = "".join(
            " |"
            + "".join(
                f"{'n/a' if v is None else f'{v:.1%}':>7}" for v in (row[net.name][s] for s in STRATEGIES)
            )
            for net in networks
        )
        lines.append(f"{row['ranks']:>5}{cells}")
    return "\n".join(lines)
