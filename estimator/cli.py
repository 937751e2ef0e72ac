"""`python -m estimator`: will this model fit? One estimate from the command line, as a table or JSON.

    python -m estimator --model llama-3.1-8b --mode infer --batch 4 --seq 2048 --gpu l4
    python -m estimator --model mistral-7b --method qlora --batch 4 --gpu rtx-4090 --json
    python -m estimator --model llama-3.1-70b --strategy fsdp --gpus 8 --gpu h100-sxm-80gb --checkpointing full

Bad input exits with code 2 and one line on stderr naming the field and what is allowed.
"""
from __future__ import annotations

import argparse
from dataclasses import replace
import json
import math
import sys
from pathlib import Path

from estimator import components as comp
from estimator import audio, cp, knobs, seq2seq, vision
from estimator.calibration_file import SEED_K
from estimator.calibration_file import CalibrationEntry, entry_for
from estimator.breakdown import COMPONENTS
import estimator.estimate as estimate_module  # ensure_profile, looked up at call time (tests replace it)
from estimator.estimate import Estimate, Options, estimate
from estimator.device import capacity_bytes, capacity_source
from estimator.gpus import GPU, get_gpu, load_gpus
from estimator.hub import OfflineError, fetch_config, split_model_ref
from estimator.model import Model, check_context, check_sizes, defaults_note, from_hf_config
from estimator.presets import default_lora_targets, load_config, preset_names
from estimator.search import Advice, advice, max_batch, max_seq, unpriced
from estimator.spec import (FSDP_WRAPS, PP_SCHEDULES, OFFLOADS,
                            STRATEGIES,
                            Parallel, Workload, spec_dict)
from estimator.units import fmt_bytes

