"""Per-rank parallel profiles against a full-depth trace of one rank, at a size no fit used.

    WILLITFIT_CACHE=/tmp/pc-cache python scripts/parallel_check.py                 # every case
    WILLITFIT_CACHE=/tmp/pc-cache python scripts/parallel_check.py --case tp2-infer

For a 6-layer Llama built offline (CONFIG: 8 heads and 8 KV heads, so tp 2, 4 and 8 all divide it), each case
derives the rank's profile (tracer.derive at reduced depth: 3 and 4 layers, fit in (b, s), verified at an unused
size; cached under $WILLITFIT_CACHE), estimates one rank at CHECK_TRAIN / CHECK_INFER (sizes the fit never traced),
traces one rank of the whole 6-layer model there (tracer.session.run_traced), and prints per stage and component
the estimate, the trace and their difference, plus the old analytic split (Options.analytic_tp) for TP. It exits
1 when any traced-profile component differs from the trace by a byte.

Cases: tp 2 / 4 / 8 (training full fine-tuning, pure bf16 AdamW; inference); FSDP2 over dp 2 composed with tp 2
and 4 on a (dp, tp) mesh (training); tp 2 with the head tied to the embedding (training); sequence parallelism:
tp 4 and FSDP 2 x TP 2 (training); plain fsdp 2 (training); pipelines (tracer.pp: every rank derived and traced,
beside the analytic rule, Options.analytic_pp): pp 2 1F1B over 4 micro-batches of the 12-layer model (stages
of 6 layers, so the reduced depths cut inside a stage), pp 4 GPipe over 6 micro-batches (amp; stages of 1, 2, 2
and 1 layers) and pp 4 1F1B over 4 micro-batches of an 8-layer model (mixed: fp32 master weights; 2, 3, 2, 1);
FSDP2 over each stage's dp ranks: FSDP 16 x PP 2 (1F1B, the 12-layer model) and FSDP 8 x PP 4 (GPipe, mixed, the
8-layer model), at a dp no fit used; TP inside every stage on torchtitan's (pp, dp, tp) mesh: pp 2 x tp 2 (1F1B, the
12-layer model), pp 2 x tp 4 with sequence parallelism (GPipe over 3 micro-batches, mixed, the 8-layer model) and
FSDP 16 x TP 2 x PP 2 (1F1B, the 12-layer model, 64 ranks); interleaved 1F1B (two stages per rank, each rank's
stages traced whole) of the 12-layer model: pp 2 over 4 micro-batches, FSDP 16 x PP 2, and PP 2 x TP 2 with
sequence parallelism, and of a 14-layer one pp 4 over 8 (mixed); the zero-bubble schedules: interleaved-zb on pp 2
(12 layers), zbv on pp 4 (14 layers, mixed), FSDP 16 x PP 2 zbv and DualPipeV on pp 2; FSDP 16 x TP 2 x PP 2
interleaved 1F1B (64 ranks); context parallelism (tracer.cp, every CP rank
traced, the derived ones against their estimates): FSDP over dp_shard 8 x cp 2, dp_shard 8 x cp 4 with grouped
KV heads, dp_shard 1 x cp 4 with the mixed recipe and full checkpointing, and with TP inside on torchtitan's
(dp_shard, cp, tp) mesh: dp_shard 8 x cp 2 x tp 2, and dp_shard 8 x cp 4 x tp 2 with sequence parallelism (mixed); and llama-3.2-1b itself,
dp_shard 1 x cp 8 at seq 32768 with full checkpointing (its profiles ship; 8 traces of 16 layers, minutes); and
batch 8 x seq 8192 over dp_shard 8 x cp 4 with amp, selective checkpointing and the chunked loss; torchtitan's FSDP
units (`--fsdp-wrap torchtitan`): FSDP 16, FSDP 8 with a tied head (mixed), FSDP 8 x TP 2 with sequence parallelism
and FSDP 8 x CP 2.
"""
from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass

