"""Fit how reserved bytes relate to allocated bytes, per workload class, from replayed traced runs.

    python scripts/fit_reserved.py              # trace, replay, fit; write data/allocator_fit.json + docs section
    python scripts/fit_reserved.py --quick      # three cases per class, nothing written (a smoke run)

Each case is a real transformers model traced on fake CPU tensors (bench.trace.streams.trace_stream: every allocation
and free of the step, in order), replayed through the caching-allocator model (offline.allocator) under the
default allocator and under expandable_segments:True. Per class (estimator.reserved.workload_class) and mode,

    reserved = allocated * (1 + r) + c

is fitted by least squares on the relative error (each case weighs the same whatever its size), where allocated
is the traced peak of tensor bytes (what estimate() computes; the allocator's own 512-byte rounding is part of
what the fit absorbs) and reserved the replayed peak of torch.cuda.memory_reserved. A negative r or c is refitted
with that term at 0. The residuals of this form and of the ratio-only form (c = 0) are both written, so the
choice can be checked. Training cases run 2 steps (the second is the steady state, with the first step's cache).
Gemma-2 runs eager attention (transformers has no SDPA path for it). Deep presets are traced at reduced depth (the config's num_hidden_layers cut, named in the case): the per-layer
tensors keep their real sizes, which is what sets the segment pattern.
"""
from __future__ import annotations

import argparse
from dataclasses import replace
import json
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from estimator.alloc_conf import parse_alloc_conf  # noqa: E402
from estimator.presets import load_config  # noqa: E402
from estimator.reserved import CASES_PATH, CLASSES, FIT_PATH, _max_ratios, workload_class  # noqa: E402
from estimator.spec import Parallel, Workload  # noqa: E402

DOC = ROOT / "docs" / "allocator.md"
SECTION = "## Reserved from allocated: the fitted classes"
CONFS = {"default": "", "expandable": "expandable_segments:True"}

# (preset, layers or None for all): small enough for a few minutes on one core
PRESETS = (("qwen2.5-0.5b", None), ("llama-3.2-1b", None), ("qwen3-1.7b", None), ("gemma-2-2b", 8),
           ("phi-3-mini", 8), ("mistral-7b", 6), ("llama-3.1-8b", 6))
FULL = Workload(mode="train", method="full", recipe="pure", precision="bf16")
SIZES_TRAIN = ((1, 512), (2, 1024), (4, 2048), (8, 512), (1, 4096))
SIZES_INFER = ((1, 512, 32), (8, 1024, 16))


def cases(quick: bool) -> list[tuple]:
    out = []
    for preset, layers in PRESETS:
        for b, s in SIZES_TRAIN:
            out.append((preset, layers, Workload(**{**_kw(FULL), "batch": b, "seq": s}), Parallel()))
        b, s = SIZES_TRAIN[1]
        out.append((preset, layers, Workload(**{**_kw(FULL), "batch": b, "seq": s, "checkpointing": "full"}),
                    Parallel()))
        for b, s in SIZES_TRAIN[::2]:
            out.append((preset, layers, Workload(**{**_kw(FULL), "method": "lora", "batch": b, "seq": s}),
                        Parallel()))
        for b, s, g in SIZES_INFER:
            out.append((preset, layers, Workload(mode="infer", precision="bf16", batch=b, seq=s, gen_tokens=g),
                        Parallel()))
        for b, s in SIZES_TRAIN[:2]:
            out.append((preset, layers, Workload(**{**_kw(FULL), "batch": b, "seq": s}),
                        Parallel(strategy="fsdp", gpus=2)))
    if quick:
        seen: dict = {}
        out = [c for c in out if seen.setdefault(workload_class(c[2], c[3]), []).append(c) or
               len(seen[workload_class(c[2], c[3])]) <= 3]
    return [(pr, la, replace(w, attention="eager") if _eager_only(pr) else w, p) for pr, la, w, p in out]


def _eager_only(preset: str) -> bool:
    """Whether transformers runs this preset with eager attention only (its inventory; Gemma-2 here)."""
    from estimator.model import from_hf_config

    return not from_hf_config(load_config(preset)[1], preset, derive=False).inventory.supports_sdpa


