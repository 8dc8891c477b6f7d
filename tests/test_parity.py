"""The paired parity guard (issue 24): the null band's arithmetic, the verdicts (pass only when the
run could see a 1% regression), the document windows every contender shares, and a planted fault
that the seed band passes and the paired guard does not."""

from __future__ import annotations

import math

import numpy as np
import pytest

from slipstream.bench.contenders import DocumentWindows, WindowedLoader
from slipstream.bench.runner import DEFAULT_NOISE_SEEDS
from slipstream.parity import (
    PARITY_MIN_STEPS,
    PARITY_STEPS_ENV,
    NullBand,
    default_parity_steps,
    judge_paired,
    min_judged_steps,
    null_band,
    short_run,
    t_quantile_995,
    unjudged_note,
)


def test_null_band_is_t_times_the_paired_spread_and_detects_a_further_power_margin():
    band = null_band(3.0, [3.003, 2.997], floor=0.0)
    sigma = float(np.std([3.0, 3.003, 2.997], ddof=1) / 3.0)
    assert band.sigma == pytest.approx(sigma) and band.df == 2
    assert band.sigma_diff == pytest.approx(math.sqrt(2) * sigma)
    assert band.threshold == pytest.approx(9.925 * math.sqrt(2) * sigma)  # t(0.995, 2 df)
    assert band.detectable == pytest.approx(band.threshold + 1.645 * math.sqrt(2) * sigma)
    assert not band.judged  # sigma 0.1% with 2 re-runs: would catch only >= 1.6%, not 1%
    assert null_band(3.0, [3.0003, 2.9997, 3.0, 3.0003], floor=0.0).judged  # 4 re-runs, sigma 0.01%
    assert null_band(3.0, [3.003, 2.997], floor=0.05).threshold == 0.05  # never below the floor
    assert t_quantile_995(4) == pytest.approx(4.604) and t_quantile_995(11) == pytest.approx(3.169)


def test_without_null_runs_nothing_is_judged_and_a_wide_band_is_unjudged():
    none = null_band(3.0, [], floor=0.002)
    assert math.isinf(none.detectable) and not none.judged
    assert judge_paired(3.001, 3.0, none)[0] == "unjudged"
    # no spread is known, so no gap is a detected difference (bench trains no order re-runs where
    # every verdict rests on another band; the floor alone would fail harmless re-batching)
    assert judge_paired(3.1, 3.0, none) == ("unjudged", pytest.approx(0.1 / 3))
    assert judge_paired(float("inf"), 3.0, none)[0] == "fail"
    wide = null_band(3.0, [3.03, 2.97], floor=0.002)  # sigma 1%: would catch only ~16%
    assert wide.detectable > 0.10 and judge_paired(3.05, 3.0, wide) == ("unjudged", pytest.approx(1 / 60))
    assert judge_paired(float("nan"), 3.0, wide)[0] == "fail"
    # the advice names the option that adds re-runs to the band that left it unjudged
    assert "(more null re-runs, --noise-seeds, narrow it)" in unjudged_note("bucket", wide)
    assert "--numerics-seeds" in unjudged_note("fused", wide, "--numerics-seeds")


def test_a_tight_band_passes_within_and_fails_beyond():
    tight = NullBand("test", (3.0, 3.0001), 2e-5, 3e-5, 0.002, 0.0021, 1, 0.002)
    assert judge_paired(3.005, 3.0, tight) == ("pass", pytest.approx(0.005 / 3))
    assert judge_paired(2.99, 3.0, tight)[0] == "fail"  # two-sided: learning differently, not worse


def test_windows_cut_the_shuffled_corpus_and_a_null_order_keeps_each_windows_documents():
    lengths = np.random.default_rng(0).integers(2, 300, size=400)
    w = DocumentWindows(lengths, max_len=128, window_tokens=2000, seed=3)
    first = [w.order(i) for i in range(5)]
    seen = np.concatenate(first)
    assert len(set(seen.tolist())) == len(seen)  # disjoint within an epoch
    for docs in first:  # cut where the running total crosses a multiple of 2000: within a document of it
        assert abs(np.minimum(lengths[docs] - 1, 128).sum() - 2000) <= 128
    other = w.order(2, order_seed=1)
    assert sorted(other.tolist()) == sorted(first[2].tolist()) and other.tolist() != first[2].tolist()
    assert DocumentWindows(lengths, 128, 2000, seed=3).order(4).tolist() == first[4].tolist()