from estimator import cp
from estimator.estimate import Options, ensure_profile, estimate, resolve
from estimator.evaluate import stage_breakdowns
from estimator.model import from_hf_config
from estimator.presets import load_config
from estimator.spec import PP_TRACED_ONLY, Parallel, Workload
from tracer.session import run_traced

CONFIG = {"model_type": "llama", "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 6,
          "num_attention_heads": 8, "num_key_value_heads": 8, "vocab_size": 512,
          "max_position_embeddings": 1024, "tie_word_embeddings": False}
CHECK_TRAIN = dict(batch=5, seq=300)             # the fit traces b 1..4 and seqs 256, 512, 768 and one near 1000
CHECK_INFER = dict(batch=5, seq=300, gen_tokens=4)
# estimate component <- the trace's categories (estimator.evaluate.Swap.rules: the map the estimate applies)
COMPONENTS = (("weights", ("weights",), ("weights",)),
              ("gradients", ("gradients",), ("gradients", "comm_buffers")),
              ("optimizer_states", ("optimizer_states", "master_weights"), ("optimizer_states",)),
              ("activations", ("activations", "temporaries"), ("activations",)),
              ("kv_cache", ("kv_cache",), ("kv_cache",)),
              ("buffers", ("buffers",), ("other",)))


@dataclass(frozen=True)
class Case:
    name: str
    workload: Workload
    parallel: Parallel
    config: dict = None   # CONFIG unless given

    def model_config(self) -> dict:
        return self.config or CONFIG


