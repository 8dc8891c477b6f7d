"""``kernels.ops=auto``: each op's candidates timed forward + backward at the model's own widths on
its device, and only a winner swapped in.

On the first H200 run six of our seven Triton kernels were slower than eager torch (0.39-0.87x), so
nothing here assumes a fused kernel pays. For every op the model has, the candidates are:

- ``keep``: the model's own module, as it will run (eager; under a whole-model ``torch.compile`` it
  is timed compiled, since inductor fuses it there);
- ``triton``: our Triton kernel (CUDA with Triton);
- ``liger``: Liger-Kernel's (CUDA with liger-kernel installed; it has no plain tanh-GELU);
- ``compile``: inductor's code for the torch reference in an eager model (CUDA, eager models only:
  on a CPU its compile costs seconds per op and per shape, more than the op's time it could save);
- ``torch``: our pure-torch path, where it differs from the reference (the chunked linear
  cross-entropy, which never builds the logits).

A candidate replaces ``keep`` only when it is at least ``MIN_GAIN`` faster; the timings, and why a
candidate was not timed, are the recorded reason. ``timer`` is injectable: tests feed timings.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from .alternatives import LIGER_OPS, alternative
from .dispatch import liger_problem, triton_available

MIN_GAIN = 1.03
"""A candidate must run an op's forward + backward at least this much faster than the model's own
module to be swapped in: a tie keeps the module the user wrote."""

KEEP = "keep"

Timer = Callable[[str, str, Callable[[], None], torch.device], float]
"""timer(op, candidate, run, device) -> seconds for one forward + backward (``run`` does one)."""


@dataclass(frozen=True)
class OpWidths:
    """The widths an op runs at in this model: rows come from the token budget."""

    rows: int
    hidden: int
    vocab: int
    ffn: int
    norm: int


@dataclass
class OpChoice:
    """One op's verdict: the candidate installed (``keep``: the model's module) and why."""

    op: str
    choice: str
    seconds: dict[str, float] = field(default_factory=dict)
    not_timed: dict[str, str] = field(default_factory=dict)
    shape: str = ""

    @property
    def reason(self) -> str:
        figures = ", ".join(
            f"{c} {s * 1e3:.3f} ms" for c, s in sorted(self.seconds.items(), key=lambda kv: kv[1])
        )
        why = f"fwd+bwd at {self.shape}: {figures or 'nothing timed'}"
        if self.choice == KEEP and len(self.seconds) > 1:
            why += f" (a swap needs >= {MIN_GAIN:.2f}x the model's own)"
        if self.not_timed:
            why += "; not timed: " + "; ".join(f"{c} ({r})" for c, r in sorted(self.not_timed.items()))
        return why

    def to_dict(self) -> dict:
        return {
            "op": self.op,
            "choice": self.choice,
            "seconds": dict(self.seconds),
            "not_timed": dict(self.not_timed),
            "shape": self.shape,
        }


def model_widths(model: nn.Module, rows: int) -> OpWidths:
    """Hidden size and vocabulary from the output head (or the largest embedding), the MLP width
    from the widest Linear that is not the head, the norm width from the first norm."""
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    embeddings = [m for m in model.modules() if isinstance(m, nn.Embedding)]
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if isinstance(head, nn.Linear):
        vocab, hidden = head.out_features, head.in_features
    elif embeddings:
        biggest = max(embeddings, key=lambda e: e.num_embeddings)
        vocab, hidden = biggest.num_embeddings, biggest.embedding_dim
    elif linears:
        vocab, hidden = linears[-1].out_features, linears[-1].in_features
    else:
        vocab, hidden = 1, 1
    ffn = max((m.out_features for m in linears if m.out_features != vocab), default=4 * hidden)
    norms = [
        m
        for m in model.modules()
        if isinstance(getattr(m, "weight", None), torch.Tensor) and "Norm" in type(m).__name__
    ]
    norm = int(norms[0].weight.numel()) if norms else hidden
    return OpWidths(rows=max(1, rows), hidden=hidden, vocab=vocab, ffn=ffn, norm=norm)


def _inputs(op: str, w: OpWidths, dtype: torch.dtype, device: torch.device, gen: torch.Generator):
    """Leaf tensors for one op at the model's widths (targets are ints; the rest need grads)."""

    def leaf(*shape, scale=1.0):
        t = (torch.randn(*shape, generator=gen) * scale).to(device=device, dtype=dtype)
        return t.requires_grad_()

    def targets(n, vocab):
        return torch.randint(0, vocab, (n,), generator=gen).to(device)

    if op == "rms_norm":
        return (leaf(w.rows, w.norm), leaf(w.norm), 1e-6)
    if op == "layer_norm":
        return (leaf(w.rows, w.norm), leaf(w.norm), leaf(w.norm), 1e-5)
    if op == "gelu_tanh":
        return (leaf(w.rows, w.ffn),)
    if op == "swiglu":
        return (leaf(w.rows, w.ffn), leaf(w.rows, w.ffn))
    if op == "cross_entropy":
        return (leaf(w.rows, w.vocab), targets(w.rows, w.vocab))
    if op == "linear_cross_entropy":
        return (
            leaf(w.rows, w.hidden),
            leaf(w.vocab, w.hidden, scale=w.hidden**-0.5),
            targets(w.rows, w.vocab),
        )
    raise ValueError(f"no timing inputs for kernel op {op!r}")


