"""Context parallelism (torchtitan's `context_parallel_degree`): what a CP rank is priced from.

    Parallel(strategy="fsdp", gpus=8, cp=4)   # 2 data-parallel shards x 4 CP ranks; FSDP2 over all 8

Each sequence of `seq` tokens is cut into 2 x cp chunks and CP rank r keeps chunks r and 2cp - 1 - r (the head-tail
load balancer); attention becomes ring attention (K and V all-gathered once per call); FSDP2 shards the model states
over dp_shard x cp (torchtitan/distributed/parallel_dims.py). A CP rank is traced as itself (tracer.cp), its profile
an FSDP rank's over n = dp_shard x cp, of one cp degree and one rank. The ranks are not all alike: in each ring step
after the first, rank r attends with the first half of the arriving K and V where the step index is at most r and
with the second half of its own queries otherwise (torch's `_templated_ring_attention`), so rank 0 only ever takes
the second branch, the last rank only the first, and a middle rank both. Two ranks are derived, rank 0 and rank
cp - 1, and the worse decides; a middle rank holds at every stage what the worse of the two holds, or less (traced:
scripts/parallel_check.py, the cp cases; docs/parallel.md, "Context parallelism").
"""
from __future__ import annotations

from dataclasses import replace

from estimator.parallel import tp_untraced
from estimator.spec import Parallel, Workload


def check(workload: Workload, parallel: Parallel, sizes: bool = True, causal: bool = True) -> None:
    """One line naming the field where a context-parallel rank is not priced (`sizes`: the seq too; `causal`: the
    model is a causal LM, not an encoder)."""
    if parallel.cp == 1:
        return
    if workload.mode != "train":
        raise ValueError("cp: context parallelism is priced for training (torchtitan's context_parallel); "
                         "inference with cp is not priced")
    if not causal:
        raise ValueError("cp: torch's ring attention balances causal attention only (its load balancer requires "
                         "is_causal); this model is an encoder")
    if workload.activation_offload:
        raise ValueError("activation_offload: torchtune's offloading hands saved tensors back as plain tensors, which "
                         "ring attention's backward (on DTensors) refuses; not priced with cp")
    if workload.attention == "eager":
        raise ValueError("attention: the step would run eager attention (asked, or the model has no SDPA path in "
                         "transformers), and context parallelism replaces SDPA with ring attention")
    if parallel.tp_size > 1:   # FSDP x TP x CP: the TP rank as tracer.tp traces it
        why = tp_untraced(workload, parallel)
        if why:
            raise ValueError(why)
    if sizes:
        check_seq(workload.seq, parallel)


def seq_multiple(p: Parallel) -> int:
    """What seq must be a multiple of: the load balancer cuts each sequence into 2 x cp equal chunks, and sequence
    parallelism splits a rank's s / cp tokens evenly over tp (torch would shard them unevenly, the ranks unalike)."""
    if p.cp == 1:
        return 1
    return 2 * p.cp * (p.tp_size if p.sequence_parallel else 1)


def check_seq(seq: int, p: Parallel) -> None:
    """One line where seq is no multiple of `seq_multiple`."""
    m = seq_multiple(p)
    if seq % m:
        what = f"2 x cp = {m}" if m == 2 * p.cp else f"2 x cp x tp = {m} (sequence parallelism)"
        lo = seq - seq % m
        raise ValueError(f"seq: {seq} is not a multiple of {what}; context parallelism cuts each sequence into 2 x cp "
                         f"equal chunks; use " + (f"{lo} or {lo + m}" if lo else f"{m}"))


def traced(p: Parallel) -> Parallel:
    """The traced class of a CP layout: an FSDP rank (FSDP2's 2-rank class, as plain FSDP's) of this cp degree, and
    with TP of its tp degree (and sequence parallelism). HSDP x CP is priced as FSDP x CP over its shard group x cp
    (the replicas hold the same, as HSDP alone: tests/test_pp.py)."""
    strategy = "fsdp-grad-op" if p.strategy == "fsdp-grad-op" else "fsdp"
    return Parallel(strategy=strategy, gpus=2 * p.cp * p.tp_size, tp=p.tp_size, cp=p.cp,
                    sequence_parallel=p.sequence_parallel, fsdp_wrap=p.fsdp_wrap)


def ranks(cp: int) -> tuple[int, ...]:
    """The CP ranks derived apart: rank 0 and the last (a middle rank holds no more than the worse of them)."""
    return (0, cp - 1)


def rank_labels(cp: int) -> tuple[str, ...]:
    """What each of `ranks` stands for, in words (Estimate.pipeline_stage of a CP layout)."""
    return "cp rank 0", f"cp rank {cp - 1}"


def rank_pairs(share, profiles: tuple, cp: int) -> tuple:
    """(share, profile) per derived CP rank: the same model share (FSDP shards alike on every rank), each rank's own
    profile, labelled by the ranks it stands for."""
    return tuple((replace(share, stage=label), prof) for label, prof in zip(rank_labels(cp), profiles))


def where(stage: str) -> str:
    """', the last pipeline stage' / ', cp rank 3' / '' (one GPU or every rank alike): which rank an estimate is of,
    for a sentence."""
    if stage == "only":
        return ""
    return f", {stage}" if stage.startswith("cp ") else f", {stage} pipeline stage"


def note(p: Parallel) -> str:
    return (f"cp: context parallelism {p.cp} (torch's context_parallel: ring attention, head-tail load balancing), "
            f"FSDP2 over dp_shard {p.dp_size} x cp {p.cp}" + (f", TP {p.tp_size} inside" if p.tp_size > 1 else "")
            + f"; cp ranks 0 and {p.cp - 1} traced, the worse decides")

