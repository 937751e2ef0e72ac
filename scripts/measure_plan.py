"""The measured tier's GPU session: one planned grid of `python -m bench measure` cases, run in priority order.

    python scripts/measure_plan.py --out runs.jsonl --stop-after 480            # on a GPU machine
    python scripts/measure_plan.py --out runs.jsonl --dry-run                   # the cases, and a count per model
    python scripts/measure_plan.py --out runs.jsonl --only 'llama-3.2-1b' --stop-after 120

It is what a lent GPU of a few minutes is spent on (issue "GPU truth"): training (full fine-tuning under the pure
bf16 and amp recipes, LoRA, with and without full checkpointing, AdamW foreach and fused) and inference (a
prefill, then 128 decoded tokens) on ten architectures from 0.5B to 30B, both allocator modes, and batches and
sequences past the largest that fit, so that OOM rows mark the cliff. Every grid goes through the same flags
and validation as `python -m bench measure`; the cases of one model and allocator setting share one worker
process (`--reuse-process`, docs/measuring.md). Rows are appended to --out as they finish; rerunning the same
command resumes. Quantized formats (QLoRA, 8-bit AdamW without bitsandbytes, an fp8 KV cache) are not in it:
the worker builds float weights only and its KV cache has the model's dtype.
"""
from __future__ import annotations

import argparse
import re
import shlex
import sys
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.commands import measure as measure_cmd  # noqa: E402
from bench.measure import harness  # noqa: E402

EXPANDABLE = "expandable_segments:True"

