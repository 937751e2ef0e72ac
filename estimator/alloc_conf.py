"""`PYTORCH_CUDA_ALLOC_CONF` parsed as torch 2.13 parses it, into a frozen `AllocatorConfig`.

Sources (torch 2.13.0; the headers are the ones shipped in the installed wheel, `torch/include/`):
- `c10/core/AllocatorConfig.h` lines 16-25 (the size constants), 35-130 (`ConfigTokenizer`: ',' ':' '[' ']' are
  tokens of their own, whitespace is dropped, booleans are exactly `True` / `False`), 340-353 (defaults).
- `c10/core/AllocatorConfig.cpp` (pytorch main, the version that added `large_segment_size_mb`): lines 83-101
  `parseLargeSegmentSize` (> 10), 104-121 `parseMaxSplitSize` and 123-140 `parseMaxNonSplitRoundingSize`
  (>= large_segment_size_mb), 142-153 `parseGarbageCollectionThreshold` (in (0, 1)), 155-221
  `parseRoundUpPower2Divisions`, 241-298 `parseArgs` (large_segment_size_mb is read first, whatever its position;
  `,` between options; an unknown key is refused).
- `c10/cuda/CUDAAllocatorConfig.h` lines 158-175 (`getKeys`: the CUDA-only keys) and the libc10 strings of the
  installed 2.13.0 wheel (`pinned_max_round_threshold_mb`, `pinned_max_cached_size_mb` are accepted there).

Stricter than torch in one place: torch reads numbers with `std::stoull` / `std::stod`, which take a numeric
prefix and ignore the rest (`max_split_size_mb:40MB` is 40 there); here a value must be a number and nothing else.
`backend:cudaMallocAsync` is valid in torch but refused here: that allocator (the driver's stream-ordered pool) is
not modelled.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

MiB = 2**20
UNLIMITED = 2**64 - 1          # torch's std::numeric_limits<size_t>::max(): "no limit"
N_ROUNDUP_INTERVALS = 16       # kRoundUpPowerOfTwoIntervals: one division count per power of two, 1 MiB .. 64 GiB
K_LARGE_BUFFER = 20 * MiB      # default large_segment_size (AllocatorConfig.h line 340)
K_MIN_LARGE_ALLOC_MB = 10      # kMinLargeAlloc / kMB: large_segment_size_mb must exceed it
PINNED_MAX_REGISTER_THREADS = 128   # CUDAAllocatorConfig.h pinned_max_register_threads()


@dataclass(frozen=True)
class AllocatorConfig:
    """The settings of the native caching allocator that change device memory, plus the host-side ones torch
    accepts (kept so a parsed string round-trips; the model ignores them). All sizes in bytes."""
    max_split_size_bytes: int = UNLIMITED        # blocks at or above this are never split (default: no limit)
    max_non_split_rounding_bytes: int = K_LARGE_BUFFER   # an oversize block serves requests up to this much smaller
    large_segment_bytes: int = K_LARGE_BUFFER    # segment size for requests in (1 MiB, 10 MiB); expandable page
    roundup_power2_divisions: tuple[int, ...] = (0,) * N_ROUNDUP_INTERVALS   # per power-of-two interval from 1 MiB
    garbage_collection_threshold: float = 0.0    # 0 = off; else reclaim cached blocks above this fraction
    expandable_segments: bool = False            # one growing virtual segment per pool instead of cudaMalloc
    backend: str = "native"
    release_lock_on_cudamalloc: bool = False     # threading only; no effect on the bytes
    graph_capture_record_stream_reuse: bool = False
    per_process_memory_fraction: float = 1.0     # as torch.cuda.set_per_process_memory_fraction
    throw_on_cudamalloc_oom: bool = False
    pinned_use_cuda_host_register: bool = False  # pinned host memory: not device memory, not modelled
    pinned_num_register_threads: int = 1
    pinned_use_background_threads: bool = False
    pinned_reserve_segment_size_mb: int = 0
    pinned_max_round_threshold_mb: int | None = None
    pinned_max_cached_size_mb: int | None = None
    pinned_free_catch_all: bool = False
    source: str = field(default="", compare=False)   # the string it was parsed from

    def __post_init__(self):
        if len(self.roundup_power2_divisions) != N_ROUNDUP_INTERVALS:
            raise ValueError(f"roundup_power2_divisions: needs {N_ROUNDUP_INTERVALS} entries (1 MiB .. 64 GiB), "
                             f"got {len(self.roundup_power2_divisions)}")
        if any(d != 0 and not _pow2(d) for d in self.roundup_power2_divisions):
            raise ValueError("roundup_power2_divisions: every division must be 0 or a power of 2")
        if self.large_segment_bytes <= K_MIN_LARGE_ALLOC_MB * MiB or self.large_segment_bytes % MiB:
            raise ValueError("large_segment_bytes: must be a whole number of MiB above 10 MiB")
        if self.max_split_size_bytes < self.large_segment_bytes:
            raise ValueError("max_split_size_bytes: must be >= large_segment_bytes")
        if self.max_non_split_rounding_bytes < self.large_segment_bytes:
            raise ValueError("max_non_split_rounding_bytes: must be >= large_segment_bytes")
        if not (self.garbage_collection_threshold == 0.0 or 0.0 < self.garbage_collection_threshold < 1.0):
            raise ValueError("garbage_collection_threshold: must be 0 (off) or in (0.0, 1.0)")
        if not 0.0 <= self.per_process_memory_fraction <= 1.0:
            raise ValueError("per_process_memory_fraction: must be in [0.0, 1.0]")
        if self.backend != "native":
            raise ValueError(f"backend: only 'native' is modelled, got {self.backend!r}")

    def divisions_for(self, size: int) -> int:
        """AcceleratorAllocatorConfig::roundup_power2_divisions(size) (AllocatorConfig.cpp lines 65-81): the
        division count of the power-of-two interval holding `size`; intervals start at 1 MiB, the last is open."""
        index = min(max(size.bit_length() - 1 - 20, 0), N_ROUNDUP_INTERVALS - 1)
        return self.roundup_power2_divisions[index]


def _pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


# key -> (kind, the allowed values in words); kind picks the value parser below
_BOOL = "True or False"
KEYS: dict[str, tuple[str, str]] = {
    "large_segment_size_mb": ("int", "an integer > 10 (MiB)"),
    "max_split_size_mb": ("int", "an integer (MiB) >= large_segment_size_mb (default 20)"),
    "max_non_split_rounding_mb": ("int", "an integer (MiB) >= large_segment_size_mb (default 20)"),
    "garbage_collection_threshold": ("float", "a number in (0.0, 1.0)"),
    "roundup_power2_divisions": ("divisions", "a power of 2, or a list like [256:1,512:2,>:8] of "
                                 "power-of-2 MiB boundaries (or >) to 0 or a power of 2"),
    "expandable_segments": ("bool", _BOOL),
    "pinned_use_background_threads": ("bool", _BOOL),
    "pinned_max_round_threshold_mb": ("int", "a non-negative integer (MiB)"),
    "pinned_max_cached_size_mb": ("int", "a non-negative integer (MiB)"),
    "backend": ("word", "native (cudaMallocAsync is valid in torch but not modelled)"),
    "release_lock_on_cudamalloc": ("bool", _BOOL),
    "release_lock_on_hipmalloc": ("bool", _BOOL),
    "pinned_use_cuda_host_register": ("bool", _BOOL),
    "pinned_use_hip_host_register": ("bool", _BOOL),
    "graph_capture_record_stream_reuse": ("bool", _BOOL),
    "pinned_reserve_segment_size_mb": ("int", "a non-negative integer (MiB)"),
    "pinned_num_register_threads": ("int", f"a power of 2 <= {PINNED_MAX_REGISTER_THREADS}"),
    "per_process_memory_fraction": ("float", "a number in [0.0, 1.0]"),
    "pinned_free_catch_all": ("bool", _BOOL),
    "throw_on_cudamalloc_oom": ("bool", _BOOL),
}
_FIELD = {"release_lock_on_hipmalloc": "release_lock_on_cudamalloc",
          "pinned_use_hip_host_register": "pinned_use_cuda_host_register"}


def tokenize(text: str) -> list[str]:
    """ConfigTokenizer (AllocatorConfig.h lines 35-53): ',' ':' '[' ']' are tokens; whitespace is dropped."""
    tokens, buf = [], []
    for ch in text:
        if ch in ",:[]":
            if buf:
                tokens.append("".join(buf))
                buf = []
            tokens.append(ch)
        elif not ch.isspace():
            buf.append(ch)
    if buf:
        tokens.append("".join(buf))
    return tokens


class _Tokens:
    """The token list with torch's checks, each failing as one line that names the key being read."""

    def __init__(self, tokens: list[str]):
        self.t = tokens

    def at(self, i: int, key: str) -> str:
        if i >= len(self.t):
            raise ValueError(f"{key}: value missing at the end of PYTORCH_CUDA_ALLOC_CONF")
        return self.t[i]

    def expect(self, i: int, token: str, key: str) -> None:
        got = self.at(i, key)
        if got != token:
            raise ValueError(f"{key}: expected {token!r} in PYTORCH_CUDA_ALLOC_CONF, got {got!r}")

    def value(self, i: int, key: str) -> str:
        v = self.at(i, key)
        if v in ",:[]":
            raise ValueError(f"{key}: expected {KEYS[key][1]}, got {v!r}")
        return v


