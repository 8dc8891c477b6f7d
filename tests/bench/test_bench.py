"""slipstream bench: schema, fairness of the token budget, parity verdicts, report rendering."""

import json
from pathlib import Path

import jsonschema
import pytest

from slipstream.bench import run_bench
from slipstream.bench.report import markdown, write_html
from slipstream.cli import main
from slipstream.recipe import RecipeError

SCHEMA = json.loads((Path(__file__).resolve().parents[2] / "docs" / "bench.schema.json").read_text())
SMALL = "+shapes.max_len=512+shapes.tokens_per_batch=1024"


@pytest.fixture(scope="module")
def result():
    return run_bench(
        "gpt-stdlib",
        ["baseline" + SMALL, "pad-batch" + SMALL, "baseline" + SMALL + "+optimizer.lr=10.0"],
        size="tiny",
        rounds=2,
        round_tokens=600,
        warmup_steps=1,
        val_batches=2,
        peers=["accelerate"],
        memory="skip",
    ).to_dict()


def test_json_validates_against_the_documented_schema(result):
    jsonschema.validate(result, SCHEMA)
    broken = dict(result, contenders=[dict(result["contenders"][0], parity="maybe")])
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(broken, SCHEMA)


def test_every_contender_gets_the_same_real_token_budget(result):
    for c in result["contenders"]:
        assert len(c["round_tokens_per_s"]) == 2
        # each round runs until 600 real tokens: at most one batch (1024 positions) over
        assert 2 * 600 <= c["real_tokens"] < 2 * (600 + 1024)


def test_padding_and_parity_are_measured(result):
    base, pad_batch, diverged, acc = result["contenders"]
    assert base["parity"] == "reference" and base["speedup"] == pytest.approx(1.0)
    assert pad_batch["padding_waste"] < base["padding_waste"]
    assert pad_batch["distinct_shapes"] > 1 and base["distinct_shapes"] == 1
    assert diverged["parity"] == "fail" and diverged["parity_gap"] > 0.05  # lr=10 wrecks the loss
    assert acc["kind"] == "peer" and acc["real_tokens_per_s"] > 0


def test_reports_render(result, tmp_path):
    path = write_html(result, tmp_path / "r.html")
    page = path.read_text()
    assert page.count("data:image/png;base64,") == 4 and "pad-batch" in page
    assert "| baseline" in markdown(result)


def test_bad_recipe_fails_before_any_work():
    with pytest.raises(RecipeError, match="unknown preset"):
        run_bench("gpt-stdlib", ["baseline", "nope"], rounds=1)
    with pytest.raises(RecipeError, match="unknown peer"):
        run_bench(
            "gpt-stdlib", ["baseline" + SMALL], rounds=1, round_tokens=100, peers=["nope"], memory="skip"
        )


def test_cli_bench_writes_json_and_report(tmp_path):
    out, rep = tmp_path / "b.json", tmp_path / "b.html"
    code = main(
        [
            "bench",
            "--recipes",
            "baseline" + SMALL,
            "--rounds",
            "1",
            "--round-tokens",
            "300",
            "--warmup-steps",
            "1",
        ]
        + ["--no-memory", "--json", str(out), "--report", str(rep)]
    )
    assert code == 0 and rep.exists() and rep.with_suffix(".md").exists()
    jsonschema.validate(json.loads(out.read_text()), SCHEMA)
