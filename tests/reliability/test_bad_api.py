"""The bad-input catalogue, Python API: `Session`, `train`, `Recipe.override`, `load_recipe`,
`save_recipe`. Each bad call raises the library's own error (RecipeError, CheckpointError) or a
TypeError whose one-line message names the fix; never an IsADirectoryError, UnicodeDecodeError,
KeyError or ZeroDivisionError from deep inside, and never a silently accepted value."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from _bad_input import FAST, assert_unchanged, snapshot

import slipstream
from slipstream import Recipe, RecipeError, Session, load_recipe, save_recipe
from slipstream.checkpoint import CheckpointError


@dataclass(frozen=True)
class ApiCase:
    id: str
    call: Callable[[Path], Any]
    """Called with the folder of bad files."""
    error: type[Exception]
    needles: tuple[str, ...]
    keep: tuple[str, ...] = ()


def _train(**kw):
    return slipstream.train("gpt-stdlib", kw.pop("recipe", FAST), kw.pop("steps", 2), progress=False, **kw)


API_CASES = [
    ApiCase(
        "session-unknown-preset", lambda b: Session("nosuch"), RecipeError, ("unknown preset", "available")
    ),
    ApiCase("session-empty-spec", lambda b: Session(""), RecipeError, ("names no preset or file",)),
    ApiCase("session-folder", lambda b: Session(str(b / "empty_dir")), RecipeError, ("is a folder",)),
    ApiCase("session-not-a-recipe", lambda b: Session(42), TypeError, ("takes a Recipe", "not int 42")),
    ApiCase(
        "session-malformed-file", lambda b: Session(b / "malformed.toml"), RecipeError, ("not valid TOML",)
    ),
    ApiCase(
        "override-without-equals",
        lambda b: Recipe().override("shapes.max_len"),
        RecipeError,
        ("section.field=value",),
    ),
    ApiCase(
        "override-not-a-string",
        lambda b: Recipe().override(5),
        RecipeError,
        ("must be a 'section.field=value' string",),
    ),
    ApiCase("override-nan", lambda b: Recipe().override("optimizer.lr=nan"), RecipeError, ("finite number",)),
    ApiCase(
        "override-out-of-range",
        lambda b: Recipe().override("shapes.max_len=1"),
        RecipeError,
        ("between 2 and",),
    ),
    ApiCase(
        "override-unknown-field",
        lambda b: Recipe().override("shapes.maxlen=64"),
        RecipeError,
        ("unknown field shapes.maxlen", "max_len"),
    ),
    ApiCase(
        "recipe-section-as-dict",
        lambda b: Recipe(shapes={"max_len": 64}),
        RecipeError,
        ("shapes must be a ShapesConfig",),
    ),
    ApiCase("load-folder", lambda b: load_recipe(b / "empty_dir"), RecipeError, ("is a folder",)),
    ApiCase("load-binary", lambda b: load_recipe(b / "binary.toml"), RecipeError, ("not valid TOML",)),
    ApiCase("load-deep-json", lambda b: load_recipe(b / "deep.json"), RecipeError, ("nesting too deep",)),
    ApiCase(
        "load-yaml", lambda b: load_recipe(b / "recipe.yaml"), RecipeError, ("must end in .toml or .json",)
    ),
    ApiCase(
        "save-bad-suffix-keeps-file",
        lambda b: save_recipe(Recipe(), b / "recipe.yaml"),
        RecipeError,
        ("must end in .toml or .json",),
        keep=("recipe.yaml",),
    ),
    ApiCase(
        "train-unknown-workload",
        lambda b: slipstream.train("nosuch", FAST, 2),
        RecipeError,
        ("unknown workload",),
    ),
    ApiCase("train-recipe-not-a-recipe", lambda b: _train(recipe=5), TypeError, ("a recipe is a Recipe",)),
    ApiCase("train-steps-0", lambda b: _train(steps=0), RecipeError, ("at least 1",)),
    ApiCase(
        "train-eval-batches-0",
        lambda b: _train(eval_every=1, eval_batches=0),
        RecipeError,
        ("eval_batches=0",),
    ),
    ApiCase(
        "train-export-onto-a-file",
        lambda b: _train(eval_every=0, export_dir=b / "a_file"),
        RecipeError,
        ("not an earlier export",),
        keep=("a_file",),
    ),
    ApiCase(
        "loader-max-len-0",
        lambda b: Session(Recipe()).prepare_loader([[1, 2, 3]], max_len=0),
        RecipeError,
        ("max_len=0", "between 2 and"),
    ),
    ApiCase(
        "loader-no-data", lambda b: Session(Recipe()).prepare_loader([]), RecipeError, ("dataset is empty",)
    ),
    ApiCase(
        "loader-float-ids",
        lambda b: Session(Recipe()).prepare_loader([[1.5, 2.0]]),
        RecipeError,
        ("token ids must be integers",),
    ),
    ApiCase(
        "prepare-model-not-a-module",
        lambda b: Session(Recipe()).prepare_model("gpt"),
        TypeError,
        ("torch.nn.Module", "not str"),
    ),
    ApiCase(
        "load-state-dict-junk",
        lambda b: Session(Recipe()).load_state_dict({"x": 1}),
        CheckpointError,
        ("Session.state_dict()",),
    ),
]


@pytest.mark.parametrize("case", API_CASES, ids=[c.id for c in API_CASES])
def test_bad_api_call_raises_one_line_naming_the_fix(case, bad, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    before = snapshot([bad / k for k in case.keep])
    with pytest.raises(Exception) as info:
        case.call(bad)
    assert type(info.value) is case.error or isinstance(info.value, case.error), repr(info.value)
    message = str(info.value)
    assert "\n" not in message.strip(), message
    for needle in case.needles:
        assert needle in message, f"{needle!r} not in {message!r}"
    assert_unchanged(before)
    assert not list(tmp_path.iterdir()), "wrote into the working folder"