def cases() -> list[Case]:
    train, infer = Workload(**CHECK_TRAIN), Workload(mode="infer", **CHECK_INFER)
    out = [Case(f"tp{n}-{w.mode}", w, Parallel("tp", gpus=n)) for n in (2, 4, 8) for w in (train, infer)]
    out += [Case(f"fsdp{2 * n}-tp{n}-train", train, Parallel("fsdp", gpus=2 * n, tp=n)) for n in (2, 4)]
    out += [Case("tp2-train-tied", train, Parallel("tp", gpus=2), {**CONFIG, "tie_word_embeddings": True})]
    out += [Case("tp4-sp-train", train, Parallel("tp", gpus=4, sequence_parallel=True)),
            Case("fsdp4-tp2-sp-train", train, Parallel("fsdp", gpus=4, tp=2, sequence_parallel=True))]
    out += [Case("fsdp2-train", train, Parallel("fsdp", gpus=2))]
    deep = {**CONFIG, "num_hidden_layers": 12}
    return out + [Case("pp2-1f1b-train", train, Parallel("pp", gpus=2, microbatches=4), deep),
                  Case("pp4-gpipe-train", Workload(recipe="amp", **CHECK_TRAIN),
                       Parallel("pp", gpus=4, microbatches=6, pp_schedule="gpipe")),
                  Case("pp4-1f1b-train-mixed", Workload(recipe="mixed", **CHECK_TRAIN),
                       Parallel("pp", gpus=4, microbatches=4), {**CONFIG, "num_hidden_layers": 8}),
                  # FSDP2 over each stage's dp ranks, at a dp the fit (2, 4) and its check (8) did not use
                  Case("fsdp16-pp2-1f1b-train", train, Parallel("fsdp", gpus=32, pp=2, microbatches=4), deep),
                  Case("fsdp8-pp4-gpipe-train-mixed", Workload(recipe="mixed", **CHECK_TRAIN),
                       Parallel("fsdp", gpus=32, pp=4, microbatches=4, pp_schedule="gpipe"),
                       {**CONFIG, "num_hidden_layers": 8}),
                  # TP inside every stage (torchtitan's (pp, dp, tp) mesh), with and without sequence parallelism
                  Case("pp2-tp2-1f1b-train", train, Parallel("pp", gpus=4, pp=2, tp=2, microbatches=4), deep),
                  Case("pp2-tp4-sp-gpipe-train-mixed", Workload(recipe="mixed", **CHECK_TRAIN),
                       Parallel("pp", gpus=8, pp=2, tp=4, sequence_parallel=True, microbatches=3,
                                pp_schedule="gpipe"), {**CONFIG, "num_hidden_layers": 8}),
                  Case("fsdp16-tp2-pp2-1f1b-train", train, Parallel("fsdp", gpus=64, pp=2, tp=2, microbatches=4),
                       deep),
                  # interleaved 1F1B (two stages per rank, each rank's stages traced whole): pp 2 over 4 and pp 4
                  # over 8 micro-batches (mixed), FSDP 16 x PP 2, TP 2 inside every stage with sequence parallelism
                  Case("pp2-interleaved-train", train, Parallel("pp", gpus=2, microbatches=4,
                                                                pp_schedule="interleaved-1f1b"), deep),
                  Case("pp4-interleaved-train-mixed", Workload(recipe="mixed", **CHECK_TRAIN),
                       Parallel("pp", gpus=4, microbatches=8, pp_schedule="interleaved-1f1b"),
                       {**CONFIG, "num_hidden_layers": 14}),   # 8 stages: 12 layers would leave the last none
                  Case("fsdp16-pp2-interleaved-train", train, Parallel("fsdp", gpus=32, pp=2, microbatches=4,
                                                                       pp_schedule="interleaved-1f1b"), deep),
                  Case("pp2-tp2-sp-interleaved-train", train,
                       Parallel("pp", gpus=4, pp=2, tp=2, sequence_parallel=True, microbatches=2,
                                pp_schedule="interleaved-1f1b"), deep),
                  # zero bubble (the backward's weight gradients run apart, later): looped and V-shaped
                  Case("pp2-interleaved-zb-train", train, Parallel("pp", gpus=2, microbatches=4,
                                                                   pp_schedule="interleaved-zb"), deep),
                  Case("pp4-zbv-train-mixed", Workload(recipe="mixed", **CHECK_TRAIN),
                       Parallel("pp", gpus=4, microbatches=8, pp_schedule="zbv"), {**CONFIG, "num_hidden_layers": 14}),
                  Case("fsdp16-pp2-zbv-train", train, Parallel("fsdp", gpus=32, pp=2, microbatches=4,
                                                               pp_schedule="zbv"), deep),
                  Case("pp2-dualpipev-train", train, Parallel("pp", gpus=2, microbatches=4, pp_schedule="dualpipev"),
                       deep),
                  Case("fsdp16-tp2-pp2-interleaved-train", train,
                       Parallel("fsdp", gpus=64, pp=2, tp=2, microbatches=4, pp_schedule="interleaved-1f1b"), deep),
                  # context parallelism (tracer.cp): FSDP2 over dp_shard x cp, ring attention; the fit traces
                  # dp_shard 1 and 2 and checks 4, so dp_shard 8 is unused; seq a multiple of 2 x cp
                  Case("fsdp16-cp2-train", train, Parallel("fsdp", gpus=16, cp=2)),
                  Case("fsdp32-cp4-train-gqa", Workload(batch=5, seq=296), Parallel("fsdp", gpus=32, cp=4),
                       {**CONFIG, "num_key_value_heads": 2}),
                  Case("fsdp4-cp4-train-mixed-ckpt", Workload(batch=5, seq=296, recipe="mixed", checkpointing="full"),
                       Parallel("fsdp", gpus=4, cp=4)),
                  # FSDP x CP x TP on torchtitan's (dp_shard, cp, tp) mesh, with and without sequence parallelism
                  Case("fsdp8-cp2-tp2-train", train, Parallel("fsdp", gpus=32, cp=2, tp=2)),
                  Case("fsdp8-cp4-tp2-sp-train-mixed", Workload(batch=5, seq=304, recipe="mixed"),   # 2 x cp x tp
                       Parallel("fsdp", gpus=64, cp=4, tp=2, sequence_parallel=True)),
                  # batch 8 x seq 8192 with knobs no CP case derived before: amp, selective checkpointing, chunked loss
                  Case("fsdp32-cp4-amp-selective-chunked-b8-s8192",
                       Workload(batch=8, seq=8192, recipe="amp", checkpointing="selective", loss="chunked"),
                       Parallel("fsdp", gpus=32, cp=4), {**CONFIG, "max_position_embeddings": 16384}),
                  # torchtitan's FSDP units (the embedding, each block, the norm with the head, the root): alone at
                  # a dp no fit used, tied, under TP with sequence parallelism, under CP
                  Case("fsdp16-titan-train", train, Parallel("fsdp", gpus=16, fsdp_wrap="torchtitan")),
                  Case("fsdp8-titan-train-tied-mixed", Workload(recipe="mixed", **CHECK_TRAIN),
                       Parallel("fsdp", gpus=8, fsdp_wrap="torchtitan"), {**CONFIG, "tie_word_embeddings": True}),
                  Case("fsdp8-tp2-sp-titan-train", train,
                       Parallel("fsdp", gpus=16, tp=2, sequence_parallel=True, fsdp_wrap="torchtitan")),
                  Case("fsdp16-cp2-titan-train", train, Parallel("fsdp", gpus=16, cp=2, fsdp_wrap="torchtitan")),
                  # at scale, a preset (its rank profiles ship): every one of 8 CP ranks traced, 16 layers
                  Case("llama-3.2-1b-fsdp1-cp8-ckpt", Workload(batch=1, seq=32768, checkpointing="full"),
                       Parallel("fsdp", gpus=8, cp=8), load_config("llama-3.2-1b")[1])]


