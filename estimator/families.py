"""Families: model types grouped for reporting and for the fitted activation constant k (one k per family).

Memory is never computed per family (profiles are derived from each model's own code); this grouping only
decides which runs are pooled in a calibration and how the app groups architectures. A model type not listed is
its own family. This is the one table: code reads families from here. SQL mirrors it in the `v_runs` view's `family` column
(bench/store/schema.sql; the migrations that wrote the view, 003-005, are history and stay as they were);
tests/test_db.py checks the view against this table.
"""
from __future__ import annotations

FAMILIES = {
    "llama": "llama", "mistral": "llama", "qwen2": "llama", "qwen3": "llama",
    "gemma": "gemma", "gemma2": "gemma",
    "phi3": "llama",
    "gpt2": "gpt2", "gpt_neox": "gpt_neox", "falcon": "falcon", "opt": "opt",
    "mixtral": "moe", "qwen2_moe": "moe", "qwen3_moe": "moe",
    "deepseek_v2": "deepseek", "deepseek_v3": "deepseek",
    "bert": "bert",
}
# The vision encoders willitfit models (tracer.vision: pixel values in, sized by image_size): a model type whose
# image-classification model runs one transformer encoder over patch tokens. SigLIP and CLIP configs hold the tower
# in their vision_config.
VISION_TYPES = ("vit", "dinov2", "dinov2_with_registers", "siglip", "clip")


def family_of(model_type: str) -> str:
    return FAMILIES.get(model_type, model_type)
