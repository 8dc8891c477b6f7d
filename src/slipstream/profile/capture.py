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

import os
import runpy
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from ..recipe import RecipeError
from .records import Capture, CaptureConfig
from .steps import ProfileComplete, bf16_verdict, capturing

# ----------------------------------------------------------------------------- event extraction


# ----------------------------------------------------------------------------- the capture


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
    from ..runtime import resolve_device
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
