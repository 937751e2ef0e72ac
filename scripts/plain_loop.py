"""The tracer against a plain training loop counted by torch's own MemTracker, preset by preset.

    python scripts/plain_loop.py                 # presets <= 13B parameters, batch 4, seq 2048, both loops
    python scripts/plain_loop.py --all           # every preset (a 405B step takes minutes)
    python scripts/plain_loop.py --model llama-3.2-1b --batch 1 --no-doc
    python scripts/plain_loop.py --all --resume  # rows kept in build/plain_loop.jsonl; a rerun skips those done
    python scripts/plain_loop.py --report        # only rewrite the doc's section from build/plain_loop.jsonl

The plain loop is what the project's ground truth must match, written without anything from tracer:

    # model built on meta with default dtype bf16, to_empty(device="cpu") inside FakeTensorMode, tie_weights()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, foreach=True)
    for _ in range(2):
        loss = model(input_ids=x, labels=x, use_cache=False).loss        # loop "loss-only"
        loss.backward(); del loss
        opt.step(); opt.zero_grad()

and, for loop "keep-output", `out = model(...)`, `out.loss.backward()`, with `out` alive until the next
iteration's `out = model(...)` returns. BERT is a masked LM (AutoModelForMaskedLM, no use_cache); Gemma-2 and gpt-oss
are built with eager attention (transformers refuses SDPA for them), everything else with SDPA; a multimodal
checkpoint is built as transformers' causal LM for its type, or from its text_config when its type has none. Full fine-tuning, pure bf16.
MemTracker (torch.distributed._tools.mem_tracker) counts it; its overall peak must equal, to the byte,
`run_traced(..., kernels="cpu")` of the same case (tracer.kernels: the CPU's own kernels, labels the
input ids tensor itself). The table also gives the `kernels="cuda"` peak (what a GPU keeps) and its difference.
Presets with learned positions shorter than --seq run at their own maximum (GPT-2 1024, BERT 512).
Unless --no-doc, the table replaces the section "## Plain loop vs tracer" of docs/activations.md.
"""
from __future__ import annotations

import argparse
import copy
import json
import sys
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from scripts.perf_doc import replace_section  # noqa: E402

DOC = Path(__file__).resolve().parent.parent / "docs" / "activations.md"
ROWS = Path(__file__).resolve().parent.parent / "build" / "plain_loop.jsonl"
HEADING = "## Plain loop vs tracer"
LOOPS = ("loss-only", "keep-output")
DEFAULT_MAX_PARAMS = 13_500_000_000   # "<= 13B": llama-2-13b (13.0B) in, qwen1.5-moe (14.3B) out
MiB = 2**20


def build_plain_model(config: dict):
    """The model as the plain loop builds it: transformers' own class on meta, bf16, then fake CPU storage."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForMaskedLM

    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    rest = copy.deepcopy({k: v for k, v in config.items() if k not in ("model_type", "auto_map")})
    cfg = AutoConfig.for_model(config["model_type"], **rest)
    cls = AutoModelForMaskedLM if cfg.model_type == "bert" else AutoModelForCausalLM
    if cls is AutoModelForCausalLM and cfg.model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        cfg = cfg.text_config  # a multimodal checkpoint without a causal-LM class of its own (Llama-4, Mistral-3)
    attn = "eager" if _eager_only(config) else "sdpa"  # no SDPA path in transformers
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)  # module.to(dtype) fails under FakeTensorMode
    try:
        with torch.device("meta"):
            # dtype too: transformers builds in the config's torch_dtype when it names one (gemma-2-9b: float32)
            model = cls.from_config(cfg, attn_implementation=attn, dtype=torch.bfloat16)
    finally:
        torch.set_default_dtype(old)
    return model


def plain_loop_peak(config: dict, batch: int, seq: int, loop: str = "loss-only") -> int:
    """Overall peak bytes MemTracker counts for two steps of the plain loop (module docstring)."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.mem_tracker import MemTracker

    if loop not in LOOPS:
        raise ValueError(f"loop: {loop!r} is not allowed; choose one of {', '.join(LOOPS)}")
    model = build_plain_model(config)
    masked = config["model_type"] == "bert"
    with FakeTensorMode(allow_non_fake_inputs=True):
        model.to_empty(device="cpu")
        model.tie_weights()
        model.train()
        x = torch.randint(0, int(model.config.get_text_config().vocab_size), (batch, seq))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-5, foreach=True)
        kw = {} if masked else {"use_cache": False}
        tracker = MemTracker()
        tracker.track_external(model, opt, x)
        with tracker:
            out = None
            for step in range(2):
                if step:
                    tracker.reset_mod_stats()  # MemTracker refuses a second iteration without it
                if loop == "keep-output":
                    out = model(input_ids=x, labels=x, **kw)
                    out.loss.backward()
                else:
                    loss = model(input_ids=x, labels=x, **kw).loss
                    loss.backward()
                    del loss
                opt.step()
                opt.zero_grad()
            del out
    snap = tracker.get_tracker_snapshot("peak")
    return sum(dev["Total"] for dev in snap.values())


