"""Derive a model's memory profile from traces of its own code (torch; imported only to derive a profile).

    profile = derive_profile(config, Workload(method="lora"), Parallel(), progress=print)

The method, for one config and one workload class:

1. **Reduced depth.** The model is built on the meta device and its decoder layers are told apart by type
   (`estimator.trace.depth.layer_infos`). R1 keeps the first layer, the first middle layer of every type and the
   last layer; for every middle type that occurs more than once, R2_T is R1 with one more layer of that type
   right after its first one. A uniform 32-layer Llama is traced with 3 and 4 layers.
2. **Sizes.** Each reduced model is traced at batch 1, 2 x three sequence lengths (and, for FSDP, a second world
   size; for inference, two generated tokens), every tick of the step counted (`estimator.trace.session`), and
   the ticks that can hold a peak (an allocation followed by a free) kept. Their live bytes per category are fit
   exactly as polynomials in (b, s[, g][, 1/n]) (`estimator.profile.poly`); a further traced size must agree to
   the byte, or the derivation stops with the moment that disagrees. Sliding-window and chunked attention make
   memory piecewise in s: each piece between window sizes is fit on its own.
3. **Full depth.** Ticks outside the decoder layers (embedding, head, loss, optimizer step) extend linearly in the
   number of layers of each type: c_full = c_R1 + sum_T (n_T - 1) (c_R2T - c_R1). A tick inside a middle layer of
   type T at full position j sees the layers before and after it: c_R1 plus, per type T', the extra layers before
   j times the effect of one more T' layer before (measured where R2 puts it before) and likewise after. Every
   middle position is a candidate; dominated candidates are dropped.
The result is a `Profile` (pure data, JSON) that `estimator.estimate` evaluates without torch.
"""
from __future__ import annotations

import gc
import platform
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from fractions import Fraction

import numpy as np

from estimator.profile import poly
from estimator.profile.profile import CATEGORIES, Moment, Piece, Profile
from estimator.spec import Parallel, Workload

FSDP_STRATEGIES = ("fsdp", "zero3", "fsdp-grad-op")
# Batch 1 is its own region: with one sequence, size-1 dimensions make some copies unnecessary (a sliced
# (1, s+1) label tensor is already contiguous, so the loss's .contiguous() copies nothing), so bytes at b = 1 are not
# the b >= 2 polynomial's value. Each region: (batches fit, batch verified, b_lo, b_hi).
BATCH_REGIONS = (((1,), 1, 1, 1), ((2, 3), 4, 2, None))
# Decode windows traced per inference point. The first decoding step is its own stage ("decode1": a sliding-window
# cache still holds the whole prompt then, and crops it); steps g >= 2 are fit in g from windows 2 and 3.
GEN_TOKENS = 3
UNITS = (256, 128, 64, 32, 16, 8)  # sequence steps tried, largest first (32 and up keep CUDA padded shapes exact)
FSDP_WORLD = (2, 4, 8)              # fit at 2 (all sizes) and 4 (one size), verify at 8
# Config keys whose values are attention windows: memory bends in s there (a sliding-window mask or cache, chunked
# attention). Data, not code per family: a key that changes nothing only splits the fit in two exact pieces.
WINDOW_KEYS = ("sliding_window", "sliding_window_size", "attention_chunk_size", "window_size", "local_window_size",
               "attention_window")
TRACER_CATEGORIES = ("weights", "gradients", "optimizer_states", "activations", "kv_cache", "comm_buffers",
                     "other")


# ------------------------------------------------------------------------------------------------- plan

@dataclass(frozen=True)
class Plan:
    """Which layers each reduced model keeps, and the full model's layer types."""

    n_layers: int
    types: tuple[int, ...]           # per full layer: -1 first, -2 last, else the middle type id
    variants: tuple[tuple[int, ...], ...]   # variants[0] = R1; then one R2_T per repeated middle type
    extra_type: tuple[int | None, ...]      # per variant: the type whose extra layer it adds (None for R1)
    full: bool                       # R1 is the whole model: nothing to extend

    def position_types(self, v: int) -> list[int]:
        return [self._type_in(v, i, pos) for pos, i in enumerate(self.variants[v])]

    def _type_in(self, v: int, i: int, pos: int) -> int:
        keep = self.variants[v]
        if pos == 0:
            return -1
        if pos == len(keep) - 1 and not self.full:
            return -2
        return self.types[i] if self.types[i] >= 0 else (-1 if i == 0 else -2)


