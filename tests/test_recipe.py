import json

import pytest

from slipstream import Recipe, RecipeError, get_preset, load_recipe, resolve_recipe, save_recipe
from slipstream.recipe import PrecisionConfig, ShapesConfig, describe_fields, recipe_from_dict


def test_baseline_is_the_naive_pipeline():
    r = get_preset("baseline")
    assert (r.shapes.mode, r.precision.dtype, r.compile.mode) == ("pad_max", "fp32", "off")


def test_bad_literal_names_field_and_choices():
    with pytest.raises(RecipeError, match=r"precision.dtype='fp64'.*'fp32'.*'bf16'"):
        Recipe(precision=PrecisionConfig(dtype="fp64"))


def test_out_of_range_names_field():
    with pytest.raises(RecipeError, match=r"shapes.max_len=0 is out of range"):
        Recipe(shapes=ShapesConfig(max_len=0))


def test_wrong_type_is_rejected():
    with pytest.raises(RecipeError, match=r"shapes.max_len='big' must be an integer"):
        recipe_from_dict({"shapes": {"max_len": "big"}})


def test_unknown_section_and_field_are_named():
    with pytest.raises(RecipeError, match="unknown recipe section 'shape'"):
        recipe_from_dict({"shape": {}})
    with pytest.raises(RecipeError, match=r"unknown field shapes.maxlen; fields of shapes: .*max_len"):
        recipe_from_dict({"shapes": {"maxlen": 3}})


def test_override_parses_values_and_keeps_rest():
    r = get_preset("baseline").override("precision.dtype=bf16", "shapes.max_len=512", "optimizer.lr=3e-4")
    assert r.precision.dtype == "bf16" and r.shapes.max_len == 512 and r.optimizer.lr == pytest.approx(3e-4)
    assert r.shapes.mode == "pad_max"
    with pytest.raises(RecipeError, match="must look like section.field=value"):
        r.override("precision.dtype")
    with pytest.raises(RecipeError, match="unknown field precision.dtyp"):
        r.override("precision.dtyp=bf16")


def test_spec_with_overrides_and_unknown_preset():
    r = resolve_recipe("baseline+precision.dtype=bf16+shapes.max_len=256")
    assert r.name == "baseline+precision.dtype=bf16+shapes.max_len=256"
    assert (r.precision.dtype, r.shapes.max_len) == ("bf16", 256)
    with pytest.raises(RecipeError, match="unknown preset 'fastest'; available: .*baseline"):
        resolve_recipe("fastest")


@pytest.mark.parametrize("suffix", [".toml", ".json"])
def test_save_load_round_trip(tmp_path, suffix):
    r = get_preset("baseline").override("precision.dtype=bf16", "optimizer.betas=[0.8, 0.9]")
    path = save_recipe(r, tmp_path / f"r{suffix}")
    back = load_recipe(path)
    assert back == r
    assert back.optimizer.betas == (0.8, 0.9)


def test_corrupt_recipe_file_is_a_clear_error(tmp_path):
    p = tmp_path / "bad.json"
    p.write_text("{not json")
    with pytest.raises(RecipeError, match="not valid JSON"):
        load_recipe(p)
    with pytest.raises(RecipeError, match="does not exist"):
        load_recipe(tmp_path / "missing.toml")


def test_every_field_has_a_docstring():
    rows = describe_fields()
    assert len(rows) >= 10
    missing = [path for path, _, _, doc in rows if not doc]
    assert missing == []


def test_to_dict_is_json_serialisable():
    json.dumps(get_preset("baseline").to_dict())


def test_a_float_or_absurd_max_len_is_refused_naming_the_field():
    # issue 25: shapes.max_len=1e23 was reported accepted; 10**23 written out was, and crashed in
    # the model's position table allocation
    with pytest.raises(RecipeError, match=r"shapes.max_len=1e\+23 must be an integer \(write it without"):
        Recipe().override("shapes.max_len=1e23")
    with pytest.raises(
        RecipeError,
        match=r"shapes.max_len=100000000000000000000000 is out of range; use a value between 2 and 16777216",
    ):
        Recipe().override("shapes.max_len=100000000000000000000000")
    with pytest.raises(RecipeError, match=r"shapes.tokens_per_batch=\d+ is out of range"):
        Recipe().override(f"shapes.tokens_per_batch={10**30}")
    with pytest.raises(
        RecipeError, match=r"optimizer.warmup_steps=\d+ is out of range; use a value below 2\*\*63"
    ):
        Recipe().override(f"optimizer.warmup_steps={10**30}")
    assert Recipe().override("shapes.max_len=16777216").shapes.max_len == 2**24


def test_prepare_loader_arguments_are_checked_as_the_recipe_fields_they_override():
    from slipstream import Session

    with pytest.raises(RecipeError, match=r"shapes.max_len=1e\+23 must be an integer"):
        Session(Recipe()).prepare_loader([[1, 2, 3]], max_len=1e23)
    with pytest.raises(RecipeError, match=r"shapes.tokens_per_batch=0 is out of range"):
        Session(Recipe()).prepare_loader([[1, 2, 3]], tokens_per_batch=0)
