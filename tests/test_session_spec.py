"""Session(recipe) takes what `--recipe` takes: a Recipe, a preset name, a file or a spec."""

from __future__ import annotations

import pytest

import slipstream
from slipstream.presets import get_preset
from slipstream.recipe import RecipeError


def test_preset_name_and_spec_strings_resolve_like_the_cli():
    assert slipstream.Session("bf16").recipe == get_preset("bf16")
    s = slipstream.Session("baseline+shapes.mode=bucket+shapes.max_len=128")
    assert (s.recipe.shapes.mode, s.recipe.shapes.max_len) == ("bucket", 128)
    assert s.recipe.precision == get_preset("baseline").precision


def test_recipe_file_path_resolves(tmp_path):
    from slipstream.recipe import save_recipe

    path = tmp_path / "mine.toml"
    save_recipe(get_preset("baseline").override("shapes.max_len=64"), path)
    assert slipstream.Session(path).recipe.shapes.max_len == 64
    assert slipstream.Session(str(path)).recipe.shapes.max_len == 64


def test_bad_specs_and_types_say_what_to_pass():
    with pytest.raises(RecipeError, match="unknown preset 'no-such'"):
        slipstream.Session("no-such")
    with pytest.raises(TypeError, match=r"a Recipe, a preset name .* file path .* spec, not int 3"):
        slipstream.Session(3)  # type: ignore[arg-type]
