"""Grids of cases: comma lists on the command line expanded into (model, workload, parallel) cases.

    --model llama-2-7b,qwen2.5-7b --batch 1,2,4 --seq 512,1024 --recipe pure,amp --mode train,infer

Every flag of `Workload` and `Parallel` that takes one value per case takes a comma list here; the grid is
their cartesian product. A combination the specs reject (e.g. mode=infer with method=lora) is skipped and
counted, with the first message of each kind kept for the summary. `--lora-targets` is not a grid axis:
its one value is itself a comma list of module names.
"""
from __future__ import annotations

import argparse
import itertools
from collections import Counter
from dataclasses import dataclass, fields

from estimator import spec
from estimator.presets import load_config
from estimator.spec import Parallel, Workload

# (flag dest, owner, element type, allowed values or None). Order = the order cases vary (last fastest).
AXES = (
    ("mode", "workload", str, spec.MODES),
    ("method", "workload", str, spec.METHODS),
    ("recipe", "workload", str, spec.RECIPES),
    ("precision", "workload", str, spec.PRECISIONS),
    ("weight_format", "workload", str, spec.WEIGHT_FORMATS),
    ("optimizer", "workload", str, spec.OPTIMIZERS),
    ("optimizer_impl", "workload", str, spec.OPTIMIZER_IMPLS),
    ("checkpointing", "workload", str, spec.CHECKPOINTING),
    ("attention", "workload", str, spec.ATTENTION),
    ("kv_dtype", "workload", str, spec.KV_DTYPES),
    ("loop", "workload", str, spec.LOOPS),
    ("lora_rank", "workload", int, None),
    ("grad_accum", "workload", int, None),
    ("gen_tokens", "workload", int, None),
    # the recipe knobs (tracer.recipes, docs/recipes.md)
    ("loss", "workload", str, spec.LOSSES),
    ("loss_chunks", "workload", int, None),
    ("optimizer_in_backward", "workload", bool, None),
    ("activation_offload", "workload", bool, None),
    ("float8", "workload", bool, None),
    ("compile", "workload", bool, None),
    ("strategy", "parallel", str, spec.STRATEGIES),
    ("offload", "parallel", str, spec.OFFLOADS),
    ("gpus", "parallel", int, None),
    ("tp", "parallel", int, None),
    ("sequence_parallel", "parallel", bool, None),
    ("pp", "parallel", int, None),
    ("pp_schedule", "parallel", str, spec.PP_SCHEDULES),
    ("microbatches", "parallel", int, None),
    ("cp", "parallel", int, None),
    ("batch", "workload", int, None),
    ("seq", "workload", int, None),
)
# What a flag does, where the field name alone does not say it (docs/recipes.md has the sources)
HELP = {
    "loss": "full: HF cross-entropy on all logits; chunked: torchtune CEWithChunkedOutputLoss (lm_head and fp32 "
            "upcast per chunk); fused-linear: Liger fused linear cross-entropy (no logits beyond one chunk)",
    "loss_chunks": "chunks of the sequence for --loss chunked (torchtune num_output_chunks)",
    "optimizer_in_backward": "torchtune optimizer_in_bwd: step each parameter in its post-accumulate-grad hook and "
                             "free its gradient",
    "activation_offload": "torchtune enable_activation_offloading: saved activations of 1024 bytes or more go to "
                          "CPU in forward and come back in backward",
    "float8": "torchao float8 training of the decoder Linears (tensorwise dynamic scaling; needs torchao)",
    "pp": "pipeline stages composed with an FSDP strategy (--strategy fsdp --gpus dp*tp*pp --pp pp; --strategy pp "
          "takes every GPU as a stage, or --gpus pp*tp --pp pp --tp tp for TP inside each stage)",
    "pp_schedule": "pipeline schedule with --strategy pp (torch.distributed.pipelining; 1f1b, gpipe and "
                   "interleaved-1f1b are traced per rank)",
    "microbatches": "micro-batches per step through a pipeline (0: --grad-accum)",
    "tp": "tensor-parallel degree composed with FSDP or a pipeline (--strategy tp takes every GPU)",
    "sequence_parallel": "Megatron/torchtitan sequence parallelism over the tp ranks (training)",
    "cp": "context-parallel degree under an FSDP strategy (--strategy fsdp --gpus dp_shard*cp --cp cp; training, seq a "
          "multiple of 2 x cp): torch's ring attention, two CP ranks traced (estimator.cp)",
    "compile": "torch.compile'd model: AOTAutograd's min-cut partitioner decides what forward saves (no inductor "
               "fusion; one GPU, full loss, no other knob)",
}
BOOLS = {"true": True, "false": False}
MAX_CASES = 100_000  # a typo like --seq 1,2,...  should not start a week-long sweep


