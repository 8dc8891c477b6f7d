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


def test_cli_bench_writes_json_and_report(tmp_path, capsys):
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
    # not a terminal: plain time-stamped progress lines, one per contender and round
    err = capsys.readouterr().err
    assert "[bench" in err and f"round 1/1 baseline{SMALL}:" in err and "real tok/s" in err


def test_a_custom_contender_runs_beside_the_recipes():
    from slipstream.bench.runner import RecipeContender, custom_factory

    built = []

    class Counted(RecipeContender):
        def __init__(self, *args, **kwargs):
            built.append(kwargs["real_tokens_per_step"])
            super().__init__(*args, **kwargs)

    res = run_bench(
        "gpt-stdlib",
        ["baseline" + SMALL, "mine@pad-batch" + SMALL],
        size="tiny", rounds=1, round_tokens=300, warmup_steps=1, val_batches=1, memory="skip",
        noise_seeds=0, custom={"mine@pad-batch" + SMALL: custom_factory(Counted)},
    )  # fmt: skip
    mine = res.contenders[1]
    assert mine.name == "mine@pad-batch" + SMALL and mine.info["recipe"]["shapes"]["mode"] == "pad_batch"
    assert built == [res.method["real_tokens_per_step"]]


def test_parity_is_judged_against_the_null_band_measured_in_the_run(result):
    from slipstream.parity import judge_parity, noise_band, null_band

    m = result["method"]
    vals = m["parity_noise_val_losses"]
    assert len(vals) == 3  # the reference and two re-runs with another order inside each window
    assert m["parity_design"] == "paired"
    assert m["parity_noise_band"] == pytest.approx(noise_band(vals))
    assert m["parity_tolerance"] == pytest.approx(null_band(vals[0], vals[1:], m["parity_floor"]).threshold)
    assert noise_band([3.0, 3.06, 2.94]) == pytest.approx(0.04)
    assert judge_parity(3.05, 3.0, 0.02, 0.002)[0] == "pass"
    assert judge_parity(3.07, 3.0, 0.02, 0.002)[0] == "fail"
    assert judge_parity(float("nan"), 3.0, 0.02, 0.002)[0] == "fail"
    assert judge_parity(3.001, 3.0, 0.0, 0.002)[0] == "pass"  # the floor when seeds land together


def test_every_contender_trains_on_the_references_real_tokens_per_step():
    from slipstream.bench.contenders import real_tokens_per_step
    from slipstream.bench.runner import RecipeContender
    from slipstream.workloads import get_workload

    data = get_workload("gpt-stdlib").load_data()
    spec = "baseline+shapes.max_len=256+shapes.tokens_per_batch=2048"
    ref = RecipeContender(spec, "gpt-stdlib", "tiny", data, 1, __import__("slipstream").resolve_recipe(spec))
    target = real_tokens_per_step(ref.loader)
    pack_spec = "pack+shapes.max_len=256+shapes.tokens_per_batch=2048"
    unmatched = RecipeContender(pack_spec, "gpt-stdlib", "tiny", data, 1, ref.recipe)
    matched = RecipeContender(
        pack_spec, "gpt-stdlib", "tiny", data, 1, ref.recipe, real_tokens_per_step=target
    )
    assert real_tokens_per_step(unmatched.loader) > 1.1 * target  # packing fills rows: fuller steps
    assert real_tokens_per_step(matched.loader) == pytest.approx(target, rel=0.05)


def test_a_dtype_the_probe_measured_far_slower_is_skipped_with_the_figures(machine_like):
    machine_like(bf16=0.0133)  # an AVX2-only CPU: bf16 0.8 vs fp32 60 GFLOP/s
    res = run_bench(
        "gpt-stdlib",
        ["baseline" + SMALL, "bf16" + SMALL],
        size="tiny",
        rounds=1,
        round_tokens=300,
        warmup_steps=1,
        val_batches=1,
        memory="skip",
        noise_seeds=0,
    )
    assert [c.name for c in res.contenders] == ["baseline" + SMALL]
    why = res.skipped["bf16" + SMALL]
    assert "GFLOP/s" in why and "--all-dtypes" in why


def test_a_contender_that_fails_is_dropped_with_the_error_when_tolerated():
    broken = "baseline" + SMALL + "+compile.cudagraphs=true"  # CUDA graphs on a CPU: refused at build
    res = run_bench(
        "gpt-stdlib", ["baseline" + SMALL, broken], size="tiny", rounds=1, round_tokens=300,
        warmup_steps=1, val_batches=1, memory="skip", noise_seeds=0, tolerate_failures=True,
    )  # fmt: skip
    assert [c.name for c in res.contenders] == ["baseline" + SMALL]
    assert res.skipped[broken].startswith("failed to build: RecipeError: compile.cudagraphs=true needs CUDA")
    with pytest.raises(RecipeError, match="needs CUDA"):
        run_bench("gpt-stdlib", ["baseline" + SMALL, broken], size="tiny", rounds=1, round_tokens=300,
                  memory="skip", noise_seeds=0)  # fmt: skip


def test_a_contender_that_crashes_mid_run_is_dropped_and_the_rest_finish():
    from slipstream.bench.runner import RecipeContender, custom_factory

    class RunsOutOfMemory(RecipeContender):
        def train_step(self, batch):
            raise RuntimeError("DefaultCPUAllocator: not enough memory: you tried to allocate 8 GB")

    res = run_bench(
        "gpt-stdlib", ["baseline" + SMALL, "oom@pad-batch" + SMALL], size="tiny", rounds=2,
        round_tokens=300, warmup_steps=1, val_batches=1, memory="skip", noise_seeds=0,
        tolerate_failures=True, custom={"oom@pad-batch" + SMALL: custom_factory(RunsOutOfMemory)},
    )  # fmt: skip
    assert [c.name for c in res.contenders] == ["baseline" + SMALL]
    assert (
        "failed while training: RuntimeError: DefaultCPUAllocator: not enough memory"
        in res.skipped["oom@pad-batch" + SMALL]
    )


def test_mfu_counts_the_models_own_flops_formula():
    from torch import nn

    from slipstream.bench.mfu import model_flops_per_token
    from slipstream.workloads.gpt import build_gpt

    gpt = build_gpt("tiny", max_len=64)
    assert model_flops_per_token(gpt, 64) == gpt.flops_per_token(64)
    assert model_flops_per_token(gpt, 64) > 6 * (gpt.num_parameters() - gpt.wpe.weight.numel())
    plain = nn.Linear(4, 3)
    assert model_flops_per_token(plain, 64) == 6 * 15
    assert model_flops_per_token(None, 64) == 0.0
