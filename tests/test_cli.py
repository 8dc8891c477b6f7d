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


def _entry_points():
    from slipstream.profile.cli import main as profile_main
    from slipstream.serve.cli import main as serve_main
    from slipstream.tune.cli import main as tune_main

    return [
        ("slipstream", main, ["bench"], "bench"),
        ("serve.cli", serve_main, ["quantize-eval"], "quantize-eval"),
        ("tune.cli", tune_main, ["lr-find"], "lr-find"),
        ("profile.cli", profile_main, [], "profile"),
    ]


@pytest.mark.parametrize("entry", range(4), ids=[e[0] for e in _entry_points()])
def test_every_entry_point_refuses_an_unwritable_output_before_any_work(entry, tmp_path, capsys):
    """`python -m slipstream.{serve,tune,profile}.cli` run commands as `slipstream` does: the same
    checks and one line on stderr, exit 2, not a traceback at the end of a long run."""
    _, entry_main, argv, name = _entry_points()[entry]
    assert entry_main([*argv, "--json", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert (
        err
        == f"slipstream {name}: error: --json {tmp_path} is a folder; give a file path such as {tmp_path / 'out.json'}"
    )


def test_interrupt_and_refused_path_exits(monkeypatch, capsys):
    import slipstream.tune.cli as tune_cli

    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(tune_cli, "cmd_tune", interrupted)
    assert tune_cli.main(["tune", "--objective", "quadratic"]) == 130
    assert capsys.readouterr().err.strip() == (
        "slipstream tune: interrupted (the study keeps its trials; run again to resume)"
    )

    def refused(args):
        raise PermissionError(13, "Permission denied", "/ro/study.db")

    monkeypatch.setattr(tune_cli, "cmd_tune", refused)
    assert tune_cli.main(["tune", "--objective", "quadratic"]) == 2
    assert (
        "slipstream tune: error: /ro/study.db: Permission denied; check the path" in capsys.readouterr().err
    )

    def bug(args):
        raise OSError("no file involved")

    monkeypatch.setattr(tune_cli, "cmd_tune", bug)
    with pytest.raises(OSError, match="no file involved"):  # a bug keeps its traceback
        tune_cli.main(["tune", "--objective", "quadratic"])