@pytest.mark.parametrize("mode", ["bucket", "pack", "pad_batch"])
def test_every_shape_policy_consumes_exactly_the_windows_documents(mode):
    from slipstream.session import Session
    from slipstream.workloads import get_workload

    data = get_workload("gpt-stdlib").load_data()
    windows = DocumentWindows(data.train_lengths, 512, 6000, seed=0)
    session = Session(f"baseline+shapes.mode={mode}+shapes.max_len=512+shapes.tokens_per_batch=2048")

    def build(seqs, lens):
        return session._shaped_loader(seqs, None, None, pad_id=data.pad_id, lengths=lens)

    loader = WindowedLoader(build, data.train, data.train_lengths, windows)
    for w in range(3):
        shaped = loader.window_loader(w)
        used = {int(shaped.item_seq[s.item]) for plan in shaped.plans(0) for row in plan.rows for s in row}
        assert used == set(range(len(windows.order(w))))  # every document of the window, no other


def test_step_ends_group_consecutive_batches_into_balanced_non_empty_steps():
    from slipstream.bench.contenders import step_ends

    ends = step_ends([10, 10, 10, 10, 10, 10], 3)
    assert ends == [False, True, False, True, False, True]
    ends = step_ends([30, 5, 5, 5, 5, 10], 2)  # balanced by tokens, not by count
    assert ends == [True, False, False, False, False, True]
    # every step keeps at least one batch, even when the tokens would put two steps on one batch
    assert step_ends([100, 1, 1], 3) == [True, True, True]
    assert step_ends([4, 4], 5) == [True, True]  # fewer batches than steps: a step each
    assert sum(step_ends([3] * 11, 4)) == 4


def test_a_paired_contender_trains_each_window_in_the_references_steps_with_its_tokens():
    """Bucket and pack batch a window's documents into more batches than the reference's steps;
    grouped into the reference's steps (micro-batches weighted by their targets), after any whole
    window they have consumed the reference's documents and tokens, in the reference's step count."""
    from slipstream.bench.contenders import real_tokens_per_step
    from slipstream.bench.runner import Pairing, RecipeContender
    from slipstream.presets import resolve_recipe
    from slipstream.workloads import get_workload

    data = get_workload("gpt-stdlib").load_data()
    ref_spec = "baseline+shapes.max_len=256+shapes.tokens_per_batch=2048"
    reference = resolve_recipe(ref_spec)
    pairing = Pairing(DocumentWindows(data.train_lengths, 256, 4096, seed=0))
    ref = RecipeContender(ref_spec, "gpt-stdlib", "tiny", data, 1, reference, pairing=pairing)
    target = real_tokens_per_step(ref.loader)
    pairing.plan_windows(sum(pairing.steps_per_window(w) for w in range(4)), margin=0)
    assert pairing.windows_needed == 4

    def steps(c, windows):
        per_window, it = [], c.loader.forever()
        for w in range(windows):
            tokens = n = 0
            while n < pairing.steps_per_window(w):
                batch = next(it)
                tokens += batch.real_tokens
                n += getattr(batch, "step_end", True)
                if getattr(batch, "step_end", True):
                    assert getattr(batch, "weight", 1.0) > 0
            per_window.append(tokens)
        return per_window

    want = steps(ref, 4)
    for mode in ("bucket", "pack"):
        spec = ref_spec.replace("baseline", mode)
        c = RecipeContender(spec, "gpt-stdlib", "tiny", data, 1, reference, real_tokens_per_step=target,
                            pairing=pairing)  # fmt: skip
        assert pairing.fits(c.loader)  # never fewer batches in a window than the reference's steps
        assert real_tokens_per_step(c.loader) <= 1.1 * target
        assert steps(c, 4) == want  # window by window: the same real tokens in the same steps
        assert c.loader.short_windows == 0
        c.close()
    ref.close()


def test_micro_batches_weighted_by_their_targets_give_the_token_weighted_step():
    """One step over two grouped micro-batches moves the weights exactly as one step over the
    concatenated tokens would: the gradient of the token-weighted mean loss."""
    import torch

    from slipstream.bench.contenders import LoopContender
    from slipstream.shapes.loader import Batch

    torch.manual_seed(0)
    x, y = torch.randn(5, 3), torch.randn(5, 1)

    class Tiny(LoopContender):
        def __init__(self, batches):
            self.model = torch.nn.Linear(3, 1)
            torch.nn.init.ones_(self.model.weight)
            torch.nn.init.zeros_(self.model.bias)
            self.opt = torch.optim.SGD(self.model.parameters(), lr=0.1)
            self.batches, self.device, self.shapes_seen = iter(batches), torch.device("cpu"), set()

        def train_step(self, batch):
            loss = torch.nn.functional.mse_loss(self.model(batch["x"]), batch["y"])
            (loss * getattr(batch, "weight", 1.0)).backward()
            if getattr(batch, "step_end", True):
                self.opt.step()
                self.opt.zero_grad()
            return loss

        def validation_loss(self):
            return 0.0

    def batch(rows, **attrs):
        b = Batch(x=x[rows], y=y[rows])
        b.real_tokens, b.padded_tokens, b.shape = len(rows), 0, (len(rows), 1)
        b.__dict__.update(attrs)
        return b

    whole = Tiny([batch([0, 1, 2, 3, 4])])
    parts = Tiny([batch([0, 1], weight=0.4, step_end=False), batch([2, 3, 4], weight=0.6, step_end=True)])
    a, b = whole.run_round(None, max_steps=1), parts.run_round(None, max_steps=1)
    assert a.steps == b.steps == 1 and b.real_tokens == 5  # the round ran the whole step
    assert b.losses[0] == pytest.approx(a.losses[0], rel=1e-6)  # the step's loss: weighted sum
    torch.testing.assert_close(parts.model.weight, whole.model.weight)
    torch.testing.assert_close(parts.model.bias, whole.model.bias)


