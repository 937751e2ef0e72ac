"""The run row: one column list shared by `trace`, `measure`, `ingest`, `export` and `bench/store/schema.sql`.

A row is a flat dict. `COLUMNS` is the single definition of its fields (name, type, bounds, allowed values);
`bench/store/schema.sql` must declare exactly these columns (a test checks it), and `validate_row` checks an
untrusted row against them. This module imports neither torch nor duckdb, so the GPU measuring script can
use it on a machine that has no DuckDB.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass

from estimator import knobs, spec
from estimator.presets import config_hash as _hash

SOURCES = ("measured", "traced", "published")
STAGES = ("load", "forward", "backward", "optimizer", "prefill", "decode")
# published runs (bench/published/mapping.py): which counter a number is, its unit as published, the source's
# reliability class, how far the workload could be expressed
METRICS = ("allocated", "active", "reserved", "device", "tracemalloc", "capacity", "unknown")
UNITS = ("GB(1e9)", "GiB", "MiB", "GB(ambiguous)")
RELIABILITY = ("high", "medium", "low", "suspect", "derived")
MAPPING_STATUS = ("mapped", "partial", "unmapped")
MAX_TEXT = 256            # ordinary text fields
MAX_NOTES = 4096          # free-text notes and error messages
MAX_JSON = 262_144        # config_json, breakdown_json, per_rank_json
MAX_BYTES = 1 << 50       # 1 PiB: far above any GPU, catches unit mistakes (e.g. bytes * 1024)


@dataclass(frozen=True)
class Column:
    name: str
    kind: str                     # 'text' | 'int' | 'bytes' | 'float' | 'bool' | 'json' | 'timestamp'
    required: bool = False
    allowed: tuple[str, ...] = ()  # for enum text columns
    max_len: int = MAX_TEXT
    lo: float = 0
    hi: float = MAX_BYTES
    doc: str = ""


# The workload's columns, in the order migrations 001 and 004 created them; each column's type, bounds, allowed
# values and doc come from the field's declaration (estimator.spec.Workload), not from here.
WORKLOAD_001 = ("mode", "method", "lora_rank", "lora_targets", "recipe", "precision", "weight_format", "optimizer",
                "optimizer_impl", "batch", "seq", "gen_tokens", "grad_accum", "checkpointing", "attention", "kv_dtype")
WORKLOAD_004 = ("loop", "loss", "loss_chunks", "optimizer_in_backward", "activation_offload", "quantize_scope",
                "double_quant", "float8", "compile")


# Workload fields that are no run column: a vision encoder's image_size is resolved to its tokens per image before a
# run (estimator.vision.sized), and `seq` holds those tokens: the memory depends on them alone (with the config's
# patch size, in config_json, the image size is the square whose patches plus the CLS/register tokens make seq), so
# a run's identity and every query stay on seq, and no migration is needed. A vision-language model's images per
# sample (an audio-language model's clips, a speech model's seconds) have no column yet: a stored row is a text-only
# step (bench.trace.cases.unstorable refuses to store one with images or audio, or audio of another length).
# target_seq: an encoder-decoder model's decoder length
NOT_COLUMNS = ("image_size", "images", "audios", "audio_seconds", "target_seq")


def workload_row(w) -> dict:
    """A Workload's run-row columns (estimator.spec.spec_dict less NOT_COLUMNS)."""
    return {k: v for k, v in spec.spec_dict(w).items() if k not in NOT_COLUMNS}


def _knob_columns(names: tuple[str, ...]) -> list[Column]:
    by_name = {d.name: d for d in knobs.declared()}
    cols = []
    for name in names:
        d = by_name[name]
        k = d.knob
        if d.kind == "choice":
            cols.append(Column(name, "text", k.row_required, k.choices, doc=k.help))
        elif d.kind == "int":
            # lora_rank 0: rows of full fine-tunes written before it was declared say 0 for "no adapters"
            cols.append(Column(name, "int", k.row_required, lo=0 if name == "lora_rank" else k.lo, hi=k.hi,
                               doc=k.help))
        elif d.kind == "bool":
            cols.append(Column(name, "bool", k.row_required, doc=k.help))
        else:
            cols.append(Column(name, "text", k.row_required, doc=k.help))
    return cols


def _stage_columns() -> list[Column]:
    cols = []
    for st in STAGES:
        cols.append(Column(f"{st}_peak_alloc_bytes", "bytes", doc=f"peak allocated bytes during the {st} stage"))
        cols.append(Column(f"{st}_peak_reserved_bytes", "bytes", doc=f"peak reserved (caching allocator) bytes during {st}"))
    return cols


