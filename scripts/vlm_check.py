"""Vision-language models at full size with their images: the estimate against a full-depth trace, at real batch
sizes and sequence lengths.

    python scripts/vlm_check.py                          # every case below
    python scripts/vlm_check.py --case llava-lora-b4-2048
    python scripts/vlm_check.py --list

Each case is a preset (data/models/) or a model type's default config (`AutoConfig.for_model(type)`: PaliGemma-3B's
SigLIP + Gemma-2B, InternVL's, VipLLaVA's), run with `images` images per sample at the config's image size. The
profile is derived from an empty cache (a temporary WILLITFIT_CACHE; the fit traces reduced depths at other sizes)
and the whole model is traced at the case's size on fake tensors with the CUDA kernels emulated
(`bench.trace.cases.trace_case`, two steps). Every stage's tensor bytes must be equal; the script prints a row per
case and exits 1 if any differs. Prints; writes nothing else (docs/architectures.md, "Vision-language models", holds
the table of its last run).
"""
from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

import fullsize_check  # noqa: E402  (scripts/, beside this file)

# (name, preset or model type, mode, method, batch, seq, images[, checkpointing[, generated tokens[, image px]]])
CASES = (
    ("llava-lora-b4-2048", "llava-1.5-7b", "train", "lora", 4, 2048, 1),
    ("llava-full-ckpt-b2-1024", "llava-1.5-7b", "train", "full", 2, 1024, 1, "full"),
    ("llava-infer-b8-1024-gen64", "llava-1.5-7b", "infer", "full", 8, 1024, 1, "none", 64),
    ("paligemma-full-b8-512", "paligemma", "train", "full", 8, 512, 1),
    ("internvl-lora-b4-1024-2img", "internvl", "train", "lora", 4, 1024, 2),
    ("vipllava-infer-b4-1536-2img", "vipllava", "infer", "full", 4, 1536, 2),
    ("gemma3-4b-lora-b2-2048", "gemma-3-4b", "train", "lora", 2, 2048, 1),
    # Qwen2-VL's family: images of any size (the last field: the image's side in px), its vision tower under flash
    ("qwen25vl-lora-b4-2048-2img-672px", "qwen2.5-vl-7b", "train", "lora", 4, 2048, 2, "none", 0, 672),
    ("qwen25vl-full-ckpt-b2-4096-1008px", "qwen2.5-vl-7b", "train", "full", 2, 4096, 1, "full", 0, 1008),
    ("qwen25vl-infer-b4-1024-gen32", "qwen2.5-vl-7b", "infer", "full", 4, 1024, 1, "none", 32, 448),
    ("qwen3vl-lora-b2-2048-640px", "qwen3-vl-8b", "train", "lora", 2, 2048, 1, "none", 0, 640),
    ("exaone45-lora-b4-2048-672px", "exaone4_5", "train", "lora", 4, 2048, 1, "none", 0, 672),   # its context: 2048
    # host values: Idefics2's pixels stacked per sample with a pixel mask, padding images dropped by a boolean index
    ("idefics2-lora-b4-2048-2img", "idefics2", "train", "lora", 4, 2048, 2),
    # SmolVLM2-500M: Idefics3's path, 512-px tiles shuffled by 4 to 64 tokens each (--images counts tiles)
    ("smolvlm2-full-b8-4096-5tiles", "smolvlm2-500m", "train", "full", 8, 4096, 5),
    # a loop over the images, marked per iteration (tracer.vlm_loop): LLaVA-NeXT's tiles (672 px: 2,928 tokens),
    # Pixtral's tower under flash (Mistral-Small-3.1 at 1540 px: 3,025 tokens and 55 row breaks)
    ("llava-next-lora-b2-4096", "llava_next", "train", "lora", 2, 4096, 1),
    ("mistral-small-lora-b2-4096-1540px", "mistral-small-3.1-24b", "train", "lora", 2, 4096, 1, "none", 0, 1540),
    # Llama-4-Scout whole: its tower on 336-px tiles, 144 tokens each (--images counts tiles)
    ("llama4-scout-lora-b2-2048", "llama-4-scout", "train", "lora", 2, 2048, 1),
)


def run_case(case) -> tuple[bool, str]:
    from estimator.spec import Workload

    name, ref, mode, method, b, s, images, *rest = case
    ckpt = rest[0] if rest else "none"
    gen = rest[1] if len(rest) > 1 else 0
    # a grid or Pixtral model's image side, under flash
    grid = dict(image_size=rest[2], attention="flash") if len(rest) > 2 else {}
    w = Workload(batch=b, seq=s, images=images, mode=mode, method=method, checkpointing=ckpt, gen_tokens=gen, **grid)
    return fullsize_check.checked(name, ref, w)


def main(argv=None) -> int:
    return fullsize_check.main(__doc__, CASES, run_case, "willitfit-vlm-", 30, argv)


if __name__ == "__main__":
    sys.exit(main())