def _kw(w: Workload) -> dict:
    from dataclasses import asdict
    return asdict(w)


def run_case(preset: str, layers: int | None, w: Workload, p: Parallel) -> dict:
    from bench.trace.streams import trace_stream
    from offline.allocator.replay import replay

    name, cfg = load_config(preset)
    if layers is not None:
        cfg = {**cfg, "num_hidden_layers": layers}
        for key in ("layer_types",):       # per-layer lists must match the cut depth
            if isinstance(cfg.get(key), list):
                cfg[key] = cfg[key][:layers]
        name = f"{name} ({layers} layers)"
    t0 = time.perf_counter()
    row, stream = trace_stream(cfg, name, w, p)
    traced_s = time.perf_counter() - t0
    out = {"case": name, "class": workload_class(w, p), "mode": w.mode, "method": w.method, "batch": w.batch,
           "seq": w.seq, "gen_tokens": w.gen_tokens, "checkpointing": w.checkpointing, "strategy": p.strategy,
           "gpus": p.gpus, "events": len(stream), "allocated_bytes": int(row["peak_alloc_bytes"]),
           "trace_s": round(traced_s, 1)}
    for mode, conf in CONFS.items():
        r = replay(stream, parse_alloc_conf(conf))
        out[f"reserved_{mode}_bytes"] = r.overall.peak_reserved_bytes
        out[f"replayed_allocated_{mode}_bytes"] = r.overall.peak_allocated_bytes
        out[f"largest_free_{mode}_bytes"] = r.overall.largest_free_at_peak_bytes
    return out


def fit(rows: list[dict], mode: str) -> dict:
    """Least squares of reserved = x (1 + r) + c on relative error; also the ratio-only form for comparison."""
    x = np.array([r["allocated_bytes"] for r in rows], float)
    y = np.array([r[f"reserved_{mode}_bytes"] for r in rows], float)
    A = np.stack([x / y, 1.0 / y], axis=1)
    target = (y - x) / y
    (ratio, const), *_ = np.linalg.lstsq(A, target, rcond=None)
    if const < 0:
        ratio, const = float(np.sum(A[:, 0] * target) / np.sum(A[:, 0] ** 2)), 0.0
    if ratio < 0:
        ratio, const = 0.0, max(0.0, float(np.sum(A[:, 1] * target) / np.sum(A[:, 1] ** 2)))
    rel = (x * (1 + ratio) + const - y) / y
    r0 = float(np.sum(A[:, 0] * target) / np.sum(A[:, 0] ** 2))
    rel0 = (x * (1 + r0) - y) / y
    return {"ratio": round(float(ratio), 6), "const_bytes": int(round(const)), "n": len(rows),
            "median_rel_error": round(float(np.median(np.abs(rel))), 5),
            "worst_rel_error": round(float(np.max(np.abs(rel))), 5),
            "residuals": [round(float(v), 5) for v in rel],
            "ratio_only": {"ratio": round(r0, 6), "median_rel_error": round(float(np.median(np.abs(rel0))), 5),
                           "worst_rel_error": round(float(np.max(np.abs(rel0))), 5)}}