def rows(estimate_, trace) -> list[tuple[str, str, int, int]]:
    """(stage, component, estimate bytes, trace bytes) for every stage both have."""
    return stage_rows(estimate_.stages, trace)


def stage_rows(stages, trace) -> list[tuple[str, str, int, int]]:
    """`rows` from (stage, Breakdown) pairs."""
    out = []
    peaks = {p.stage: p.breakdown for p in trace.log.stages}
    for stage, bd in stages:
        if stage not in peaks:
            continue
        for comp, ours, theirs in COMPONENTS:
            out.append((stage, comp, sum(getattr(bd, c) for c in ours), sum(peaks[stage][c] for c in theirs)))
        out.append((stage, "total", bd.tensor_bytes, sum(peaks[stage].values())))
    return out


def check(case: Case, progress=None) -> tuple[bool, list[str]]:
    """(exact, printed lines) for one case."""
    config = case.model_config()
    model = from_hf_config(config, "parallel-check", derive=True)
    ensure_profile(model, case.workload, case.parallel, progress=progress, tp_rank=True)
    ours = estimate(model, case.workload, case.parallel)
    if case.parallel.pp_size > 1:
        return check_pipeline(case, model)
    if case.parallel.cp > 1:
        return check_cp(case, model)
    old = estimate(model, case.workload, case.parallel, options=Options(analytic_tp=True)) \
        if case.parallel.tp_size > 1 else None
    trace = run_traced(config, case.workload, case.parallel, name="parallel-check")
    lines = [f"{case.name}: {case.parallel.strategy} on {case.parallel.gpus} GPUs, {case.workload.mode}, batch "
             f"{case.workload.batch}, seq {case.workload.seq}, tp {case.parallel.tp_size}"
             + (" with sequence parallelism" if case.parallel.sequence_parallel else "") + f" (rank 0, {CONFIG['num_hidden_layers']} layers)",
             f"  {'stage':10s} {'component':17s} {'estimate':>10s} {'trace':>10s} {'diff':>8s}"
             + (f" {'analytic':>10s} {'diff':>8s}" if old else "")]
    exact = True
    old_rows = {(s, c): e for s, c, e, _ in rows(old, trace)} if old else {}
    for stage, comp, est, tr in rows(ours, trace):
        exact &= est == tr
        line = f"  {stage:10s} {comp:17s} {est:10d} {tr:10d} {est - tr:+8d}"
        if old:
            a = old_rows.get((stage, comp), 0)
            line += f" {a:10d} {a - tr:+8d}"
        lines.append(line)
    lines.append(f"  {'exact' if exact else 'MISMATCH'}; notes: " + "; ".join(n for n in ours.notes if "tp" in n
                                                                           or "fsdp" in n))
    return exact, lines


