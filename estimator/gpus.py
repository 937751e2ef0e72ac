"""GPU presets: `data/gpus.json` loaded into frozen `GPU` dataclasses.

    >>> from estimator.gpus import get_gpu
    >>> get_gpu("h100-sxm-80gb").memory_bytes   # 81559 MiB, what nvidia-smi shows as memory.total
    85520809984

The numbers are data, not code: each entry in the JSON cites where it comes from (see its `_sources`, each
entry's `notes` and docs/presets.md). Conventions, stated once here and in the file's `_conventions`:
- `memory_bytes` is the total the driver reports (nvidia-smi memory.total x 2**20, or rocm-smi bytes) when
  `memory_source == "driver"`, else the physical capacity. What CUDA can allocate is lower still (context and
  driver reserve); that reserve is the estimator's business, not this file's.
- throughputs are dense (no 2:4 sparsity) tensor-core TFLOP/s with FP32 accumulate, 10**12 FLOP/s;
  `bf16_dense_tflops` is None where the hardware has no BF16 (Volta, Turing).
- bandwidth is GB/s with GB = 10**9 bytes, as vendors quote it.
No torch here: this module is imported by the pure-Python estimator.
"""
from __future__ import annotations

import functools
import json
import re
from dataclasses import asdict, dataclass, fields
from pathlib import Path

from estimator.names import compact, did_you_mean

GPUS_PATH = Path(__file__).resolve().parent.parent / "data" / "gpus.json"

GiB = 2**30
GB = 10**9

VENDORS = ("nvidia", "amd")
MEMORY_SOURCES = ("driver", "marketing")
# Every shipped device has 12-288 GiB; these bounds only catch unit slips (MiB typed as bytes, GB as GiB x 1024).
MIN_MEMORY_BYTES = 1 * GiB
MAX_MEMORY_BYTES = 1024 * GiB
MAX_TFLOPS = 100_000.0       # 100 PFLOP/s dense per device is far above anything sold
MAX_BANDWIDTH_GBPS = 100_000.0
_NAME_RE = re.compile(r"^[a-z0-9][a-z0-9.-]*$")   # stable ids: lower-case, used in URLs, CLI flags and the DB


def _check_positive(name: str, value, hi: float) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name}: must be a number, got {value!r}")
    if not 0 < value <= hi:
        raise ValueError(f"{name}: {value} is out of range; allowed 0 < {name} <= {hi}")


@dataclass(frozen=True)
class GPU:
    """One device as a framework sees it (torch.cuda.device_count() counts it once)."""

    name: str                      # stable id, e.g. "h100-sxm-80gb"
    display_name: str              # e.g. "NVIDIA H100 SXM 80GB"
    vendor: str                    # one of VENDORS
    architecture: str              # e.g. "Hopper"
    memory_bytes: int              # driver-reported total (or physical capacity if memory_source == "marketing")
    memory_source: str             # "driver" | "marketing"
    memory_reported: str           # the raw figure behind memory_bytes, e.g. "81559 MiB (nvidia-smi memory.total)"
    marketing_memory: str          # as sold, e.g. "80 GB HBM3"
    bf16_dense_tflops: float | None  # None: no BF16 support on this hardware
    fp16_dense_tflops: float
    memory_bandwidth_gbps: float   # GB/s, GB = 10**9 bytes
    notes: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not _NAME_RE.match(self.name):
            raise ValueError(f"name: {self.name!r} is not a valid id; allowed lower-case letters, digits, '.', '-'")
        for field_name in ("display_name", "architecture", "memory_reported", "marketing_memory"):
            value = getattr(self, field_name)
            if not isinstance(value, str) or not value.strip():
                raise ValueError(f"{field_name}: must be a non-empty string, got {value!r}")
        if not isinstance(self.notes, str):
            raise ValueError(f"notes: must be a string, got {self.notes!r}")
        if self.vendor not in VENDORS:
            raise ValueError(f"vendor: {self.vendor!r} is not allowed; choose one of {', '.join(VENDORS)}")
        if self.memory_source not in MEMORY_SOURCES:
            raise ValueError(f"memory_source: {self.memory_source!r} is not allowed; "
                             f"choose one of {', '.join(MEMORY_SOURCES)}")
        if isinstance(self.memory_bytes, bool) or not isinstance(self.memory_bytes, int):
            raise ValueError(f"memory_bytes: must be an integer number of bytes, got {self.memory_bytes!r}")
        if not MIN_MEMORY_BYTES <= self.memory_bytes <= MAX_MEMORY_BYTES:
            raise ValueError(f"memory_bytes: {self.memory_bytes} is out of range; "
                             f"allowed {MIN_MEMORY_BYTES}..{MAX_MEMORY_BYTES}")
        if self.bf16_dense_tflops is not None:
            _check_positive("bf16_dense_tflops", self.bf16_dense_tflops, MAX_TFLOPS)
        _check_positive("fp16_dense_tflops", self.fp16_dense_tflops, MAX_TFLOPS)
        _check_positive("memory_bandwidth_gbps", self.memory_bandwidth_gbps, MAX_BANDWIDTH_GBPS)

    @property
    def memory_gib(self) -> float:
        return self.memory_bytes / GiB

    @property
    def supports_bf16(self) -> bool:
        return self.bf16_dense_tflops is not None


