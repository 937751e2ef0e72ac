"""Where a run happened: library versions, the GPU and its driver, as run-row columns.

Shared by `trace` and `measure` so every row carries the versions that produced it. Every probe degrades to
None when its library or device is missing (CPU-only machines, no NVML, no transformers); nothing here
imports DuckDB, and torch is imported only inside the functions that need it.

NVML is read through `pynvml` (the `nvidia-ml-py` package). Its device indices are physical, while CUDA's
are renumbered by CUDA_VISIBLE_DEVICES, so `nvml_handle` maps one to the other without touching CUDA
(measuring the CUDA context needs an NVML reading taken *before* CUDA starts).
"""
from __future__ import annotations

import importlib.metadata
import os
import platform

# The willitfit version written into every row's tool_version; bump it when a change alters measured values.
TOOL_VERSION = "0.2.0"  # 0.2.0: the load stage starts once the model is built


def package_version(name: str) -> str | None:
    """Installed distribution version, read from metadata so the package itself is not imported."""
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def _pynvml():
    """The pynvml module, initialised; None when it is not installed or no NVIDIA driver is loaded."""
    try:
        import pynvml
        pynvml.nvmlInit()  # reference-counted by NVML itself, so repeated calls are cheap and safe
        return pynvml
    except Exception:  # ImportError, NVMLError_LibraryNotFound, NVMLError_DriverNotLoaded, ...
        return None


def driver_version() -> str | None:
    nvml = _pynvml()
    if nvml is None:
        return None
    try:
        return str(nvml.nvmlSystemGetDriverVersion())
    except Exception:
        return None


def nvml_handle(cuda_index: int):
    """NVML handle of the device CUDA calls `cuda_index`, honouring CUDA_VISIBLE_DEVICES; None if unavailable.

    CUDA_VISIBLE_DEVICES holds physical ordinals ("2,3") or UUIDs ("GPU-..."/"MIG-..."); torch does the same
    mapping in torch.cuda._get_nvml_device_index, which is private, so it is repeated here with public NVML calls.
    """
    nvml = _pynvml()
    if nvml is None:
        return None
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    try:
        if visible is None or not visible.strip():
            return nvml.nvmlDeviceGetHandleByIndex(cuda_index)
        entries = [e.strip() for e in visible.split(",") if e.strip()]
        if cuda_index >= len(entries):
            return None
        entry = entries[cuda_index]
        if entry.isdigit():
            return nvml.nvmlDeviceGetHandleByIndex(int(entry))
        return nvml.nvmlDeviceGetHandleByUUID(entry)
    except Exception:
        return None


def nvml_used_bytes(handle) -> int | None:
    """Device memory in use per NVML (`nvmlDeviceGetMemoryInfo(...).used`, the v1 struct, as
    torch.cuda.device_memory_used reads it): every process on the device, CUDA contexts included."""
    if handle is None:
        return None
    try:
        import pynvml
        return int(pynvml.nvmlDeviceGetMemoryInfo(handle).used)
    except Exception:
        return None


def software_fields() -> dict:
    """Version columns of a run row. cuda_version is the CUDA runtime torch was built with (torch.version.cuda)."""
    import torch
    return {
        "tool_version": TOOL_VERSION,
        "torch_version": torch.__version__,
        "transformers_version": package_version("transformers"),
        "python_version": platform.python_version(),
        "cuda_version": torch.version.cuda,
        "driver_version": driver_version(),
    }


def gpu_fields(cuda_index: int = 0) -> dict:
    """gpu_name and gpu_total_bytes of one CUDA device, or None for both without CUDA.

    Calling this initialises CUDA in the calling process (it asks the runtime for device properties);
    total_memory is cudaDeviceProp.totalGlobalMem, e.g. 81559 MiB on an "80 GB" H100.
    """
    import torch
    if not torch.cuda.is_available():
        return {"gpu_name": None, "gpu_total_bytes": None}
    props = torch.cuda.get_device_properties(cuda_index)
    return {"gpu_name": props.name, "gpu_total_bytes": int(props.total_memory)}


def extra_versions() -> dict:
    """Versions that have no column of their own (peft, nvidia-ml-py); measure writes them into notes."""
    return {"peft": package_version("peft"), "nvidia-ml-py": package_version("nvidia-ml-py")}


def environment_fields(cuda_index: int | None = 0) -> dict:
    """All environment columns; cuda_index=None skips the GPU (a CPU process, or one that must not init CUDA)."""
    gpu = gpu_fields(cuda_index) if cuda_index is not None else {"gpu_name": None, "gpu_total_bytes": None}
    return {**software_fields(), **gpu}