MAX_K = 10_000.0  # k is ~10-100 for real models; anything larger is a typo
MAX_CONTEXT_MIB = 64 * 1024  # --cuda-context: a context is 300-1,500 MiB; more than 64 GiB is a unit mistake
BAR_WIDTH = 40


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, exit 2 (argparse's default also prints the usage block)
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def _choices(values) -> str:
    return "|".join(values)


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="python -m estimator", description="Estimate per-GPU memory of training or inference "
                "of a Hugging Face model, by component and stage. Bytes: GiB = 2**30, GB = 10**9.")
    a = p.add_argument
    a("--model", help="preset name (see --list-models), path to a Hugging Face config.json, or a Hugging Face id "
      "org/name[@revision] whose config.json is fetched (HF_TOKEN for gated models; HF_HUB_OFFLINE=1: cache only)")
    knobs.add_flags(p)  # every workload field, from its declaration (estimator.spec.Workload)
    a("--gpu", help="GPU preset (see --list-gpus): adds the verdict (device bytes against what cudaMemGetInfo "
      "reports), headroom, max batch and max seq; picks the CUDA context of its architecture")
    a("--alloc-conf", default="", metavar="CONF",
      help="PYTORCH_CUDA_ALLOC_CONF the run uses, e.g. 'expandable_segments:True': changes reserved bytes through "
           "the fitted classes (docs/allocator.md)")
    a("--cuda-context", metavar="MIB",
      help="CUDA context in MiB, as measured on the run's machine (e.g. 1343): overrides the GPU preset's "
           "(data/cuda_context.json) and --calibrated's")
    a("--gpus", type=int, default=1, help="world size; more than 1 needs --strategy")
    a("--strategy", choices=STRATEGIES, help="parallelism; default single for 1 GPU")
    a("--tp", type=int, default=1, help="tensor-parallel degree (strategy tp uses --gpus if left at 1)")
    a("--pp", type=int, default=1, help="pipeline stages (strategy pp uses --gpus if left at 1)")
    a("--ep", type=int, default=1, help="expert-parallel degree for MoE (strategy ep uses --gpus if left at 1)")
    a("--cp", type=int, default=1,
      help="torchtitan's context_parallel_degree: each sequence split over N ranks (ring attention), FSDP2 over "
           "dp-shard x cp (TP inside with --tp); needs --strategy fsdp, zero3 or fsdp-grad-op (or --dp-shard, with "
           "--dp-replicate for HSDP) and a seq that is a multiple of 2 x N; training only")
    a("--sequence-parallel", action="store_true", help="Megatron sequence parallelism (needs tensor parallelism)")
    a("--pp-schedule", choices=PP_SCHEDULES, default="1f1b",
      help="pipeline schedule: 1f1b (the first stage keeps min(pp, micro-batches) of activations), gpipe (every "
           "stage keeps all of them), interleaved-1f1b (torchtitan's Interleaved1F1B: two stages per rank, rank r "
           "holding stages r and r + pp), or the zero-bubble interleaved-zb (stages r and r + pp), zbv and "
           "dualpipev (stages r and 2 pp - 1 - r), priced from traced ranks only; needs --pp")
    a("--microbatches", type=int, default=0, metavar="N",
      help="micro-batches per step through the pipeline (default: --grad-accum); needs --pp")
    a("--dp-shard", type=int, default=0, metavar="N",
      help="torchtitan's data_parallel_shard_degree: FSDP shards over N ranks (with --dp-replicate: HSDP); sets "
           "--gpus to dp-shard x dp-replicate x tp x pp and the strategy to fsdp or hsdp")
    a("--dp-replicate", type=int, default=0, metavar="N",
      help="torchtitan's data_parallel_replicate_degree: N replicas of the FSDP shard group (HSDP)")
    a("--offload", choices=OFFLOADS, default="none", help="CPU offload of optimizer states (and params)")
    a("--fsdp-wrap", choices=FSDP_WRAPS, default="layers",
      help="FSDP2's units: layers (each decoder layer, then the root, which holds the embedding, final norm and head "
           "for the whole step: HF Accelerate's transformer wrap) or torchtitan (its apply_fsdp: the embedding a unit, "
           "each block, the final norm with the head a unit kept gathered after forward, then the root); needs an "
           "FSDP strategy, no pipeline")
    a("--activation-model", choices=("detailed", "k"),
      help="detailed: the model's traced profile (default); k: the seeds' k*b*s*h*L*bytes form for activations")
    a("--k", type=float, help=f"k for --activation-model k (default {SEED_K:g}, the seeds'); implies it")
    a("--no-derive", action="store_true",
      help="never trace to derive a missing profile (needs torch); fail with the command that derives it")
    a("--price-advice", action="store_true",
      help="price every row of 'What would help': derive the profile of each change not priced yet (a few minutes "
           "of CPU each, once; cached after), then answer; without it such rows are listed without a number")
    a("--derive-ranks", action="store_true",
      help="with tp, pp or cp: derive every traced rank's profile first (each pipeline rank, the TP rank, the CP "
           "ranks: minutes each, progress on stderr; cached after), then answer from them, exact per rank; without "
           "it such a layout is priced by the analytic rule and a note names the command")
    a("--calibrated", action="store_true",
      help="use the family's fitted k from data/calibration.json (env WILLITFIT_CALIBRATION) and report a "
           "95%% prediction interval")
    a("--allow-defaults", action="store_true",
      help="answer for a config.json that lacks size fields (layers, heads, widths, vocabulary) with transformers' "
           "defaults for them, and list them in a note; without it such a config is refused")
    a("--allow-beyond-context", action="store_true",
      help="estimate a seq (+ gen tokens) past the model's max_position_embeddings (RoPE scaling) with a note; "
           "without it such a run is refused (learned position embeddings are refused either way)")
    a("--json", action="store_true", help="print one JSON object instead of the table")
    a("--list-models", action="store_true", help="list the model presets and exit")
    a("--list-gpus", action="store_true", help="list the GPU presets and exit")
    return p


SEQ_DEFAULT = Workload().seq


def _workload(args) -> Workload:
    return knobs.workload_from_args(args)


def parallel_from_args(args) -> Parallel:
    if args.dp_shard or args.dp_replicate:
        return _torchtitan_mesh(args)
    strategy = args.strategy
    if strategy is None:
        if args.gpus > 1:
            raise ValueError(f"strategy: --gpus {args.gpus} needs --strategy; choose one of {', '.join(STRATEGIES[1:])}")
        strategy = "single"
    return Parallel(strategy=strategy, gpus=args.gpus, tp=args.tp, pp=args.pp, ep=args.ep,
                    sequence_parallel=args.sequence_parallel, offload=args.offload, pp_schedule=args.pp_schedule,
                    microbatches=args.microbatches, cp=args.cp, fsdp_wrap=args.fsdp_wrap)


