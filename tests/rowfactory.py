"""`make_row(**overrides)`: a fully valid traced-style run row for tests, with a correct run_id.

The row is JSON-serialisable exactly as a JSONL line would carry it (created_at an ISO string, JSON
columns as JSON text). Overrides replace fields before run_id is computed, so changing an identity
field (batch, seq, model, ...) gives a new run_id; pass run_id=... to force one.

    from rowfactory import make_row
    row = make_row(batch=4, seq=1024)
"""
from __future__ import annotations

from bench.store.rows import COLUMN_NAMES, canonical_json, compute_run_id, config_hash

GiB = 2**30

# A tiny Llama-architecture config.json (hand-written, not fetched): 2 layers, hidden 64.
TINY_LLAMA_CONFIG = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
    "intermediate_size": 172, "num_attention_heads": 4, "num_key_value_heads": 2,
    "num_hidden_layers": 2, "vocab_size": 1000, "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
}


def make_row(**overrides) -> dict:
    """A valid traced training row of the tiny Llama; every column of bench.store.rows.COLUMNS is present."""
    config = overrides.pop("config", TINY_LLAMA_CONFIG)
    row = dict.fromkeys(COLUMN_NAMES)
    row.update({
        "source": "traced",
        "created_at": "2025-01-15T12:00:00Z",
        "contributor": "tests",
        "tool_version": "0.1.0",
        "gpu_name": "fake-cpu",
        "gpu_count": 1,
        "torch_version": "2.13.0",
        "transformers_version": "5.23.0",
        "python_version": "3.11.7",
        "model_name": "tiny-llama",
        "model_type": config["model_type"],
        "params": 291_456,
        "trainable_params": 291_456,
        "config_hash": config_hash(config),
        "config_json": canonical_json(config),
        "mode": "train",
        "method": "full",
        "lora_targets": "q_proj,v_proj",
        "recipe": "pure",
        "precision": "bf16",
        "weight_format": "auto",
        "optimizer": "adamw",
        "optimizer_impl": "foreach",
        "batch": 1,
        "seq": 128,
        "gen_tokens": 0,
        "grad_accum": 1,
        "checkpointing": "none",
        "attention": "sdpa",
        "kv_dtype": "auto",
        "strategy": "single",
        "world_size": 1,
        # stage peaks rise through the step; the overall peak is their maximum
        "load_peak_alloc_bytes": 600_000,
        "load_peak_reserved_bytes": 2 * 1024**2,
        "forward_peak_alloc_bytes": 1_400_000,
        "forward_peak_reserved_bytes": 2 * 1024**2,
        "backward_peak_alloc_bytes": 1_900_000,
        "backward_peak_reserved_bytes": 4 * 1024**2,
        "optimizer_peak_alloc_bytes": 2_500_000,
        "optimizer_peak_reserved_bytes": 4 * 1024**2,
        "peak_alloc_bytes": 2_500_000,
        "peak_reserved_bytes": 4 * 1024**2,
        "oom": False,
        "breakdown_json": canonical_json({"weights": 582_912, "gradients": 582_912, "optimizer": 1_165_824}),
        "notes": "made by tests/rowfactory.py",
    })
    row.update(overrides)
    if "run_id" not in overrides:
        row["run_id"] = compute_run_id(row)
    return row