# (phase, grid flags, allocator settings), run in this order; each grid is the product of its flags, as on the
# command line. Phase 1 covers every architecture under torch's default allocator (small models first: the most
# rows per second, and the OOM cliff of a batch x seq sweep); phase 2 repeats the core grids under expandable
# segments; phase 3 adds two more small models and the training loop's variants. A phase's cases of one model
# and allocator setting share a worker process.
TRAIN_CORE = "--mode train --method full --recipe pure --batch 1,2,4,8 --seq 512,1024,2048,4096"
LORA = "--mode train --method lora --checkpointing none,full"
INFER = "--mode infer --gen-tokens 128"
SMALL = [  # the grids of a sub-2B model: core sweep (its top corner OOMs), checkpointing, amp, LoRA, fused, infer
    TRAIN_CORE,
    "--mode train --method full --recipe pure --checkpointing full --batch 8,16 --seq 4096,8192",
    "--mode train --method full --recipe amp --checkpointing none,full --batch 1,4 --seq 2048",
    LORA + " --batch 1,4 --seq 2048,8192",
    "--mode train --method full --optimizer-impl fused --batch 1,4 --seq 2048",
    INFER + " --batch 1,8,32 --seq 512,4096",
]
SEVEN_B = [  # a 7-8B model: full fine-tuning at the card's edge, LoRA, inference
    "--mode train --method full --recipe pure --batch 1 --seq 512,2048",
    LORA + " --batch 1,4 --seq 2048",
    INFER + " --batch 1,8 --seq 1024",
]
KERNEL_CONFIGS = "scripts/kernel_configs"
KERNEL_MODELS = {  # config file: the Linears LoRA adapts (every projection of every layer kind)
    "qwen3.5-text-8l": "q_proj,k_proj,v_proj,o_proj,in_proj_qkv,in_proj_z,out_proj",
    "nemotron-h-8l": "q_proj,k_proj,v_proj,o_proj,in_proj,out_proj",
}
PLAN: list[tuple[int, str, tuple[str, ...]]] = [
    *[(1, f"--model qwen2.5-0.5b {g}", ("",)) for g in SMALL],
    *[(1, f"--model llama-3.2-1b {g}", ("",)) for g in SMALL],
    (1, "--model llama-3.2-3b --mode train --method full --recipe pure --batch 1,2,4 --seq 512,2048,4096", ("",)),
    (1, "--model llama-3.2-3b --mode train --method full --recipe pure --checkpointing full --batch 4,8 "
        "--seq 4096,8192", ("",)),
    (1, "--model llama-3.2-3b --mode train --method full --recipe amp --batch 1 --seq 512,2048", ("",)),
    (1, f"--model llama-3.2-3b {LORA} --batch 1,4 --seq 2048,4096", ("",)),
    (1, "--model llama-3.2-3b --mode train --method full --optimizer-impl fused --batch 1 --seq 512,2048", ("",)),
    (1, f"--model llama-3.2-3b {INFER} --batch 1,16 --seq 1024,4096", ("",)),
    # llama-3.1-8b: full fine-tuning needs 8 bytes per parameter before activations; amp (16) cannot fit
    (1, "--model llama-3.1-8b --mode train --method full --recipe pure --batch 1 --seq 512,2048,4096", ("",)),
    (1, "--model llama-3.1-8b --mode train --method full --recipe pure --checkpointing full --batch 1,2 "
        "--seq 4096", ("",)),
    (1, "--model llama-3.1-8b --mode train --method full --recipe amp --batch 1 --seq 512", ("",)),
    (1, "--model llama-3.1-8b --mode train --method full --optimizer-impl fused --batch 1 --seq 512", ("",)),
    (1, f"--model llama-3.1-8b {LORA} --batch 1,4 --seq 2048,4096", ("",)),
    (1, f"--model llama-3.1-8b {INFER} --batch 1,16 --seq 1024,4096", ("",)),
    # gemma-3-4b (the Gemma 3 VLM config), a 262k vocabulary and sliding windows
    (1, "--model gemma-3-4b --mode train --method full --recipe pure --batch 1,4 --seq 512,2048", ("",)),
    (1, f"--model gemma-3-4b {LORA} --batch 1,4 --seq 2048", ("",)),
    (1, f"--model gemma-3-4b {INFER} --batch 1,8 --seq 1024", ("",)),
    *[(1, f"--model {m} {g}", ("",)) for m in ("qwen3-8b", "qwen2.5-7b", "mistral-7b") for g in SEVEN_B],
    # phi-4 (14.7B): full fine-tuning cannot fit (an OOM row); LoRA and inference do
    (1, "--model phi-4 --mode train --method full --recipe pure --batch 1 --seq 512", ("",)),
    # Phi-3's attention is one fused qkv_proj, so PEFT's q_proj,v_proj default matches nothing (the 2026-11-26
    # session lost these four rows to that): PEFT's phi3 default is qkv_proj
    (1, f"--model phi-4 {LORA} --lora-targets qkv_proj --batch 1,4 --seq 2048", ("",)),
    (1, f"--model phi-4 {INFER} --batch 1,8 --seq 1024", ("",)),
    # qwen3-30b-a3b (MoE, 61 GB of bf16 weights): LoRA on attention, and inference
    (1, "--model qwen3-30b-a3b --mode train --method lora --checkpointing full --batch 1 --seq 512,2048", ("",)),
    (1, f"--model qwen3-30b-a3b {INFER} --batch 1,8 --seq 1024", ("",)),
    # phase 2: expandable segments on the core grids
    *[(2, f"--model {m} {g}", (EXPANDABLE,)) for m in ("qwen2.5-0.5b", "llama-3.2-1b")
      for g in (TRAIN_CORE, LORA + " --batch 1,4 --seq 2048,8192", INFER + " --batch 1,8,32 --seq 512,4096")],
    (2, "--model llama-3.1-8b --mode train --method full --recipe pure --batch 1 --seq 512,2048,4096",
     (EXPANDABLE,)),
    (2, f"--model llama-3.1-8b {LORA} --batch 1,4 --seq 2048,4096", (EXPANDABLE,)),
    (2, "--model llama-3.2-3b --mode train --method full --recipe pure --batch 1,2,4 --seq 512,2048,4096",
     (EXPANDABLE,)),
    (2, f"--model llama-3.2-3b {LORA} --batch 1,4 --seq 2048,4096", (EXPANDABLE,)),
    # phase 3: two more small models, and the training loop's variants
    *[(3, f"--model {m} {g}", ("",)) for m in ("qwen3-0.6b", "qwen3-1.7b")
      for g in (TRAIN_CORE, LORA + " --batch 1,4 --seq 2048,8192", INFER + " --batch 1,8,32 --seq 512,4096")],
    (3, "--model llama-3.2-1b --mode train --loop keep-output --batch 1,4 --seq 2048", ("",)),
    (3, "--model llama-3.2-1b --mode train --grad-accum 2,4 --batch 2,4 --seq 2048", ("",)),
    # phase 4: hybrid layers on the kernels the estimate assumes (flash-linear-attention, mamba_ssm's Triton SSD,
    # causal_conv1d at the commits docs/activations.md cites; scripts/measure_kernels.sh installs them), on
    # 8-layer configs at real widths (scripts/kernel_configs); phase 6 adds LoRA and checkpointing at the same
    # (batch, seq), whose Triton autotuning phase 4 already did (scripts/measure_kernels.sh runs phase 4 twice)
    *[(4, f"--model {KERNEL_CONFIGS}/{m}.json {g}", ("",)) for m in KERNEL_MODELS
      for g in ("--mode train --method full --recipe pure --batch 1,2 --seq 2048,8192",
                INFER + " --batch 1,8 --seq 2048")],
    *[(6, f"--model {KERNEL_CONFIGS}/{m}.json {g}", ("",)) for m, targets in KERNEL_MODELS.items()
      for g in ("--mode train --method full --recipe pure --checkpointing full --batch 2 --seq 8192",
                f"--mode train --method lora --lora-rank 16 --lora-targets {targets} --batch 1,2 --seq 8192")],
    # phase 5: vision encoders at 224 pixels (--seq is tokens per image: 16 x 16 patches, plus a CLS token)
    *[(5, f"--model {m} {g}", ("",)) for m, tokens in (("vit-huge-patch14", 257), ("dinov2-giant", 257),
                                                        ("siglip-so400m-patch14-224", 256))
      for g in (f"--mode train --method full --recipe pure --batch 32,128 --seq {tokens}",
                f"--mode infer --batch 256 --seq {tokens}")],
]
PHASES = (1, 2, 3, 4, 5, 6)


