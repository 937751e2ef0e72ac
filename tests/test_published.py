"""The published tier: the data file, its mapping rules, the all-or-nothing import, the estimator beside it."""
from __future__ import annotations

import csv
import json

import pytest

from bench.published import importer as published
from bench.store.db import connect
from bench.published.mapping import map_row, metric, translate_targets, unit_bytes

ROWS = published.load_data()


def _published_ids(db) -> list[str]:
    with connect(db, read_only=True) as con:
        return sorted(r[0] for r in con.execute("SELECT published_id FROM runs WHERE source = 'published'").fetchall())


def _run_ids(db) -> set[str]:
    with connect(db, read_only=True) as con:
        return {r[0] for r in con.execute("SELECT run_id FROM runs WHERE source = 'published'").fetchall()}


def test_the_data_file_keeps_every_collected_row_with_a_status():
    assert len(ROWS) == 169
    assert all(p["mapping_status"] in ("mapped", "partial", "unmapped") for p in ROWS)
    assert all(p["mapping_reason"] for p in ROWS if p["mapping_status"] != "mapped")


def test_every_row_is_a_run_after_import_and_reimport_is_idempotent(tmp_path):
    db = tmp_path / "pub.duckdb"
    assert published.import_published(db) == 169
    first = _run_ids(db)
    assert _published_ids(db) == sorted(p["published_id"] for p in ROWS)
    assert published.import_published(db) == 169
    assert _run_ids(db) == first                      # stable run_ids, no duplicates


def test_a_bad_row_leaves_the_previous_tier_intact(tmp_path):
    db = tmp_path / "pub.duckdb"
    published.import_published(db)
    bad = tmp_path / "points.csv"
    with published.DATA_FILE.open() as f:
        rows = list(csv.DictReader(f))
    rows[5]["batch"] = "0"                            # the runs table refuses batch 0 (bench/store/validate.py)
    with bad.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=published.FIELDS)
        w.writeheader()
        w.writerows(rows[:20])
    with pytest.raises(ValueError, match=r"^published: row at line 7 .*batch"):
        published.import_published(db, path=bad)
    assert len(_published_ids(db)) == 169              # nothing of the bad file, nothing lost


def test_a_malformed_value_is_one_line_naming_the_field(tmp_path):
    bad = tmp_path / "points.csv"
    with published.DATA_FILE.open() as f:
        rows = list(csv.DictReader(f))
    rows[0]["measured_bytes"] = "lots"
    with bad.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=published.FIELDS)
        w.writeheader()
        w.writerows(rows)
    with pytest.raises(ValueError) as e:
        published.load_data(bad)
    assert str(e.value).startswith("measured_bytes: 'lots' of P001") and "\n" not in str(e.value)


def test_units_as_published():
    assert unit_bytes(9.29, "GB(1e9)")[0] == 9_290_000_000
    assert unit_bytes(18.9, "GiB")[0] == round(18.9 * 2**30)
    assert unit_bytes(9404, "MiB")[0] == 9404 * 2**20
    assert unit_bytes(47.14, "GB(ambiguous)")[0] == 47_140_000_000
    with pytest.raises(ValueError, match="^measured_unit: 'GiBs'"):
        unit_bytes(1, "GiBs")
    for p in ROWS:  # every stored value is its published number in its published unit
        assert p["measured_bytes"] == unit_bytes(float(p["measured_value"]), p["measured_unit"])[0]


def test_torchtune_units_follow_the_commit_date():
    # torchtune logged GB (1e9) until mid-2024 and GiB from September 2024 (the collected file's README)
    for p in ROWS:
        if p["source_repo"] == "github.com/pytorch/torchtune" and "2024-04" in (p["source_version"] or ""):
            assert p["measured_unit"] == "GB(1e9)", p["published_id"]
        if p["source_repo"] == "github.com/pytorch/torchtune" and "2025" in (p["source_version"] or ""):
            assert p["measured_unit"] == "GiB", p["published_id"]


@pytest.mark.parametrize("text, kind", [
    ("torch.cuda.max_memory_allocated()/1e9", "allocated"),
    ("peak memory ACTIVE (torch memory_stats active_bytes.all.peak)", "active"),
    ("peak memory RESERVED (stated)", "reserved"),
    ("TorchTracemalloc in example script: torch.cuda.max_memory_allocated (begin + peak delta)", "tracemalloc"),
    ("GPU capacity at which this context length is the max that fits (NOT a peak reading)", "capacity"),
    ("torchtune peak memory (type unstated)", "unknown"),
])
def test_metric_typing(text, kind):
    assert metric(text)[0] == kind


def test_knobs_named_by_a_source_are_mapped_with_them():
    named = {p["published_id"]: json.loads(p["field_origins"]) for p in ROWS}
    chunked = [p for p in ROWS if p["loss"] == "chunked"]
    in_bwd = [p for p in ROWS if p["optimizer_in_backward"]]
    offload = [p for p in ROWS if p["activation_offload"]]
    compiled = [p for p in ROWS if p["compile"]]
    paged = [p for p in ROWS if (p["optimizer"] or "").startswith("paged")]
    adapted = [p for p in ROWS if p["quantize_scope"] == "adapted"]
    assert chunked and in_bwd and offload and compiled and paged and adapted
    assert all(named[p["published_id"]]["loss"] == "stated" for p in chunked)
    assert all(p["loss_chunks"] == 8 for p in chunked)  # torchtune's num_output_chunks


def test_lora_targets_use_each_architectures_names():
    assert translate_targets("gpt_neox", ("q_proj", "v_proj")) == ("query_key_value",)
    assert translate_targets("phi3", ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "down_proj")) == \
        ("qkv_proj", "gate_up_proj", "down_proj")
    assert translate_targets("llama", ("q_proj", "v_proj")) == ("q_proj", "v_proj")


def test_unmappable_rows_say_why():
    raw = {"id": "P999", "source": "github.com/x/y", "model": "T0_3B (T5-3B LM-adapted)", "params_B": "3",
           "mode": "finetune", "method": "LoRA", "measured_value": "14.4", "measured_unit": "GB(ambiguous)",
           "metric": "max_memory_allocated", "micro_batch_size": "8", "seq_len": "", "per_gpu": "yes"}
    row = map_row(raw)
    assert row["mapping_status"] == "unmapped" and "encoder-decoder" in row["mapping_reason"]
    with pytest.raises(ValueError, match="^measured_value: 'n/a' of P998"):
        map_row({**raw, "id": "P998", "measured_value": "n/a"})


def test_estimate_row_prices_a_mapped_run_and_not_an_unmapped_one():
    by = {p["published_id"]: p for p in ROWS}
    unmapped = next(p for p in ROWS if p["mapping_status"] == "unmapped")
    assert published.estimate_row(published.run_row(unmapped)) is None
    from estimator.estimate import Options, estimate
    from estimator.model import from_hf_config
    from estimator.presets import load_config
    from estimator.spec import Parallel, Workload

    p = by["P150"]  # litgpt, Llama-3.2-1B full fine-tuning, batch 4, seq 512, one A10G: a shipped class
    row = published.run_row(p)
    got = published.estimate_row(row)
    assert got is not None
    name, cfg = load_config("llama-3.2-1b")
    w = Workload(batch=4, seq=512, **{k: row[k] for k in ("mode", "method", "recipe", "precision", "optimizer",
                                                            "checkpointing", "attention")})
    assert got["allocated_bytes"] == estimate(from_hf_config(cfg, name, derive=False), w, Parallel(),
                                              Options(derive=False)).allocated_bytes