def _int(text: str, key: str) -> int:
    if not text.isdigit():
        raise ValueError(f"{key}: expected {KEYS[key][1]}, got {text!r}")
    return int(text)


def _float(text: str, key: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise ValueError(f"{key}: expected {KEYS[key][1]}, got {text!r}") from None
    if math.isnan(v):
        raise ValueError(f"{key}: expected {KEYS[key][1]}, got {text!r}")
    return v


def _divisions(tok: _Tokens, i: int) -> tuple[tuple[int, ...], int]:
    """parseRoundUpPower2Divisions (AllocatorConfig.cpp lines 155-221). The list form sets one interval per
    power-of-two boundary in MiB (index log2(boundary), clamped to 0..15); the first entry also fills every
    interval below it; '>' fills every interval after the last one named. Returns the table and the index of
    the value's last token."""
    key = "roundup_power2_divisions"
    table = [0] * N_ROUNDUP_INTERVALS
    first = tok.value(i, key) if tok.at(i, key) != "[" else "["
    if first != "[":
        d = _int(first, key)
        if not _pow2(d):
            raise ValueError(f"{key}: the single-number form must be a power of 2, got {d}")
        return (d,) * N_ROUNDUP_INTERVALS, i
    last_index, first_value = 0, True
    i += 1
    while tok.at(i, key) != "]":
        bound = tok.value(i, key)
        tok.expect(i + 1, ":", key)
        d = _int(tok.value(i + 2, key), key)
        if d != 0 and not _pow2(d):
            raise ValueError(f"{key}: divisions must be 0 or a power of 2, got {d}")
        if bound == ">":
            for j in range(last_index + 1, N_ROUNDUP_INTERVALS):
                table[j] = d
        else:
            b = _int(bound, key)
            if not _pow2(b):
                raise ValueError(f"{key}: interval boundaries must be powers of 2 (MiB), got {b}")
            index = min(b.bit_length() - 1, N_ROUNDUP_INTERVALS - 1)
            if first_value:
                for j in range(index):
                    table[j] = d
                first_value = False
            table[index] = d
            last_index = index
        i += 3
        if tok.at(i, key) != "]":
            tok.expect(i, ",", key)
            i += 1
    return tuple(table), i


def parse_alloc_conf(text: str | None) -> AllocatorConfig:
    """`PYTORCH_CUDA_ALLOC_CONF` -> AllocatorConfig, following AcceleratorAllocatorConfig::parseArgs and
    CUDAAllocatorConfig::parseArgs. Empty or None gives the defaults. A bad key or value raises ValueError in one
    line naming the key and what is allowed."""
    text = text or ""
    tok = _Tokens(tokenize(text))
    t = tok.t
    values: dict = {}
    # large_segment_size_mb first: the minimum of the two split sizes depends on it (parseArgs lines 255-263)
    large_mb = K_LARGE_BUFFER // MiB
    for i, token in enumerate(t):
        if token == "large_segment_size_mb" and (i == 0 or t[i - 1] == ","):
            tok.expect(i + 1, ":", token)
            large_mb = _int(tok.value(i + 2, token), token)
            if large_mb <= K_MIN_LARGE_ALLOC_MB:
                raise ValueError(f"large_segment_size_mb: must be > {K_MIN_LARGE_ALLOC_MB} (MiB), got {large_mb}")
    values["large_segment_bytes"] = large_mb * MiB
    values["max_non_split_rounding_bytes"] = large_mb * MiB
    i = 0
    while i < len(t):
        key = t[i]
        if key not in KEYS:
            raise ValueError(f"PYTORCH_CUDA_ALLOC_CONF: unrecognized key {key!r}; allowed: {', '.join(KEYS)}")
        tok.expect(i + 1, ":", key)
        i = _parse_value(tok, key, i + 2, values, large_mb)
        if i + 1 < len(t):
            tok.expect(i + 1, ",", key)
            i += 2
        else:
            i += 1
    return AllocatorConfig(**values, source=text)


def _parse_value(tok: _Tokens, key: str, i: int, values: dict, large_mb: int) -> int:
    """Read the value of `key` starting at token i into `values`; return the index of its last token."""
    kind, allowed = KEYS[key]
    if kind == "divisions":
        values["roundup_power2_divisions"], i = _divisions(tok, i)
        return i
    raw = tok.value(i, key)
    name = _FIELD.get(key, key)
    if kind == "bool":
        if raw not in ("True", "False"):
            raise ValueError(f"{key}: expected True or False, got {raw!r}")
        values[name] = raw == "True"
    elif kind == "word":
        if raw == "cudaMallocAsync":
            raise ValueError("backend: cudaMallocAsync (the driver's stream-ordered allocator) is not modelled; "
                             "only native is")
        if raw != "native":
            raise ValueError(f"backend: expected native or cudaMallocAsync, got {raw!r}")
        values["backend"] = raw
    elif kind == "float":
        v = _float(raw, key)
        ok = 0.0 < v < 1.0 if key == "garbage_collection_threshold" else 0.0 <= v <= 1.0
        if not ok:
            raise ValueError(f"{key}: expected {allowed}, got {raw}")
        values[name] = v
    elif key == "large_segment_size_mb":
        pass                                              # read in the first pass
    else:
        v = _int(raw, key)
        if key in ("max_split_size_mb", "max_non_split_rounding_mb"):
            if v < large_mb:
                raise ValueError(f"{key}: too small, must be >= {large_mb} (large_segment_size_mb), got {v}")
            v = min(v, UNLIMITED // MiB) * MiB
            values["max_split_size_bytes" if key == "max_split_size_mb" else "max_non_split_rounding_bytes"] = v
        elif key == "pinned_num_register_threads":
            if not _pow2(v) or v > PINNED_MAX_REGISTER_THREADS:
                raise ValueError(f"{key}: expected {allowed}, got {v}")
            values[name] = v
        else:
            values[name] = v
    return i