def plan_cases(device: str = "cuda", contributor: str | None = None, notes: str | None = None,
               only: str | None = None, phases: tuple[int, ...] = (1, 2, 3)) -> list[harness.Case]:
    """Every case of PLAN in `phases` (in that order), validated as `bench measure` validates its flags, repeats
    dropped."""
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers()
    measure_cmd.register(sub)
    pattern = re.compile(only) if only else None
    cases, seen = [], set()
    for phase, flags, confs in [g for p in dict.fromkeys(phases) for g in PLAN if g[0] == p]:
        argv = ["measure", *shlex.split(flags), "--out", "-", "--device", device]
        for conf in confs:
            argv += ["--alloc-conf", conf]
        if contributor:
            argv += ["--contributor", contributor]
        if notes:
            argv += ["--notes", notes]
        args = parser.parse_args(argv)
        if pattern and not pattern.search(args.model):
            continue
        for case in measure_cmd._cases(args):
            key = harness.canonical_json(case.to_json())
            if key not in seen:
                seen.add(key)
                cases.append((phase, case))
    return _by_process(cases)


def _by_process(cases: list[tuple[int, harness.Case]]) -> list[harness.Case]:
    """A phase's cases of one model and allocator setting next to each other (one worker process each), keeping
    the plan's order of first appearance."""
    order: dict[tuple, list] = {}
    for phase, case in cases:
        order.setdefault((phase, case.model_name, case.alloc_conf), []).append(case)
    return [c for group in order.values() for c in group]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="JSONL file the rows are appended to (resumes)")
    p.add_argument("--stop-after", type=float, default=None, metavar="SECONDS",
                   help="start no case after this many seconds")
    p.add_argument("--only", default=None, metavar="REGEX", help="only the grids whose --model matches")
    p.add_argument("--contributor", default=None)
    p.add_argument("--notes", default=None)
    p.add_argument("--timeout", type=float, default=600, help="seconds one case may take (default 600)")
    p.add_argument("--phases", default="1,2,3", metavar="LIST",
                   help="the phases to run, in this order (default 1,2,3; a GPU other than the last session's "
                        "might start with 2,3: cases no GPU has measured; 4 and 6: hybrid layers on their CUDA "
                        "kernels, which scripts/measure_kernels.sh installs first; 5: vision encoders)")
    p.add_argument("--dry-run", action="store_true", help="print the cases and a count per model, then exit")
    p.add_argument("--device", choices=harness.DEVICES, default="cuda", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    start = time.time()
    try:
        phases = tuple(int(x) if x.strip().isdigit() else 0 for x in args.phases.split(","))
        if any(x not in PHASES for x in phases):
            raise ValueError(f"--phases: {args.phases!r}; allowed: a comma-separated list of "
                             + ", ".join(map(str, PHASES)))
        cases = plan_cases(args.device, args.contributor, args.notes, args.only, phases)
    except (ValueError, re.error) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.dry_run:
        print("\n".join(harness.case_name(c) for c in cases))
        counts = Counter((c.model_name, c.alloc_conf or "default") for c in cases)
        for (model, conf), n in counts.items():
            print(f"{n:4d}  {model}  {conf}")
        print(f"{len(cases)} cases")
        return 0
    try:
        info = harness.probe_environment(args.device)
    except RuntimeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    deadline = None if args.stop_after is None else start + args.stop_after
    summary = harness.run_cases(cases, Path(args.out), info["env"], args.timeout, reuse_process=True,
                                deadline=deadline)
    print(summary.text(), file=sys.stderr)
    return 1 if summary.failed else 0


if __name__ == "__main__":
    sys.exit(main())
