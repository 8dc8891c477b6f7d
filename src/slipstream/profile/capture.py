"""Capture: run a training loop under torch.profiler and keep what the analyzers need.

Steps are found without touching the user's loop: a global optimizer step post-hook (registered
for the capture, removed afterwards) closes a step each time the *first* optimizer that stepped
steps again, or `mark_step()` does when the loop calls it (then optimizer steps stop counting).
Each step boundary advances the profiler's wait / warm-up / active schedule, so only the active
steps are recorded, and the wait and tail steps run unprofiled: their wall times are the baseline
that the profiler's overhead is measured against, in the same run.

Everything the analyzers read lands in a `Capture` of plain data (events with their Python
stacks, step windows, step wall times, compilations and guard failures), so analysis is a set of
stateless functions over it.
"""

from __future__ import annotations

import contextlib
import os
import re
import runpy
import sys
import sysconfig
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..recipe import RecipeError

# ----------------------------------------------------------------------------- configuration


@dataclass(frozen=True)
class CaptureConfig:
    wait: int = 3
    """Unprofiled steps first (the first one holds warm-up and compilation); the baseline for overhead."""

    warmup: int = 1
    """Steps the profiler runs but discards (its own start-up cost lands here)."""

    active: int = 3
    """Steps recorded and analysed."""

    tail: int = 3
    """Unprofiled steps after the active ones: more baseline for the overhead figure."""

    light: bool = False
    """Light mode: no Python stacks and no input shapes/dtypes. Much less overhead, but findings
    have no `where` and the dtype-based ones (fp32 matmuls, boolean masks by dtype) are skipped."""

    trace_path: str | None = None
    """Write the active steps as a Chrome/Perfetto trace (JSON) here."""

    stop_when_done: bool = True
    """Scripts only: end the script (a BaseException raised at a step boundary) once the schedule
    and the tail steps are done, instead of training to the end."""

    def __post_init__(self) -> None:
        for name in ("wait", "warmup", "active", "tail"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise RecipeError(f"profile {name}={value!r} must be an integer >= 0")
        if self.active < 1:
            raise RecipeError(f"profile active={self.active} must be at least 1")

    @property
    def total_steps(self) -> int:
        return self.wait + self.warmup + self.active + self.tail

    def phase(self, step: int) -> str:
        """Phase of 1-based step `step`: wait, warmup, active or tail."""
        if step <= self.wait:
            return "wait"
        if step <= self.wait + self.warmup:
            return "warmup"
        if step <= self.wait + self.warmup + self.active:
            return "active"
        return "tail"


# ----------------------------------------------------------------------------- captured data


@dataclass
class Event:
    """One profiler event, normalized. Times in microseconds from the profiler's start."""

    name: str
    start_us: float
    end_us: float
    thread: int
    device: str
    """cpu (host events: ops, annotations, Python calls, runtime calls) or cuda (kernels, memcpy)."""
    kind: str
    """op (aten:: and other dispatcher ops), python (a Python call), annotation (record_function,
    ProfilerStep#), runtime (cudaLaunchKernel, cudaStreamSynchronize ...) or kernel (on the device)."""
    stack: tuple[str, ...] = ()
    """Python frames, innermost first, as `path(line): function` (empty in light mode)."""
    input_dtypes: tuple[str, ...] = ()
    input_shapes: tuple[Any, ...] = ()
    parent: int = -1
    """Index of the enclosing host event, -1 at the top."""
    kernels: tuple[str, ...] = ()
    """Device activity this host event launched (kernel and memcpy names)."""

    @property
    def dur_us(self) -> float:
        return self.end_us - self.start_us


@dataclass
class CompileRecord:
    """One torch.compile (dynamo) compilation seen during the capture."""

    compile_id: str
    step: int
    """The step it happened in (1-based)."""
    duration_s: float
    call_site: tuple[str, int, str] | None
    """(file, line, function) of the innermost user frame that called the compiled code."""

    @property
    def is_recompile(self) -> bool:
        """Frame compile id > 0: the same frame compiled again (a guard failed)."""
        m = re.match(r"^!?(?:\d+/)?\d+/(\d+)", self.compile_id)
        return bool(m and int(m.group(1)) > 0)


@dataclass
class Capture:
    """Everything one profiled run produced, as plain data."""

    config: CaptureConfig
    source: dict[str, Any]
    """What ran: {"workload": ..., "recipe": ..., "size": ...} or {"script": ..., "argv": [...]}."""
    device: str
    bf16_pays: bool
    """bf16 matmuls measured faster than fp32 here (machine probe, by PAYS_RATIO); merely running
    is not enough: on an Intel AVX512-BF16 CPU without AMX they run at ~0.55x fp32."""
    bf16_verdict: str = ""
    """The probe's figures behind bf16_pays ("bf16 66.0 GFLOP/s vs fp32 119.0 GFLOP/s at ...")."""
    events: list[Event] = field(default_factory=list)
    step_windows_us: list[tuple[float, float]] = field(default_factory=list)
    """(start, end) of each recorded step, from the profiler's ProfilerStep# events."""
    step_times_s: list[float] = field(default_factory=list)
    """Wall time of every step, profiled or not (the profiler's own step handling excluded)."""
    step_phases: list[str] = field(default_factory=list)
    step_source: str = "optimizer"
    """What closed the steps: optimizer (a step post-hook) or mark_step."""
    compiles: list[CompileRecord] = field(default_factory=list)
    guard_failures: list[dict[str, str]] = field(default_factory=list)
    """Dynamo guard failures during the capture: {"code": file:line (function), "reason": ...}."""
    metrics: dict[str, Any] | None = None
    """The built-in loop's MetricsSummary (padding waste, data wait ...); None for scripts."""
    user_code: str = "outside torch, slipstream and the standard library"
    own_code_is_user: bool = False
    """True when profiling a built-in workload: slipstream's own loop is the code to point at."""
    trace_path: str | None = None
    postprocess_s: float = 0.0
    """Time the profiler took to process the recorded steps (not charged to any step)."""
    light: bool = False
    """Whether the profiled steps ran in light mode (asked for, or chosen: see light_reason)."""
    light_reason: str | None = None
    script_exit: str | None = None
    """How the script ended: None (ran to the end), 'stopped' (after the schedule), or an error."""

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.pop("events")
        return d


# ----------------------------------------------------------------------------- user frames

_FRAME = re.compile(r"^(?P<path>.*)\((?P<line>\d+)\): (?P<func>.*)$")
_TORCH_DIR = str(Path(torch.__file__).resolve().parent)
_OWN_DIR = str(Path(__file__).resolve().parents[1])
_STDLIB_DIRS = tuple(
    {str(Path(p).resolve()) for p in (sysconfig.get_paths()["stdlib"], sysconfig.get_paths()["platstdlib"])}
)


def parse_frame(entry: str) -> tuple[str, int, str] | None:
    """`path(line): function` -> (path, line, function); None for builtins and module markers."""
    m = _FRAME.match(entry)
    if m is None or entry.startswith("<"):
        return None
    return m.group("path"), int(m.group("line")), m.group("func")


def is_user_file(path: str, own_code_is_user: bool = False) -> bool:
    """User code: not torch, not the standard library, not slipstream (unless profiling its own loop)."""
    if not path or path.startswith("<"):
        return False
    p = str(Path(path).resolve()) if os.path.isabs(path) else path
    if p.startswith(_TORCH_DIR + os.sep) or p.startswith(("torch/", "torch\\")):
        return False
    if not own_code_is_user and (p.startswith(_OWN_DIR + os.sep) or p.startswith("slipstream/")):
        return False
    if os.path.isabs(p) and p.startswith(_STDLIB_DIRS) and "site-packages" not in p:
        return False
    return os.path.isabs(p)  # unresolved relative names are library files the profiler shortened


def _resolve_path(path: str, search: Sequence[str]) -> str:
    """The profiler shortens paths relative to sys.path entries; find the file they name."""
    if os.path.isabs(path):
        return path
    for base in search:
        candidate = os.path.join(base or os.getcwd(), path)
        if os.path.isfile(candidate):
            return str(Path(candidate).resolve())
    return path


def resolve_stack(stack: Sequence[str], cache: dict[str, str], search: Sequence[str]) -> tuple[str, ...]:
    out = []
    for entry in stack:
        frame = parse_frame(entry)
        if frame is None:
            out.append(entry)
            continue
        path, line, func = frame
        if path not in cache:
            cache[path] = _resolve_path(path, search)
        out.append(f"{cache[path]}({line}): {func}")
    return tuple(out)


def innermost_user_frame(
    frames: Sequence[traceback.FrameSummary], own_code_is_user: bool = False
) -> tuple[str, int, str] | None:
    for fs in reversed(frames):
        if is_user_file(fs.filename, own_code_is_user):
            return str(Path(fs.filename).resolve()), int(fs.lineno or 0), fs.name
    return None


# ----------------------------------------------------------------------------- hardware facts


def bf16_verdict(device: str) -> tuple[bool, str]:
    """Whether bf16 matmuls *pay* here, and the measured figures that say so (the machine probe,
    cached per machine): not whether they merely run, which they do everywhere, 75x slower than
    fp32 on AVX2-only CPUs."""
    from .. import machine

    return machine.dtype_verdict(machine.probe(device), "bf16")


# ----------------------------------------------------------------------------- steps


class ProfileComplete(BaseException):  # noqa: N818 - a control-flow signal, not an error
    """Raised at a step boundary to end a script once the schedule is done (BaseException, so
    the script's `except Exception` does not swallow it)."""


_ACTIVE: _StepClock | None = None


def mark_step() -> None:
    """Close a training step for `slipstream profile` (a no-op when nothing is profiling).

    Call it once per step where optimizer steps do not delimit steps (gradient accumulation, no
    torch.optim optimizer, several optimizers); after the first call optimizer steps stop counting.
    """
    clock = _ACTIVE
    if clock is not None:
        clock.mark()


class _StepClock:
    """Closes steps: times them, advances the profiler, watches compilations, stops the script."""

    def __init__(
        self,
        cfg: CaptureConfig,
        capture: Capture,
        stop: bool,
        on_trace_ready: Callable[[torch.profiler.profile], None],
    ):
        self.prof: torch.profiler.profile | None = None
        self.on_trace_ready = on_trace_ready
        self.cfg = cfg
        self.capture = capture
        self.stop = stop
        self.steps = 0
        self.first_optimizer: int | None = None
        self.mode = "optimizer"
        self.stepped_since_mark = False
        self.last = time.perf_counter()
        self.compile_started: dict[str, float] = {}
        self.call_sites: dict[str, tuple[str, int, str] | None] = {}
        self.dynamo_hooked = False
        self.failures_before: dict[Any, int] = {}

    # -- step boundaries ------------------------------------------------------------------------

    def on_optimizer_step(self, optimizer: torch.optim.Optimizer, *_: Any) -> None:
        if self.mode != "optimizer":
            return
        if self.first_optimizer is None:
            self.first_optimizer = id(optimizer)
        if id(optimizer) != self.first_optimizer:
            return  # a second optimizer in the same step (GAN, separate heads) is not a new step
        self.stepped_since_mark = True
        self.boundary()

    def mark(self) -> None:
        if self.mode == "optimizer":
            self.mode = "mark_step"
            self.capture.step_source = "mark_step"
            if self.stepped_since_mark:
                return  # this step was already closed by its optimizer step
        self.boundary()

    def boundary(self) -> None:
        now = time.perf_counter()
        self.steps += 1
        self.capture.step_times_s.append(now - self.last)
        self.capture.step_phases.append(self.cfg.phase(self.steps))
        self.hook_dynamo()
        t0 = time.perf_counter()
        if self.prof is not None:
            self.prof.step()  # may process the recorded steps (on_trace_ready): not charged to a step
        elif self.steps == self.cfg.wait:
            self.start_profiler()
        self.last = time.perf_counter()
        if self.last - t0 > 0.05:
            self.capture.postprocess_s += self.last - t0
        if self.stop and self.steps >= self.cfg.total_steps:
            raise ProfileComplete

    def start_profiler(self) -> None:
        """Start torch.profiler for the warm-up and active steps (the wait steps ran without it).

        Python stacks trace every call the compiler makes: a run still recompiling after its first
        step would spend minutes in dynamo under the tracer, so it is profiled in light mode."""
        full = not self.cfg.light
        # Recompiling in the last wait step (not just once early, as automatic dynamic shapes do).
        if full and any(c.is_recompile and 2 < c.step == self.steps for c in self.capture.compiles):
            full = False
            self.capture.light_reason = "still recompiling during the wait steps"
        self.capture.light = not full
        self.prof = make_profiler(
            light=not full,
            device=self.capture.device,
            schedule=torch.profiler.schedule(
                wait=0, warmup=self.cfg.warmup, active=self.cfg.active, repeat=1
            ),
            on_trace_ready=self.on_trace_ready,
        )
        self.prof.start()

    # -- compilations ---------------------------------------------------------------------------

    def hook_dynamo(self) -> None:
        """Watch dynamo once something imported it (importing it ourselves costs seconds)."""
        if self.dynamo_hooked or "torch._dynamo" not in sys.modules:
            return
        from torch._dynamo.callback import callback_handler
        from torch._dynamo.utils import guard_failures

        callback_handler.register_start_callback(self.on_compile_start)
        callback_handler.register_end_callback(self.on_compile_end)
        self.failures_before = {code: len(r) for code, r in guard_failures.items()}
        self.dynamo_hooked = True

    def unhook_dynamo(self) -> None:
        if not self.dynamo_hooked:
            return
        from torch._dynamo.callback import callback_handler
        from torch._dynamo.utils import guard_failures

        with contextlib.suppress(ValueError):
            callback_handler.remove_start_callback(self.on_compile_start)
        with contextlib.suppress(ValueError):
            callback_handler.remove_end_callback(self.on_compile_end)
        for code, reasons in list(guard_failures.items()):
            for reason in reasons[self.failures_before.get(code, 0) :]:
                where = f"{code.co_filename}:{code.co_firstlineno} ({code.co_name})"
                self.capture.guard_failures.append({"code": where, "reason": str(reason).split("\n")[0]})
        self.dynamo_hooked = False

    def on_compile_start(self, args: Any) -> None:
        cid = str(args.compile_id)
        self.compile_started[cid] = time.perf_counter()
        self.call_sites[cid] = innermost_user_frame(traceback.extract_stack(), self.capture.own_code_is_user)

    def on_compile_end(self, args: Any) -> None:
        cid = str(args.compile_id)
        start = self.compile_started.pop(cid, None)
        if start is None:
            return
        self.capture.compiles.append(
            CompileRecord(
                compile_id=cid,
                step=self.steps + 1,
                duration_s=time.perf_counter() - start,
                call_site=self.call_sites.pop(cid, None),
            )
        )


# ----------------------------------------------------------------------------- event extraction


def _kind(evt: Any) -> str:
    if evt.device_type != torch.autograd.DeviceType.CPU:
        return "kernel"
    name = evt.name
    if (
        name.startswith("ProfilerStep")
        or "#" in name
        and name.split("#")[0]
        in (
            "Optimizer.step",
            "Optimizer.zero_grad",
        )
    ):
        return "annotation"
    if name.startswith(("cuda", "cu")) and not name.startswith("cudnn"):
        return "runtime"
    if _FRAME.match(name) or name.startswith("<built-in") or name.startswith("nn.Module:"):
        return "python"
    if "::" in name:
        return "op"
    return "annotation"


def extract_events(prof: torch.profiler.profile, capture: Capture, search: Sequence[str]) -> None:
    """Normalize the profiler's function events into `capture.events` and its step windows."""
    raw = list(prof.events())
    index = {id(e): i for i, e in enumerate(raw)}
    cache: dict[str, str] = {}
    events = capture.events
    for e in raw:
        parent = getattr(e, "cpu_parent", None)
        kernels = tuple(k.name for k in getattr(e, "kernels", []) or [])
        kind = _kind(e)
        events.append(
            Event(
                # Python events are named by their frame: resolve its path like the stacks'.
                name=resolve_stack([e.name], cache, search)[0] if kind == "python" else e.name,
                start_us=float(e.time_range.start),
                end_us=float(e.time_range.end),
                thread=int(e.thread),
                device="cpu" if e.device_type == torch.autograd.DeviceType.CPU else "cuda",
                kind=kind,
                stack=resolve_stack(e.stack or (), cache, search),
                input_dtypes=tuple(str(d) for d in (getattr(e, "input_dtypes", None) or ())),
                input_shapes=tuple(e.input_shapes or ()),
                parent=index.get(id(parent), -1) if parent is not None else -1,
                kernels=kernels,
            )
        )
    steps = sorted((ev.start_us, ev.end_us) for ev in events if ev.name.startswith("ProfilerStep"))
    capture.step_windows_us = steps


# ----------------------------------------------------------------------------- the capture


def make_profiler(
    *,
    light: bool,
    device: str,
    schedule: Callable[[int], Any],
    on_trace_ready: Callable[[torch.profiler.profile], None] | None = None,
) -> torch.profiler.profile:
    """The profiler a capture runs: full (shapes, Python stacks kept on every op) or light."""
    from torch._C._profiler import _ExperimentalConfig

    full = not light
    return torch.profiler.profile(
        activities=_activities(device),
        schedule=schedule,
        on_trace_ready=on_trace_ready,
        record_shapes=full,
        with_stack=full,
        # verbose: keep each op's Python stack in the events (not only in the trace)
        experimental_config=_ExperimentalConfig(verbose=full, enable_cuda_sync_events=device == "cuda"),
    )


def _activities(device: str) -> list[torch.profiler.ProfilerActivity]:
    acts = [torch.profiler.ProfilerActivity.CPU]
    if device == "cuda":
        acts.append(torch.profiler.ProfilerActivity.CUDA)
    return acts


@contextlib.contextmanager
def capturing(
    cfg: CaptureConfig,
    capture: Capture,
    *,
    stop_when_done: bool,
    path_search: Callable[[], Sequence[str]] = lambda: sys.path,
) -> Iterator[_StepClock]:
    """Profile whatever runs inside: steps close at optimizer steps or `mark_step()`."""
    global _ACTIVE
    if _ACTIVE is not None:
        raise RecipeError("slipstream profile is already capturing in this process; profiles do not nest")

    def on_trace_ready(prof: torch.profiler.profile) -> None:
        if cfg.trace_path:
            Path(cfg.trace_path).parent.mkdir(parents=True, exist_ok=True)
            prof.export_chrome_trace(cfg.trace_path)
            capture.trace_path = cfg.trace_path
        extract_events(prof, capture, path_search())

    clock = _StepClock(cfg, capture, stop_when_done, on_trace_ready)
    from torch.optim.optimizer import register_optimizer_step_post_hook

    handle = register_optimizer_step_post_hook(clock.on_optimizer_step)
    _ACTIVE = clock
    clock.hook_dynamo()
    if cfg.wait == 0:
        clock.start_profiler()
    clock.last = time.perf_counter()
    try:
        yield clock
    finally:
        _ACTIVE = None
        handle.remove()
        try:
            if clock.prof is not None:
                t0 = time.perf_counter()
                clock.prof.stop()  # processes a cycle cut short by the end of the run
                capture.postprocess_s += time.perf_counter() - t0
        finally:
            clock.unhook_dynamo()


def _default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def capture_workload(
    workload: str = "gpt-stdlib",
    recipe: Any = "baseline",
    *,
    size: str = "tiny",
    config: CaptureConfig | None = None,
) -> Capture:
    """Profile slipstream's built-in loop for `config.total_steps` steps."""
    from ..presets import resolve_recipe
    from ..session import resolve_device
    from ..train import train

    cfg = config or CaptureConfig()
    rec = resolve_recipe(recipe)
    device = resolve_device(rec.runtime.device).type
    pays, verdict = bf16_verdict(device)
    capture = Capture(
        config=cfg,
        source={"workload": workload, "size": size, "recipe": rec.name},
        device=device,
        bf16_pays=pays,
        bf16_verdict=verdict,
        own_code_is_user=True,
    )
    with capturing(cfg, capture, stop_when_done=False):
        result = train(workload, rec, cfg.total_steps, size=size, progress=False, eval_every=0)
    capture.metrics = result.metrics.to_dict()
    capture.metrics["precision"] = result.metrics.precision
    capture.source["recipe_fields"] = result.recipe
    return capture


def _script_command(command: Sequence[str]) -> tuple[str, str, list[str]]:
    """`python x.py a b`, `x.py a b` or `python -m pkg.mod a` -> (kind, target, argv)."""
    cmd = list(command)
    if cmd and (Path(cmd[0]).name.startswith("python") or cmd[0] == sys.executable):
        cmd = cmd[1:]
    if not cmd:
        raise RecipeError("profile needs a command after `--`, e.g. `-- python train.py --epochs 1`")
    if cmd[0] == "-m":
        if len(cmd) < 2:
            raise RecipeError("`-- python -m` needs a module name")
        return "module", cmd[1], [cmd[1], *cmd[2:]]
    if cmd[0].startswith("-"):
        raise RecipeError(f"python option {cmd[0]!r} is not supported; run `-- python script.py args`")
    path = Path(cmd[0])
    if not path.is_file():
        raise RecipeError(f"script {cmd[0]!r} not found; pass `-- python path/to/script.py args`")
    return "script", str(path.resolve()), [str(path), *cmd[1:]]


def _forget_modules_from(folder: Path, keep: set[str]) -> None:
    """Unload the modules the script imported from its own folder, as a separate process would."""
    for name in set(sys.modules) - keep:
        file = getattr(sys.modules.get(name), "__file__", None)
        if file and Path(file).resolve().is_relative_to(folder.resolve()):
            del sys.modules[name]


def capture_script(command: Sequence[str], *, config: CaptureConfig | None = None) -> Capture:
    """Run `python script.py args` (or `python -m module args`) in this process under the profiler."""
    cfg = config or CaptureConfig()
    kind, target, argv = _script_command(command)
    device = _default_device()
    pays, verdict = bf16_verdict(device)
    capture = Capture(
        config=cfg,
        source={kind: target, "argv": argv},
        device=device,
        bf16_pays=pays,
        bf16_verdict=verdict,
    )
    saved_argv, saved_path, saved_modules = sys.argv[:], sys.path[:], set(sys.modules)
    sys.argv = argv
    if kind == "script":
        sys.path.insert(0, str(Path(target).parent))
    else:
        sys.path.insert(0, os.getcwd())
    search = sys.path[:]
    try:
        with capturing(cfg, capture, stop_when_done=cfg.stop_when_done, path_search=lambda: search):
            try:
                if kind == "script":
                    runpy.run_path(target, run_name="__main__")
                else:
                    runpy.run_module(target, run_name="__main__", alter_sys=True)
            except ProfileComplete:
                capture.script_exit = "stopped"
            except SystemExit as exc:
                if exc.code not in (0, None):
                    capture.script_exit = f"exit status {exc.code}"
    finally:
        sys.argv, sys.path[:] = saved_argv, saved_path
        if kind == "script":
            _forget_modules_from(Path(target).parent, saved_modules)
    if not capture.step_windows_us:
        raise RecipeError(
            f"the script made {len(capture.step_times_s)} step(s), too few to reach the profiler's active "
            f"steps (wait {cfg.wait} + warm-up {cfg.warmup} + active {cfg.active}); lower --wait/--warmup, "
            "or call slipstream.mark_step() once per step if the loop has no torch.optim optimizer"
        )
    return capture