SMALL = "+shapes.max_len=512+shapes.tokens_per_batch=1024"


@pytest.fixture(scope="module")
def frozen_runs():
    from slipstream.bench import run_bench
    from slipstream.bench.faults import fault_contenders

    names, custom = fault_contenders(SMALL, ("frozen-layer",))
    kw = dict(
        size="tiny", rounds=2, round_tokens=600, warmup_steps=1, val_batches=2, memory="skip", custom=custom
    )
    # the order band is asked for: on its own, bench trains none here (the frozen layer keeps the
    # reference's batches and is judged on the numerics band)
    paired = run_bench("gpt-stdlib", ["baseline" + SMALL, *names], noise_seeds=2, **kw).to_dict()
    seeds = run_bench("gpt-stdlib", ["baseline" + SMALL, *names], paired=False, **kw).to_dict()
    return paired, seeds


def test_paired_contenders_share_the_references_init_and_steps(frozen_runs):
    paired, _ = frozen_runs
    ref, frozen = paired["contenders"]
    assert frozen["info"]["init"] == "reference" and frozen["steps"] == ref["steps"]
    m = paired["method"]
    assert m["parity_design"] == "paired" and len(m["parity_noise_val_losses"]) == 3
    band = null_band(m["parity_noise_val_losses"][0], m["parity_noise_val_losses"][1:], m["parity_floor"])
    assert m["parity_tolerance"] == pytest.approx(band.threshold)
    assert m["parity_detectable_effect"] == pytest.approx(band.detectable)
    # its batches are the reference's: judged on the numerics band (rows permuted inside each batch)
    nb = m["parity_numerics_band"]
    assert frozen["parity_band_kind"] == "numerics" and len(nb["val_losses"]) == 2
    numerics = null_band(nb["val_losses"][0], nb["val_losses"][1:], m["parity_floor"])
    assert frozen["parity_tolerance"] == pytest.approx(numerics.threshold)


def test_a_frozen_layer_the_seed_band_passes_is_never_passed_by_the_paired_guard(frozen_runs):
    paired, seeds = frozen_runs
    assert seeds["contenders"][1]["parity"] == "pass"  # inside the spread of re-seeded runs
    frozen = paired["contenders"][1]
    assert frozen["parity"] in ("fail", "unjudged")
    if frozen["parity"] == "unjudged":  # the run is too short to see 1%: it says so
        assert any("parity unjudged: would catch >=" in w for w in paired["warnings"])


def test_the_step_budget_defaults_to_100_and_reads_the_environment(monkeypatch):
    monkeypatch.delenv(PARITY_STEPS_ENV, raising=False)
    assert default_parity_steps() == PARITY_MIN_STEPS == 100
    monkeypatch.setenv(PARITY_STEPS_ENV, "7")
    assert default_parity_steps() == 7
    for bad, msg in (("seven", "not an integer"), ("-1", "must be >= 0")):
        monkeypatch.setenv(PARITY_STEPS_ENV, bad)
        with pytest.raises(ValueError, match=msg):
            default_parity_steps()


def test_a_pass_on_a_short_run_is_unjudged_and_a_detected_difference_stands():
    assert short_run("pass", 16, 100) == "unjudged"
    assert short_run("pass", 100, 100) == "pass"
    assert short_run("fail", 16, 100) == "fail" and short_run("unjudged", 200, 100) == "unjudged"
    assert min_judged_steps(0) == PARITY_MIN_STEPS and min_judged_steps(30) == 30


