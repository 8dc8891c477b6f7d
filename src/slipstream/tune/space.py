"""Search spaces: `--param` specs, their Optuna distributions, and applying a trial to a recipe.

lr=1e-4:1e-2:log            float on a log scale (lr is short for optimizer.lr)
warmup=0:100                integer, because optimizer.warmup_steps is an int field
optimizer.weight_decay=0:0.1
optimizer.schedule=cosine,linear,one-cycle     a categorical choice
shapes.max_len=128:1024:int:log               flags: log, int (forced integer)
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any

from ..recipe import Recipe, RecipeError, describe_fields, recipe_from_dict

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

ALIASES = {
    "lr": "optimizer.lr",
    "warmup": "optimizer.warmup_steps",
    "warmup_steps": "optimizer.warmup_steps",
    "wd": "optimizer.weight_decay",
    "weight_decay": "optimizer.weight_decay",
    "schedule": "optimizer.schedule",
    "final_lr_ratio": "optimizer.final_lr_ratio",
    "grad_clip": "optimizer.grad_clip",
}


@dataclass(frozen=True)
class ParamSpec:
    """One searched parameter: a numeric range (float or int, linear or log) or a list of choices."""

    name: str
    """Recipe field path (section.field), or a free name for objectives that are not recipes."""
    low: float | None = None
    high: float | None = None
    log: bool = False
    integer: bool = False
    choices: tuple[Any, ...] | None = None

    @property
    def numeric(self) -> bool:
        return self.choices is None

    def distribution(self) -> Any:
        from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution

        if self.choices is not None:
            return CategoricalDistribution(self.choices)
        if self.integer:
            return IntDistribution(int(self.low), int(self.high), log=self.log)  # type: ignore[arg-type]
        return FloatDistribution(float(self.low), float(self.high), log=self.log)  # type: ignore[arg-type]

    def suggest(self, trial: Any) -> Any:
        if self.choices is not None:
            return trial.suggest_categorical(self.name, self.choices)
        if self.integer:
            return trial.suggest_int(self.name, int(self.low), int(self.high), log=self.log)  # type: ignore[arg-type]
        return trial.suggest_float(self.name, self.low, self.high, log=self.log)

    def describe(self) -> str:
        if self.choices is not None:
            return f"{self.name} in {{{', '.join(map(str, self.choices))}}}"
        kind = ("log " if self.log else "") + ("int" if self.integer else "float")
        return f"{self.name} in [{self.low:g}, {self.high:g}] ({kind})"


def _scalar(text: str) -> Any:
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def _recipe_fields() -> dict[str, str]:
    return {path: tp for path, tp, _default, _doc in describe_fields()}


def parse_param(spec: str, *, recipe_fields: bool = True) -> ParamSpec:
    """Parse one `--param` spec (see the module docstring); errors name the spec and the fix."""
    if "=" not in spec:
        raise RecipeError(f"--param {spec!r} must look like NAME=LOW:HIGH[:log][:int] or NAME=A,B,C")
    name, body = (s.strip() for s in spec.split("=", 1))
    name = ALIASES.get(name, name)
    field_type = None
    if recipe_fields:
        known = _recipe_fields()
        if name not in known:
            raise RecipeError(
                f"--param {spec!r}: {name!r} is not a recipe field; use section.field "
                f"(see `slipstream recipe --fields`) or one of {', '.join(sorted(ALIASES))}"
            )
        field_type = known[name]
    if ":" not in body:
        choices = tuple(_scalar(c.strip()) for c in body.split(",") if c.strip())
        if len(choices) < 2:
            raise RecipeError(f"--param {spec!r}: give a range LOW:HIGH or at least two choices A,B")
        return ParamSpec(name, choices=choices)
    parts = [p.strip() for p in body.split(":")]
    flags = set(parts[2:])
    unknown = flags - {"log", "int"}
    if unknown:
        raise RecipeError(
            f"--param {spec!r}: unknown flag(s) {', '.join(sorted(unknown))}; use log and/or int"
        )
    try:
        low, high = float(parts[0]), float(parts[1])
    except ValueError as err:
        raise RecipeError(f"--param {spec!r}: LOW and HIGH must be numbers") from err
    if not low < high:
        raise RecipeError(f"--param {spec!r}: LOW must be below HIGH")
    integer = "int" in flags or field_type == "int"
    if field_type is not None and field_type not in ("int", "float"):
        raise RecipeError(f"--param {spec!r}: {name} is a {field_type} field; list its choices as A,B,C")
    if integer and (low != int(low) or high != int(high)):
        raise RecipeError(f"--param {spec!r}: {name} is an integer; give whole-number bounds")
    if "log" in flags and low <= 0:
        raise RecipeError(f"--param {spec!r}: a log scale needs LOW > 0")
    return ParamSpec(name, low=low, high=high, log="log" in flags, integer=integer)


def apply_params(recipe: Recipe, params: dict[str, Any], name: str | None = None) -> Recipe:
    """A copy of `recipe` with `section.field` params set (validated like any recipe)."""
    data = recipe.to_dict()
    for path, value in params.items():
        section, _, fname = path.partition(".")
        if section not in data or not isinstance(data[section], dict) or fname not in data[section]:
            raise RecipeError(f"{path!r} is not a recipe field")
        data[section][fname] = value
    if name is not None:
        data["name"] = name
    return recipe_from_dict(data)


def base_params(recipe: Recipe, space: list[ParamSpec]) -> dict[str, Any] | None:
    """The recipe's own values of the searched fields, or None when one lies outside its range."""
    data = recipe.to_dict()
    out = {}
    for p in space:
        section, _, fname = p.name.partition(".")
        value = data[section][fname]
        if p.choices is not None:
            if value not in p.choices:
                return None
        elif not p.low <= value <= p.high:  # type: ignore[operator]
            return None
        out[p.name] = value
    return out


__all__ = ["ALIASES", "ParamSpec", "apply_params", "base_params", "parse_param"]
