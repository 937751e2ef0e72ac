"""Derive the profiles willitfit ships (data/profiles/), skipping those already there.

    python scripts/ship_profiles.py            # every preset's shipped classes (an hour or two of CPU)
    python scripts/ship_profiles.py --list     # print the classes without deriving, each "shipped" or "to derive"
    python scripts/ship_profiles.py --model llama-3.1-8b --force
    python scripts/ship_profiles.py --model mistral-7b --lora-only   # the rank-free LoRA profile (every rank)
    python scripts/ship_profiles.py --published  # the classes the published tier's runs need (bench/published/importer.py)
    python scripts/ship_profiles.py --measured   # the classes the measured rows in data/measured/ need

What is shipped, per preset (each a workload class: batch, seq and world size are a profile's variables):
- its inventory;
- training, pure bf16: full fine-tuning, LoRA on PEFT's default targets (rank-free where derived since the rank
  became a variable: one profile for every rank; older ones per rank 8), full fine-tuning with full activation
  checkpointing, LoRA with full activation checkpointing, both with gradient accumulation (grad_accum 2 is the
  class of every grad_accum >= 2) and both with selective checkpointing: what advice proposes first; inference;
  for a vision-language model (families.VLM_TYPES) also full, LoRA and inference with one image per sample.
  The last four were added on 2026-11-26 and are not yet derived for every preset (a full run derives the rest;
  README "The estimator CLI" says which ship);
- the presets of the shipped traced grid (bench/commands/build_db.py: dense up to 13B, plus its MoE): amp full and LoRA, and
  eager inference, so every stored traced row has its profile (`python -m bench accuracy`);
- FSDP (full, pure bf16: the Multi-GPU page's default) for every causal preset; llama-2-7b with `mixed`; a vision
  encoder's (ViT, DINOv2, SigLIP) trains and infers on one GPU here, its other classes derived on first use;
  llama-3.2-1b with `mixed` under FSDP (tests/test_parallel.py), and under FSDP x CP (cp 2; cp 8 with full
  checkpointing: both derived CP ranks of each).
Everything else is derived on first use and cached (~/.cache/willitfit).
"""
from __future__ import annotations

import argparse
import re
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from estimator import store  # noqa: E402
from estimator.estimate import traced_class  # noqa: E402
from estimator.families import GRID_IMAGE_SIZE, GRID_VLM_TYPES, PIXTRAL_VLM_TYPES, VISION_TYPES, VLM_TYPES  # noqa: E402
from estimator.seq2seq import decodes_eager_only  # noqa: E402
from estimator.presets import load_config, preset_names  # noqa: E402
from estimator.spec import Parallel, Workload  # noqa: E402
from tracer.lora import default_lora_targets  # noqa: E402



def classes(name: str, config: dict, grid: set[str]) -> list[tuple[Workload, Parallel]]:
    from estimator.model import from_hf_config

    mt = config.get("model_type")
    attn = from_hf_config(config, name, derive=False).default_attention  # eager where transformers has no SDPA
    lora = dict(method="lora", lora_targets=default_lora_targets(mt))
    out = [(Workload(attention=attn), Parallel()), (Workload(attention=attn, **lora), Parallel()),
           (Workload(attention=attn, checkpointing="full"), Parallel()),
           (Workload(attention=attn, checkpointing="full", **lora), Parallel()),
           (Workload(attention=attn, grad_accum=2), Parallel()),
           (Workload(attention=attn, grad_accum=2, **lora), Parallel()),
           (Workload(attention=attn, checkpointing="selective"), Parallel()),
           (Workload(attention=attn, checkpointing="selective", **lora), Parallel()),
           # T5's decoding is priced under eager attention: its own class
           (Workload(mode="infer", attention="eager" if decodes_eager_only(config) else attn), Parallel())]
    if mt in VLM_TYPES:  # a vision-language model with one image per sample (the app's default for one)
        # Qwen2-VL's family: its default image size, under FlashAttention-2 (its only priced vision attention)
        # Pixtral's tower (Mistral-3): its config's image size, under FlashAttention-2 too (estimator.vision.sized)
        img = dict(images=1, **({"attention": "flash", "image_size": GRID_IMAGE_SIZE} if mt in GRID_VLM_TYPES else
                                {"attention": "flash", "image_size": int(config["vision_config"]["image_size"])}
                                if mt in PIXTRAL_VLM_TYPES else {"attention": attn}))
        out += [(Workload(**img), Parallel()), (Workload(**img, **lora), Parallel()),
                (Workload(mode="infer", **img), Parallel())]
    if name in grid:
        moe = "experts" in str(config) or "num_local_experts" in config or "num_experts" in config
        if not moe:  # transformers' grouped_mm experts cannot run fp32 on fake tensors
            out += [(Workload(attention=attn, recipe="amp"), Parallel()),
                    (Workload(attention=attn, recipe="amp", **lora), Parallel())]
        if attn == "sdpa":
            out.append((Workload(mode="infer", attention="eager"), Parallel()))
    # the Multi-GPU page's default strategies include FSDP; a vision encoder's FSDP profile is derived on first use
    if config.get("model_type") != "bert" and config.get("model_type") not in VISION_TYPES:
        out.append((Workload(attention=attn), Parallel(strategy="fsdp", gpus=2)))
        if mt not in VLM_TYPES and not config.get("is_encoder_decoder"):   # and its FSDP units section's other side
            out.append((Workload(attention=attn), Parallel(strategy="fsdp", gpus=2, fsdp_wrap="torchtitan")))
    if name == "llama-2-7b":
        out.append((Workload(recipe="mixed"), Parallel()))
    if name == "llama-3.2-1b":  # mixed under FSDP: tests/test_parallel.py checks its sharded master copy
        out.append((Workload(recipe="mixed"), Parallel(strategy="fsdp", gpus=2)))
        # context parallelism (both derived ranks): the Multi-GPU page's default workload at cp 2
        # (tests/test_app_pages.py) and long-context training with full checkpointing at cp 8 (docs/parallel.md)
        out += [(Workload(), Parallel(strategy="fsdp", gpus=2, cp=2)),
                (Workload(checkpointing="full"), Parallel(strategy="fsdp", gpus=8, cp=8))]
    return out