def test_bench_adds_rounds_until_the_reference_trained_parity_steps_and_judges_only_then():
    from slipstream.bench import run_bench
    from slipstream.bench.faults import lr_times

    fused = "baseline" + SMALL + "+optimizer.impl=fused"  # the reference's batches and numerics
    kw = dict(size="tiny", rounds=1, round_tokens=600, warmup_steps=1, val_batches=1, memory="skip",
              noise_seeds=1)  # fmt: skip
    faster = lr_times("baseline" + SMALL, 3.0)
    long = run_bench("gpt-stdlib", ["baseline" + SMALL, fused, faster], parity_steps=4, **kw).to_dict()
    m = long["method"]
    assert m["rounds_asked"] == 1 and m["rounds"] > 1 and m["parity_steps_trained"] >= 4
    ref, cand, lr3 = long["contenders"]
    assert ref["steps"] == m["parity_steps_trained"] and cand["steps"] == ref["steps"]
    # every round is timed: one tokens/s figure per round, for the reference and the contender
    assert len(ref["round_tokens_per_s"]) == len(cand["round_tokens_per_s"]) == m["rounds"]
    assert cand["parity"] == "pass", long["warnings"]
    # the curve check: the same batches, step for step; the fused optimizer's curve is the reference's
    # (to rounding), lr x 3's is not, whatever its final validation loss
    assert ref["curve_check"] is None
    assert m["parity_curve_band"]["val_losses"][0] == pytest.approx(cand["curve_check"]["reference"])
    assert cand["curve_check"]["passed"] and cand["curve_check"]["gap"] < 1e-4
    assert lr3["curve_check"]["passed"] is False and lr3["parity"] == "fail"
    assert lr3["curve_check"]["gap"] > 10 * m["parity_curve_band"]["threshold"]
    assert any(
        w.startswith(lr3["name"] + ": parity fail: on the reference's batches") for w in long["warnings"]
    )
    # --parity-steps 0: only the rounds asked for, and a pass that short is not trusted
    short = run_bench("gpt-stdlib", ["baseline" + SMALL, fused], parity_steps=0, **kw).to_dict()
    assert short["method"]["rounds"] == 1 and short["method"]["parity_steps_trained"] < PARITY_MIN_STEPS
    assert short["contenders"][1]["parity"] == "unjudged"
    assert any("fewer than the 100 a planted fault needs" in w for w in short["warnings"])
    from slipstream.bench.report import summary_lines

    trained = short["method"]["parity_steps_trained"]
    assert f"judged after {trained} optimizer steps (1 round, fewer than the 100" in summary_lines(short)[0]
    assert (
        f"judged after {m['parity_steps_trained']} optimizer steps ({m['rounds']} rounds)"
        in (summary_lines(long)[0])
    )


def test_the_curve_check_fails_only_beyond_its_band_and_a_curve_that_is_not_finite():
    from slipstream.bench.curve_check import check_curve, mean_train_loss

    band = null_band(3.0, [3.0 * (1 + 1e-6)], 0.002)
    assert mean_train_loss([3.0, 2.0, 1.0]) == pytest.approx(2.0) and math.isnan(mean_train_loss([]))
    assert check_curve(3.003, 3.0, band)["passed"] and check_curve(3.003, 3.0, band)["gap"] == pytest.approx(
        1e-3
    )
    off = check_curve(2.9, 3.0, band)
    assert (
        off["passed"] is False and off["tolerance"] == band.threshold and off["gap"] == pytest.approx(1 / 30)
    )
    diverged = check_curve(math.nan, 3.0, band)
    assert diverged["passed"] is False and diverged["gap"] is None


def test_batching_check_gap_and_verdict():
    from slipstream.bench.batching_check import BATCHING_TOLERANCE, BatchingCheck

    same = BatchingCheck(5.0, 5.0 * (1 + BATCHING_TOLERANCE / 2))
    assert same.passed and same.gap == pytest.approx(BATCHING_TOLERANCE / 2)
    off = BatchingCheck(5.0, 5.01)
    assert not off.passed and off.to_dict()["gap"] == pytest.approx(0.002)
    broken = BatchingCheck(5.0, math.nan)
    assert not broken.passed and broken.to_dict()["gap"] is None


def test_the_batching_check_fails_a_broken_data_path_that_the_loss_band_cannot_see_yet():
    """Fed window 0 with the reference's final weights, pack and bucket compute the reference's
    loss (document-masked packing is exact); shifted labels do not, after a few steps already, and
    the dropped document mask moves it far more than any harmless batching does."""
    from slipstream.bench import run_bench
    from slipstream.bench.faults import fault_contenders

    names, custom = fault_contenders(SMALL, ("no-doc-mask", "label-shift"))
    res = run_bench(
        "gpt-stdlib", ["baseline" + SMALL, "bucket" + SMALL, "pack" + SMALL, *names], size="tiny", rounds=2,
        round_tokens=1200, warmup_steps=1, val_batches=1, memory="skip", noise_seeds=1, custom=custom,
    ).to_dict()  # fmt: skip
    rows = {c["name"].split("+")[0].split("@")[0]: c for c in res["contenders"]}
    assert rows["baseline"]["batching_check"] is None  # the reference is what the others match
    harmless = max(rows[k]["batching_check"]["gap"] for k in ("bucket", "pack"))
    assert rows["bucket"]["batching_check"]["passed"] and rows["pack"]["batching_check"]["passed"]
    assert harmless < 1e-6
    shifted = rows["label-shift"]
    assert shifted["batching_check"]["passed"] is False and shifted["parity"] == "fail"
    assert any(w.startswith(shifted["name"] + ": parity fail: fed window 0") for w in res["warnings"])
    assert rows["no-doc-mask"]["batching_check"]["gap"] > 100 * max(harmless, 1e-9)
    # a change of batching alone, vouched by its check: passed although one null re-run cannot
    # resolve 1%; custom code (the dropped mask, here within tolerance after 2 rounds) never is
    for name in ("bucket", "pack"):
        assert rows[name]["parity_band_kind"] == "order+check" and rows[name]["parity"] == "pass"
    assert rows["no-doc-mask"]["parity_band_kind"] == "order" and rows["no-doc-mask"]["parity"] != "pass"
    assert not any(w.startswith(rows["bucket"]["name"] + ": parity unjudged") for w in res["warnings"])