def _torchtitan_mesh(args) -> Parallel:
    """--dp-shard / --dp-replicate as torchtitan's ParallelDims reads them: world = replicate x shard x cp x tp x pp;
    one replica is FSDP (over shard x cp ranks with context parallelism), several are HSDP sharded over dp-shard
    ranks."""
    shard, replicate = args.dp_shard or 1, args.dp_replicate or 1
    for name, v in (("dp_shard", shard), ("dp_replicate", replicate)):
        if v < 1:
            raise ValueError(f"{name}: must be a positive integer, got {v}")
    gpus = shard * replicate * args.tp * args.pp * args.ep * args.cp
    if args.strategy not in (None, "fsdp", "hsdp") or (args.gpus != 1 and args.gpus != gpus):
        raise ValueError(f"dp_shard: --dp-shard/--dp-replicate set the world size ({gpus}) and the strategy (fsdp or "
                         "hsdp); drop --gpus/--strategy or make them agree")
    strategy = "hsdp" if replicate > 1 else ("fsdp" if gpus > 1 else "single")
    return Parallel(strategy=strategy, gpus=gpus, tp=args.tp, pp=args.pp, ep=args.ep,
                    sequence_parallel=args.sequence_parallel, offload=args.offload,
                    hsdp_shard=shard if strategy == "hsdp" else 0, pp_schedule=args.pp_schedule,
                    microbatches=args.microbatches, cp=args.cp, fsdp_wrap=args.fsdp_wrap)


def _progress(done: int, total: int, message: str) -> None:
    """Deriving a profile traces the model a few dozen times: say so on stderr, one line per trace."""
    print(f"[{done}/{total}] {message}", file=sys.stderr, flush=True)


def _options(args, model: Model, w: Workload) -> tuple[Options, CalibrationEntry | None]:
    base = dict(derive=not args.no_derive, progress=_progress, alloc_conf=args.alloc_conf, gpu=args.gpu,
                cuda_context_bytes=_cuda_context(args.cuda_context))
    opts, cal = _k_options(args, model, w)
    return Options(overhead=opts.overhead, activation_k=opts.activation_k, **base), cal


def _cuda_context(text: str | None) -> int | None:
    """--cuda-context MiB -> bytes (None when not given); one line naming the flag for a bad value."""
    if text is None:
        return None
    try:
        mib = float(text)
    except ValueError:
        raise ValueError(f"cuda_context: {text!r} is not a number of MiB (e.g. 1343)") from None
    if not (math.isfinite(mib) and 0 <= mib <= MAX_CONTEXT_MIB):
        raise ValueError(f"cuda_context: {text} MiB is out of range; allowed 0..{MAX_CONTEXT_MIB} MiB (64 GiB)")
    return round(mib * 2**20)


def _k_options(args, model: Model, w: Workload) -> tuple[Options, CalibrationEntry | None]:
    if args.calibrated:
        if args.k is not None or args.activation_model == "detailed":
            raise ValueError("k: --calibrated takes k from the calibration file; drop --k / --activation-model")
        cal = entry_for(model.family, w.attention, w.checkpointing)
        overhead = comp.Overhead() if cal.context_bytes is None else comp.Overhead(cuda_context_bytes=int(cal.context_bytes))
        return Options(overhead=overhead, activation_k=cal.k), cal
    if args.k is not None:
        if args.activation_model == "detailed":
            raise ValueError("k: --k applies to --activation-model k, not detailed")
        if not (math.isfinite(args.k) and 0 < args.k <= MAX_K):
            raise ValueError(f"k: {args.k} is out of range; allowed 0 < k <= {MAX_K:g}")
        return Options(activation_k=args.k), None
    if args.activation_model == "k":
        return Options(activation_k=SEED_K), None
    return Options(), None


def _verdict(est: Estimate, gpu_bytes: int, interval: tuple[int, int] | None) -> str:
    if interval is None:
        return est.verdict(gpu_bytes)
    lo, hi = interval
    return "fits" if hi <= gpu_bytes else ("oom" if lo > gpu_bytes else "tight")


def _degrees(p: dict) -> str:
    """' (tp 2 x pp 2, sequence parallel)': the mesh degrees above 1 beside the strategy's own."""
    dims = [f"{k} {p[k]}" for k in ("tp", "pp", "ep", "cp") if p.get(k, 1) > 1]
    sp = ", sequence parallel" if p.get("sequence_parallel") else ""
    return f" ({' x '.join(dims)}{sp})" if dims else (f" ({sp[2:]})" if sp else "")