def published_classes() -> list[tuple[str, Workload, Parallel]]:
    """(preset, workload, parallel) of every mapped or partial published run, so that the accuracy report and the
    app price them from shipped profiles."""
    from bench.published.importer import workload_fields, load_data, run_row

    out = []
    for p in load_data():
        if p["mapping_status"] == "unmapped" or not p["preset"]:
            continue
        row = run_row(p)
        try:
            w = Workload(**workload_fields(row))
            par = Parallel(strategy=row["strategy"], gpus=row["world_size"], offload=row["offload"] or "none")
        except ValueError as e:
            print(f"{p['published_id']}: cannot express: {e}", flush=True)
            continue
        out.append((p["preset"], w, par))
    return out


def measured_classes() -> list[tuple[str, Workload, Parallel]]:
    """(preset, workload, parallel) of every measured row shipped in data/measured/*.jsonl (no OOM), so that the
    accuracy report prices them from shipped profiles."""
    import json

    from bench.accuracy import calibrate

    out = []
    for path in sorted((Path(__file__).resolve().parent.parent / "data" / "measured").glob("*.jsonl")):
        for line in path.read_text().splitlines():
            row = json.loads(line)
            if not row["oom"] and row["model_name"] in preset_names():
                out.append((row["model_name"], calibrate.workload_from_row(row), calibrate.parallel_from_row(row)))
    return out


def _regex(text: str) -> re.Pattern:
    try:
        return re.compile(text)
    except re.error as e:
        raise argparse.ArgumentTypeError(f"not a regular expression ({e})") from None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="comma-separated presets (default: all)")
    ap.add_argument("--list", action="store_true", help="print the classes, derive nothing")
    ap.add_argument("--lora-only", action="store_true", help="only the default LoRA class (pure bf16, one GPU): "
                    "its rank-free profile, one file for every rank")
    ap.add_argument("--only", metavar="REGEX", type=_regex, help="only the classes whose line (label and key, as --list prints "
                    "it) matches, e.g. 'lora .*ckpt=full' or a key")
    ap.add_argument("--force", action="store_true", help="derive again what is already shipped")
    ap.add_argument("--published", action="store_true", help="the classes of the published tier's runs")
    ap.add_argument("--measured", action="store_true", help="the classes of the measured rows in data/measured/")
    args = ap.parse_args(argv)
    from bench.commands.build_db import grid_models

    grid = set(grid_models())
    names = args.model.split(",") if args.model else preset_names()
    listed = args.published or args.measured
    if listed:
        todo: dict[str, list] = {}
        for name, w, p in (published_classes() if args.published else measured_classes()):
            todo.setdefault(name, []).append((w, p))
        names = sorted(todo)
    failed = 0
    for name in names:
        _, config = load_config(name)
        store.inventory(config, name, ship=True)
        seen = set()
        for w, p in (todo[name] if listed else classes(name, config, grid)):
            if args.lora_only and (w.method, w.recipe, p.strategy) != ("lora", "pure", "single"):
                continue
            tw, tp, _ = traced_class(w, p)
            for rank in store.class_ranks(tp):   # context parallelism: two ranks' profiles
                key = store.profile_key(tw, tp, pp_rank=rank)
                if key in seen:
                    continue
                seen.add(key)
                label = (f"{name}: {w.mode} {w.method} {w.recipe} {w.attention} ckpt={w.checkpointing} "
                         f"ga={w.grad_accum} {p.strategy}" + (f" cp={tp.cp} rank {rank}" if tp.cp > 1 else "")
                         + (f" images={w.images}" if w.images else "")
                         + (f" wrap={tp.fsdp_wrap}" if tp.fsdp_wrap != "layers" else ""))
                if args.only and not args.only.search(f"{label} {key}"):   # the line --list prints
                    continue
                shipped = store.where(config, key=key) == "shipped" or \
                    store.stored_key(config, tw, tp, ship=True, pp_rank=rank) is not None
                if args.list:
                    print(label, key, "shipped" if shipped else "to derive")
                    continue
                if args.force:
                    store.forget(config, key, ship=True)
                elif store.where(config, key=key) == "shipped" or (shipped and not args.lora_only):
                    continue  # shipped (a per-rank LoRA file counts, except with --lora-only: its rank-free one is made)
                start = time.perf_counter()
                try:  # LoRA: the rank-free profile (every rank), even where a per-rank one is shipped
                    prof = store.stored_profile(config, tw, tp, name=name, ship=True, legacy=False, pp_rank=rank)
                except ValueError as e:
                    failed += 1
                    print(f"{label}: refused: {' '.join(str(e).split())}", flush=True)
                    continue
                print(f"{label}: {sum(len(x.moments) for x in prof.pieces)} moments, "
                      f"{time.perf_counter() - start:.1f} s", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