def test_only_a_plain_change_of_batching_with_a_passed_check_is_vouched():
    from slipstream.bench.batching_check import batching_only, vouch
    from slipstream.presets import resolve_recipe

    base = resolve_recipe("baseline")
    assert batching_only(base, resolve_recipe("bucket")) and batching_only(base, resolve_recipe("pack"))
    assert batching_only(base, resolve_recipe("baseline+dataflow.prefetch=true"))
    assert not batching_only(base, resolve_recipe("bucket+precision.dtype=bf16"))
    assert not batching_only(base, resolve_recipe("pack+optimizer.lr=0.003"))
    passed, failed = {"passed": True}, {"passed": False}
    assert vouch("unjudged", passed, True) == "pass"
    assert vouch("fail", passed, True) == "fail"  # a detected difference stands
    assert vouch("unjudged", failed, True) == "unjudged"
    assert vouch("unjudged", {"skipped": "parameters differ"}, True) == "unjudged"
    assert vouch("unjudged", None, True) == "unjudged"
    assert vouch("unjudged", passed, False) == "unjudged"  # precision or optimizer changed too


def test_a_recipe_changing_batching_and_numerics_is_judged_by_its_twin_and_its_batching_check():
    """bucket + bf16 against the reference: its twin (bf16 on the reference's batches) passes the
    numerics band and the curve check, its batching check passes: it passes although one order
    re-run cannot resolve 1%. bucket + lr x 3: its twin trains differently and fails it."""
    from slipstream.bench import run_bench
    from slipstream.bench.faults import lr_times

    ref, bucket = "baseline" + SMALL, "bucket" + SMALL
    both, faster = bucket + "+precision.dtype=bf16", lr_times(bucket, 3.0)
    kw = dict(size="tiny", rounds=1, round_tokens=600, warmup_steps=1, val_batches=1, memory="skip",
              noise_seeds=1, parity_steps=6)  # fmt: skip
    res = run_bench("gpt-stdlib", [ref, bucket, both, faster], **kw).to_dict()
    rows = {c["name"]: c for c in res["contenders"]}
    assert rows[ref]["parity_twin"] is None and rows[bucket]["parity_twin"] is None  # batching alone
    twin = rows[both]["parity_twin"]
    assert twin["name"] == both + " (twin: the reference's batches)" and twin["verdict"] == "pass"
    assert twin["curve_check"]["passed"] and twin["gap"] <= twin["tolerance"]
    assert twin["band"] == "precision"  # it computes in bf16: judged on the reference re-run in bf16
    assert rows[both]["parity"] == "pass" and rows[both]["parity_band_kind"] == "twin+check"
    assert rows[both]["batching_check"]["passed"]
    assert rows[faster]["parity_twin"]["verdict"] == "fail" and rows[faster]["parity"] == "fail"
    assert rows[faster]["parity_twin"]["curve_check"]["passed"] is False
    # the twins are not results: one row per recipe asked for
    assert len(res["contenders"]) == 4


def test_a_twin_is_the_recipe_on_the_references_batches_and_decides_only_with_a_passed_check():
    from slipstream.bench.twin import judge_with_twin, twin_recipe
    from slipstream.presets import resolve_recipe

    base = resolve_recipe("baseline")
    twin = twin_recipe(base, resolve_recipe("bucket+precision.dtype=bf16+dataflow.prefetch=true"))
    assert twin.shapes == base.shapes and twin.dataflow == base.dataflow and twin.precision.dtype == "bf16"
    assert twin_recipe(base, resolve_recipe("bucket")) is None  # batching alone: the vouch rule
    assert twin_recipe(base, resolve_recipe("baseline+precision.dtype=bf16")) is None  # same batches
    assert twin_recipe(resolve_recipe("baseline+shapes.mode=auto"), resolve_recipe("auto")) is None
    passed, failed = {"passed": True}, {"passed": False}
    assert judge_with_twin("unjudged", passed, {"verdict": "pass"}) == "pass"
    assert judge_with_twin("unjudged", passed, {"verdict": "fail"}) == "fail"
    assert judge_with_twin("fail", passed, {"verdict": "pass"}) == "fail"  # a detected difference stands
    assert judge_with_twin("unjudged", failed, {"verdict": "pass"}) == "unjudged"
    assert judge_with_twin("unjudged", {"skipped": "kernels"}, {"verdict": "pass"}) == "unjudged"
    assert judge_with_twin("unjudged", passed, {"verdict": "unjudged"}) == "unjudged"


