"""`tune` and `lr-find` commands: JSON schema, the written recipe, resume, one-line errors."""

import argparse
import json

from slipstream.recipe import load_recipe
from slipstream.tune.cli import add_parser, main

SMALL = ["--recipe", "baseline+shapes.max_len=64+shapes.tokens_per_batch=256"]


def test_commands_register_with_description_and_examples():
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="command")
    add_parser(sub)
    for name in ("tune", "lr-find"):
        p = sub.choices[name]
        assert p.description and "examples:" in p.epilog
        args = parser.parse_args([name])
        assert callable(args.fn)


def test_tune_workload_writes_json_and_a_ready_recipe(tmp_path, capsys):
    out = tmp_path / "out.json"
    rc = main(
        [
            "tune",
            *SMALL,
            "--param",
            "lr=1e-4:3e-2:log",
            "--param",
            "warmup=0:4",
            "--trials",
            "2",
            "--steps",
            "4",
            "--eval-every",
            "2",
            "--eval-batches",
            "1",
            "--run-dir",
            str(tmp_path / "run"),
            "--seed",
            "0",
            "--no-plots",
            "--json",
            str(out),
        ]
    )
    assert rc == 0
    data = json.loads(out.read_text())
    assert data["method"] == "tpe" and "pruning" in data["method_reason"]
    assert len(data["trials"]) == 2
    assert {"params", "value", "state"} <= set(data["trials"][0])
    assert data["trials"][0]["base"] and data["trials"][0]["params"] == {
        "optimizer.lr": 1e-3,
        "optimizer.warmup_steps": 0,
    }
    assert set(data["trials"][1]["intermediate"]) == {"2", "4"}
    best = data["best"]
    assert best["value"] == min(t["value"] for t in data["trials"] if t["state"] == "COMPLETE")
    recipe = load_recipe(best["recipe_path"])
    assert recipe.optimizer.lr == best["params"]["optimizer.lr"]
    assert recipe.shapes.max_len == 64  # the base recipe's other fields are kept
    assert "method: tpe" in capsys.readouterr().out


def test_tune_synthetic_resumes_by_study_name(tmp_path, capsys):
    args = ["tune", "--objective", "branin", "--method", "random", "--run-dir", str(tmp_path), "--no-plots"]
    assert main([*args, "--trials", "3"]) == 0
    assert main([*args, "--trials", "5", "--json", str(tmp_path / "r.json")]) == 0
    data = json.loads((tmp_path / "r.json").read_text())
    assert [t["number"] for t in data["trials"]] == [0, 1, 2, 3, 4]
    assert data["states"]["COMPLETE"] == 5


def test_bad_input_is_one_line_exit_2(tmp_path, capsys):
    assert main(["tune", "--param", "lr=1e-2:1e-4:log", "--run-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "LOW must be below HIGH" in err
    assert main(["tune", "--run-dir", str(tmp_path)]) == 2
    assert "--param" in capsys.readouterr().err


def test_lr_find_cli(tmp_path, capsys):
    out = tmp_path / "lr.json"
    rc = main(
        [
            "lr-find",
            *SMALL,
            "--steps",
            "12",
            "--start-lr",
            "1e-5",
            "--end-lr",
            "1",
            "--plot",
            str(tmp_path / "lr.png"),
            "--json",
            str(out),
        ]
    )
    assert rc == 0
    data = json.loads(out.read_text())
    assert data["rule"] in ("steepest", "minimum / 10") and len(data["lrs"]) <= 12
    assert (tmp_path / "lr.png").stat().st_size > 1000
    assert "suggested lr" in capsys.readouterr().out