def doc_section(result: dict, rows: list[dict]) -> str:
    prov = result["provenance"]
    lines = [SECTION, "",
             f"Made by `{prov['command']}` on {prov['created_at']} (torch {prov['torch']}, transformers "
             f"{prov['transformers']}; {len(rows)} cases traced and replayed in {prov['seconds']} s on "
             "one core). Form: `reserved = allocated * (1 + r) + c`, least squares on the relative error; allocated "
             "is the traced peak of tensor bytes, reserved the replayed peak of `memory_reserved`. "
             "Error = |predicted - replayed| / replayed over the class's cases; the ratio-only form (c = 0) is "
             "shown for comparison.", "",
             "| class | allocator | n | r | c (MiB) | median error | worst error | ratio-only r | its worst error |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for cls, modes in result["classes"].items():
        for mode, f in modes.items():
            lines.append(f"| {cls} | {mode} | {f['n']} | {f['ratio']:.4f} | {f['const_bytes'] / 2**20:.1f} | "
                         f"{f['median_rel_error']:.2%} | {f['worst_rel_error']:.2%} | {f['ratio_only']['ratio']:.4f} | "
                         f"{f['ratio_only']['worst_rel_error']:.2%} |")
    lines += ["", "Cases (GiB = 2^30 bytes):", "",
              "| case | class | batch x seq (+gen) | checkpointing | allocated GiB | reserved GiB | expandable GiB |",
              "|---|---|---|---|---:|---:|---:|"]
    for c in rows:
        gen = f" +{c['gen_tokens']}" if c["gen_tokens"] else ""
        lines.append(f"| {c['case']}{' fsdp x2' if c['strategy'] == 'fsdp' else ''} | {c['class']} | "
                     f"{c['batch']} x {c['seq']}{gen} | {c['checkpointing']} | {c['allocated_bytes'] / 2**30:.3f} | "
                     f"{c['reserved_default_bytes'] / 2**30:.3f} | {c['reserved_expandable_bytes'] / 2**30:.3f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="three cases per class; write nothing")
    ap.add_argument("--out", default=str(FIT_PATH), help="fit file to write (default data/allocator_fit.json)")
    args = ap.parse_args(argv)
    import torch
    import transformers

    start = time.perf_counter()
    rows = []
    todo = cases(args.quick)
    for i, (preset, layers, w, p) in enumerate(todo, 1):
        try:
            row = run_case(preset, layers, w, p)
        except Exception as e:  # noqa: BLE001 - a case that cannot be traced is reported, the fit goes on
            print(f"[{i}/{len(todo)}] {preset} {w.mode} {w.method} {p.strategy}: failed: "
                  f"{str(e).splitlines()[0] if str(e) else type(e).__name__}", file=sys.stderr)
            continue
        rows.append(row)
        print(f"[{i}/{len(todo)}] {row['case']} {row['class']} b{row['batch']} s{row['seq']}: allocated "
              f"{row['allocated_bytes'] / 2**30:.3f} GiB, reserved {row['reserved_default_bytes'] / 2**30:.3f} / "
              f"expandable {row['reserved_expandable_bytes'] / 2**30:.3f} GiB ({row['events']:,} events, "
              f"{row['trace_s']} s)", file=sys.stderr, flush=True)
    classes = {}
    for cls in CLASSES:
        mine = [r for r in rows if r["class"] == cls]
        if mine:
            classes[cls] = {mode: fit(mine, mode) for mode in CONFS}
    result = {
        "_about": "reserved = allocated * (1 + ratio) + const_bytes per workload class (estimator.reserved) and "
                  "allocator mode (default; expandable = expandable_segments:True), fitted on traced allocation "
                  "streams replayed through offline.allocator. docs/allocator.md has the method.",
        "provenance": {"command": "python scripts/fit_reserved.py" + (" --quick" if args.quick else ""),
                       "created_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                       "torch": torch.__version__, "transformers": transformers.__version__,
                       "seconds": round(time.perf_counter() - start), "kernels": "cuda", "steps": 2},
        "classes": classes}
    caps = _max_ratios(rows)  # the cap of each class's cache share, read by every estimate (estimator.reserved)
    for cls, modes in classes.items():
        for mode, f in modes.items():
            f["max_ratio"] = caps.get((cls, mode), float("inf"))
    for cls, modes in classes.items():
        for mode, f in modes.items():
            print(f"{cls:<11} {mode:<10} n={f['n']:>2} r={f['ratio']:.4f} c={f['const_bytes'] / 2**20:8.1f} MiB  "
                  f"median {f['median_rel_error']:.2%} worst {f['worst_rel_error']:.2%}  (ratio-only worst "
                  f"{f['ratio_only']['worst_rel_error']:.2%})")
    if args.quick:
        return 0
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    Path(args.out).with_name(CASES_PATH.name).write_text(
        json.dumps({"_about": f"the replayed cases behind {Path(args.out).name} (scripts/fit_reserved.py)",
                    "provenance": result["provenance"], "cases": rows}, indent=1) + "\n")
    from scripts.perf_doc import replace_section
    replace_section(SECTION, doc_section(result, rows), DOC)
    print(f"wrote {args.out} and the '{SECTION}' section of {DOC}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