def check_pipeline(case: Case, model) -> tuple[bool, list[str]]:
    """`check` for a pipeline: every rank's estimate (its own profile) against a full-depth trace of that rank, and
    the analytic rule's first, last and middle (rank 1) stages beside those ranks."""
    w, p, config = case.workload, case.parallel, case.model_config()
    tw, _, _, pairs = resolve(model, w, p, Options())
    ruled = p.pp_schedule not in PP_TRACED_ONLY   # the zero-bubble schedules have no analytic rule to show beside
    old_tw, _, _, old_pairs = resolve(model, w, p, Options(analytic_pp=True)) if ruled else (None, 0, 0, ())
    old_by_rank = {sh.pp_rank: (sh, prof) for sh, prof in old_pairs}   # first, last and rank 1 (the middle)
    lines = [f"{case.name}: " + (f"{p.strategy} {p.dp_size} x " if p.strategy != "pp" else "")
             + (f"tp {p.tp_size}{' (sp)' if p.sequence_parallel else ''} x " if p.tp_size > 1 else "")
             + f"pp {p.pp_size}, {p.pp_schedule}, {p.microbatches} micro-batches of {w.batch}, seq "
             f"{w.seq}, {w.recipe} ({config['num_hidden_layers']} layers)",
             f"  {'rank':18s} {'stage':10s} {'component':17s} {'estimate':>10s} {'trace':>10s} {'diff':>8s} "
             f"{'analytic':>10s} {'diff':>9s}"]
    exact, peaks = True, []
    for rank, (sh, prof) in enumerate(pairs):
        trace = run_traced(config, w, p, rank=rank, name="parallel-check")
        peaks.append(trace.log.peak.peak_bytes)
        old = {}
        if rank in old_by_rank:
            osh, oprof = old_by_rank[rank]
            old = {(st, c): e for st, c, e, _ in stage_rows(
                [(k, v[1]) for k, v in stage_breakdowns(model, oprof, w, p, old_tw, osh, Options()).items()], trace)}
        ours = [(k, v[1]) for k, v in stage_breakdowns(model, prof, w, p, tw, sh, Options()).items()]
        for stage, comp, est, tr in stage_rows(ours, trace):
            exact &= est == tr
            a = old.get((stage, comp))
            lines.append(f"  {sh.stage:18s} {stage:10s} {comp:17s} {est:10d} {tr:10d} {est - tr:+8d} "
                         + (f"{a:10d} {a - tr:+9d}" if a is not None else f"{'-':>10s} {'-':>9s}"))
    est = estimate(model, w, p)
    negative = [f"{st} {f}" for st, bd in est.stages for f, v in bd.as_dict().items() if v < 0]
    if negative:   # a breakdown that adds up but shows a negative component is wrong too
        exact = False
        lines.append(f"  NEGATIVE components in the estimate: {', '.join(negative)}")
    worst = [f"{pairs[r][0].stage} {peaks[r]}" for r in range(len(peaks)) if peaks[r] == max(peaks)]
    old = estimate(model, w, p, options=Options(analytic_pp=True)) if ruled else None
    lines.append(f"  worst traced: {', '.join(worst)} B; the estimate's: {est.pipeline_stage} ({est.peak_stage}) "
                 f"{est.components.tensor_bytes} B; " + (f"the analytic rule's: {old.pipeline_stage} ({old.peak_stage}) "
                                                        f"{old.components.tensor_bytes} B" if old else "no rule"))
    lines.append(f"  {'exact' if exact else 'MISMATCH'}; notes: " + "; ".join(n for n in est.notes if "pp" in n))
    return exact, lines


