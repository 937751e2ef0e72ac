"""Vectorised estimates over batch x seq grids: 100,000 configurations in well under a second.

A profile's moments are polynomials in (batch, seq, generated tokens), so a sweep is one tensor product per
stage: every moment's total at every point (estimator.evaluate.StagePlan.totals), the largest over moments and
stages, per pipeline stage, the largest again. No formula is copied: the same plans serve `estimate()`.
Points are grouped by the profile piece they fall in (batch 1 / batch >= 2, sliding-window pieces of seq).
The result equals `estimate(...).total_bytes` up to rounding (ROUNDING_TOL_BYTES; tests/test_search.py checks
it): estimate() truncates each of its breakdown's components to whole bytes where a swap scales it by a fraction
(a TP or ZeRO share of an odd count, 8-bit optimizer states), the sweep sums the float terms and rounds once.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from estimator import components as comp
from estimator.estimate import Options, device_options, reserved_fit, resolve
from estimator.reserved import workload_class
from estimator.evaluate import applies, stage_plans, world
from estimator.model import Model
from estimator.spec import MAX_BATCH, MAX_SEQ, Parallel, Workload

# at most 1 B per truncated component (10 fields of a Breakdown) plus the allocator cache's rounding of its
# share of that difference; deepseek-v2-lite under TP 2 with 8-bit AdamW differs by 5 B
ROUNDING_TOL_BYTES = 12


@dataclass(frozen=True)
class SweepResult:
    """Per-GPU step peak for every (workload, parallel, batch, seq) of a grid."""

    total_bytes: np.ndarray   # int64, shape (len(workloads), len(parallels), len(batches), len(seqs))
    batches: np.ndarray       # int64, the batch axis
    seqs: np.ndarray          # int64, the seq axis


def _check_axis(name: str, values, hi: int) -> np.ndarray:
    arr = np.asarray(values)
    if arr.dtype.kind not in "iu" and not (arr.dtype.kind == "f" and np.all(arr == np.floor(arr))):
        raise ValueError(f"{name}: must be integers, got dtype {arr.dtype}")
    arr = arr.astype(np.int64)
    if arr.size and (arr.min() < 1 or arr.max() > hi):
        raise ValueError(f"{name}: values must lie in 1..{hi}, got {arr.min()}..{arr.max()}")
    return arr


def sweep_points(model: Model, workload: Workload, batch, seq, parallel: Parallel = Parallel(),
                 options: Options = Options()) -> np.ndarray:
    """estimate(model, replace(workload, batch=b, seq=s), parallel, options).total_bytes for every (b, s) pair
    of the equal-length arrays `batch` and `seq` (the workload's own batch/seq are ignored), as int64. A vision
    encoder's seq is its tokens per image (estimator.vision), the workload's image_size ignored: the points equal
    estimate(..., replace(workload, batch=b, seq=s, image_size=0))."""
    bs = _check_axis("batch", batch, MAX_BATCH).ravel()
    ss = _check_axis("seq", seq, MAX_SEQ).ravel()
    if bs.shape != ss.shape:
        raise ValueError(f"batch: {bs.size} values but seq has {ss.size}; give one seq per batch")
    out = np.zeros(bs.size, dtype=np.float64)
    if bs.size == 0:
        return out.astype(np.int64)
    options = device_options(options)
    tw, _, _, stage_shares = resolve(model, workload, parallel, options)
    n = world(parallel)
    gs = np.full(bs.size, workload.gen_tokens)
    best = np.full(bs.size, -np.inf)
    for sh, sh_prof in stage_shares:
        for piece in sh_prof.pieces:
            mask = piece.covers(bs, ss)
            if not mask.any():
                continue
            _, plans = stage_plans(model, sh_prof, workload, parallel, tw, sh, options, piece)
            for stage, plan in plans.items():
                if not applies(stage, workload.gen_tokens):
                    continue
                tot = plan.totals(bs[mask], ss[mask], gs[mask], n).max(axis=0)
                best[mask] = np.maximum(best[mask], tot)
    if np.isinf(best).any():
        raise ValueError("seq: some points fall outside every piece of the profile")
    return _with_cache(np.rint(best), workload, parallel, options).astype(np.int64)


def _with_cache(best: np.ndarray, workload: Workload, parallel: Parallel, options: Options) -> np.ndarray:
    """Add the allocator's cache as estimate() does (estimator.reserved: monotone in the allocated peak, so it
    is applied to the largest stage), from the same fitted class and formula."""
    fit = reserved_fit(workload_class(workload, parallel), options.alloc_conf)[0]
    # torch's allocated bytes: everything but the context and NCCL (the cuBLAS workspaces are allocated through torch)
    allocated = best - comp.overhead_bytes(parallel.gpus, options.overhead, workspaces=0)
    return best + fit.cache_bytes_array(allocated)


def sweep(model: Model, workloads, parallels, batches, seqs, options: Options = Options()) -> SweepResult:
    """Step peak per GPU over the grid workloads x parallels x batches x seqs (batch and seq of each
    workload are replaced by the axes)."""
    workloads, parallels = list(workloads), list(parallels)
    b_axis = _check_axis("batches", batches, MAX_BATCH).ravel()
    s_axis = _check_axis("seqs", seqs, MAX_SEQ).ravel()
    bb, sg = np.meshgrid(b_axis, s_axis, indexing="ij")
    total = np.zeros((len(workloads), len(parallels), b_axis.size, s_axis.size), dtype=np.int64)
    for i, w in enumerate(workloads):
        for j, p in enumerate(parallels):
            total[i, j] = sweep_points(model, w, bb.ravel(), sg.ravel(), p, options).reshape(bb.shape)
    return SweepResult(total_bytes=total, batches=b_axis, seqs=s_axis)