def test_a_twin_adopts_the_recipes_decisions_but_batching_and_is_dropped_where_it_decided_otherwise():
    from slipstream.bench.twin import adopted_decisions, mismatch

    mine = {
        "optimizer.impl": {"choice": "fused", "reason": "timed"},
        "compile.mode": {"choice": "off", "reason": "cpu"},
        "precision.dtype": {"choice": "bf16", "reason": "probe"},
        "kernels.ops": {"choice": "linear_cross_entropy=torch", "reason": "timed"},
        "shapes.mode": {"choice": "bucket", "reason": "timed"},
        "dataflow.workers": {"choice": "2", "reason": "timed"},
    }
    adopted = adopted_decisions(mine)
    assert sorted(adopted) == ["compile.mode", "kernels.ops", "optimizer.impl", "precision.dtype"]
    assert adopted["kernels.ops"]["choice"] == "linear_cross_entropy=torch"
    assert all(d["reason"].startswith("adopted from the recipe it twins") for d in adopted.values())
    twin = {k: v for k, v in mine.items() if k != "shapes.mode"}  # its shapes are the reference's
    assert mismatch(mine, twin) == []
    twin["kernels.ops"] = {"choice": "none", "reason": "timed again"}
    assert mismatch(mine, twin) == ["kernels.ops: linear_cross_entropy=torch vs none"]


def test_a_twins_session_computes_with_the_recipes_decisions_not_its_own():
    """What a twin adopts is what its Session runs: the recipe's dtype and kernels, even where the
    twin's own probe and timing would have chosen otherwise."""
    from slipstream.bench.runner import RecipeContender
    from slipstream.bench.twin import adopted_decisions
    from slipstream.presets import resolve_recipe
    from slipstream.session import Session
    from slipstream.workloads import get_workload

    spec = "baseline+precision.dtype=auto+kernels.ops=auto" + SMALL
    own = Session(spec)
    other = "fp32" if own.precision != "fp32" else "bf16"
    own.close()
    recipe_decisions = {
        "precision.dtype": {"choice": other, "reason": "the recipe's probe"},
        "kernels.ops": {"choice": "linear_cross_entropy=torch", "reason": "timed at the recipe's shapes"},
        "shapes.mode": {"choice": "bucket", "reason": "timed"},
    }
    data = get_workload("gpt-stdlib").load_data()
    twin = RecipeContender(
        spec, "gpt-stdlib", "tiny", data, 1, resolve_recipe("baseline" + SMALL),
        adopted=adopted_decisions(recipe_decisions),
    )  # fmt: skip
    try:
        assert twin.session.precision == other
        assert twin.session.decisions["kernels.ops"]["choice"] == "linear_cross_entropy=torch"
        assert "shapes.mode" not in twin.session.decisions  # it batches the reference's way
    finally:
        twin.close()


def test_a_contender_in_another_precision_is_judged_on_that_precisions_band():
    """bf16 on the reference's batches: judged on re-runs of the reference in bf16 (its own
    arithmetic's spread), while foreach AdamW in fp32 keeps the fp32 numerics band; with
    precision_seeds=0 both are judged on the numerics band, as before."""
    from slipstream.bench import run_bench

    ref, bf16, foreach = "baseline" + SMALL, "bf16" + SMALL, "baseline+optimizer.impl=foreach" + SMALL
    kw = dict(size="tiny", rounds=1, round_tokens=600, warmup_steps=1, val_batches=1, memory="skip",
              noise_seeds=0, parity_steps=6, min_dtype_speed=None)  # fmt: skip
    res = run_bench("gpt-stdlib", [ref, bf16, foreach], **kw).to_dict()
    m, rows = res["method"], {c["name"]: c for c in res["contenders"]}
    own = m["parity_precision_bands"]["bf16"]
    assert own["validation"]["df"] == 2 and "in bf16" in own["validation"]["source"]
    assert own["curve"]["df"] == 2 and "in bf16" in own["curve"]["source"]
    assert m["parity_numerics_band"]["df"] == 1  # foreach computes in fp32: the reference's band
    assert rows[bf16]["parity_band_kind"] == "precision"
    assert rows[bf16]["parity_tolerance"] == own["validation"]["threshold"]
    assert rows[bf16]["curve_check"]["tolerance"] == own["curve"]["threshold"]
    assert rows[foreach]["parity_band_kind"] == "numerics"
    assert rows[foreach]["parity_tolerance"] == m["parity_numerics_band"]["threshold"]
    res = run_bench("gpt-stdlib", [ref, bf16], precision_seeds=0, **kw).to_dict()
    assert res["method"]["parity_precision_bands"] == {}
    assert res["contenders"][1]["parity_band_kind"] == "numerics"