def _shape(op: str, w: OpWidths, dtype: torch.dtype) -> str:
    dims = {
        "rms_norm": f"{w.rows}x{w.norm}",
        "layer_norm": f"{w.rows}x{w.norm}",
        "gelu_tanh": f"{w.rows}x{w.ffn}",
        "swiglu": f"{w.rows}x{w.ffn}",
        "cross_entropy": f"{w.rows}x{w.vocab}",
        "linear_cross_entropy": f"{w.rows}x{w.hidden} @ {w.vocab}x{w.hidden}",
    }[op]
    return f"{dims} {str(dtype).removeprefix('torch.')}"


def _forward(op: str, backend: str) -> Callable:
    """The op's forward on ``backend``, called with ``_inputs``' tuple (``keep`` = torch's reference)."""
    # submodules, not the package: the package imports swap, which imports this module
    from .activations import gelu_tanh, swiglu
    from .alternatives import _REFERENCE
    from .cross_entropy import cross_entropy
    from .fused_linear_cross_entropy import fused_linear_cross_entropy
    from .norms import layer_norm, rms_norm

    if backend == KEEP:
        return _REFERENCE[op]
    ours = {
        "rms_norm": rms_norm,
        "layer_norm": layer_norm,
        "gelu_tanh": gelu_tanh,
        "swiglu": swiglu,
        "cross_entropy": cross_entropy,
        "linear_cross_entropy": fused_linear_cross_entropy,
    }[op]
    return lambda *args: ours(*args, backend=backend)


