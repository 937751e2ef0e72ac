"""Hybrid and state-space LMs at full size: the estimate against a full-depth trace of transformers' default config.

    python scripts/hybrid_check.py                       # every case below (about 10 minutes on 2 cores)
    python scripts/hybrid_check.py --case mamba2-full-b1-s4000 --case qwen3_next-lora-b2-s3000
    python scripts/hybrid_check.py --list

Each case builds its model type from its config class's defaults (`AutoConfig.for_model(type)`: 7-80 B parameters),
derives the profile the estimate needs (empty cache: a temporary WILLITFIT_CACHE), and traces the whole model at the
same batch and sequence on fake tensors with the CUDA kernels emulated (`bench.trace.cases.trace_case`, two steps).
Every stage's tensor bytes must be equal; the script prints a row per case (estimate, trace, difference, the
derivation's traces and seconds, the estimate's notes) and exits 1 if any differs. Prints; writes nothing else.
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

import fullsize_check  # noqa: E402  (scripts/, beside this file)

# (name, model type, method, LoRA targets or None, batch, seq[, checkpointing]): seqs off the chunk multiples, past
# chunk boundaries
CASES = (
    ("mamba2-full-b1-s4000", "mamba2", "full", None, 1, 4000),
    ("mamba2-lora-b4-s8192", "mamba2", "lora", ("in_proj",), 4, 8192),
    ("nemotron_h-full-b2-s3000", "nemotron_h", "full", None, 2, 3000),
    ("nemotron_h-lora-b8-s8192", "nemotron_h", "lora", ("in_proj", "q_proj", "v_proj"), 8, 8192),
    ("bamba-lora-b1-s4100", "bamba", "lora", ("in_proj", "out_proj", "q_proj", "v_proj"), 1, 4100),
    ("granitemoehybrid-full-b2-s2048", "granitemoehybrid", "full", None, 2, 2048),
    ("falcon_h1-full-b1-s2500", "falcon_h1", "full", None, 1, 2500),
    ("zamba2-full-b1-s3000", "zamba2", "full", None, 1, 3000),
    ("qwen3_next-lora-b2-s3000", "qwen3_next", "lora", None, 2, 3000),
    ("qwen3_5_text-full-b1-s5000", "qwen3_5_text", "full", None, 1, 5000),
    ("kimi_linear-lora-b1-s3000", "kimi_linear", "lora", None, 1, 3000),
    ("jamba-lora-b1-s5000", "jamba", "lora", None, 1, 5000),
    ("falcon_mamba-full-b2-s3000", "falcon_mamba", "full", None, 2, 3000),
    ("qwen3_next-lora-ckpt-b8-s8192", "qwen3_next", "lora", None, 8, 8192, "full"),
    # MiniMax's lightning attention: a Python loop over 256-token blocks (tracer.time_loop), the last one partial
    ("minimax-lora-b2-s3000", "minimax", "lora", None, 2, 3000),
)


def run_case(case) -> tuple[bool, str]:
    from transformers import AutoConfig

    from bench.trace.cases import trace_case
    from estimator.estimate import estimate
    from estimator.model import from_hf_config
    from estimator.spec import Workload

    name, model_type, method, targets, b, s, *ckpt = case
    cfg = {**AutoConfig.for_model(model_type).to_diff_dict(), "model_type": model_type}
    cfg.pop("transformers_version", None)
    attention = "eager" if model_type in ("mamba2", "falcon_mamba") else "sdpa"
    w = Workload(batch=b, seq=s, mode="train", method=method, attention=attention, checkpointing=(ckpt or ["none"])[0],
                 **({"lora_targets": targets} if targets else {}))
    t = time.perf_counter()
    est = estimate(from_hf_config(cfg, model_type), w)
    derive_s = time.perf_counter() - t
    row = trace_case(cfg, model_type, w, steps=2)
    got = {n: st.tensor_bytes for n, st in est.stages}
    want = {n: row[f"{n}_peak_alloc_bytes"] for n in got}
    peak = max(want.values())
    diff = max(abs(got[n] - want[n]) for n in got)
    line = (f"{name:34s} {'equal' if diff == 0 else 'DIFFERS'}  peak {peak:>18,} B  largest stage difference "
            f"{diff:,} B  ({est.profile.get('traces')} traces, {derive_s:.1f} s)"
            + "".join(f"\n    note: {n}" for n in est.notes if n.startswith(("mamba_ssm", "scope"))))
    return diff == 0, line


def main(argv=None) -> int:
    return fullsize_check.main(__doc__, CASES, run_case, "willitfit-hybrid-", 34, argv)


if __name__ == "__main__":
    sys.exit(main())