def plan_layers(signatures: list[str]) -> Plan:
    """Reduced-depth variants for a model whose layers have these type signatures (in order)."""
    n = len(signatures)
    if n == 0:  # no GradientCheckpointingLayer stack (ALBERT shares one layer): the model is traced whole
        return Plan(0, (), (None,), (None,), True)
    mid_types: dict[str, int] = {}
    types = []
    for i, sig in enumerate(signatures):
        if i == 0:
            types.append(-1)
        elif i == n - 1:
            types.append(-2)
        else:
            types.append(mid_types.setdefault(sig, len(mid_types)))
    first_of = {t: types.index(t) for t in mid_types.values()}
    r1 = sorted({0, n - 1, *first_of.values()})
    if len(r1) == n or n <= 3:
        return Plan(n, tuple(types), (tuple(range(n)),), (None,), True)
    variants, extra = [tuple(r1)], [None]
    for t, first in sorted(first_of.items()):
        keep = list(r1)
        keep.insert(keep.index(first) + 1, first)  # a second copy of the type's layer, right after it
        variants.append(tuple(keep))
        extra.append(t)
    return Plan(n, tuple(types), tuple(variants), tuple(extra), False)


def pieces_for(hf_config, max_positions: int, infer: bool) -> list[tuple[int, int | None, tuple[int, ...], int]]:
    """(s_lo, s_hi, fit seqs, verify seq) per piece of s, split at the config's attention window sizes."""
    # transformers keeps a sliding window's mask implicit while kv_length < window (masking_utils
    # `_ignore_causal_mask_sdpa`): s = window is already the other side, so the cut is window - 1
    cuts = sorted({v - 1 for v in _window_values(hf_config) if 1 < v < max_positions})
    # a piece too narrow to hold four sizes is merged into the next one (the verification says if that is exact)
    gen = GEN_TOKENS if infer else 0
    cuts = [c for i, c in enumerate(cuts) if c - (cuts[i - 1] if i else 0) - gen >= 4 * UNITS[-1]]
    bounds = [0, *cuts]
    out = []
    for k, lo in enumerate(bounds):
        hi = bounds[k + 1] if k + 1 < len(bounds) else None
        cap = min(hi if hi is not None else max_positions, max_positions) - gen
        unit = next((u for u in UNITS if lo + 4 * u <= cap), None)
        if unit is None:
            raise ValueError(f"seq: the model's context ({max_positions} positions) is too short to derive a profile")
        out.append((lo, hi, (lo + unit, lo + 2 * unit, lo + 3 * unit), lo + 4 * unit))
    if not out:
        raise ValueError(f"seq: the model's context ({max_positions} positions) is too short to derive a profile")
    return out


SCAN_CHUNK_KEYS = ("mamba_chunk_size", "chunk_size")   # Mamba-2 style chunked scans (SSD)


def chunked_scan(cfg) -> tuple[str, int] | None:
    """(key, chunk) when the model runs a chunked state-space scan: it pads the sequence to a multiple of the
    chunk (transformers' Mamba-2 mixers: `pad_tensor_by_size`), so its memory steps with ceil(s / chunk) and is
    no polynomial in s. Read from the config (a chunk key beside state-space keys), not from a list of families."""
    for c in (cfg, getattr(cfg, "text_config", None)):
        if c is None:
            continue
        d = vars(c)
        ssm = any("mamba" in k or "ssm" in k or k in ("state_size", "d_state") for k in d)
        for k in SCAN_CHUNK_KEYS:
            v = d.get(k)
            if ssm and isinstance(v, int) and not isinstance(v, bool) and v > 1:
                return k, v
    return None


def _window_values(cfg) -> list[int]:
    vals = []
    for c in (cfg, getattr(cfg, "text_config", None)):
        if c is None:
            continue
        for k, v in vars(c).items():
            if k in WINDOW_KEYS and isinstance(v, int) and not isinstance(v, bool):
                vals.append(v)
    return vals


# ------------------------------------------------------------------------------------------------- one trace

