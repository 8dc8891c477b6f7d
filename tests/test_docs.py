"""Docs cannot drift from the code: every recipe field and every command is documented."""

from pathlib import Path

from slipstream.cli import build_parser
from slipstream.recipe import describe_fields

DOCS = Path(__file__).resolve().parents[1] / "docs"


def test_every_recipe_field_is_in_recipe_md():
    text = (DOCS / "recipe.md").read_text()
    missing = [path for path, *_ in describe_fields() if f"`{path}`" not in text]
    assert missing == [], "regenerate: slipstream recipe --fields --markdown (see docs/recipe.md)"


def test_every_command_is_in_cli_md():
    text = (DOCS / "cli.md").read_text()
    commands = build_parser()._subparsers._group_actions[0].choices
    assert [c for c in commands if f"`slipstream {c}`" not in text] == []