COLUMNS: tuple[Column, ...] = tuple([
    # identity and provenance
    Column("run_id", "text", True, max_len=64, doc="sha256 content hash of config, workload and environment (dedupe key)"),
    Column("source", "text", True, SOURCES, doc="measured on a GPU, traced on fake CPU tensors, or published by a third party"),
    Column("created_at", "timestamp", True, doc="UTC ISO-8601 time the row was produced"),
    Column("contributor", "text", doc="who produced the row (free text, e.g. a GitHub handle)"),
    Column("tool_version", "text", doc="willitfit version that produced the row"),
    # hardware and software
    Column("gpu_name", "text", doc="torch.cuda.get_device_name(), or 'fake-cpu' for traced rows"),
    Column("gpu_total_bytes", "bytes", doc="device memory as the driver reports it"),
    Column("gpu_count", "int", True, lo=1, hi=spec.MAX_GPUS, doc="GPUs in the run (world size)"),
    Column("driver_version", "text"),
    Column("cuda_version", "text"),
    Column("torch_version", "text", True),
    Column("transformers_version", "text"),
    Column("python_version", "text"),
    # the model
    Column("model_name", "text", True, doc="preset name, or the config file's name"),
    Column("model_type", "text", True, max_len=64, doc="config.json model_type"),
    Column("params", "int", True, lo=1, hi=1e14, doc="total parameters"),
    Column("trainable_params", "int", lo=0, hi=1e14, doc="parameters with requires_grad"),
    Column("config_hash", "text", True, max_len=64, doc="sha256 of the canonical config JSON"),
    Column("config_json", "json", max_len=MAX_JSON, doc="the model config.json itself"),
    # the workload (same vocabulary as the estimator CLI)
    *_knob_columns(WORKLOAD_001),
    Column("strategy", "text", True, spec.STRATEGIES),
    Column("world_size", "int", True, lo=1, hi=spec.MAX_GPUS),
    # results
    *_stage_columns(),
    Column("peak_alloc_bytes", "bytes", doc="overall peak allocated bytes (max over stages and ranks)"),
    Column("peak_reserved_bytes", "bytes", doc="overall peak reserved bytes"),
    Column("nvml_used_bytes", "bytes", doc="device memory in use per NVML at the peak (includes context)"),
    Column("cuda_context_bytes", "bytes", doc="NVML used after CUDA init, before any tensor"),
    Column("oom", "bool", True, doc="the run hit CUDA out-of-memory"),
    Column("oom_stage", "text", allowed=STAGES, doc="stage in which the OOM happened"),
    Column("oom_message", "text", max_len=MAX_NOTES),
    Column("step_time_s", "float", lo=0, hi=1e7),
    Column("breakdown_json", "json", max_len=MAX_JSON, doc="bytes per category at the peak (traced runs)"),
    Column("per_rank_json", "json", max_len=MAX_JSON, doc="per-rank peaks for multi-GPU runs"),
    Column("notes", "text", max_len=MAX_NOTES),
    # migration 004: the training-loop and recipe knobs of the workload, the tracer's kernels, the allocator
    *_knob_columns(WORKLOAD_004),
    Column("kernels", "text", allowed=("cuda", "cpu"), doc="traced rows: CUDA's kernels emulated, or the CPU's own"),
    Column("alloc_conf", "text", doc="PYTORCH_CUDA_ALLOC_CONF of a measured run (empty: torch's defaults)"),
    # migration 005: the workload's CPU offload, and the published tier (bench/published/importer.py)
    Column("offload", "text", allowed=spec.OFFLOADS, doc="CPU offload of optimizer states (and parameters)"),
    Column("published_id", "text", max_len=16, doc="published runs: the row's id in data/published/points.csv"),
    Column("metric", "text", allowed=METRICS, doc="published runs: which counter the number is"),
    Column("measured_unit", "text", allowed=UNITS, doc="published runs: the unit as published"),
    Column("per_gpu", "bool", doc="published runs: the number is per GPU"),
    Column("published_value_bytes", "bytes", doc="published runs: the published number in bytes, any metric"),
    Column("reliability", "text", allowed=RELIABILITY, doc="published runs: how well the source states its setup"),
    Column("source_repo", "text", doc="published runs: where it was published"),
    Column("source_section", "text", max_len=MAX_NOTES, doc="published runs: file or section"),
    Column("source_version", "text", max_len=MAX_NOTES, doc="published runs: commit or date"),
    Column("source_url", "text", doc="published runs: a link to the source"),
    Column("mapping_status", "text", allowed=MAPPING_STATUS, doc="published runs: how far the workload is expressed"),
    Column("mapping_reason", "text", max_len=MAX_NOTES, doc="published runs: what could not be expressed"),
    Column("field_origins", "json", max_len=MAX_JSON, doc="published runs: each workload field stated or inferred"),
])
COLUMN_NAMES: tuple[str, ...] = tuple(c.name for c in COLUMNS)
BY_NAME = {c.name: c for c in COLUMNS}

# Fields that define *what* was run, and where. Two rows equal on these are the same experiment.
IDENTITY_FIELDS = (
    "source", "gpu_name", "gpu_count", "torch_version", "transformers_version", "config_hash",
    "mode", "method", "lora_rank", "lora_targets", "recipe", "precision", "weight_format", "optimizer",
    "optimizer_impl", "batch", "seq", "gen_tokens", "grad_accum", "checkpointing", "attention", "kv_dtype",
    "strategy", "world_size",
)
# Identity fields added after rows existed (migration 004): they join the hash only when they differ from
# their default, so every run_id computed before them stays the same.
LATER_IDENTITY_DEFAULTS = {
    "loop": "loss-only", "loss": "full", "loss_chunks": 8, "optimizer_in_backward": False,
    "activation_offload": False, "quantize_scope": "all", "double_quant": True, "float8": False,
    "compile": False, "kernels": "cuda", "alloc_conf": "",
    "offload": "none", "published_id": None,
}


def canonical_json(obj) -> str:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True)


def config_hash(config: dict) -> str:
    """The config's sha256 (estimator.presets.config_hash, so rows and profiles share one key)."""

    return _hash(config)


def compute_run_id(row: dict) -> str:
    """sha256 over the identity fields; missing fields hash as null so it can be computed before the run."""
    ident = {k: row.get(k) for k in IDENTITY_FIELDS}
    ident.update({k: row[k] for k, default in LATER_IDENTITY_DEFAULTS.items()
                  if row.get(k) is not None and row[k] != default})
    return hashlib.sha256(canonical_json(ident).encode()).hexdigest()