@dataclass(frozen=True)
class Case:
    model_name: str
    config: dict
    workload: Workload
    parallel: Parallel


def _defaults() -> dict:
    out = {f.name: f.default for f in fields(Workload)} | {f.name: f.default for f in fields(Parallel)}
    return out


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add --model and one comma-list flag per axis; defaults are the specs' defaults."""
    parser.add_argument("--model", required=True,
                        help="preset name(s) or config.json path(s), comma-separated")
    defaults = _defaults()
    for dest, owner, typ, allowed in AXES:
        choices = f"; one or more of {', '.join(allowed)}" if allowed else "; true or false" if typ is bool else ""
        what = f": {HELP[dest]}" if dest in HELP else ""
        parser.add_argument(f"--{dest.replace('_', '-')}", dest=dest, default=None,
                            help=f"{owner} {dest}{what} (default {defaults[dest]}), comma-separated{choices}")
    parser.add_argument("--lora-targets", default=None,
                        help="module names LoRA adapts, comma-separated (one value, not a grid axis; "
                             f"default {','.join(Workload.lora_targets)})")


def parse_list(name: str, text: str, typ: type, allowed: tuple[str, ...] | None) -> list:
    """'1,2,4' -> [1, 2, 4]; raises ValueError naming the flag and what is allowed."""
    items = [t.strip() for t in text.split(",")]
    if not items or any(not t for t in items):
        raise ValueError(f"{name}: empty value in {text!r}; give a comma-separated list")
    out = []
    for t in items:
        if typ is int:
            try:
                out.append(int(t))
            except ValueError:
                raise ValueError(f"{name}: {t!r} is not an integer") from None
        elif typ is bool:
            if t.lower() not in BOOLS:
                raise ValueError(f"{name}: {t!r} is not allowed; choose true or false")
            out.append(BOOLS[t.lower()])
        else:
            if allowed and t not in allowed:
                raise ValueError(f"{name}: {t!r} is not allowed; choose one of {', '.join(allowed)}")
            out.append(t)
    return list(dict.fromkeys(out))  # keep order, drop repeats


def axes_from_args(args: argparse.Namespace) -> dict[str, list]:
    """{axis: values} for the axes given on the command line; missing ones are left to the spec default."""
    axes = {}
    for dest, _, typ, allowed in AXES:
        text = getattr(args, dest, None)
        if text is not None:
            axes[dest] = parse_list(dest, text, typ, allowed)
    if getattr(args, "lora_targets", None):
        axes["lora_targets"] = [tuple(parse_list("lora_targets", args.lora_targets, str, None))]
    return axes


def expand(models: list[str], axes: dict[str, list]) -> tuple[list[Case], Counter]:
    """All valid cases of the grid, and a Counter of skipped combinations by their error message."""
    n = len(models)
    for values in axes.values():
        n *= len(values)
    if n > MAX_CASES:
        raise ValueError(f"grid: {n} combinations is more than {MAX_CASES}; split the sweep")
    configs = [load_config(m) for m in models]
    workload_keys = {f.name for f in fields(Workload)}
    names = list(axes)
    cases, skipped = [], Counter()
    for name, config in configs:
        for combo in itertools.product(*(axes[k] for k in names)):
            values = dict(zip(names, combo))
            try:
                workload = Workload(**{k: v for k, v in values.items() if k in workload_keys})
                parallel = Parallel(**{k: v for k, v in values.items() if k not in workload_keys})
            except ValueError as e:
                skipped[str(e)] += 1
                continue
            cases.append(Case(name, config, workload, parallel))
    return cases, skipped


ALWAYS_SHOWN = ("mode", "method", "recipe", "precision", "batch", "seq")


def describe(case: Case) -> str:
    """One line naming the case: the main fields, then whatever else differs from the defaults."""
    defaults = _defaults()
    parts = [case.model_name]
    for obj in (case.workload, case.parallel):
        for f in fields(obj):
            v = getattr(obj, f.name)
            if f.name in ALWAYS_SHOWN or v != defaults[f.name]:
                parts.append(f"{f.name}={','.join(v) if isinstance(v, tuple) else v}")
    return " ".join(parts)


def summarize_skipped(skipped: Counter) -> str:
    """'skipped 5 invalid combinations: 4 x method: ...; 1 x ...' or '' when none were skipped."""
    if not skipped:
        return ""
    total = sum(skipped.values())
    kinds = "; ".join(f"{n} x {msg}" for msg, n in skipped.most_common())
    return f"skipped {total} invalid combination{'s' if total != 1 else ''}: {kinds}"