def test_the_update_check_is_the_median_error_over_the_tensors_the_reference_moved():
    import torch

    from slipstream.bench.update_check import UPDATE_TOLERANCE, UpdateCheck, update_errors

    ref = {"a": torch.ones(4), "b": torch.full((4,), 2.0), "c": torch.ones(2), "frozen": torch.zeros(3)}
    own = {
        "a": torch.full((4,), 1.01),
        "b": torch.full((4,), 2.0),
        "c": torch.zeros(2),
        "frozen": torch.ones(3),
    }
    errors = update_errors(own, ref)
    assert sorted(errors) == ["a", "b", "c"]  # a tensor the reference did not move says nothing
    assert errors["a"] == pytest.approx(0.01) and errors["b"] == 0 and errors["c"] == pytest.approx(1.0)
    check = UpdateCheck(errors)
    assert check.median == pytest.approx(0.01) and check.passed  # one lost tensor of three: the median holds
    row = check.to_dict()
    assert row["worst"][0] == ["c", pytest.approx(1.0)] and row["tensors"] == 3
    lost = UpdateCheck(update_errors({k: torch.zeros_like(v) for k, v in ref.items()}, ref))
    assert lost.median == pytest.approx(1.0) and not lost.passed
    edge = UpdateCheck({"a": UPDATE_TOLERANCE * 1.001, "b": 0.0, "c": 1.0})
    assert not edge.passed
    nothing = UpdateCheck({})  # no tensor moved: nothing to vouch for
    assert not nothing.passed and nothing.to_dict()["median_error"] is None


def test_only_a_plain_change_of_precision_with_a_passed_update_check_is_vouched():
    from slipstream.bench.update_check import precision_only, vouch
    from slipstream.presets import resolve_recipe

    base = resolve_recipe("baseline")
    assert precision_only(base, resolve_recipe("baseline+precision.dtype=bf16"))
    assert precision_only(
        base, resolve_recipe("baseline+precision.dtype=fp16+precision.loss_scale_init=1024")
    )
    assert not precision_only(base, resolve_recipe("baseline+precision.dtype=bf16+optimizer.lr=0.003"))
    assert not precision_only(base, resolve_recipe("bucket+precision.dtype=bf16"))
    passed, failed = {"passed": True}, {"passed": False}
    assert vouch("unjudged", passed, True) == "pass"
    assert vouch("fail", passed, True) == "fail"  # the band saw a difference: it stands
    assert vouch("unjudged", failed, True) == "unjudged"
    assert vouch("unjudged", {"skipped": "parameters differ"}, True) == "unjudged"
    assert vouch("unjudged", passed, False) == "unjudged"  # custom code, or more than precision changed
    from slipstream.bench.runner import _band_kind

    assert _band_kind("precision", True, False, False) == "precision+update"
    assert _band_kind("precision", False, False, False) == "precision"


def test_the_update_check_fails_weights_kept_in_bf16_and_passes_bf16_autocast():
    """From the reference's final state, one step of bf16 autocast moves the weights as fp32 does
    (rounding in the gradient), one step of pure bf16 weights does not (updates below a weight's
    spacing are lost): the fault fails on the check, whatever its loss band says."""
    from slipstream.bench import run_bench
    from slipstream.bench.faults import fault_contenders

    ref, bf16 = "baseline" + SMALL, "bf16" + SMALL
    names, custom = fault_contenders(SMALL, ("bf16-pure",))
    kw = dict(size="tiny", rounds=1, round_tokens=600, warmup_steps=1, val_batches=1, memory="skip",
              noise_seeds=0, parity_steps=6, min_dtype_speed=None, precision_seeds=1)  # fmt: skip
    res = run_bench("gpt-stdlib", [ref, bf16, *names], custom=custom, **kw).to_dict()
    rows = {c["name"]: c for c in res["contenders"]}
    assert rows[ref]["update_check"] is None  # the reference is what the others match
    autocast, pure = rows[bf16]["update_check"], rows[names[0]]["update_check"]
    assert autocast["passed"] and autocast["median_error"] < autocast["tolerance"] / 3
    assert pure["passed"] is False and pure["median_error"] > 3 * pure["tolerance"]
    assert rows[names[0]]["parity"] == "fail" and rows[bf16]["parity"] != "fail"
    assert any(
        w.startswith(names[0] + ": parity fail: from the reference's final weights") for w in res["warnings"]
    )


