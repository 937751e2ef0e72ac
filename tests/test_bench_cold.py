"""scripts/bench_cold.py's grid (scripts/bench_cold_grid.py): what the cold-estimate benchmark runs, checked without
running it: at least 40 pairs, every category the issue names, each pair valid CLI input, none shipped."""
from __future__ import annotations

import json

import pytest

from estimator.presets import load_config, preset_names
from scripts import bench_cold
from scripts.bench_cold_grid import CATEGORIES, CONFIG_DIR, GRID, NON_PRESET_TYPES, Pair


def test_the_grid_is_large_enough_and_covers_every_category():
    assert len(GRID) >= 40
    assert len({p.name for p in GRID}) == len(GRID)
    covered = {c for p in GRID for c in p.categories}
    assert set(CATEGORIES) <= covered, set(CATEGORIES) - covered
    parsed = [bench_cold.parse_pair(p) for p in GRID]
    ranks = {w.lora_rank for w, _ in parsed if w.method != "full"}
    assert min(ranks) == 8 and max(ranks) == 128
    gpus = {par.gpus for _, par in parsed if par.strategy != "single"}
    assert min(gpus) == 2 and max(gpus) == 64
    strategies = {par.strategy for _, par in parsed}
    assert {"fsdp", "ddp", "tp", "pp"} <= strategies and strategies & {"zero1", "zero2", "zero3"}
    infer = [w for w, _ in parsed if w.mode == "infer"]
    assert infer and all(w.kv_dtype == "fp8" and w.seq + w.gen_tokens >= 8192 for w in infer)


@pytest.mark.parametrize("pair", GRID, ids=lambda p: p.name)
def test_every_pair_is_valid_cli_input_and_not_shipped(pair):
    w, p = bench_cold.parse_pair(pair)   # the CLI's own parser and the Workload / Parallel rules, nothing derived
    assert pair.argv()[-1] == "--json" and "--gpu" in pair.flags
    assert bench_cold.shipped_where(pair) is None


def test_non_preset_configs_are_model_types_no_preset_has():
    preset_types = {load_config(n)[1]["model_type"] for n in preset_names()}
    for t in NON_PRESET_TYPES:
        cfg = json.loads((CONFIG_DIR / f"{t}.json").read_text())
        assert cfg["model_type"] == t and t not in preset_types
    assert {p.model for p in GRID} & set(NON_PRESET_TYPES) == set(NON_PRESET_TYPES)


def test_a_shipped_pair_is_refused_before_anything_runs(monkeypatch, capsys):
    shipped = Pair("shipped-llama", "llama-3.1-8b", ("--batch", "1", "--gpu", "h100-sxm-80gb"), ())
    assert bench_cold.shipped_where(shipped) == "shipped"   # the default class: full fine-tune, pure bf16, sdpa
    monkeypatch.setattr(bench_cold, "GRID", (shipped,))
    monkeypatch.setattr(bench_cold, "run_pair", lambda *a: pytest.fail("ran a shipped pair"))
    assert bench_cold.main(["--limit", "1"]) == 2
    assert "pair 'shipped-llama' is shipped" in capsys.readouterr().err


def test_summary_and_report_say_missed_against_the_targets():
    # nearest rank: of 20 values 1..20 the 95th percentile is the 19th
    assert bench_cold.nearest_rank([float(i) for i in range(20, 0, -1)], 0.95) == 19.0
    rows = [{"name": f"p{i}", "model": "m", "wall_s": w, "cpu_s": w / 2, "rc": 0, "timed_out": False,
             "verdict": "fits"} for i, w in enumerate((0.5, 0.75, 1.25, 7.0))]
    s = bench_cold.summary(rows)
    assert s["wall_s"] == {"median": 1.0, "p95": 7.0, "max": 7.0}   # a median at the target meets it
    result = {"command": "python scripts/bench_cold.py", "timeout_s": 600, "summary": s, "rows": rows,
              "machine": {"cores": 2, "platform": "x", "versions": {"python": "3", "torch": "t", "transformers": "t"},
                          "load_before": (1.0, 1.0, 1.0), "load_after": (2.0, 2.0, 2.0)}}
    text = bench_cold.report_section(result)
    assert "| wall (s) | 1.00 (met) | 7.00 (missed) | 7.00 (missed) |" in text
    assert "| CPU (s) | 0.50 (met) | 3.50 (missed) | 3.50 (met) |" in text
