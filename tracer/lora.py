"""The LoRA adapters a model gets by default: PEFT's own mapping, one function for every tier above.

`default_lora_targets(model_type)` is what `peft.LoraConfig(target_modules=None)` would pick
(`TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING`), with two kinds of exception:

- NOT_IN_PEFT: types PEFT has no default for (it asks for target_modules) whose attention has no q_proj/v_proj:
  the fused or low-rank projections that play their part;
- ATTENTION_ONLY: types where PEFT's default also adapts the MLP (Phi: fc1, fc2); here, as for every other type,
  the default adapts attention only (the shipped phi profiles were derived so).

Any other type gets ("q_proj", "v_proj"), `Workload.lora_targets`' default.
"""
from __future__ import annotations

from estimator.spec import Workload
from estimator.store import is_rank_variable

FALLBACK = ("q_proj", "v_proj")
NOT_IN_PEFT = {
    "phi3": ("qkv_proj",),                      # one fused q/k/v projection
    "deepseek_v3": ("q_b_proj", "kv_b_proj"),   # MLA: the up-projections out of the low-rank q and kv
}
ATTENTION_ONLY = {"phi": ("q_proj", "v_proj")}  # PEFT: q_proj, v_proj, fc1, fc2


DEFAULTS_FILE = "lora_defaults.json"   # data/: this table for the tiers that import no torch (estimator.presets)


def defaults_table() -> dict[str, list[str]]:
    """Every model type PEFT or the exceptions name, with its default targets: what `python -m tracer.lora` writes
    to data/lora_defaults.json (tests/test_lora_defaults.py checks the shipped file against it)."""
    from peft.utils.constants import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING as peft_defaults

    types = sorted({*peft_defaults, *NOT_IN_PEFT, *ATTENTION_ONLY})
    return {mt: list(default_lora_targets(mt)) for mt in types}


def default_lora_targets(model_type: str) -> tuple[str, ...]:
    """The default LoRA target modules of this model_type (see the module docstring)."""
    from peft.utils.constants import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING as peft_defaults

    if model_type in ATTENTION_ONLY:
        return ATTENTION_ONLY[model_type]
    targets = peft_defaults.get(model_type)
    if targets:
        return tuple(targets)
    return NOT_IN_PEFT.get(model_type, FALLBACK)


# LoRA's rank r as a variable of a profile (estimator.profile.poly RANK_MONOMIALS): fit at 8 (every size) and 16 (the
# sizes its b- and s-linear terms need: tracer.extend.size_points), verified at a third rank with the unused size. 3
# is odd and below both (a term that steps with r's alignment shows); under FSDP 24, a multiple of 8 (FSDP2 pads a
# shard's rows, A's r rows, to a multiple of the world size: the verified world is 8).
LORA_RANKS = (8, 16)
LORA_VERIFY_RANK, LORA_VERIFY_RANK_FSDP = 3, 24


def derivation_ranks(workload: Workload, fsdp: bool, rank_variable: bool | None = None) -> tuple[tuple[int, ...], int]:
    """(ranks fit, rank verified) of a derivation (tracer.derive): LORA_RANKS for a LoRA class unless `rank_variable`
    is False; the workload's own rank alone otherwise (a per-rank profile, or no adapters)."""
    ranked = is_rank_variable(workload) if rank_variable is None else rank_variable
    if not ranked:
        return (workload.lora_rank,), workload.lora_rank
    return LORA_RANKS, LORA_VERIFY_RANK_FSDP if fsdp else LORA_VERIFY_RANK


if __name__ == "__main__":   # python -m tracer.lora: write data/lora_defaults.json from PEFT's mapping
    import json
    from pathlib import Path

    out = Path(__file__).resolve().parent.parent / "data" / DEFAULTS_FILE
    out.write_text(json.dumps(defaults_table(), indent=1, sort_keys=True) + "\n")
    print(f"wrote {out} ({len(defaults_table())} model types)")