def check_cp(case: Case, model) -> tuple[bool, list[str]]:
    """`check` for context parallelism: each derived CP rank's estimate (rank 0 and the last, estimator.cp.ranks)
    against a full-depth trace of that rank, and every rank traced: at every stage the worst of them holds what the
    worse of the two derived ranks holds (the middle ranks run both branches of the ring, estimator.cp)."""
    w, p, config = case.workload, case.parallel, case.model_config()
    tw, _, _, pairs = resolve(model, w, p, Options())
    lines = [f"{case.name}: {p.strategy} dp_shard {p.dp_size} x cp {p.cp}"
             + (f" x tp {p.tp_size}{' (sp)' if p.sequence_parallel else ''}" if p.tp_size > 1 else "")
             + f", batch {w.batch}, seq {w.seq}, {w.recipe}"
             + (f", checkpointing {w.checkpointing}" if w.checkpointing != "none" else "")
             + f" ({config['num_hidden_layers']} layers, {config['num_key_value_heads']} KV heads)",
             f"  {'rank':18s} {'stage':10s} {'component':17s} {'estimate':>10s} {'trace':>10s} {'diff':>8s}"]
    traces = {r: run_traced(config, w, p, rank=r, name="parallel-check") for r in range(p.cp)}
    exact = True
    for rank, (sh, prof) in zip(cp.ranks(p.cp), pairs):
        ours = [(k, v[1]) for k, v in stage_breakdowns(model, prof, w, p, tw, sh, Options()).items()]
        for stage, comp, est, tr in stage_rows(ours, traces[rank]):
            exact &= est == tr
            lines.append(f"  {sh.stage:18s} {stage:10s} {comp:17s} {est:10d} {tr:10d} {est - tr:+8d}")
    stage_peaks = {r: {s.stage: s.peak_bytes for s in t.log.stages} for r, t in traces.items()}
    for stage in stage_peaks[0]:
        worst = max(stage_peaks[r][stage] for r in traces)
        derived = max(stage_peaks[r][stage] for r in cp.ranks(p.cp))
        exact &= worst == derived
        lines.append(f"  {stage}: worst traced rank {worst} B, worse derived rank {derived} B"
                     + ("" if worst == derived else "  MISMATCH"))
    est = estimate(model, w, p)
    peaks = {r: t.log.peak.peak_bytes for r, t in traces.items()}
    exact &= est.components.tensor_bytes == max(peaks.values())
    lines.append(f"  traced peaks by cp rank: {peaks}; the estimate's rank: {est.pipeline_stage} ({est.peak_stage}) "
                 f"{est.components.tensor_bytes} B")
    lines.append(f"  {'exact' if exact else 'MISMATCH'}; notes: " + "; ".join(n for n in est.notes if n.startswith("cp")))
    return exact, lines


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--case", action="append", help="a case name (repeatable); default every case: "
                    + ", ".join(c.name for c in cases()))
    ap.add_argument("--quiet", action="store_true", help="no derivation progress")
    args = ap.parse_args(argv)
    chosen = [c for c in cases() if not args.case or c.name in args.case]
    unknown = set(args.case or ()) - {c.name for c in cases()}
    if unknown:
        print(f"error: case: {', '.join(sorted(unknown))} unknown; allowed: "
              + ", ".join(c.name for c in cases()), file=sys.stderr)
        return 2
    progress = None if args.quiet else (lambda d, t, m: print(f"    [{d}/{t}] {m}", file=sys.stderr, flush=True))
    failed = 0
    for c in chosen:
        ok, lines = check(c, progress)
        print("\n".join(lines), flush=True)
        failed += not ok
    print(f"{len(chosen) - failed} of {len(chosen)} cases exact")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