@dataclass
class Ticks:
    """The candidate peak ticks of one traced run: keys and bytes per profile category."""

    keys: list[tuple]                # (stage, segment, block position or None, local index)
    gs: list[int]                    # per key: the decode window (tokens generated so far), 0 elsewhere
    values: np.ndarray               # (len(keys), len(CATEGORIES)) int64


def trace_ticks(config: dict, workload: Workload, parallel: Parallel, layers: list[int] | None,
                kernels: str = "cuda") -> Ticks:
    """Trace one reduced model (or the whole one: layers None) at one size and keep the ticks that can be a peak
    (with the same kernels as session.run_traced, so a profile and a traced row agree)."""
    from estimator.trace import kernels as kernels_mod
    from estimator.trace import losses, session

    steps = 2 if workload.mode == "train" else 1
    gc.disable()  # frees happen at refcount zero; a collector pass at a random tick would break the alignment
    try:
        # Liger's power-of-two chunk rule is not polynomial in the sizes: the profile uses a bounding fixed count
        with kernels_mod.emulate(kernels), losses.bounding_chunks():
            prime = None
            if workload.mode == "train" and workload.loop == "loss-only" and not workload.optimizer_in_backward:
                prime = session.grad_names(config, workload, parallel, layers, kernels)
            with session._prepared(config, workload, parallel, layers, kernels=kernels) as case:
                counter = session._run(case, steps, observe_layers=layers is not None, prime=prime)
            tl = counter.timeline()
    finally:
        gc.enable()
    return _candidates(tl, workload.mode == "train")


def _stage_of_ticks(tl) -> list[tuple[int, int, str, int]]:
    """(first tick, last tick, stage, window ordinal) per stage window, in order."""
    out, prev, seen = [], 0, {}
    for t, st in tl.marks:
        seen[st] = seen.get(st, 0) + 1
        out.append((prev + 1, t, st, seen[st]))
        prev = t
    return out


def _candidates(tl, train: bool) -> Ticks:
    live = tl.live()                                    # (tracer categories, T + 1)
    T = len(tl.kind) - 1
    block = np.full(T + 2, -1, dtype=np.int64)
    for t, b in sorted(tl.blocks, key=lambda x: x[0]):
        block[t + 1:] = -1 if b is None else int(b)
    windows = _stage_of_ticks(tl)
    if train:  # the steady state: the last step (its micro-batches and its optimizer step)
        opt_ends = [i for i, w in enumerate(windows) if w[2] == "optimizer"]
        start = opt_ends[-2] + 1 if len(opt_ends) >= 2 else 1
        keep = [windows[0]] + windows[start:]
    else:
        keep = windows
    keys, gs, rows = [], [], []
    act = TRACER_CATEGORIES.index("activations")
    for lo, hi, stage, ordinal in keep:
        g = ordinal if stage == "decode" and ordinal >= 2 else 0
        if stage == "decode" and ordinal == 1:
            stage = "decode1"
        if stage == "load":
            keys.append(("load", 0, None, 0))
            gs.append(0)
            rows.append(_row(live[:, hi], 0))
            continue
        ticks = [t for t in range(lo, hi + 1) if tl.kind[t] == 1 and
                 (t == hi or tl.kind[t + 1] == -1 or block[t + 1] != block[t])]
        if stage == "optimizer":  # the step's temporaries differ between its ticks by constants: keep the largest
            base = live[act, lo - 1]
            t = max(ticks, key=lambda t: int(live[:, t].sum())) if ticks else hi
            keys.append(("optimizer", 0, None, 0))
            gs.append(0)
            rows.append(_row(live[:, t], int(live[act, t] - base)))
            continue
        seg, prev_block, local = 0, None, {}
        for t in ticks:
            b = None if block[t] < 0 else int(block[t])
            if b is None and prev_block is not None:
                seg += 1
            prev_block = b
            group = (stage, seg if b is None else 0, b)
            local[group] = local.get(group, -1) + 1
            keys.append((*group, local[group]))
            gs.append(g)
            rows.append(_row(live[:, t], 0))
    return Ticks(keys, gs, np.array(rows, dtype=np.int64).reshape(len(rows), len(CATEGORIES)))


