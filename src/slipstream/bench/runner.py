"""Side-by-side benchmark of recipes (and peers) on one workload, interleaved round by round.

Method (torch.utils.benchmark / MLPerf style):
- every contender is built once and warmed up (compile happens there; timed as compile_s),
- then rounds run A B C A B C ...: in each round every contender trains until it has consumed the
  same budget of *real* tokens, so drift on a noisy machine hits all of them alike and each sees
  the same amount of learning signal,
- figures are medians over rounds with the interquartile range; IQR/median > 0.1 is flagged.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import numpy as np
import torch

from ..metrics import dynamo_graph_count
from ..presets import resolve_recipe
from ..recipe import Recipe, RecipeError
from ..session import Session
from ..shapes.loader import Batch, ShapedLoader
from ..train import evaluate
from ..workloads import get_workload

NOISY_IQR_RATIO = 0.1


@dataclass
class RoundStats:
    seconds: float
    real_tokens: int
    padded_tokens: int
    steps: int
    data_wait_s: float
    losses: list[float]


@dataclass
class ContenderResult:
    name: str
    kind: str
    """"recipe" or "peer"."""
    real_tokens_per_s: float
    """Median over rounds."""
    real_tokens_per_s_iqr: float
    round_tokens_per_s: list[float]
    speedup: float
    """real_tokens_per_s over the first contender's."""
    step_time_s: float
    padding_waste: float
    data_wait_s: float
    distinct_shapes: int
    recompiles: int
    compile_s: float
    """Warm-up time beyond its steps' steady cost: compilation, autotuning, first allocations."""
    peak_memory_bytes: int | None
    peak_memory_note: str
    real_tokens: int
    steps: int
    val_loss: float
    parity_gap: float
    """Relative gap of the final validation loss to the reference (first) contender's."""
    parity: str
    """"pass", "fail", or "reference"."""
    mfu: float
    """Model FLOP/s (6 x params per real token) over the peak matmul rate measured in this run."""
    precision: str
    noisy: bool
    loss_curve: list[tuple[int, float]] = field(default_factory=list)
    """(cumulative real tokens, training loss) per step."""
    time_breakdown_s: dict[str, float] = field(default_factory=dict)
    info: dict[str, Any] = field(default_factory=dict)


@dataclass
class BenchResult:
    workload: str
    size: str
    machine: dict[str, Any]
    method: dict[str, Any]
    peak_flops: dict[str, float]
    contenders: list[ContenderResult]
    skipped: dict[str, str]
    """Contenders that could not run, with the reason."""
    warnings: list[str]
    wall_s: float

    def to_dict(self) -> dict[str, Any]:
        """JSON-native (tuples become lists), exactly what --json writes."""
        return json.loads(json.dumps(asdict(self)))


class Contender(ABC):
    """One thing being measured. Subclasses own their model, optimizer and data."""

    name: str
    kind = "recipe"
    precision = "fp32"

    @abstractmethod
    def run_round(self, real_token_budget: int | None, max_steps: int | None = None) -> RoundStats:
        """Train until `real_token_budget` real tokens (or `max_steps` steps) are consumed."""

    @abstractmethod
    def validation_loss(self) -> float:
        """Token-weighted validation loss on the batches shared by every contender."""

    def info(self) -> dict[str, Any]:
        return {}


class LoopContender(Contender):
    """A contender whose loop we drive: one `train_step` per batch from `self.batches`."""

    batches: Iterator[Batch]
    device: torch.device
    shapes_seen: set[tuple[int, int]]

    @abstractmethod
    def train_step(self, batch: Batch) -> torch.Tensor:
        """One optimizer step on `batch`; returns the loss (left on the device)."""

    def data_wait_since(self, mark: int) -> float:
        """Seconds spent waiting for data since `round_mark()` returned `mark`."""
        return 0.0

    def round_mark(self) -> int:
        return 0

    def run_round(self, real_token_budget: int | None, max_steps: int | None = None) -> RoundStats:
        real = padded = steps = 0
        losses: list[torch.Tensor] = []  # kept on the device until the round ends: no sync per step
        mark = self.round_mark()
        _sync(self.device)
        t0 = time.perf_counter()
        while (real_token_budget is None or real < real_token_budget) and (
            max_steps is None or steps < max_steps
        ):
            batch = next(self.batches)
            self.shapes_seen.add(batch.shape)
            losses.append(self.train_step(batch).detach())
            real += batch.real_tokens
            padded += batch.padded_tokens
            steps += 1
        _sync(self.device)
        return RoundStats(
            seconds=time.perf_counter() - t0,
            real_tokens=real,
            padded_tokens=padded,
            steps=steps,
            data_wait_s=self.data_wait_since(mark),
            losses=torch.stack(losses).float().tolist() if losses else [],
        )


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class RecipeContender(LoopContender):
    """A recipe run through Session: the way a slipstream user trains."""

    def __init__(self, spec: str, workload: str, size: str, data, val_batches: int, reference: Recipe):
        self.name = spec
        self.recipe: Recipe = resolve_recipe(spec)
        self.spec = spec
        self.session = Session(self.recipe)
        self.precision = self.session.precision
        wl = get_workload(workload)
        self.model = self.session.prepare_model(wl.model(size, self.recipe.shapes.max_len))
        self.optimizer = self.session.build_optimizer(self.model)
        self.loader = self.session.prepare_loader(data.train, lengths=data.train_lengths, pad_id=data.pad_id)
        self.batches = self.loader.forever()
        self.val_loader = ShapedLoader(
            data.validation,
            replace(reference.shapes, mode="pad_max"),  # one fixed validation shape for every contender
            device=self.session.device,
            pad_id=data.pad_id,
            lengths=data.validation_lengths,
        )
        self.val_batches = val_batches
        self.device = self.session.device
        self.shapes_seen = set()

    def train_step(self, batch: Batch) -> torch.Tensor:
        with self.session.autocast():
            loss = self.model(**batch)
        self.session.backward(loss)
        self.session.step(self.optimizer)
        return loss

    def round_mark(self) -> int:
        return len(self.session.tracker.records)

    def data_wait_since(self, mark: int) -> float:
        return sum(r.data_wait_s for r in self.session.tracker.records[mark:])

    def validation_loss(self) -> float:
        return evaluate(self.model, self.val_loader, self.session, self.val_batches)

    def info(self) -> dict[str, Any]:
        m = self.session.metrics()
        return {
            "distinct_shapes": m.distinct_shapes,
            "recompiles": m.recompiles,
            "recipe": self.recipe.to_dict(),
            **{k: v for k, v in m.extra.items() if isinstance(v, (int, float, str, bool))},
        }


