"""Which chunked sequence kernels a config's layers run, read from the config (no torch): the chunk that sizes their
states, so a profile is fit in q = chunk * ceil(s / chunk) (estimator.profile.poly.scan_monomials), and the words an
estimate says about the code it assumes (docs/activations.md). The tracer's derivation reads it; estimator.ssd reads
its keys too.
"""
from __future__ import annotations


SCAN_CHUNK_KEYS = ("mamba_chunk_size", "chunk_size")   # Mamba-2 style chunked scans (SSD)
GDN_KEYS = ("linear_num_value_heads", "linear_key_head_dim",   # Gated DeltaNet layers (Qwen3-Next, Qwen3.5, ...)
            "linear_num_heads", "linear_head_dim")              # and KDA layers (Kimi-Linear, Bailing-Hybrid)
GDN_CHUNK = ("fla chunk_size", 64)     # flash-linear-attention's default chunk: its states are (b, chunks, ...)
MAMBA1_KEYS = ("time_step_rank", "mamba_dt_rank")              # Mamba-1 mixers (Mamba, Falcon-Mamba, Jamba)
MAMBA1_CHUNK = ("selective_scan chunk", 2048)   # mamba_ssm selective_scan.cpp: states per 2048 tokens
LIGHTNING_KEY = "block_size"   # MiniMax's lightning attention: a Python loop over blocks of this many positions


def has_ssm_keys(d: dict) -> bool:
    """Whether a config's keys are a state-space mixer's (a `mamba`/`ssm` key, or a state size)."""
    return any("mamba" in k or "ssm" in k or k in ("state_size", "d_state") for k in d)


def chunked_scan(cfg) -> tuple[str, int] | None:
    """(key, chunk) when the model runs a chunked state-space scan: its chunk tensors (mamba_ssm's kernels on a GPU,
    tracer.kernels_ssm; transformers' torch reference pads s to the chunk) are sized by ceil(s / chunk), so its
    memory is a polynomial in b, s and q = chunk * ceil(s / chunk) (estimator.profile.poly.scan_monomials). Read
    from the config (a transformers config or its config.json dict: a chunk key beside state-space keys), not from a
    list of families."""
    for c in (cfg, cfg.get("text_config") if isinstance(cfg, dict) else getattr(cfg, "text_config", None)):
        if c is None:
            continue
        d = c if isinstance(c, dict) else vars(c)
        ssm = has_ssm_keys(d)
        for k in SCAN_CHUNK_KEYS:
            v = d.get(k)
            if ssm and isinstance(v, int) and not isinstance(v, bool) and v > 1:
                return k, v
        if any(k in d for k in GDN_KEYS):   # Gated DeltaNet layers: fla's chunked kernels (tracer.kernels_gdn)
            return GDN_CHUNK
        if ssm and any(k in d for k in MAMBA1_KEYS):   # Mamba-1: the selective scan's 2048-token chunk states
            return MAMBA1_CHUNK
        block = d.get(LIGHTNING_KEY)   # MiniMax: its blocks' products and outputs (tracer.time_loop)
        if "linear_attn_alpha_factor" in d and isinstance(block, int) and not isinstance(block, bool) and block > 1:
            return LIGHTNING_KEY, block
    return None


def scan_path(scan: tuple[str, int], train: bool = False) -> str:
    """Which code the profile's chunked layers ran (said with every estimate: docs/activations.md)."""
    if scan == MAMBA1_CHUNK:
        return ("Mamba-1 mixers on mamba_ssm's selective scan (its chunk states per 2048 tokens) and causal_conv1d "
                "(installed beside transformers on the GPU)" + ("; training on mamba_inner_fn (Mamba, Falcon-Mamba) "
                                                                "or selective_scan_fn (Jamba)" if train else ""))
    if scan[0] == LIGHTNING_KEY:
        return (f"MiniMax's lightning attention as transformers runs it on a GPU too: a Python loop over blocks of "
                f"{scan[1]} positions (block_size), each block's products saved (tracer.time_loop)")
    if scan == GDN_CHUNK:
        return ("Gated DeltaNet / KDA layers on flash-linear-attention's chunk_gated_delta_rule or chunk_kda (chunk 64) "
                "and their fused recurrent kernels, with causal_conv1d (installed beside transformers on the GPU)")
    return (f"Mamba-2 mixers on mamba_ssm's chunk scan and causal_conv1d (installed beside transformers on the GPU), "
            f"{scan[0]}={scan[1]}" + ("; training on mamba_ssm's fused mamba_split_conv1d_scan_combined with one "
                                      "split of its dB, dC and dCB sums (tracer.kernels_ssd)" if train else ""))
