import json

import pytest

from slipstream.cli import build_parser, main


@pytest.mark.parametrize(
    "command",
    [
        "train",
        "bench",
        "doctor",
        "data",
        "recipe",
        "profile",
        "tune",
        "lr-find",
        "serve",
        "loadtest",
        "quantize-eval",
    ],
)
def test_every_command_has_help_with_examples(command, capsys):
    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args([command, "--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert "examples:" in out and f"slipstream {command}" in out


def test_train_json_has_the_documented_fields(tmp_path):
    out = tmp_path / "o.json"
    code = main(
        ["train", "--recipe", "baseline+shapes.max_len=64+shapes.tokens_per_batch=256", "--steps", "3"]
        + ["--eval-every", "0", "--no-progress", "--json", str(out)]
    )
    assert code == 0
    data = json.loads(out.read_text())
    for key in ["loss", "real_tokens", "padded_tokens", "padding_waste", "real_tokens_per_s", "step_time_s"]:
        assert key in data
    assert "peak_memory_bytes" in data and len(data["loss"]) == 3


def test_doctor_reports_devices(tmp_path, capsys, monkeypatch):
    # A real probe of this host into a fresh cache: structure only (tests/test_machine.py feeds
    # figures in to check the verdicts; this host's speed decides nothing asserted here).
    monkeypatch.setenv("SLIPSTREAM_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "d.json"
    assert main(["doctor", "--no-compile", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["torch"] and report["probe"]["matmul_flops_per_s"]["fp32"]
    assert set(report["dtypes"]) == {"fp32", "bf16", "fp16"} and "triton" in report["checks"]
    assert report["decisions"]["precision.dtype"]["choice"] in ("fp32", "bf16", "fp16")


def test_data_prints_percentiles_and_waste(tmp_path, capsys):
    out = tmp_path / "c.json"
    assert main(["data", "--max-len", "256", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["splits"]["train"]["documents"] > 1000
    assert 0.05 < data["padding_waste"]["pad_max"] < 0.9


def test_recipe_save_and_fields(tmp_path, capsys):
    path = tmp_path / "r.toml"
    assert main(["recipe", "baseline+precision.dtype=bf16", "--save", str(path)]) == 0
    assert 'dtype = "bf16"' in path.read_text()
    assert main(["recipe", "--fields"]) == 0
    assert "shapes.max_len" in capsys.readouterr().out