def _row(col, opt_step: int) -> list[int]:
    by = dict(zip(TRACER_CATEGORIES, (int(x) for x in col)))
    by["activations"] -= opt_step
    by["optimizer_step"] = opt_step
    return [by.get(c, 0) for c in CATEGORIES]


# ------------------------------------------------------------------------------------------------- fit

@dataclass
class Fit:
    """One reduced model's ticks as polynomials: key -> numerators (categories x monomials) over `den[key]`."""

    keys: list[tuple]
    num: dict                        # key -> np.ndarray(object) of shape (len(CATEGORIES), len(monomials))
    den: dict                        # key -> int
    monomials: dict                  # key -> monomial tuple


def _points(batches, seqs, world: tuple[int, ...]) -> list[tuple[int, int, int]]:
    """(b, s, n) trace points: every batch x seq at the first world size, one more point per other size."""
    pts = [(b, s, world[0]) for b in batches for s in seqs]
    pts += [(batches[0], seqs[0], n) for n in world[1:]]
    return pts


def _monomials(decode: bool, fsdp: bool, one_batch: bool) -> tuple:
    monos = poly.DECODE_MONOMIALS if decode else poly.STEP_MONOMIALS
    if one_batch:  # b fixed at 1: b's monomials coincide with b-free ones
        monos = tuple(m for m in monos if m[0] == 0)
    return monos + ((poly.INV_N,) if fsdp else ())


def fit_variant(traces: dict[tuple, Ticks], fsdp: bool, one_batch: bool = False) -> Fit:
    """Fit every candidate tick of one reduced model over its traced points; keys must agree between points."""
    pts = list(traces)
    first = traces[pts[0]]
    ref = list(zip(first.keys, first.gs))
    for p in pts[1:]:
        got = list(zip(traces[p].keys, traces[p].gs))
        if got != ref:
            diff = next((i for i, (a, b) in enumerate(zip(ref, got)) if a != b), min(len(ref), len(got)))
            raise ValueError(f"fit: the step runs other operations at (b, s, n) = {pts[0]} and {p} (from tick "
                             f"{diff}: {len(ref)} vs {len(got)} ticks), as a loop over sequence chunks or time "
                             "steps does (linear attention, recurrent or state-space scans, block-sparse attention); "
                             "its memory is not one polynomial in the sizes and no exact profile can be derived; "
                             "trace it (`python -m bench trace`)")
    keys = list(dict.fromkeys(k for k, _ in ref))
    index = {kg: i for i, kg in enumerate(ref)}
    out = Fit(keys, {}, {}, {})
    for decode in (False, True):
        group = [k for k in keys if (k[0] == "decode") == decode]
        if not group:
            continue
        members = set(group)
        gvals = sorted({g for k, g in ref if k in members})
        design, cols = [], []
        for (b, s, n) in pts:
            for g in gvals:
                design.append((b, s, g, Fraction(1, n)))
                cols.append([traces[(b, s, n)].values[index[(k, g)]] for k in group])
        values = [[int(x) for row in r for x in row] for r in cols]  # point x (key, category)
        monos = _monomials(decode, fsdp, one_batch)
        nums, den = poly.fit_columns(monos, design, values)
        C = len(CATEGORIES)
        for j, k in enumerate(group):
            arr = np.empty((C, len(monos)), dtype=object)
            for c in range(C):
                for i in range(len(monos)):
                    arr[c, i] = nums[i][j * C + c]
            out.num[k], out.den[k], out.monomials[k] = arr, den, monos
    return out


# FSDP2 pads every parameter's first dimension to a multiple of the world size (fsdp/_fully_shard/_fsdp_param.py):
# a shard is ceil(d0 / n) rows, not d0 / n, so where a dimension does not divide (GPT-2's 50,257-token vocabulary)
# the 1/n term is exact only up to that padding. It is at most one row per parameter per rank; the verification
# allows it (this fraction of the tick's bytes) and the profile records the largest deviation seen.
FSDP_PADDING_TOLERANCE = 2e-3


