"""The device side of the verdict: what a process can get on a GPU, and the CUDA context it holds there.

    from estimator.device import capacity_bytes, context_bytes
    capacity_bytes(get_gpu("h100-sxm-80gb"))   # 85,017,493,504 B = 81079 MiB (cudaMemGetInfo total), not 81559 MiB
    context_bytes(get_gpu("h100-sxm-80gb"))    # CUDA context + kernel images, data/cuda_context.json

capacity: data/cuda_capacity.json, the total cudaMemGetInfo reports (what torch's OOM message calls "total
capacity"), which is below nvidia-smi's memory.total (data/gpus.json) by the driver's own reserve; a GPU without
a sourced entry gets memory.total minus the file's default reserve (the largest gap seen). The verdict compares
device_bytes = reserved + CUDA context + NCCL buffers (what nvidia-smi shows for the process) with it.

context: data/cuda_context.json, by the GPU's architecture. An entry measured after running work ('step') with
lazy module loading (torch's default since 1.13) is used as it is; a 'bare' entry (right after CUDA init) is a
lower bound, so the file's default (500 MiB: the largest bare context plus the kernel images a step loads) is
used when it is larger; eager-loading entries (torch < 1.13) are not used. No GPU given: the default.
Both files are read once and cached.
"""
from __future__ import annotations

import functools
import json
from pathlib import Path

from estimator.gpus import GPU

DATA = Path(__file__).resolve().parent.parent / "data"
CAPACITY_PATH = DATA / "cuda_capacity.json"
CONTEXT_PATH = DATA / "cuda_context.json"


@functools.cache
def _capacity(path: str) -> tuple[dict[str, int], int]:
    doc = json.loads(Path(path).read_text())
    entries = {e["gpu"]: int(e["cuda_total_bytes"]) for e in doc["entries"]}
    return entries, int(doc["default_reserve_bytes"])


def capacity_bytes(gpu: GPU, path: Path = CAPACITY_PATH) -> int:
    """Bytes a process can get on `gpu`: cudaMemGetInfo's total where a source reports it, else memory.total
    minus the default driver reserve (AMD entries too: rocm-smi's total is what hipMemGetInfo reports)."""
    entries, reserve = _capacity(str(path))
    if gpu.name in entries:
        return entries[gpu.name]
    if gpu.vendor != "nvidia" or gpu.memory_source != "driver":
        return gpu.memory_bytes
    return gpu.memory_bytes - reserve


def capacity_source(gpu: GPU, path: Path = CAPACITY_PATH) -> str:
    """Where capacity_bytes(gpu) comes from, in words (for the report and the app)."""
    entries, reserve = _capacity(str(path))
    if gpu.name in entries:
        return "cudaMemGetInfo total, data/cuda_capacity.json"
    if gpu.vendor != "nvidia" or gpu.memory_source != "driver":
        return f"{gpu.memory_source} total (data/gpus.json)"
    return f"nvidia-smi memory.total minus {reserve // 2**20} MiB driver reserve (data/cuda_capacity.json default)"


@functools.cache
def _context(path: str) -> tuple[tuple[dict, ...], int]:
    doc = json.loads(Path(path).read_text())
    return tuple(doc["entries"]), int(doc["default"]["bytes"])


def context_bytes(gpu: GPU | None = None, path: Path = CONTEXT_PATH) -> int:
    """CUDA context + loaded kernel images of a process that has run a step, for the GPU's architecture."""
    entries, default = _context(str(path))
    if gpu is None:
        return default
    mine = [e for e in entries if e.get("architecture") == gpu.architecture and e.get("lazy")]
    steps = [int(e["bytes"]) for e in mine if e.get("what") == "step"]
    if steps:
        return max(steps)
    return max([default, *(int(e["bytes"]) for e in mine)])


def clear_tables() -> None:
    """Forget the data files read so far (they are read again on next use)."""
    _capacity.cache_clear()
    _context.cache_clear()