def measure_peak_matmul_flops(device: torch.device, n: int = 1024, repeats: int = 5) -> dict[str, float]:
    """Best-of-N dense matmul FLOP/s per dtype on this device: the denominator of MFU."""
    out = {}
    for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        a = torch.randn(n, n, device=device, dtype=dtype)
        b = torch.randn(n, n, device=device, dtype=dtype)
        a @ b
        best = float("inf")
        for _ in range(repeats):
            _sync(device)
            t0 = time.perf_counter()
            a @ b
            _sync(device)
            best = min(best, time.perf_counter() - t0)
        out[name] = 2 * n**3 / best
    out["fp16"] = out["bf16"]
    return out


def peak_memory_in_subprocess(spec: str, workload: str, size: str, steps: int = 2) -> tuple[int | None, str]:
    """Process peak RSS of a short run of this recipe alone (RSS is per process, so one each)."""
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "m.json")
        cmd = [sys.executable, "-m", "slipstream.cli", "train", "--workload", workload, "--size", size]
        cmd += ["--recipe", spec, "--steps", str(steps), "--eval-every", "0", "--no-progress", "--json", out]
        env = {k: v for k, v in os.environ.items() if k != "SLIPSTREAM_FAULT"}
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
        except subprocess.TimeoutExpired:
            return None, "memory run timed out"
        if proc.returncode != 0:
            last = proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else ""
            return None, f"memory run failed: {last}"
        with open(out) as fh:
            data = json.load(fh)
    return int(data["peak_memory_bytes"]), f"{data['peak_memory_kind']} of a {steps}-step run alone"


def _iqr(values: list[float]) -> float:
    q75, q25 = np.percentile(values, [75, 25])
    return float(q75 - q25)