def verify(fit: Fit, ticks: Ticks, point: tuple[int, int, int]) -> int:
    """Every fitted tick must reproduce a trace at sizes the fit did not use, to the byte (FSDP: up to its
    shards' padding, see FSDP_PADDING_TOLERANCE). Returns the largest deviation in bytes (0: exact)."""
    b, s, n = point
    got = {(k, g): row for k, g, row in zip(ticks.keys, ticks.gs, ticks.values)}
    worst = 0
    for (k, g), row in got.items():
        if k not in fit.num:
            raise ValueError(f"fit: tick {k} appears at (b, s, n) = {point} but not at the fitted sizes")
        mv = [poly.monomial_value(m, (b, s, g, Fraction(1, n))) for m in fit.monomials[k]]
        for c, cat in enumerate(CATEGORIES):
            pred = sum(x * v for x, v in zip(fit.num[k][c], mv))
            actual = int(row[c])
            if pred == fit.den[k] * actual:
                continue
            off = abs(float(pred / fit.den[k]) - actual)
            if n > 1 and off <= FSDP_PADDING_TOLERANCE * max(actual, 1):
                worst = max(worst, int(round(off)))
                continue
            raise ValueError(f"fit: not exact at (b, s, n) = {point}: {cat} at {k} is {actual} B, the fit "
                             f"says {float(pred / fit.den[k]):.0f} B; refusing this profile")
    return worst


# ------------------------------------------------------------------------------------------------- depth

def _remap(key: tuple, pos: int | None) -> tuple:
    return (key[0], key[1], pos, key[3])


def extend(plan: Plan, fits: list[Fit]) -> list[tuple[str, str, tuple, int, np.ndarray]]:
    """Full-depth candidate moments (stage, label, monomials, den, numerators) from the reduced fits."""
    r1, f1 = plan.variants[0], fits[0]
    if plan.full:
        return [(k[0], _label(k, None if k[2] is None else r1[k[2]], plan.n_layers), f1.monomials[k], f1.den[k],
                 f1.num[k]) for k in f1.keys]
    counts = {t: sum(1 for x in plan.types if x == t) for t in set(plan.types) if t >= 0}
    a_pos = {}  # variant -> (position of its type's first layer in R1, type)
    for v in range(1, len(plan.variants)):
        t = plan.extra_type[v]
        a_pos[v] = (r1.index(plan.types.index(t)), t)

    def map_pos(v: int, q: int | None) -> int | None:
        if q is None:
            return None
        return q if q <= a_pos[v][0] else q + 1

    def delta(v: int, key: tuple, pos: int | None):
        k2 = _remap(key, pos)
        if k2 not in fits[v].num:
            raise ValueError(f"depth: tick {key} has no counterpart with one more layer; the step's structure "
                             "changes with depth, so this model cannot be extended from a reduced trace")
        return fits[v].num[k2] - f1.num[key]

    out = []
    last = len(r1) - 1
    effects = _stage_effects(plan, fits, a_pos)
    for key in f1.keys:
        q = key[2]
        base = f1.num[key]
        if q is None or q == 0 or q == last:
            c = base.copy()
            for v in a_pos:
                c = c + (counts[a_pos[v][1]] - 1) * delta(v, key, map_pos(v, q))
            full_index = None if q is None else (0 if q == 0 else plan.n_layers - 1)
            out.append((key[0], _label(key, full_index, plan.n_layers), f1.monomials[key], f1.den[key], c))
            continue
        # a tick in the first middle layer of its type: at its own full position, with every later layer of its
        # type after it (measured: R2's A block is that layer with one more of its type after it)
        t = plan.types[r1[q]]
        v = next(v for v in a_pos if a_pos[v][1] == t)
        j = plan.types.index(t)
        c = base + (counts[t] - 1) * delta(v, key, a_pos[v][0])
        c = c + _others(plan, effects, key[0], t, j, reference=r1, ref_pos=q)
        out.append((key[0], _label(key, j, plan.n_layers), f1.monomials[key], f1.den[key], c))
    for v, (pa, t) in a_pos.items():
        out += _typical_candidates(plan, fits[v], effects, v, pa, t, counts)
    return out