GPU_FIELDS = tuple(f.name for f in fields(GPU))


def gpu_from_dict(d: dict) -> GPU:
    """Build a GPU from one JSON entry; unknown or missing keys are errors, not silently dropped."""
    if not isinstance(d, dict):
        raise ValueError(f"gpu: each entry must be a JSON object, got {type(d).__name__}")
    unknown = sorted(set(d) - set(GPU_FIELDS))
    if unknown:
        raise ValueError(f"gpu: unknown keys {', '.join(unknown)}; allowed {', '.join(GPU_FIELDS)}")
    missing = [k for k in GPU_FIELDS if k not in d and k != "notes"]
    if missing:
        raise ValueError(f"gpu: entry {d.get('name', '?')!r} is missing {', '.join(missing)}")
    return GPU(**d)


def gpu_to_dict(gpu: GPU) -> dict:
    return asdict(gpu)


@functools.cache
def _load(path: str) -> tuple[GPU, ...]:
    doc = json.loads(Path(path).read_text())
    if not isinstance(doc, dict) or not isinstance(doc.get("gpus"), list):
        raise ValueError(f"gpu: {path} must be a JSON object with a 'gpus' list")
    gpus = tuple(gpu_from_dict(entry) for entry in doc["gpus"])
    # Names and display names are both lookup keys (case-insensitive), so neither may collide with any other.
    seen: dict[str, str] = {}
    for gpu in gpus:
        for key in {gpu.name.lower(), gpu.display_name.lower()}:
            if key in seen:
                raise ValueError(f"gpu: {key!r} names both {seen[key]!r} and {gpu.name!r} in {path}")
            seen[key] = gpu.name
    return gpus


@functools.cache
def _keys(path: str) -> dict[str, str]:
    """compact(name), compact(display_name) and compact(alias) -> name; the file's aliases must name a GPU and
    no two GPUs may share a key."""
    doc = json.loads(Path(path).read_text())
    keys: dict[str, str] = {}
    aliases = {k: v for k, v in (doc.get("aliases") or {}).items() if not k.startswith("_")}
    names = {gpu.name for gpu in _load(path)}
    pairs = [(s, gpu.name) for gpu in _load(path) for s in (gpu.name, gpu.display_name)] + list(aliases.items())
    for spelling, name in pairs:
        if name not in names:
            raise ValueError(f"gpu: alias {spelling!r} in {path} names no GPU ({name!r})")
        key = compact(spelling)
        if keys.setdefault(key, name) != name:
            raise ValueError(f"gpu: {spelling!r} names both {keys[key]!r} and {name!r} in {path}")
    return keys


def load_gpus(path: Path | str = GPUS_PATH) -> dict[str, GPU]:
    """All presets keyed by `name`, in file order. The parse is cached; the dict is a fresh copy each call."""
    return {gpu.name: gpu for gpu in _load(str(path))}


def gpu_names(path: Path | str = GPUS_PATH) -> list[str]:
    return [gpu.name for gpu in _load(str(path))]


def get_gpu(name: str, path: Path | str = GPUS_PATH) -> GPU:
    """Look a GPU up by `name`, `display_name` or an alias of data/gpus.json, ignoring case, spaces, '-', '_' and
    vendor words ("H100", "rtx4090", "4090", "a100-80gb", "NVIDIA L4"); else one line with "did you mean"."""
    found = _keys(str(path)).get(compact(name))
    if found is not None:
        return load_gpus(path)[found]
    hint = did_you_mean(str(name), gpu_names(path), "--list-gpus lists all", _keys(str(path)))
    raise ValueError(f"gpu: unknown GPU {str(name)[:60]!r}{hint}")


def clear_tables() -> None:
    """Forget the data files read so far (they are read again on next use)."""
    _load.cache_clear()
    _keys.cache_clear()
