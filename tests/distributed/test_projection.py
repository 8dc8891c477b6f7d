"""The scaling cost model against hand-computed values, its limits, and the script's given-numbers path."""

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from slipstream.distributed.projection import (
    Assumptions,
    Link,
    Network,
    StepProfile,
    bubble,
    ddp_buckets,
    ddp_step_s,
    derive_assumptions,
    efficiency,
    fsdp_step_s,
    pipeline_step_s,
    project,
)

ROOT = Path(__file__).resolve().parents[2]
SLOW = Network("slow", Link("slow", bandwidth_bytes_per_s=8e6, latency_s=1e-3))
FREE = Network("free", Link("free", bandwidth_bytes_per_s=math.inf, latency_s=0.0))

# 1 s step, half of it backward; 1e6 params x 4 B = 4 MB of gradients; 0.8 MB per micro-batch.
SMALL = StepProfile(
    step_s=1.0, params=1_000_000, activation_bytes=8e5, micro_batches=4, backward_fraction=0.5
)


def test_ddp_hand_computed():
    # all-reduce over 4 ranks: 2 * 3/4 * 4e6 / 8e6 + 2 * 3 * 1e-3 = 0.75 + 0.006 = 0.756 s
    assert ddp_step_s(SMALL, 4, SLOW, Assumptions()) == pytest.approx(1.756)
    # half of it (0.378 s) hides behind the 0.5 s backward: 0.5 + 0.5 + 0.378
    assert ddp_step_s(SMALL, 4, SLOW, Assumptions(ddp_overlap=0.5)) == pytest.approx(1.378)
    # all of it may overlap, but backward lasts only 0.5 s: 0.5 + max(0.5, 0.756)
    assert ddp_step_s(SMALL, 4, SLOW, Assumptions(ddp_overlap=1.0)) == pytest.approx(1.256)
    # two buckets: two rings' latency, same bytes: 0.75 + 2 * 0.006
    assert ddp_step_s(SMALL, 4, SLOW, Assumptions(ddp_buckets=2)) == pytest.approx(1.762)
    assert efficiency(SMALL, 4, SLOW)["ddp"] == pytest.approx(1 / 1.756)


def test_fsdp_hand_computed():
    # all-gather = reduce-scatter = 3/4 * 4e6 / 8e6 + 3 * 1e-3 = 0.378 s;
    # forward 0.5 + 0.378, backward 0.5 + 2 * 0.378
    assert fsdp_step_s(SMALL, 4, SLOW, Assumptions()) == pytest.approx(2.134)
    # bf16 params halve the all-gathers: 3/4 * 2e6 / 8e6 + 0.003 = 0.1905
    bf16 = StepProfile(**{**vars(SMALL), "param_bytes": 2})
    assert fsdp_step_s(bf16, 4, SLOW, Assumptions()) == pytest.approx(1.0 + 0.1905 * 2 + 0.378)
    # everything prefetched: forward max(0.5, 0.378), backward max(0.5, 0.756)
    assert fsdp_step_s(SMALL, 4, SLOW, Assumptions(fsdp_overlap=1.0)) == pytest.approx(0.5 + 0.756)


def test_pipeline_hand_computed():
    # slot = 1 / (4 stages * 4 micro-batches) + 2 * (8e5 / 8e6 + 1e-3) = 0.0625 + 0.202;
    # 7 slots; ideal 1 / 4 s
    assert pipeline_step_s(SMALL, 4, SLOW) == pytest.approx(7 * 0.2645)
    assert efficiency(SMALL, 4, SLOW)["pipeline"] == pytest.approx(0.25 / (7 * 0.2645))


def test_free_network_scales_perfectly_for_ddp_and_fsdp():
    for n in (2, 8, 1024):
        e = efficiency(SMALL, n, FREE, Assumptions())
        assert e["ddp"] == pytest.approx(1.0) and e["fsdp"] == pytest.approx(1.0)


@pytest.mark.parametrize("m", [1, 4, 16])
def test_pipeline_with_free_communication_is_one_minus_the_bubble(m):
    for p in (2, 4, 8):
        profile = StepProfile(step_s=2.0, params=10, activation_bytes=1e9, micro_batches=m, layers=8)
        assert efficiency(profile, p, FREE)["pipeline"] == pytest.approx(1 - bubble(p, m))
        assert bubble(p, m) == pytest.approx((p - 1) / (m + p - 1))


def test_pipeline_cannot_cut_more_stages_than_blocks_and_uneven_stages_pace_it():
    profile = StepProfile(step_s=1.0, params=10, activation_bytes=0, micro_batches=8, layers=12)
    assert pipeline_step_s(profile, 16, FREE) is None
    assert efficiency(profile, 16, FREE)["pipeline"] is None
    # 8 stages of 12 blocks: some hold 2, so each slot is 2/12 of the step, not 1/8
    assert efficiency(profile, 8, FREE)["pipeline"] == pytest.approx((1 / 8) / (15 * (2 / 12) / 8))


def test_efficiency_falls_as_ranks_grow_at_fixed_bandwidth():
    profile = StepProfile(step_s=0.2, params=50_000_000, activation_bytes=2e6, micro_batches=8)
    a = derive_assumptions(profile, fsdp_units=9)
    rows = project(profile, [SLOW], [2**k for k in range(1, 11)], a)
    for strategy in ("ddp", "fsdp", "pipeline"):
        values = [row["slow"][strategy] for row in rows]
        assert all(later <= earlier for earlier, later in zip(values, values[1:])), strategy
        assert values[-1] < values[0]


def test_hierarchical_network_is_flat_intra_inside_a_node_and_cheaper_across_nodes():
    eth = Link("eth", 50e9, 10e-6)
    nvl = Link("nvl", 450e9, 2e-6)
    hier = Network("h", eth, intra=nvl, ranks_per_node=8)
    a = Assumptions()
    assert ddp_step_s(SMALL, 8, hier, a) == pytest.approx(ddp_step_s(SMALL, 8, Network("n", nvl), a))
    assert ddp_step_s(SMALL, 64, hier, a) < ddp_step_s(SMALL, 64, Network("e", eth), a)


def test_ddp_buckets_follow_torch_defaults():
    mib = 1024 * 1024
    assert ddp_buckets(0.5 * mib) == (1, 0.0)
    count, overlap = ddp_buckets(12 * mib)  # 1 MiB, then one bucket of 11 MiB that fires last
    assert count == 2 and overlap == pytest.approx(1 / 12)
    count, overlap = ddp_buckets(76 * mib)  # 1 + 25 + 25 + 25
    assert count == 4 and overlap == pytest.approx(51 / 76)


def test_script_with_given_numbers_prints_the_table(tmp_path):
    out = tmp_path / "projection.json"
    args = ["--step-s", "0.5", "--params", "124e6", "--activation-bytes", "3e6", "--layers", "12"]
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks/scaling_projection.py"), *args, "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    for name in ("25GbE", "100GbE", "400GbE", "NVLink"):
        assert name in proc.stdout
    rows = [line for line in lines if line.split("|")[0].strip().isdigit()]
    assert [int(r.split("|")[0]) for r in rows] == [2**k for k in range(1, 11)]
    assert "n/a" in rows[-1]  # 1024 pipeline stages of a 12-block model
    doc = json.loads(out.read_text())
    assert doc["measured"] is None and doc["inputs"]["params"] == 124_000_000
    assert [row["ranks"] for row in doc["efficiency"]] == [2**k for k in range(1, 11)]
    assert doc["efficiency"][-1]["NVLink"]["pipeline"] is None