def candidates(op: str, device: torch.device, compiled_model: bool) -> tuple[list[str], dict[str, str]]:
    """(candidates to time beside ``keep``, why each other one is not timed here)."""
    device = torch.device(device)
    timed: list[str] = []
    skipped: dict[str, str] = {}
    if device.type == "cuda" and triton_available():
        timed.append("triton")
    else:
        skipped["triton"] = "needs CUDA and triton"
    problem = liger_problem(device) if op in LIGER_OPS else "Liger-Kernel has no such op"
    if problem is None:
        timed.append("liger")
    else:
        skipped["liger"] = problem
    if compiled_model:
        skipped["compile"] = (
            "the whole model is compiled: inductor already fuses the module (keep is timed compiled)"
        )
    elif device.type != "cuda":
        skipped["compile"] = "CPU: a per-op compile costs more than the op's time it could save"
    else:
        timed.append("compile")
    if op == "linear_cross_entropy":
        timed.append("torch")  # chunked: never builds the [rows, vocab] logits
    return timed, skipped


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(
    op: str,
    candidate: str,
    run: Callable[[], None],
    device: torch.device,
    *,
    reps: int = 5,
    budget_s: float = 1.0,
) -> float:
    """Median seconds of ``run`` (one forward + backward) after two warm-up runs; CUDA events on a GPU.

    Stops early once ``budget_s`` is spent (at least one timed run): a large vocabulary on a CPU
    must not cost the user minutes before the first step."""
    for _ in range(2):
        run()
    _sync(device)
    times: list[float] = []
    start_all = time.perf_counter()
    for _ in range(reps):
        if device.type == "cuda":
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            run()
            end.record()
            end.synchronize()
            times.append(begin.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            run()
            times.append(time.perf_counter() - t0)
        if time.perf_counter() - start_all > budget_s:
            break
    return statistics.median(times)


def _runner(op: str, backend: str, inputs: tuple, compiled_keep: bool) -> Callable[[], None]:
    fn = alternative(op, "compile") if backend == KEEP and compiled_keep else _forward(op, backend)
    leaves = [t for t in inputs if isinstance(t, torch.Tensor) and t.requires_grad]

    def run() -> None:
        for t in leaves:
            t.grad = None
        out = fn(*inputs)
        out.float().sum().backward() if out.dim() else out.backward()

    return run


_MEMO: dict[tuple, OpChoice] = {}


def choose_op(
    op: str,
    widths: OpWidths,
    device: torch.device | str,
    dtype: torch.dtype = torch.float32,
    *,
    compiled_model: bool = False,
    timer: Timer | None = None,
) -> OpChoice:
    """Time ``op``'s candidates at ``widths`` and return the verdict (memoised per process for the
    real timer: bench builds one session per round and contender)."""
    device = torch.device(device)
    key = (op, widths, str(device), dtype, compiled_model)
    if timer is None and key in _MEMO:
        return _MEMO[key]
    timed, skipped = candidates(op, device, compiled_model)
    choice = OpChoice(op=op, choice=KEEP, not_timed=dict(skipped), shape=_shape(op, widths, dtype))
    gen = torch.Generator().manual_seed(0)
    inputs = _inputs(op, widths, dtype, device, gen)
    clock = timer or measure
    for name in (KEEP, *timed):
        try:
            choice.seconds[name] = float(clock(op, name, _runner(op, name, inputs, compiled_model), device))
        except Exception as err:  # a candidate that fails here is not installed; say why
            choice.not_timed[name] = f"failed: {type(err).__name__}: {str(err)[:120]}"
    base = choice.seconds.get(KEEP)
    others = {c: s for c, s in choice.seconds.items() if c != KEEP}
    if base is not None and others:
        best = min(others, key=others.__getitem__)
        if others[best] * MIN_GAIN <= base:
            choice.choice = best
    if timer is None:
        _MEMO[key] = choice
    return choice


def choose_kernels(
    model: nn.Module,
    ops: Sequence[str],
    device: torch.device | str,
    *,
    rows: int = 8192,
    dtype: torch.dtype = torch.float32,
    compiled_model: bool = False,
    timer: Timer | None = None,
) -> dict[str, OpChoice]:
    """``choose_op`` for each of ``ops`` at this model's widths (ops the model lacks are the swap's
    business: it reports them as absent)."""
    widths = model_widths(model, rows)
    return {
        op: choose_op(op, widths, device, dtype, compiled_model=compiled_model, timer=timer) for op in ops
    }


@dataclass(frozen=True)
class KernelChooser:
    """How ``apply_kernels`` decides ``auto``: rows per timed call (the recipe's tokens per batch),
    the compute dtype, whether the whole model will be compiled, and the timer (tests inject one)."""

    rows: int = 8192
    dtype: torch.dtype = torch.float32
    compiled_model: bool = False
    timer: Timer | None = None
    fixed: Mapping[str, str] | None = None
    """op -> candidate decided earlier (a resumed run): installed again without timing."""
    agree: Callable[[dict], dict] | None = None
    """Makes every rank take rank 0's verdicts (ranks that swapped differently would diverge)."""

    def __call__(
        self, model: nn.Module, ops: Sequence[str], device: torch.device | str
    ) -> dict[str, OpChoice]:
        if self.fixed is not None:
            return {
                op: OpChoice(op=op, choice=self.fixed.get(op, KEEP), shape="the resumed run's choice")
                for op in ops
            }
        verdicts = choose_kernels(
            model,
            ops,
            device,
            rows=self.rows,
            dtype=self.dtype,
            compiled_model=self.compiled_model,
            timer=self.timer,
        )
        return self.agree(verdicts) if self.agree is not None else verdicts


def injected_timer(seconds: Mapping[str, Mapping[str, float]]) -> Timer:
    """A timer that answers ``seconds[op][candidate]`` without running anything (tests, what-ifs);
    a candidate missing from the table raises, so it shows as not timed."""

    def timer(op: str, candidate: str, run: Callable[[], None], device: torch.device) -> float:
        return seconds[op][candidate]

    return timer