def _stage_effects(plan, fits, a_pos) -> dict:
    """(type, stage) -> (effect of one more layer of that type before a tick, after it), measured outside the
    layers: in a forward pass every layer is before the head and after the embedding; in backward every layer is
    before (by index) the head's backward and after the embedding's. A layer's effect there is what it holds
    while the pass is on either side of it (saved activations, its gradients, its weights and states), the same for
    a tick inside another layer. Where backward has no tick past the layers (LoRA: nothing flows into the frozen
    embedding), the effect after is measured on the type's own first layer (R2's A block)."""
    f1 = fits[0]
    out = {}
    for v, (pa, t) in a_pos.items():
        fv = fits[v]
        for stage in {k[0] for k in f1.keys}:
            seg_bef, seg_aft = (0, 1) if stage == "backward" else (1, 0)
            bef = _segment_delta(f1, fv, stage, seg_bef)
            aft = _segment_delta(f1, fv, stage, seg_aft)
            if aft is None:
                k1 = next((k for k in f1.keys if k[0] == stage and k[2] == pa), None)
                aft = fv.num[_remap(k1, pa)] - f1.num[k1] if k1 is not None else 0
            out[(t, stage)] = (0 if bef is None else bef, aft)
    return out


def _segment_delta(f1, fv, stage, seg):
    k = next((k for k in f1.keys if k[0] == stage and k[2] is None and k[1] == seg), None)
    if k is None or k not in fv.num:
        return None
    return fv.num[k] - f1.num[k]


def _others(plan, effects, stage, t, j, reference, ref_pos):
    """Bytes the other middle types add to a tick at full position j, relative to the reduced model `reference`
    (whose tick sits at position ref_pos): per type, the layers before and after j beyond those in `reference`."""
    mids = range(1, plan.n_layers - 1)
    total = 0
    for tv in {x for x in plan.types if x >= 0}:
        if tv == t:
            continue
        before = sum(1 for i in mids if i < j and plan.types[i] == tv)
        after = sum(1 for i in mids if i > j and plan.types[i] == tv)
        ref_before = sum(1 for p, i in enumerate(reference) if 0 < p < ref_pos and plan.types[i] == tv)
        ref_after = sum(1 for p, i in enumerate(reference) if ref_pos < p < len(reference) - 1
                        and plan.types[i] == tv)
        bef, aft = effects[(tv, stage)]
        total = total + (before - ref_before) * bef + (after - ref_after) * aft
    return total


def _typical_candidates(plan, fv, effects, v, pa, t, counts):
    """Ticks of a layer of type t that is not the first of its type (R2's B block: the copy after the first), at
    every full position of that type after its first: the type's first layer and the others before it."""
    keep = plan.variants[v]
    first = plan.types.index(t)
    mids = range(1, plan.n_layers - 1)
    out = []
    for key in (k for k in fv.keys if k[2] == pa + 1):
        path = []
        for j in (i for i in mids if i > first and plan.types[i] == t):
            before = sum(1 for i in mids if i < j and plan.types[i] == t)      # includes the first of the type
            after = counts[t] - before - 1
            bef, aft = effects[(t, key[0])]
            c = fv.num[key] + (before - 1) * bef + after * aft                 # R2 has one (A) before, none after
            c = c + _others(plan, effects, key[0], t, j, reference=keep, ref_pos=pa + 1)
            path.append((j, c))
        out += [(key[0], _label(key, j, plan.n_layers), fv.monomials[key], fv.den[key], c)
                for j, c in _vertices(path)]
    return out


def _vertices(path: list[tuple[int, np.ndarray]]) -> list[tuple[int, np.ndarray]]:
    """The points of a tick's path over layer positions that are not on the straight line between their
    neighbours: bytes affine in the position between two points are never above both (for any non-negative
    weighting of the categories), so only the path's corners can hold a peak."""
    kept = list(path)
    i = 1
    while i < len(kept) - 1:
        (j0, c0), (j1, c1), (j2, c2) = kept[i - 1], kept[i], kept[i + 1]
        if np.all((j2 - j0) * c1 == (j2 - j1) * c0 + (j1 - j0) * c2):
            del kept[i]
        else:
            i += 1
    return kept


def _label(key: tuple, full_index: int | None, n_layers: int) -> str:
    stage, seg, _, local = key
    if full_index is None:
        where = {("forward", 0): "before the layers", ("forward", 1): "head and loss",
                 ("backward", 0): "head and loss backward", ("backward", 1): "embedding backward",
                 ("prefill", 0): "before the layers", ("prefill", 1): "head",
                 ("decode", 0): "before the layers", ("decode", 1): "head",
                 ("decode1", 0): "before the layers", ("decode1", 1): "head"}.get((stage, seg), f"segment {seg}")
    else:
        where = f"layer {full_index}" + (" (first)" if full_index == 0 else
                                         " (last)" if full_index == n_layers - 1 else "")
    return f"{stage}: {where}, tick {local}"


