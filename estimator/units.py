"""Units. Everything inside willitfit is integer bytes; these are the only conversions, used at the edges."""
from __future__ import annotations

KiB = 2**10
MiB = 2**20
GiB = 2**30   # binary: what torch.cuda and nvidia-smi (MiB) report
GB = 10**9    # decimal: what GPU marketing ("80 GB") and the seed posts use

DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2, "fp8": 1, "int8": 1}


def dtype_bytes(name: str) -> int:
    """Bytes per element of a plain (unquantized) dtype."""
    try:
        return DTYPE_BYTES[name]
    except KeyError:
        raise ValueError(f"dtype: {name!r} is not a plain dtype; choose one of {', '.join(DTYPE_BYTES)}") from None


def gib(n_bytes: int | float) -> float:
    return n_bytes / GiB


def gb(n_bytes: int | float) -> float:
    return n_bytes / GB


def fmt_bytes(n_bytes: int | float, unit: str = "GiB", digits: int = 2) -> str:
    """The one formatting function: '12.55 GiB' or '13.48 GB', unit always spelled out."""
    div = {"GiB": GiB, "GB": GB, "MiB": MiB, "MB": 10**6, "B": 1}[unit]
    return f"{n_bytes / div:,.{digits}f} {unit}"