def report(model: Model, est: Estimate, gpu: GPU | None, options: Options,
           cal: CalibrationEntry | None, price_advice: bool = False) -> dict:
    """Everything the CLI shows, as one JSON-ready dict (bytes are ints; GiB/GB only in the text view)."""
    out = {
        "model": model.name, "model_type": model.model_type, "family": model.family,
        **({"image_seq": vision.size_words(model, est.workload.seq)} if vision.is_vision(model) else {}),
        **({"images": vision.image_words(model, est.workload)} if est.workload.images else {}),
        **({"audio": audio.audio_words(model, est.workload)} if est.workload.audios else {}),
        **({"lengths": seq2seq.words(model, est.workload)} if seq2seq.seq2seq_of(model) else {}),
        "params": est.params, "active_params": est.params if vision.is_vision(model) else model.active_params,
        "trainable_params": est.trainable_params,
        "workload": spec_dict(est.workload), "parallel": spec_dict(est.parallel),
        "activation_model": "detailed" if options.activation_k is None else "k",
        "activation_k": options.activation_k,
        "total_bytes": est.total_bytes, "allocated_bytes": est.allocated_bytes,
        "reserved_bytes": est.reserved_bytes, "device_bytes": est.device_bytes, "alloc_conf": options.alloc_conf,
        "device_parts": [{"name": n, "bytes": b, "source": src} for n, b, src in est.device_parts()],
        "peak_stage": est.peak_stage, "pipeline_stage": est.pipeline_stage, "peak_moment": est.peak_moment,
        "paged_bytes": est.paged_bytes, "notes": list(est.notes), "profile": est.profile,
        "components": est.components.as_dict(),
        "stages": {name: {**b.as_dict(), "total_bytes": b.total} for name, b in est.stages},
    }
    interval = cal.interval(est.total_bytes) if cal else None
    if cal:
        out["calibration"] = {"family": cal.family, "k": cal.k, "k_ci_low": cal.k_ci_low, "k_ci_high": cal.k_ci_high,
                              "residual_std_bytes": cal.residual_std_bytes, "n_points": cal.n_points,
                              "created_at": cal.created_at.isoformat(), "attention": cal.attention,
                              "checkpointing": cal.checkpointing, "context_bytes": cal.context_bytes}
        out["interval_bytes"] = list(interval)
    if gpu is not None:
        cap = capacity_bytes(gpu)   # what cudaMemGetInfo reports, below nvidia-smi's memory.total
        w, p = est.workload, est.parallel
        out.update(gpu=gpu.name, gpu_bytes=cap, gpu_bytes_source=capacity_source(gpu),
                   gpu_memory_total_bytes=gpu.memory_bytes, fits=est.device_bytes <= cap,
                   headroom_bytes=cap - est.device_bytes, verdict=_verdict(est, cap, interval),
                   max_batch=max_batch(model, w, p, cap, options),
                   # a vision encoder's tokens follow its image size: no sequence length to search
                   max_seq=None if vision.is_vision(model) else max_seq(model, w, p, cap, options,
                                                                        limit=max(model.max_positions, w.seq)),
                   max_positions=model.max_positions)
        if not out["fits"]:
            # pricing other workload classes would trace each one: only classes whose profile is on disk
            priced = Options(overhead=options.overhead, activation_k=options.activation_k, derive=False,
                             alloc_conf=options.alloc_conf, gpu=options.gpu,
                             cuda_context_bytes=options.cuda_context_bytes)
            items = advice(model, w, p, cap, priced)
            if price_advice and _price(model, unpriced(w, p, items)):
                items = advice(model, w, p, cap, priced)
            out["advice"] = [_advice_dict(a) for a in items]
    return out


def _price(model: Model, todo: list) -> int:
    """Derive the profile of each unpriced advice row (progress on stderr); returns how many were derived. A row
    whose class cannot be traced stays unpriced, with its reason on stderr."""
    done = 0
    for i, (title, w, p) in enumerate(todo, 1):
        print(f"pricing {i}/{len(todo)}: {title}", file=sys.stderr, flush=True)
        try:
            estimate_module.ensure_profile(model, w, p, _progress)
            done += 1
        except ValueError as e:
            print(f"  not priced: {' '.join(str(e).split())}", file=sys.stderr, flush=True)
    return done