def test_the_precision_band_needs_only_the_precisions_the_reference_does_not_compute_in():
    from slipstream.bench.precision_band import null_recipe, precisions_to_null, unjudged_note
    from slipstream.parity import null_band
    from slipstream.presets import resolve_recipe

    assert precisions_to_null("fp32", ["bf16", "fp32", "bf16", "fp16"]) == ["bf16", "fp16"]
    assert precisions_to_null("bf16", ["bf16"]) == []
    base = resolve_recipe("baseline+shapes.mode=bucket")
    twin = null_recipe(base, "bf16")
    assert twin.precision.dtype == "bf16" and twin.shapes == base.shapes and twin.optimizer == base.optimizer
    wide = null_band(2.70, [2.65, 2.69])  # bf16 on GPT small, seed 1: its own arithmetic moves ~1%
    assert not wide.judged
    note = unjudged_note("bf16", "bf16", wide)
    assert "re-run in bf16 moved the loss by itself" in note and "--precision-seeds" in note


def test_bench_trains_order_re_runs_only_where_a_verdict_rests_on_them():
    """bucket is judged by its batching check and fused AdamW on the numerics band: no order re-run
    is trained for them. A custom contender on other batches (the dropped mask) can be judged by
    nothing else, so it brings the two order re-runs back."""
    from slipstream.bench import run_bench
    from slipstream.bench.faults import fault_contenders
    from slipstream.bench.report import summary_lines

    kw = dict(size="tiny", rounds=1, round_tokens=600, warmup_steps=1, val_batches=1, memory="skip",
              parity_steps=4)  # fmt: skip
    fused = "baseline" + SMALL + "+optimizer.impl=fused"
    res = run_bench("gpt-stdlib", ["baseline" + SMALL, "bucket" + SMALL, fused], **kw).to_dict()
    m = res["method"]
    assert m["parity_noise_val_losses"] == [res["contenders"][0]["val_loss"]]  # the reference alone
    bucket, same = res["contenders"][1], res["contenders"][2]
    assert bucket["batching_check"]["passed"]
    assert bucket["parity_band_kind"] == "check" and bucket["parity"] == "pass", res["warnings"]
    assert bucket["parity_tolerance"] is None  # no spread was measured: the check decided
    assert same["parity_band_kind"] == "numerics" and same["parity"] == "pass", res["warnings"]
    assert summary_lines(res)[0].startswith(
        "parity (paired: same init, same document windows): no order re-runs"
    )

    names, custom = fault_contenders(SMALL, ("no-doc-mask",))
    res = run_bench("gpt-stdlib", ["baseline" + SMALL, *names], custom=custom, **kw).to_dict()
    assert len(res["method"]["parity_noise_val_losses"]) == 1 + DEFAULT_NOISE_SEEDS
    assert res["contenders"][1]["parity_band_kind"] == "order"


def test_a_numerics_re_run_that_moved_the_loss_brings_more_after_the_rounds(monkeypatch):
    """The one fp32 re-run assumes a spread of ~1e-7. Where it moved the loss (here, injected: 0.5%),
    bench trains more after the rounds, each replaying the reference's steps, up to
    MAX_NUMERICS_SEEDS; an explicit --numerics-seeds is kept as asked."""
    from slipstream.bench import run_bench
    from slipstream.bench.runner import MAX_NUMERICS_SEEDS, RecipeContender

    real = RecipeContender.validation_loss

    def moved(self):
        return real(self) * (1.005 if self.name.endswith("(null: row order 1)") else 1.0)

    monkeypatch.setattr(RecipeContender, "validation_loss", moved)
    said: list[str] = []
    kw = dict(size="tiny", rounds=1, round_tokens=600, warmup_steps=1, val_batches=1, memory="skip",
              parity_steps=4, progress=said.append)  # fmt: skip
    specs = ["baseline" + SMALL, "baseline" + SMALL + "+optimizer.impl=fused"]
    res = run_bench("gpt-stdlib", specs, **kw).to_dict()
    band, curve = res["method"]["parity_numerics_band"], res["method"]["parity_curve_band"]
    assert len(band["val_losses"]) == 1 + MAX_NUMERICS_SEEDS and band["df"] == MAX_NUMERICS_SEEDS
    assert sum("after the rounds" in line for line in said) == MAX_NUMERICS_SEEDS - 1
    # the later re-runs trained the reference's steps on its batches: their mean training loss is
    # the reference's to reassociation, as the first re-run's is
    assert len(curve["val_losses"]) == 1 + MAX_NUMERICS_SEEDS
    assert max(abs(v / curve["val_losses"][0] - 1) for v in curve["val_losses"]) < 1e-4
    assert abs(band["val_losses"][2] / band["val_losses"][0] - 1) < 1e-4  # the injected move is one run's
    asked = run_bench("gpt-stdlib", specs, numerics_seeds=1, **kw).to_dict()
    assert len(asked["method"]["parity_numerics_band"]["val_losses"]) == 2
    # a run too short for a pass (--parity-steps 0, 1 round) is unjudged whatever the band: no more
    short = run_bench("gpt-stdlib", specs, **{**kw, "parity_steps": 0}).to_dict()
    assert len(short["method"]["parity_numerics_band"]["val_losses"]) == 2
