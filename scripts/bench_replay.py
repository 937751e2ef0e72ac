"""Replayed classes: what one derivation with the replays costs against deriving each class on its own, and whether
the replayed classes' estimates equal full-depth traces.

    python scripts/bench_replay.py                  # the cases below; writes "## Replayed classes" of docs/performance.md
    python scripts/bench_replay.py --only llama --no-write

Per case (a preset and its knobs; one GPU), each in a fresh process with an empty cache: one derivation with the
replays (tracer.derive.derive_profiles: the traced class, gradient accumulation's, for full fine-tuning full
checkpointing's, and selective checkpointing's), and each of those classes derived on its own without them (what
four derivations cost before the replays). Wall time is perf_counter around the process, CPU time its own and its children's (the forked traces).
Then every replayed class's estimate at sizes no fit used, against a full-depth trace of the same workload
(bench.trace.cases.trace_case), stage by stage, in bytes.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import re
import resource
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from estimator.spec import Parallel, Workload  # noqa: E402
from scripts.perf_doc import replace_section  # noqa: E402

SECTION = "## Replayed classes"
# (preset, knobs of the traced class)
CASES = [
    ("llama-3.2-1b", {}),
    ("qwen3-0.6b", {"recipe": "amp"}),
    ("gpt2", {}),
    ("smollm3-3b", {"loss": "chunked"}),
    ("llama-3.2-1b", {"method": "lora", "lora_targets": ["q_proj", "k_proj", "v_proj", "o_proj"]}),
]
SIZES = ((2, 1000), (8, 4096))   # (batch, seq) of the full-depth checks: no fitted size


def _workload(knobs: dict, **more) -> Workload:
    k = dict(knobs, **more)
    if "lora_targets" in k:
        k["lora_targets"] = tuple(k["lora_targets"])
    return Workload(**k)


def derive_one(name: str, knobs: dict, replays: bool, out: str) -> None:
    """In this (fresh) process: derive, save every profile given as JSON into `out`."""
    from estimator.presets import config_hash, load_config
    from tracer import derive

    _, cfg = load_config(name)
    profs = derive.derive_profiles(cfg, _workload(knobs), replays=replays, config_hash=config_hash(cfg))
    Path(out).write_text(json.dumps([p.to_json() for p in profs]))


def _timed(name: str, knobs: dict, replays: bool, cache: str) -> tuple[float, float, list]:
    out = Path(cache) / f"profiles-{int(replays)}-{abs(hash(json.dumps(knobs, sort_keys=True)))}.json"
    code = (f"import sys; sys.path.insert(0, {str(ROOT)!r}); from scripts.bench_replay import derive_one; "
            f"derive_one({name!r}, {knobs!r}, {replays!r}, {str(out)!r})")
    env = dict(os.environ, WILLITFIT_CACHE=cache, HF_HUB_OFFLINE="1")
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-c", code], check=True, env=env, cwd=ROOT, stdout=subprocess.DEVNULL,
                   stderr=subprocess.DEVNULL)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return wall, cpu, json.loads(out.read_text())


def _check(name: str, profile_json: str, knobs: dict, cache: str) -> list[int]:
    """Per size: the largest |estimate - full-depth trace| over the training stages, in bytes. The estimate reads the
    replayed profile from `cache` alone (the shipped profiles set aside: a shipped, traced one of the same class would
    be read first)."""
    from bench.trace.cases import trace_case
    from estimator import store
    from estimator.estimate import Options, estimate
    from estimator.model import from_hf_config
    from estimator.presets import config_hash, load_config
    from estimator.profile.profile import TRAIN_STAGES, Profile

    prof = Profile.from_json(profile_json)
    _, cfg = load_config(name)
    os.environ["WILLITFIT_CACHE"] = cache
    store.SHIPPED_DIR = Path(cache) / "shipped-set-aside"
    key = store.class_key(prof.workload_class, prof.parallel_class, prof.provenance.get("kernels", "cuda"))
    path = Path(cache) / config_hash(cfg)[:16] / f"{key}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(profile_json)
    store.clear_memo()
    model = from_hf_config(cfg, name)
    out = []
    for b, s in SIZES:
        s = min(s, cfg.get("n_positions") or s)   # GPT-2's learned positions
        w = _workload(knobs, batch=b, seq=s)
        if w.grad_accum > 1:
            w = replace(w, grad_accum=4)
        est = estimate(model, w, Parallel(), Options(derive=False))
        if "replayed" not in est.profile:
            raise SystemExit(f"{name}: the estimate did not read the replayed profile")
        row = trace_case(cfg, name, w, steps=2)
        got = {st: bt.tensor_bytes for st, bt in est.stages if st in TRAIN_STAGES}
        out.append(max(abs(got[st] - row[f"{st}_peak_alloc_bytes"]) for st in TRAIN_STAGES))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", help="cases whose preset matches this regex")
    ap.add_argument("--no-write", action="store_true", help="print, do not write docs/performance.md")
    args = ap.parse_args()
    lines = []
    for name, knobs in CASES:
        if args.only and not re.search(args.only, name):
            continue
        with tempfile.TemporaryDirectory() as cache:
            wall, cpu, profs = _timed(name, knobs, True, cache)
            classes = [json.loads(p) for p in profs]
            alone, checks = [], {}
            for c, text in zip(classes, profs):   # each class the replays gave, derived on its own
                wc = c["workload_class"]
                kc = {**knobs, **({"grad_accum": 2} if int(wc.get("grad_accum", 1)) > 1 else {}),
                      **({"checkpointing": wc["checkpointing"]} if wc.get("checkpointing", "none") != "none" else {})}
                alone.append(_timed(name, kc, False, cache)[:2])
                if "replayed" in c["provenance"]:
                    checks[_label(c)] = _check(name, text, kc, cache)
        refused = classes[0]["provenance"].get("replay_refused", {})
        lines.append((name, knobs, classes[0]["provenance"]["traces"], wall, cpu, [_label(c) for c in classes],
                      sum(a[0] for a in alone), sum(a[1] for a in alone), checks, refused))
        print(lines[-1], flush=True)
    text = _report(lines)
    print(text)
    if not args.no_write and not args.only:
        replace_section(SECTION, text)


def _label(c: dict) -> str:
    wc = c["workload_class"]
    return f"ckpt {wc.get('checkpointing', 'none')}, ga {wc.get('grad_accum', 1)}"


def _report(lines) -> str:
    out = [SECTION, "",
           f"`python scripts/bench_replay.py` ({time.strftime('%Y-%m-%d')}, {platform.machine()}, "
           f"{os.cpu_count()} CPUs, torch and transformers as pinned; each derivation a fresh process with an empty "
           "cache). One derivation with the replays (tracer.replay, tracer.recompute, tracer.selective) against each class it gives "
           f"derived alone; each replayed class's estimate against a full-depth trace at batch x seq "
           f"{', '.join(f'{b} x {s}' for b, s in SIZES)} (grad_accum 4 for the grad_accum class), the largest "
           "difference over the training stages.", "",
           "| preset | knobs | traces | one derivation, wall / CPU s | classes given | each alone, wall / CPU s | "
           "replayed vs full-depth trace |",
           "|---|---|---|---|---|---|---|"]
    for name, knobs, traces, wall, cpu, labels, a_wall, a_cpu, checks, refused in lines:
        k = ", ".join(f"{a}={','.join(b) if isinstance(b, list) else b}" for a, b in knobs.items()) or "full, none"
        chk = "; ".join(f"{lab}: {' / '.join(f'{d} B' for d in ds)}" for lab, ds in checks.items())
        if refused:
            chk += "; refused: " + "; ".join(f"{k2}: {v[:80]}" for k2, v in refused.items())
        out.append(f"| {name} | {k} | {traces} | {wall:.1f} / {cpu:.1f} | {'; '.join(labels)} | "
                   f"{a_wall:.1f} / {a_cpu:.1f} | {chk} |")
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    main()