def _advice_dict(a: Advice) -> dict:
    change = {k: (",".join(v) if isinstance(v, tuple) else v) for k, v in a.change.items()}
    return {"title": a.title, "change": change, "saving_bytes": a.saving_bytes,
            "new_total_bytes": a.new_total_bytes, "fits": a.fits, "note": a.note, "priced": a.priced}


def _both(n: int) -> str:
    return f"{fmt_bytes(n, 'GiB'):>12} {fmt_bytes(n, 'GB'):>12}"


def _bar(n: int, scale: int) -> str:
    return "#" * max(0, round(BAR_WIDTH * n / scale)) if scale > 0 else ""


def render_text(r: dict) -> str:
    w, p = r["workload"], r["parallel"]
    lines = [f"{r['model']} ({r['model_type']}): {r['params']:,} params"
             + (f", {r['active_params']:,} active per token" if r["active_params"] != r["params"] else "")
             + f", {r['trainable_params']:,} trainable",
             f"{w['mode']} {w['method']}, " + (f"recipe {w['recipe']} " if w["mode"] == "train" else "")
             + f"{w['precision']}, weights {w['weight_format']}, "
             + (f"batch {w['batch']} x {w['image_size']}x{w['image_size']} px images ({r.get('image_seq', '')})"
                if w.get("image_size") and not w.get("images") else f"batch {w['batch']} x seq {w['seq']}")
             + (f" with {r['images']}" if r.get("images") else "")
             + (f" with {r['audio']}" if r.get("audio") else "")
             + (f" ({r['lengths']})" if r.get("lengths") else "")
             + (f" + {w['gen_tokens']} generated" if w["gen_tokens"] else "")
             + (f", {w['optimizer']} ({w['optimizer_impl']}), grad_accum {w['grad_accum']}, checkpointing "
                f"{w['checkpointing']}" if w["mode"] == "train" else "") + f", attention {w['attention']}",
             f"{p['gpus']} GPU(s), strategy {p['strategy']}" + _degrees(p)
             + f"; activation model {r['activation_model']}"
             + (f" (k={r['activation_k']:.2f})" if r["activation_k"] is not None else ""), ""]
    scale = max(r["total_bytes"], r.get("gpu_bytes", 0))
    lines.append(f"Per GPU at the peak ({r['peak_stage']}{cp.where(r['pipeline_stage'])}):")
    lines.append(f"  {'component':<18}{'GiB (2^30)':>12} {'GB (10^9)':>12}")
    for name in COMPONENTS:
        n = r["components"][name]
        if n:
            lines.append(f"  {name:<18}{_both(n)}  {_bar(n, scale)}")
    lines.append(f"  {'TOTAL (device)':<18}{_both(r['total_bytes'])}")
    lines.append(f"  allocated {fmt_bytes(r['allocated_bytes'])} <= reserved {fmt_bytes(r['reserved_bytes'])} <= device "
                 f"{fmt_bytes(r['device_bytes'])} (torch memory_allocated / memory_reserved / nvidia-smi; "
                 f"allocator {r['alloc_conf'] or 'defaults'})")
    if r.get("peak_moment"):
        lines.append(f"  peak moment: {r['peak_moment']}")
    if r.get("paged_bytes"):
        lines.append(f"  + {fmt_bytes(r['paged_bytes'])} of paged optimizer states in CUDA unified memory "
                     "(outside torch's allocator; they page to host RAM under pressure)")
    prof = r.get("profile") or {}
    if prof:
        lines.append(f"  profile: derived from transformers {prof.get('transformers')} / torch {prof.get('torch')}"
                     f" ({prof.get('kernels')} kernels), {prof.get('traces')} traces of "
                     f"{vision.traced_depths(prof)} in {prof.get('seconds')} s")
        if prof.get("scan"):
            lines.append(f"  assumes: {prof['scan']}")
    for note in r.get("notes", []):
        lines.append(f"  note: {note}")
    lines += ["", "Stages (waterfall):"]
    for name, st in r["stages"].items():
        mark = "  <- peak" if name == r["peak_stage"] else ""
        lines.append(f"  {name:<18}{_both(st['total_bytes'])}  {_bar(st['total_bytes'], scale)}{mark}")
    if "interval_bytes" in r:
        lo, hi = r["interval_bytes"]
        lines.append(f"\n95% prediction interval (calibrated k={r['calibration']['k']:.2f}, "
                     f"n={r['calibration']['n_points']}): {fmt_bytes(lo)} .. {fmt_bytes(hi)}")
    if "gpu" in r:
        lines += ["", f"GPU {r['gpu']}: {fmt_bytes(r['gpu_bytes'])} = {fmt_bytes(r['gpu_bytes'], 'GB')} usable "
                  f"({r['gpu_bytes_source']}; memory.total {fmt_bytes(r['gpu_memory_total_bytes'])}); the verdict "
                  "compares device bytes with it"]
        head = r["headroom_bytes"]
        verdict = {"fits": f"fits with {fmt_bytes(head)} ({fmt_bytes(head, 'GB')}) to spare",
                   "oom": f"OOM by {fmt_bytes(-head)} ({fmt_bytes(-head, 'GB')})",
                   "tight": (f"tight: the interval crosses capacity (headroom {fmt_bytes(head)})"
                             if "interval_bytes" in r else
                             f"tight: over by {fmt_bytes(-head)} with the allocator's estimated cache, which PyTorch "
                             "frees and retries before it gives up: the tensors fit, fragmentation decides "
                             "(expandable_segments:True makes it likelier to run)")}[r["verdict"]]
        lines.append(f"Verdict: {verdict}")
        lines.append(f"Max micro-batch that fits: {r['max_batch']}" + (
            f"; max seq that fits: {r['max_seq']} (model context {r['max_positions']})" if r["max_seq"] is not None
            else ""))
        if r.get("advice"):
            lines += ["", "What would help (each alone, largest saving first):"]
            shown = r["advice"][:7] + [a for a in r["advice"][7:] if a["title"].startswith("Combine")
                                       or "alloc_conf" in a["change"] or not a["priced"]]
            for a in shown:
                if not a["priced"]:
                    lines.append(f"  - {a['title']}: {a['note']}")
                    continue
                lines.append(f"  - {a['title']}: saves {fmt_bytes(a['saving_bytes'])} -> "
                             f"{fmt_bytes(a['new_total_bytes'])} ({'fits' if a['fits'] else 'still OOM'}). {a['note']}")
            if not all(a["priced"] for a in r["advice"]):
                lines.append("  (rows without a number: add --price-advice to derive their profiles now, a few "
                             "minutes of CPU each, once)")
    return "\n".join(lines)