def run_bench(
    workload: str = "gpt-stdlib",
    recipes: list[str] | None = None,
    *,
    size: str = "tiny",
    rounds: int = 3,
    round_tokens: int | None = None,
    warmup_steps: int = 2,
    val_batches: int = 4,
    peers: list[str] | None = None,
    memory: str = "auto",
    parity_tolerance: float = 0.05,
    progress: Callable[[str], None] | None = None,
) -> BenchResult:
    """Benchmark recipes (and peers) side by side; the first contender is the reference."""
    from .peers import PEERS, PeerUnavailable

    say = progress or (lambda msg: None)
    t_start = time.perf_counter()
    recipes = recipes or ["baseline"]
    if rounds < 1:
        raise RecipeError(f"rounds={rounds} must be at least 1")
    specs = [resolve_recipe(s) for s in recipes]  # fail fast on a bad spec, before any work
    wl = get_workload(workload)
    if size not in wl.sizes:
        raise RecipeError(f"workload {workload!r} has no size {size!r}; choose one of {', '.join(wl.sizes)}")
    data = wl.load_data()
    budget = round_tokens or 2 * specs[0].shapes.tokens_per_batch

    contenders: list[Contender] = []
    skipped: dict[str, str] = {}
    for spec in recipes:
        say(f"building {spec}")
        contenders.append(RecipeContender(spec, workload, size, data, val_batches, specs[0]))
    for peer in peers or []:
        if peer not in PEERS:
            raise RecipeError(f"unknown peer {peer!r}; available: {', '.join(PEERS)}")
        try:
            say(f"building peer {peer}")
            contenders.append(PEERS[peer](workload, size, data, specs[0], val_batches))
        except PeerUnavailable as why:
            skipped[peer] = str(why)

    device = getattr(contenders[0], "device", torch.device("cpu"))
    warm: dict[str, float] = {}
    # dynamo's graph counter is process-wide, so each contender's recompiles are the graphs built
    # while it alone was running, after its first step.
    recompiles: dict[str, int] = {c.name: 0 for c in contenders}

    def counted_round(c: Contender, budget: int | None, max_steps: int | None = None) -> RoundStats:
        before = dynamo_graph_count()
        stats = c.run_round(budget, max_steps=max_steps)
        recompiles[c.name] += dynamo_graph_count() - before
        return stats

    for c in contenders:
        say(f"warm-up {c.name}")
        t0 = time.perf_counter()
        c.run_round(None, max_steps=1)  # the first step's graphs are compiles, not recompiles
        if warmup_steps > 1:
            counted_round(c, None, warmup_steps - 1)
        warm[c.name] = time.perf_counter() - t0

    per_round: dict[str, list[RoundStats]] = {c.name: [] for c in contenders}
    for r in range(rounds):
        for c in contenders:  # interleaved: A B C A B C ...
            say(f"round {r + 1}/{rounds}: {c.name}")
            per_round[c.name].append(counted_round(c, budget))

    say("measuring peak matmul rate")
    peak = measure_peak_matmul_flops(device)
    results: list[ContenderResult] = []
    warnings: list[str] = []
    ref_val: float | None = None
    for c in contenders:
        stats = per_round[c.name]
        tps = [s.real_tokens / s.seconds for s in stats]
        med = float(np.median(tps))
        steps = sum(s.steps for s in stats)
        seconds = sum(s.seconds for s in stats)
        real = sum(s.real_tokens for s in stats)
        padded = sum(s.padded_tokens for s in stats)
        step_time = seconds / max(steps, 1)
        say(f"validation {c.name}")
        val = c.validation_loss()
        if ref_val is None:
            ref_val = val
        gap = abs(val - ref_val) / ref_val if ref_val else 0.0
        info = c.info()
        n_params = getattr(c, "model", None)
        params = sum(p.numel() for p in n_params.parameters()) if n_params is not None else 0
        mfu = med * 6 * params / peak.get(c.precision, peak["fp32"])
        noisy = med > 0 and _iqr(tps) / med > NOISY_IQR_RATIO
        if noisy:
            warnings.append(
                f"{c.name}: IQR/median of tokens/s is {_iqr(tps) / med:.2f} (> {NOISY_IQR_RATIO}); rerun with more rounds"
            )
        mem, note = None, "not measured"
        if c.kind == "recipe":
            if device.type == "cuda":
                mem, note = int(info.get("peak_memory_bytes", 0)) or None, "cuda_max_allocated (whole run)"
            elif memory in ("auto", "subprocess"):
                say(f"peak memory {c.name}")
                mem, note = peak_memory_in_subprocess(c.name, workload, size)
        cum, curve = 0, []
        per_step_tokens = real / max(steps, 1)
        for s in stats:
            for loss in s.losses:
                cum += per_step_tokens
                curve.append((int(cum), loss))
        data_wait = sum(s.data_wait_s for s in stats)
        results.append(
            ContenderResult(
                name=c.name,
                kind=c.kind,
                real_tokens_per_s=med,
                real_tokens_per_s_iqr=_iqr(tps),
                round_tokens_per_s=tps,
                speedup=0.0,
                step_time_s=step_time,
                padding_waste=padded / (real + padded) if real + padded else 0.0,
                data_wait_s=data_wait,
                distinct_shapes=int(info.get("distinct_shapes", 0)),
                recompiles=recompiles[c.name],
                compile_s=max(0.0, warm[c.name] - warmup_steps * step_time),
                peak_memory_bytes=mem,
                peak_memory_note=note,
                real_tokens=real,
                steps=steps,
                val_loss=val,
                parity_gap=gap,
                parity="reference" if c is contenders[0] else ("pass" if gap <= parity_tolerance else "fail"),
                mfu=mfu,
                precision=c.precision,
                noisy=noisy,
                loss_curve=curve,
                time_breakdown_s={"compute": max(0.0, seconds - data_wait), "data_wait": data_wait},
                info={k: v for k, v in info.items() if k not in ("distinct_shapes", "recompiles")},
            )
        )
    base = results[0].real_tokens_per_s
    for r in results:
        r.speedup = r.real_tokens_per_s / base if base else 0.0
    from ..doctor import machine_info

    return BenchResult(
        workload=workload,
        size=size,
        machine=machine_info(),
        method={
            "rounds": rounds,
            "round_real_tokens": budget,
            "warmup_steps": warmup_steps,
            "val_batches": val_batches,
            "parity_tolerance": parity_tolerance,
            "order": "interleaved A B C per round; medians over rounds",
        },
        peak_flops=peak,
        contenders=results,
        skipped=skipped,
        warnings=warnings,
        wall_s=time.perf_counter() - t_start,
    )
