"""Encoder-decoder models at full size: the estimate against a full-depth trace, at real batch sizes and lengths.

    python scripts/seq2seq_check.py                      # every case below
    python scripts/seq2seq_check.py --case t5-large-full-b4-512
    python scripts/seq2seq_check.py --list

Each case is a preset (data/models/) or a model type's default config (`AutoConfig.for_model(type)`: BART-large's
sizes, Marian's), as `--seq` (the encoder's tokens; Whisper: its decoder's) and `--target-seq` (the decoder's in
training; 0: as many as seq) say. The profile is derived from an empty cache (a temporary WILLITFIT_CACHE; the fit
traces reduced depths of both layer stacks at other sizes) and the whole model is traced at the case's size on fake
tensors with the CUDA kernels emulated (`bench.trace.cases.trace_case`, two steps). Every stage's tensor bytes must be
equal; the script prints a row per case and exits 1 if any differs. Prints; writes nothing else
(docs/architectures.md, "Encoder-decoder models", holds the table of its last run).
"""
from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

import fullsize_check  # noqa: E402  (scripts/, beside this file)

# (name, preset or model type, mode, method, batch, seq, target_seq[, attention[, generated tokens]])
CASES = (
    ("t5-large-full-b4-512", "t5-large", "train", "full", 4, 512, 0),
    ("t5-large-lora-b8-1000", "t5-large", "train", "lora", 8, 1000, 0),
    ("t5-large-eager-target-b4-512-128", "t5-large", "train", "full", 4, 512, 128, "eager"),
    ("flan-t5-xl-lora-b8-1024-256", "flan-t5-xl", "train", "lora", 8, 1024, 256),
    ("whisper-large-v3-full-b8-448", "whisper-large-v3", "train", "full", 8, 448, 0),
    ("whisper-large-v3-lora-b16-301", "whisper-large-v3", "train", "lora", 16, 301, 0),
    ("whisper-large-v3-infer-b8-4-gen200", "whisper-large-v3", "infer", "full", 8, 4, 0, "sdpa", 200),
    ("bart-full-target-b8-1024-142", "bart", "train", "full", 8, 1024, 142),
    ("marian-infer-b16-512-gen256", "marian", "infer", "full", 16, 512, 0, "sdpa", 256),
)


def run_case(case) -> tuple[bool, str]:
    from estimator.presets import default_lora_targets
    from estimator.spec import Workload

    name, ref, mode, method, b, s, target, *rest = case
    attention = rest[0] if rest else "sdpa"
    gen = rest[1] if len(rest) > 1 else 0
    lora = {"lora_targets": default_lora_targets(fullsize_check.config(ref)["model_type"])} if method == "lora" else {}
    w = Workload(batch=b, seq=s, target_seq=target, mode=mode, method=method, attention=attention, gen_tokens=gen,
                 **lora)
    return fullsize_check.checked(name, ref, w)


def main(argv=None) -> int:
    return fullsize_check.main(__doc__, CASES, run_case, "willitfit-seq2seq-", 36, argv)


if __name__ == "__main__":
    sys.exit(main())