def _list_models() -> str:
    rows = []
    for name in preset_names():
        m = from_hf_config(load_config(name)[1], name)
        active = f" ({m.active_params / 1e9:,.2f} B active)" if m.is_moe else ""
        rows.append(f"{name:<22} {m.model_type:<12} {m.params / 1e9:>9,.3f} B params{active}")
    return "\n".join(rows)


def _list_gpus() -> str:
    return "\n".join(f"{g.name:<18} {g.display_name:<28} {fmt_bytes(g.memory_bytes):>11} = "
                     f"{fmt_bytes(g.memory_bytes, 'GB'):>10} ({g.memory_source})" for g in load_gpus().values())


def _config(args) -> tuple[str, dict, list[str]]:
    """(name, config.json, size fields left to defaults) for --model: a preset, a config.json path (its sizes
    checked: estimator.model.check_sizes), or a hub id org/name[@revision] (the same fetch as the app's)."""
    is_file = args.model.endswith(".json") or Path(args.model).exists()
    ref = None if is_file or args.model in preset_names() else split_model_ref(args.model)
    if ref is not None:
        model_id, revision = ref
        try:
            cfg = fetch_config(model_id, revision)
        except OfflineError as e:
            raise ValueError(f"model: {e}") from None
        return (model_id if revision == "main" else f"{model_id}@{revision}"), cfg, []
    name, cfg = load_config(args.model)
    return name, cfg, check_sizes(cfg, args.allow_defaults) if is_file else []