def prune(cands):
    """Drop candidates another candidate of the same stage bounds in every category and monomial (all monomials
    are non-negative for b, s, g >= 0 and n >= 1, so a dominated tick is never the peak)."""
    kept = []
    by_stage: dict[str, list] = {}
    for c in cands:
        by_stage.setdefault(c[0], []).append(c)
    for stage, group in by_stage.items():
        vecs = [(_as_key(c)) for c in group]
        order = sorted(range(len(group)), key=lambda i: -sum(vecs[i][1]))
        survivors: list[int] = []
        for i in order:
            mono_i, vi = vecs[i]
            if any(vecs[j][0] == mono_i and all(a <= b for a, b in zip(vi, vecs[j][1])) for j in survivors):
                continue
            survivors.append(i)
        kept += [group[i] for i in sorted(survivors)]
    return kept


def _as_key(c):
    """(monomials, flattened numerators scaled to a common reference denominator) for dominance tests."""
    _, _, monos, den, num = c
    return monos, [Fraction(int(x), den) for x in num.flatten()]


# ------------------------------------------------------------------------------------------------- driver

def _max_positions(hf_config) -> int:
    from estimator.trace.depth import text_config

    cfg = text_config(hf_config)
    for key in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
        v = getattr(cfg, key, None)
        if isinstance(v, int) and v > 0:
            return v
    return 1 << 17


def _signatures(config: dict, workload: Workload) -> tuple[list[str], object, bool]:
    """(layer type signatures, transformers config, built as a masked LM)."""
    from estimator.trace import runner
    from estimator.trace.depth import layer_infos

    base = replace(workload, method="full", gen_tokens=0) if workload.method == "lora" else \
        replace(workload, gen_tokens=0)
    model = runner.build_model(config, base, device="meta")
    try:
        sigs = [li.signature for li in layer_infos(model)]
    except ValueError:  # no decoder layer stack to tell apart: trace the whole model
        sigs = []
    return sigs, model.config, runner.is_masked_lm(model)