def tracer_peak(config: dict, name: str, batch: int, seq: int, loop: str, kernels: str) -> int:
    """Overall peak of the tracer (tracer.session.run_traced) on the same case."""
    from estimator.spec import Workload
    from tracer.session import run_traced

    attention = "eager" if _eager_only(config) else "sdpa"
    w = Workload(batch=batch, seq=seq, loop=loop, attention=attention)
    return run_traced(config, w, kernels=kernels, name=name).log.peak.peak_bytes


def _eager_only(config: dict) -> bool:
    """Whether transformers has no SDPA path for this model (its inventory: `_supports_sdpa` of its class)."""
    from estimator.model import from_hf_config

    return not from_hf_config(config, "plain").inventory.supports_sdpa


def window_peaks(config: dict, name: str, batch: int, seq: int, loop: str, kernels: str) -> list[tuple[str, int]]:
    """(stage, peak) of every stage window of the tracer's run, in order (load, then each step's forward,
    backward, optimizer): where in which step the peak is."""
    from estimator.spec import Parallel, Workload
    from tracer import kernels as kernels_mod
    from tracer import session

    attention = "eager" if _eager_only(config) else "sdpa"
    w = Workload(batch=batch, seq=seq, loop=loop, attention=attention)
    with kernels_mod.emulate(kernels), session._prepared(config, w, Parallel(), kernels=kernels) as case:
        counter = session._run(case, 2)
    live = counter.timeline().live().sum(axis=0)
    out, prev = [], 0
    for tick, stage in counter.marks:
        out.append((stage, int(live[prev:tick + 1].max())))
        prev = tick + 1
    return out


def presets(names: list[str] | None, include_all: bool) -> list[tuple[str, dict, int, int]]:
    """(name, config, parameters, max positions) of the presets to run, smallest first."""
    from estimator.model import from_hf_config
    from estimator.presets import load_config, preset_names

    out = []
    for n in names or preset_names():
        name, config = load_config(n)
        m = from_hf_config(config, name, derive=False)
        if names or include_all or m.params <= DEFAULT_MAX_PARAMS:
            out.append((name, config, m.params, m.max_positions))
    return sorted(out, key=lambda p: p[2])


def compare(name: str, config: dict, batch: int, seq: int, loop: str) -> dict:
    """One row; a run that raises is a row too, with the error (it counts as not equal)."""
    start = time.perf_counter()
    row = {"preset": name, "loop": loop, "batch": batch, "seq": seq}
    try:
        mem = plain_loop_peak(config, batch, seq, loop)
        cpu = tracer_peak(config, name, batch, seq, loop, "cpu")
        cuda = tracer_peak(config, name, batch, seq, loop, "cuda")
    except Exception as e:  # noqa: BLE001 - recorded in the table
        return {**row, "error": f"{type(e).__name__}: {' '.join(str(e).split())[:200]}", "equal": False,
                "seconds": time.perf_counter() - start}
    return {**row, "memtracker": mem, "tracer_cpu": cpu, "equal": mem == cpu, "tracer_cuda": cuda,
            "seconds": time.perf_counter() - start}