def run(args) -> dict | str:
    if args.list_models:
        return _list_models()
    if args.list_gpus:
        return _list_gpus()
    if not args.model:
        raise ValueError("model: required; give a preset name (--list-models), a config.json path or a Hugging Face "
                         "id org/name[@revision]")
    name, cfg, defaulted = _config(args)
    try:
        model = from_hf_config(cfg, name, derive=not args.no_derive, progress=_progress)
    except (TypeError, KeyError, ArithmeticError) as e:  # a config.json with wrongly typed fields
        raise ValueError(f"model: cannot build {name!r} from its config ({type(e).__name__}: {e})") from None
    w, p = _workload(args), parallel_from_args(args)
    if vision.is_vision(model) and args.seq != SEQ_DEFAULT:
        raise ValueError(f"seq: {name} is a vision encoder, sized by --image-size (pixels), not --seq")
    w = vision.sized(model, w)  # a vision encoder's image size -> tokens per image (seq); a text model as it is
    w, targets_note = model_lora_targets(model, w)
    w, attention_note = grid_attention(model, w, getattr(args, "attention_given", True))
    vision.check_images(model, w)  # a vision-language model's images fit in seq (before any derivation)
    seq2seq.check(model, w, p)     # an encoder-decoder model's lengths, knobs and layout (before any derivation)
    gpu = get_gpu(args.gpu) if args.gpu else None
    options, cal = _options(args, model, w)
    # an encoder-decoder model's encoder reads seq; its decoder's positions are checked by seq2seq.check
    beyond = check_context(model, w.seq, 0 if seq2seq.seq2seq_of(model) else w.gen_tokens, args.allow_beyond_context)
    if args.derive_ranks and not args.no_derive:
        estimate_module.ensure_profile(model, w, p, _progress, tp_rank=True)   # every traced rank: tracer.pp, tp, cp
    out = report(model, estimate(model, w, p, options), gpu, options, cal, price_advice=args.price_advice)
    out["notes"][:0] = [n for n in (defaults_note(model, defaulted) if defaulted else None, beyond, targets_note,
                                    attention_note) if n]
    return out


def model_lora_targets(model: Model, w: Workload) -> tuple[Workload, str | None]:
    """--lora-targets at its default (q_proj,v_proj) on a model with no such module (T5's q and v, GPT-2's c_attn,
    Phi-3's qkv_proj): PEFT's default for the model type instead (`peft.LoraConfig(target_modules=None)`,
    data/lora_defaults.json), said in a note. Other targets are kept (one the model lacks is refused later)."""
    default = Workload().lora_targets
    if w.method == "full" or w.lora_targets != default:
        return w, None
    names = set(model.inventory.lora_target_names())
    peft = default_lora_targets(model.model_type)
    if set(default) & names or not set(peft) & names:
        return w, None
    return replace(w, lora_targets=peft), (f"lora_targets: {','.join(peft)}, PEFT's default for {model.model_type} "
                                           f"(it has no {' or '.join(default)}); --lora-targets names others")


def grid_attention(model: Model, w: Workload, given: bool) -> tuple[Workload, str | None]:
    """A Qwen2-VL-family or Pixtral-towered model with images and --attention left at its default: priced under flash
    (its vision tower's one varlen call per layer, the attention it is priced under: estimator.vision.check_images), said in a
    note, as the app starts it. An --attention given on the command line is kept (SDPA and eager are refused)."""
    packed = vision.grid(model) is not None or vision.pixtral(model) is not None
    if given or not w.images or not packed or w.attention != Workload().attention:
        return w, None
    why = "masks every image's patches against every other's" if vision.pixtral(model) is not None else \
        "runs one call per image"
    return replace(w, attention="flash"), (f"attention: flash, FlashAttention-2 (its vision tower's one varlen call "
                                           f"per layer); under {w.attention} {model.name}'s tower {why}, which is not "
                                           "priced")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    given = sys.argv[1:] if argv is None else argv
    # --attention or a prefix of it that argparse took (its abbreviations), with or without "=value"
    args.attention_given = any(len(f) > 2 and "--attention".startswith(f) for f in (a.split("=", 1)[0] for a in given
                                                                                    if a.startswith("--")))
    try:
        result = run(args)
    except ValueError as e:
        print(f"python -m estimator: error: {' '.join(str(e).split())}", file=sys.stderr)
        return 2
    if isinstance(result, str):
        print(result)
    elif args.json:
        print(json.dumps(result, indent=2))
    else:
        print(render_text(result))
    return 0