def derive_profile(config: dict, workload: Workload, parallel: Parallel = Parallel(),
                   progress: Callable[[int, int, str], None] | None = None, config_hash: str = "",
                   kernels: str = "cuda") -> Profile:
    """Trace the model at reduced depth and a few sizes, fit, verify and extend: see the module docstring.

    `workload` and `parallel` fix the class; their sizes (batch, seq, gen_tokens, gpus) are ignored; `kernels`
    as in session.run_traced. Raises ValueError (one line) when the case cannot be traced or the fit is not
    exact."""
    from estimator.trace import session

    start = time.perf_counter()
    infer = workload.mode == "infer"
    w0 = replace(workload, batch=1, seq=1, gen_tokens=GEN_TOKENS if infer else 0)
    fsdp = parallel.strategy in FSDP_STRATEGIES
    world = FSDP_WORLD if fsdp else ((2,) if parallel.strategy == "ddp" else (1,))
    session.check_traceable(w0, replace(parallel, gpus=world[0]) if parallel.gpus != world[0] else parallel)
    sigs, hf_config, masked = _signatures(config, w0)
    scan = chunked_scan(hf_config)
    if scan:
        raise ValueError(f"model_type: {config.get('model_type')} runs a chunked state-space scan ({scan[0]}="
                         f"{scan[1]}): it pads the sequence to a multiple of {scan[1]}, so its memory is no "
                         "polynomial in seq and no exact profile can be derived; trace it (`python -m bench trace`)")
    if masked and infer:
        w0 = replace(w0, gen_tokens=0)  # an encoder runs one forward pass: no decoding
    plan = plan_layers(sigs)
    pieces = pieces_for(hf_config, _max_positions(hf_config), infer)
    fit_world = world[:2] if fsdp else world
    reduced_refused = ""
    try:
        out_pieces, n_jobs, padding = _derive_pieces(config, w0, parallel, plan, pieces, world, fit_world, fsdp,
                                                     kernels, progress)
    except _ReducedDepthFailed as e:
        # The model's code outside its layer stack depends on the layer count (Gemma-3n / Gemma-4 per-layer
        # embeddings: one table num_hidden_layers x width wide, reshaped by the config's count), so a model cut in
        # place cannot run: it is traced whole, at every size (slower, exact by construction).
        reduced_refused = e.reason
        plan = Plan(plan.n_layers, plan.types, (tuple(range(plan.n_layers)),), (None,), True)
        out_pieces, n_jobs, padding = _derive_pieces(config, w0, parallel, plan, pieces, world, fit_world, fsdp,
                                                     kernels, progress)
    jobs = range(n_jobs)
    if progress:
        progress(len(jobs), len(jobs), "done")
    import torch
    import transformers

    prov = {"torch": torch.__version__, "transformers": transformers.__version__, "kernels": kernels,
            "python": platform.python_version(), "traces": len(jobs), "fsdp_padding_max_bytes": padding,
            "seconds": round(time.perf_counter() - start, 2),
            "reduced_depths": [list(v) for v in plan.variants if v is not None and not reduced_refused],
            **({"traced_whole": f"the reduced-depth model failed: {reduced_refused}"} if reduced_refused else {}),
            "derived_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    from estimator.store import parallel_class, workload_class

    return Profile(config_hash, str(config.get("model_type")), workload_class(workload),
                   parallel_class(parallel), plan.n_layers, tuple(out_pieces), prov)


class _ReducedDepthFailed(Exception):
    """The reduced-depth model raised inside the model's own code on its first trace."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


def _derive_pieces(config, w0, parallel, plan, pieces, world, fit_world, fsdp, kernels, progress):
    """(fitted pieces, traces run, largest FSDP padding): every piece of s and batch region, every variant of
    `plan` traced, fit, verified and extended. A reduced plan whose first trace fails in the model's code raises
    _ReducedDepthFailed (the caller traces the model whole)."""
    regions = [(pi, r) for pi in range(len(pieces)) for r in BATCH_REGIONS]
    n_jobs = sum(len(_points(r[0], pieces[pi][2], fit_world)) + 1 for pi, r in regions) * len(plan.variants)
    done, padding = 0, 0
    out_pieces = []
    for pi, (batches, vbatch, b_lo, b_hi) in regions:
        lo, hi, seqs, vseq = pieces[pi]
        vpoint = (vbatch, vseq, world[-1])
        fits = []
        for keep in plan.variants:
            traces = {}
            for pt in _points(batches, seqs, fit_world) + [vpoint]:
                b, s, n = pt
                if progress:
                    progress(done, n_jobs, ("tracing the whole model" if keep is None or plan.full else
                                            f"tracing {len(keep)} of {plan.n_layers} layers") + f" at batch {b}, seq {s}"
                                           + (f", {n} GPUs" if n > 1 else ""))
                par = replace(parallel, gpus=n) if parallel.strategy != "single" else parallel
                try:
                    traces[pt] = trace_ticks(config, replace(w0, batch=b, seq=s), par,
                                             None if keep is None else list(keep), kernels)
                except RuntimeError as e:
                    if done or plan.full:
                        raise
                    raise _ReducedDepthFailed(" ".join(str(e).split())[:200]) from e
                done += 1
            check = traces.pop(vpoint)
            fit = fit_variant(traces, fsdp, one_batch=len(batches) == 1)
            padding = max(padding, verify(fit, check, vpoint))
            fits.append(fit)
        cands = prune(extend(plan, fits))
        out_pieces.append(Piece.from_moments(lo, hi, [_moment(c) for c in cands], b_lo, b_hi))
    return out_pieces, n_jobs, padding


def _moment(c) -> Moment:
    stage, label, monos, den, num = c
    nums = {}
    for ci, cat in enumerate(CATEGORIES):
        row = tuple(int(x) for x in num[ci])
        if any(row):
            nums[cat] = row
    g = 0
    for row in nums.values():
        for x in row:
            g = _gcd_int(g, abs(x))
    g = _gcd_int(g, den) or 1
    return Moment(stage, label, monos, den // g, {c: tuple(x // g for x in r) for c, r in nums.items()})


def _gcd_int(a: int, b: int) -> int:
    while b:
        a, b = b, a % b
    return a