def table(rows: list[dict], batch: int) -> str:
    head = ("| preset | loop | seq | MemTracker peak (B) | tracer `--kernels cpu` (B) | equal | "
            "tracer `--kernels cuda` (B) | cuda - plain loop (MiB) |")
    lines = [head, "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['preset']} | {r['loop']} | {r['seq']} | {r['error'].replace('|', '/')} | | **no** | | |")
            continue
        diff = (r["tracer_cuda"] - r["memtracker"]) / MiB
        lines.append(f"| {r['preset']} | {r['loop']} | {r['seq']} | {r['memtracker']:,} | {r['tracer_cpu']:,} | "
                     f"{'yes' if r['equal'] else '**no**'} | {r['tracer_cuda']:,} | {diff:+,.1f} |")
    return "\n".join(lines) + f"\n\nBatch {batch}, full fine-tuning, pure bf16, AdamW foreach, two steps; MiB = 2^20 B."


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="preset names, comma-separated (default: every preset <= 13B)")
    p.add_argument("--all", action="store_true", help="every preset, the 70B-671B ones included")
    p.add_argument("--batch", type=int, default=4, help="sequences per step (default 4)")
    p.add_argument("--seq", type=int, default=2048, help="tokens per sequence (default 2048; capped at a "
                   "preset's learned positions)")
    p.add_argument("--loop", default=",".join(LOOPS), help="loss-only, keep-output or both (default both)")
    p.add_argument("--no-doc", action="store_true", help="print only; do not write docs/activations.md")
    p.add_argument("--resume", action="store_true", help=f"append rows to {ROWS.relative_to(ROWS.parent.parent)} "
                   "and skip the (preset, loop, batch, seq) already there")
    p.add_argument("--report", action="store_true", help="run nothing: write the doc's section from the rows kept "
                   "by --resume")
    p.add_argument("--windows", action="store_true", help="also print the tracer's peak in every stage window "
                   "(load, each step's forward, backward, optimizer) for both kernels")
    args = p.parse_args(argv)
    warnings.filterwarnings("ignore")
    loops = [x.strip() for x in args.loop.split(",") if x.strip()]
    bad = [x for x in loops if x not in LOOPS]
    if bad or not loops:
        p.error(f"loop: {bad or 'none'} not allowed; choose from {', '.join(LOOPS)}")
    names = [x.strip() for x in args.model.split(",")] if args.model else None
    kept = [json.loads(x) for x in ROWS.read_text().splitlines()] if (args.resume or args.report) and \
        ROWS.exists() else []
    done = {(r["preset"], r["loop"], r.get("batch", 4), r["seq"]): r for r in kept}
    rows = []
    for name, config, params, max_pos in ([] if args.report else presets(names, args.all)):
        seq = min(args.seq, max_pos)
        for loop in loops:
            if (name, loop, args.batch, seq) in done:
                rows.append(done.pop((name, loop, args.batch, seq)))
                continue
            r = {**compare(name, config, args.batch, seq, loop), "params": params}
            rows.append(r)
            if args.resume:
                ROWS.parent.mkdir(parents=True, exist_ok=True)
                with ROWS.open("a") as f:
                    f.write(json.dumps(r) + "\n")
            if "error" in r:
                print(f"{name:20s} {loop:11s} seq {seq:5d}  ERROR {r['error']}", flush=True)
                continue
            print(f"{name:20s} {loop:11s} seq {seq:5d}  MemTracker {r['memtracker']:>16,}  tracer cpu "
                  f"{r['tracer_cpu']:>16,}  {'equal' if r['equal'] else 'DIFFERENT'}  tracer cuda "
                  f"{r['tracer_cuda']:>16,}  ({r['seconds']:.0f} s)", flush=True)
            if args.windows:
                for kind in ("cpu", "cuda"):
                    wins = window_peaks(config, name, args.batch, seq, loop, kind)
                    print(f"  {kind:4s} windows: " + ", ".join(f"{st} {b:,}" for st, b in wins), flush=True)
    if args.report:
        rows = sorted(kept, key=lambda r: (r.get("params", 0), r["preset"], r["loop"]))
    text = table(rows, args.batch)
    print(text)
    if not args.no_doc:
        cmd = "python scripts/plain_loop.py" + (" --all" if args.all or args.report else "") + \
            (" --resume" if args.resume or args.report else "") + \
            (f" --model {args.model}" if args.model else "") + \
            (f" --batch {args.batch}" if args.batch != 4 else "") + (f" --seq {args.seq}" if args.seq != 2048 else "")
        which = "every preset" if args.all or args.model or args.report else "presets <= 13B parameters (`--all` runs the rest)"
        replace_section(HEADING, f"{HEADING}\n\nMade with `{cmd}` ({which}); scripts/plain_loop.py says what the "
                        f"plain loop is.\n\n{text}\n", DOC)
    return 0 if all(r["equal"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
