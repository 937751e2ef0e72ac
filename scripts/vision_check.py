"""Vision models at full size: the estimate against a full-depth trace of transformers' default config, at real batch
sizes and image sizes.

    python scripts/vision_check.py                       # every case below (about 15 minutes on 2 cores)
    python scripts/vision_check.py --case resnet-full-b128-224 --case swin-ckpt-b32-448
    python scripts/vision_check.py --list

Each case builds its model type from its config class's defaults (`AutoConfig.for_model(type)`: ResNet-50,
ConvNeXt-T, Swin-T, EfficientNet-B7, ViT-B/16, ...), derives the profile the estimate needs (empty cache: a temporary
WILLITFIT_CACHE; the fit traces other sizes than the case's), and traces the whole model at the case's batch and
image size on fake tensors with the CUDA kernels emulated (`bench.trace.cases.trace_case`, two steps). Every stage's
tensor bytes must be equal; the script prints a row per case (peak, largest stage difference, the derivation's
traces and seconds) and exits 1 if any differs. Prints; writes nothing else (docs/architectures.md, "Vision
encoders", holds the table of its last run).
"""
from __future__ import annotations

import sys
import time
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

import fullsize_check  # noqa: E402  (scripts/, beside this file)

# (name, model type, mode, method, batch, image size in pixels[, checkpointing])
CASES = (
    ("resnet-full-b128-224", "resnet", "train", "full", 128, 224),
    ("convnext-full-b64-384", "convnext", "train", "full", 64, 384),
    ("regnet-infer-b256-224", "regnet", "infer", "full", 256, 224),
    ("efficientnet-full-b16-608", "efficientnet", "train", "full", 16, 608),
    ("mobilenet_v2-full-b256-224", "mobilenet_v2", "train", "full", 256, 224),
    ("pvt_v2-full-b64-224", "pvt_v2", "train", "full", 64, 224),
    ("swin-full-b32-448", "swin", "train", "full", 32, 448),
    ("segformer-ckpt-b64-448", "segformer", "train", "full", 64, 448, "full"),
    ("focalnet-infer-b64-448", "focalnet", "infer", "full", 64, 448),
    ("vit-lora-b64-384", "vit", "train", "lora", 64, 384),
    ("deit-full-b64-224", "deit", "train", "full", 64, 224),
    ("beit-full-b32-224", "beit", "train", "full", 32, 224),
)


def run_case(case) -> tuple[bool, str]:
    from transformers import AutoConfig

    from bench.trace.cases import trace_case
    from estimator.estimate import estimate
    from estimator.model import from_hf_config
    from estimator.spec import Workload

    name, model_type, mode, method, b, image, *ckpt = case
    cfg = {**AutoConfig.for_model(model_type).to_diff_dict(), "model_type": model_type}
    cfg.pop("transformers_version", None)
    w = Workload(batch=b, image_size=image, mode=mode, method=method, checkpointing=(ckpt or ["none"])[0])
    t = time.perf_counter()
    est = estimate(from_hf_config(cfg, model_type), w)
    derive_s = time.perf_counter() - t
    row = trace_case(cfg, model_type, replace(est.workload, image_size=0), steps=2)
    return fullsize_check.compared(name, est, row, derive_s, f"seq {est.workload.seq:>4}")


def main(argv=None) -> int:
    return fullsize_check.main(__doc__, CASES, run_case, "willitfit-vision-", 30, argv)


if __name__ == "__main__":
    sys.exit(main())
