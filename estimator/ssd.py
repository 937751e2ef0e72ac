"""When mamba_ssm's Mamba-2 backward splits its sums over more than one program per head group (no torch).

A training profile of a model with Mamba-2 mixers is traced on mamba_ssm's fused kernel with one split of dB, dC and
dCB (tracer.kernels_ssd): `_chunk_state_bwd_db`, `_chunk_scan_bwd_dC` and `_chunk_scan_bwd_dcb` allocate nsplits
partial sums, nsplits = cdiv(heads / groups, max(min(ceil(b * chunks * heads / SMs), heads / groups), 1)), and sum
them at once. Where a step's (b, s) gives nsplits > 1 on the GPU, each layer's backward holds (nsplits - 1) more fp32
copies for the moment of each sum; the estimate says so, with the bound.
"""
from __future__ import annotations

import math

from estimator.scans import SCAN_CHUNK_KEYS, has_ssm_keys

SM_COUNT = 132   # H100 SXM and H200 (tracer.kernels_ssd sizes the gated norm's partial weight gradient by it too)

_HEADS = ("num_heads", "mamba_n_heads", "mamba_num_heads", "n_mamba_heads")
_GROUPS = ("n_groups", "mamba_n_groups", "mamba_ngroups")
_STATE = ("state_size", "mamba_d_state", "ssm_state_size")
_PARAMS: dict = {}


def _first(cfg: dict, keys) -> int | None:
    for k in keys:
        v = cfg.get(k)
        if isinstance(v, int) and not isinstance(v, bool) and v > 0:
            return v
    return None


def scan_params(config: dict) -> tuple[int, int, int, int] | None:
    """(heads, groups, state, chunk) of a Mamba-2 mixer config (its text config for a multimodal one), or None."""
    for cfg in (config, config.get("text_config")):
        if not isinstance(cfg, dict) or not has_ssm_keys(cfg):
            continue
        vals = (_first(cfg, _HEADS), _first(cfg, _GROUPS), _first(cfg, _STATE), _first(cfg, SCAN_CHUNK_KEYS))
        if all(vals):
            return vals
    return None


def nsplits(b: int, s: int, heads: int, groups: int, chunk: int, sm_count: int = SM_COUNT) -> int:
    """mamba_ssm's nsplits for one (b, s) (ssd_chunk_state.py `_chunk_state_bwd_db`)."""
    ratio = heads // groups
    per_program = max(min(math.ceil(b * math.ceil(s / chunk) * heads / sm_count), ratio), 1)
    return -(-ratio // per_program)


def split_notes(config: dict, config_hash: str, mode: str, b: int, s: int) -> tuple[str, ...]:
    """A note where a training step at (b, s) splits the Mamba-2 backward sums on SM_COUNT SMs, else ()."""
    if mode != "train":
        return ()
    if config_hash not in _PARAMS:
        if len(_PARAMS) > 256:
            _PARAMS.clear()
        _PARAMS[config_hash] = scan_params(config)
    params = _PARAMS[config_hash]
    if params is None:
        return ()
    heads, groups, state, chunk = params
    n = nsplits(b, s, heads, groups, chunk)
    if n == 1:
        return ()
    chunks = math.ceil(s / chunk)
    extra = (n - 1) * 4 * b * max(s * groups * state, chunks * groups * chunk * chunk)
    return (f"mamba_ssm: at batch {b} x seq {s} a {SM_COUNT}-SM GPU splits each Mamba-2 layer's dB, dC and dCB "
            f"backward sums {n} ways (traced with one): up to {extra:,} B more for an instant "
            f"(tracer.kernels_ssd)",)
