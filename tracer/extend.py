"""Fitting traced ticks and extending them to full depth: the pure (NumPy) half of the derivation (tracer.derive).

- `fit_variant` / `verify`: a reduced model's ticks at several sizes -> exact polynomials per category, checked at one
  more size;
- `extend`: fits of the reduced models (R1, R2_T) -> every moment of the full-depth model (docs/estimator.md);
- `prune`: dominated candidate moments dropped.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from fractions import Fraction

import numpy as np

from estimator.profile import poly
from estimator.profile.profile import CATEGORIES, Moment

TRACER_CATEGORIES = ("weights", "gradients", "optimizer_states", "activations", "kv_cache", "comm_buffers",
                     "other")


@dataclass(frozen=True)
class Plan:
    """Which layers each reduced model keeps, and the full model's layer types."""

    n_layers: int
    types: tuple[int, ...]           # per full layer: -1 first, -2 last, else the middle type id
    variants: tuple[tuple[int, ...], ...]   # variants[0] = R1; then one R2_T per repeated middle type
    extra_type: tuple[int | None, ...]      # per variant: the type whose extra layer it adds (None for R1)
    full: bool                       # R1 is the whole model: nothing to extend
    copies: tuple[int, ...] = ()     # per middle type: R1's consecutive copies of its first layer (1 if absent)

    def copies_of(self, t: int) -> int:
        return self.copies[t] if t < len(self.copies) else 1

    def position_types(self, v: int) -> list[int]:
        return [self._type_in(v, i, pos) for pos, i in enumerate(self.variants[v])]

    def _type_in(self, v: int, i: int, pos: int) -> int:
        keep = self.variants[v]
        if pos == 0:
            return -1
        if pos == len(keep) - 1 and not self.full:
            return -2
        return self.types[i] if self.types[i] >= 0 else (-1 if i == 0 else -2)


def plan_layers(signatures: list[str], copies: int = 1) -> Plan:
    """Reduced-depth variants for a model whose layers have these type signatures (in order).

    `copies`: how many consecutive copies of each middle type's first layer R1 keeps (R2_T one more). One is enough
    where a tick depends on the layers before it linearly from the first; where it depends on a window of the
    latest ones (activation offloading keeps its last few offloaded tensors on the GPU, tracer.offload), R1 needs
    enough layers before every tick to fill that window, or the effect of one more layer is measured while the
    window is still filling and the extension reads it for every further layer (docs/estimator.md)."""
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
    per_type = tuple(min(copies, types.count(t)) for t in range(len(mid_types)))
    r1 = sorted([0, n - 1, *(i for t, i in first_of.items() for _ in range(per_type[t]))])
    if len(r1) >= n or n <= 3:
        return Plan(n, tuple(types), (tuple(range(n)),), (None,), True)
    variants, extra = [tuple(r1)], [None]
    for t, first in sorted(first_of.items()):
        keep = list(r1)
        keep.insert(keep.index(first) + 1, first)  # one more copy of the type's layer, right after its first
        variants.append(tuple(keep))
        extra.append(t)
    return Plan(n, tuple(types), tuple(variants), tuple(extra), False, per_type)


@dataclass
class Ticks:
    """The candidate peak ticks of one traced run: keys and bytes per profile category."""

    keys: list[tuple]                # (stage, segment, block position or None, local index)
    gs: list[int]                    # per key: the decode window (tokens generated so far), 0 elsewhere
    values: np.ndarray               # (len(keys), len(CATEGORIES)) int64
    efficient: frozenset = frozenset()   # "lse", "mask": how the step called memory-efficient attention (derive)
    # the same run replayed under another knob: "grad_accum" (a step of grad_accum 2, tracer.replay), "checkpointing"
    # (full activation checkpointing, tracer.recompute)
    replayed: dict = field(default_factory=dict)
    refused: str = ""                    # why these ticks cannot be fit (a replayed step the tracer's guards refuse)


def encode_ticks(t: Ticks) -> dict:
    """Ticks as JSON-able data (a forked trace's result on its pipe, tracer.forked); `decode_ticks` reads it."""
    return {"keys": [list(k) for k in t.keys], "gs": list(t.gs), "values": t.values.tolist(),
            "efficient": sorted(t.efficient), "refused": t.refused,
            "replayed": {k: encode_ticks(v) for k, v in t.replayed.items()}}


def decode_ticks(d: dict) -> Ticks:
    values = np.array(d["values"], dtype=np.int64).reshape(len(d["keys"]), len(CATEGORIES))
    return Ticks([tuple(k) for k in d["keys"]], [int(g) for g in d["gs"]], values, frozenset(d["efficient"]),
                 {k: decode_ticks(v) for k, v in d.get("replayed", {}).items()}, d.get("refused", ""))


def tick_row(col, opt_step: int) -> list[int]:
    by = dict(zip(TRACER_CATEGORIES, (int(x) for x in col)))
    by["activations"] -= opt_step
    by["optimizer_step"] = opt_step
    return [by.get(c, 0) for c in CATEGORIES]


@dataclass
class Fit:
    """One reduced model's ticks as polynomials: key -> numerators (categories x monomials) over `den[key]`."""

    keys: list[tuple]
    num: dict                        # key -> np.ndarray(object) of shape (len(CATEGORIES), len(monomials))
    den: dict                        # key -> int
    monomials: dict                  # key -> monomial tuple


def size_points(batches, seqs, world: tuple[int, ...], ranks: tuple[int, ...] = (1,)) -> list[tuple[int, int, int, int]]:
    """(b, s, n, r) trace points: every batch x seq at the first world size and rank, one more point per other world
    size; per other rank (LoRA's rank as a variable) the first two batches x the first two seqs, which determine its
    terms linear in b and s (poly.RANK_MONOMIALS), and one point per other world size (r/n)."""
    r0 = ranks[0]
    pts = [(b, s, world[0], r0) for b in batches for s in seqs]
    pts += [(batches[0], seqs[0], n, r0) for n in world[1:]]
    for r in ranks[1:]:
        pts += [(b, s, world[0], r) for b in batches[:2] for s in seqs[:2]]
        pts += [(batches[0], seqs[0], n, r) for n in world[1:2]]
    return pts


def _monomials(decode: bool, fsdp: bool, one_batch: bool, extra: tuple = (), ranked: bool = False) -> tuple:
    # a batch^2 term (estimator.families.batch_squared) in decoding too (RWKV's (b, b, hidden) mix of each token)
    monos = poly.DECODE_MONOMIALS + tuple(m for m in extra if m == poly.B2) if decode else poly.STEP_MONOMIALS + extra
    if ranked:
        monos = monos + poly.RANK_MONOMIALS + (poly.RANK_DECODE_MONOMIALS if decode else ())
    if one_batch:  # b fixed at 1: b's monomials coincide with b-free ones
        monos = tuple(m for m in monos if m[0] == 0)
    return monos + ((poly.INV_N,) if fsdp else ()) + ((poly.RANK_INV_N,) if fsdp and ranked else ())


def fit_variant(traces: dict[tuple, Ticks], fsdp: bool, one_batch: bool = False, extra: tuple = (),
                ranked: bool = False) -> Fit:
    """Fit every candidate tick of one reduced model over its traced points (b, s, n, r); keys must agree between
    points. `extra`: monomials in m or l (estimator.profile.poly) the prompt's ticks get, where the step calls CUDA's
    memory-efficient attention (the traced seqs then determine them: tracer.derive.choose_seqs); `ranked`: LoRA's
    rank is a variable (poly.RANK_MONOMIALS; the points hold two ranks: size_points)."""
    pts = list(traces)
    if any(list(zip(traces[p].keys, traces[p].gs)) != list(zip(traces[pts[0]].keys, traces[pts[0]].gs))
           for p in pts[1:]):
        traces = {p: _without_optional(t) for p, t in traces.items()}   # per-tick optimizer keys differ: drop them
    first = traces[pts[0]]
    ref = list(zip(first.keys, first.gs))
    for p in pts[1:]:
        got = list(zip(traces[p].keys, traces[p].gs))
        if got != ref:
            diff = next((i for i, (a, b) in enumerate(zip(ref, got)) if a != b), min(len(ref), len(got)))
            raise ValueError(f"fit: the step runs other operations at (b, s, n, r) = {pts[0]} and {p} (from tick "
                             f"{diff}: {len(ref)} vs {len(got)} ticks), as a loop over sequence chunks, time "
                             "steps or images does (linear attention, recurrent or state-space scans, block-sparse "
                             "attention, a vision tower that runs per image); "
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
        for pt in pts:
            b, s, n, r = pt
            for g in gvals:
                design.append((b, s, g, Fraction(1, n), r))
                cols.append([traces[pt].values[index[(k, g)]] for k in group])
        values = [[int(x) for row in r for x in row] for r in cols]  # point x (key, category)
        monos = _monomials(decode, fsdp, one_batch, extra, ranked)
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


STEP_MAX = ("optimizer", 0, None, 0)   # the optimizer step's largest tick (tracer.ticks._candidates)
OPTIONAL = ("optimizer", -1)           # (stage, segment) of the step's per-tick keys


def optional(key: tuple) -> bool:
    """A per-tick key of the optimizer step (tracer.ticks._candidates): kept where every trace of a reduced model and
    every reduced model has it, dropped elsewhere (the step's largest tick has a key of its own)."""
    return key[:2] == OPTIONAL


def _without_optional(t: Ticks) -> Ticks:
    keep = [i for i, k in enumerate(t.keys) if not optional(k)]
    return Ticks([t.keys[i] for i in keep], [t.gs[i] for i in keep], t.values[keep], t.efficient)


def verify(fit: Fit, ticks: Ticks, point: tuple[int, int, int, int]) -> int:
    """Every fitted tick must reproduce a trace at sizes (b, s, n, r) the fit did not use (for a rank-variable fit,
    at a third rank too), to the byte (FSDP: up to its shards' padding, see FSDP_PADDING_TOLERANCE). Returns the
    largest deviation in bytes (0: exact)."""
    b, s, n, r = point
    got = {(k, g): row for k, g, row in zip(ticks.keys, ticks.gs, ticks.values)}
    worst = 0
    stepwise = any(optional(k) for k in fit.num)   # every optimizer tick fit: its largest is one of them
    for (k, g), row in got.items():
        if (k not in fit.num and optional(k)) or (stepwise and k == STEP_MAX):
            continue   # which tick is largest can change with the sizes or the LoRA rank; each tick is checked
        if k not in fit.num:
            raise ValueError(f"fit: tick {k} appears at (b, s, n, r) = {point} but not at the fitted sizes")
        mv = [poly.monomial_value(m, (b, s, g, Fraction(1, n), r)) for m in fit.monomials[k]]
        for c, cat in enumerate(CATEGORIES):
            pred = sum(x * v for x, v in zip(fit.num[k][c], mv))
            actual = int(row[c])
            if pred == fit.den[k] * actual:
                continue
            off = abs(float(pred / fit.den[k]) - actual)
            if n > 1 and off <= FSDP_PADDING_TOLERANCE * max(actual, 1):
                worst = max(worst, int(round(off)))
                continue
            raise ValueError(f"fit: not exact at (b, s, n, r) = {point}: {cat} at {k} is {actual} B, the fit "
                             f"says {float(pred / fit.den[k]):.0f} B; refusing this profile")
    return worst


def _remap(key: tuple, pos: int | None) -> tuple:
    return (key[0], key[1], pos, key[3])


def extend(plan: Plan, fits: list[Fit]) -> list[tuple[str, str, tuple, int, np.ndarray]]:
    """Full-depth candidate moments (stage, label, monomials, den, numerators) from the reduced fits."""
    r1, f1 = plan.variants[0], fits[0]
    if plan.full:   # the optimizer step: its ticks where the fit has them (their largest is one), else the largest
        stepwise = any(optional(k) for k in f1.keys)
        return [(k[0], _label(k, None if k[2] is None else r1[k[2]], plan.n_layers), f1.monomials[k], f1.den[k],
                 f1.num[k]) for k in f1.keys if not (stepwise and k == STEP_MAX)]
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
    # the optimizer step: every tick where every reduced model has the same ticks (their largest is one of them, and
    # which one can change with depth), else the largest tick alone
    stepwise = {k for k in f1.keys if optional(k)}
    stepwise = stepwise if stepwise and all({k for k in fits[v].num if optional(k)} == stepwise for v in a_pos) \
        else set()
    for key in f1.keys:
        q = key[2]
        base = f1.num[key]
        if (optional(key) and key not in stepwise) or (stepwise and key == STEP_MAX):
            continue
        if q is None or q == 0 or q == last:
            c = base.copy()
            for v in a_pos:
                c = c + (counts[a_pos[v][1]] - plan.copies_of(a_pos[v][1])) * delta(v, key, map_pos(v, q))
            full_index = None if q is None else (0 if q == 0 else plan.n_layers - 1)
            out.append((key[0], _label(key, full_index, plan.n_layers), f1.monomials[key], f1.den[key], c))
            continue
        # a tick in copy k of its type's first middle layer: the type's (k + 1)-th layer at its full position, with
        # every later layer of its type after it (measured: R2 at the same position is that copy with one more of
        # its type after it, the one R2 inserts after the first copy)
        t = plan.types[r1[q]]
        v = next(v for v in a_pos if a_pos[v][1] == t)
        k = q - a_pos[v][0]
        j = [i for i in range(1, plan.n_layers - 1) if plan.types[i] == t][k]
        c = base + (counts[t] - plan.copies_of(t)) * delta(v, key, q)
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
    """Ticks of a layer of type t that is not the first of its type, at every full position of that type after its
    first. R2 holds m + 1 copies of the type's first layer (m = plan.copies_of(t)); the copy at pa + k has k of its type
    before it and m - k after. A full layer with `before` of its type before it is read from the copy with as many
    before it, or, past the last copy, from the last one plus the effect of each further layer before."""
    keep = plan.variants[v]
    first = plan.types.index(t)
    mids = range(1, plan.n_layers - 1)
    m = plan.copies_of(t)
    out = []
    for k in range(1, m + 1):
        for key in (x for x in fv.keys if x[2] == pa + k):
            path = []
            for j in (i for i in mids if i > first and plan.types[i] == t):
                before = sum(1 for i in mids if i < j and plan.types[i] == t)      # includes the first of the type
                if min(before, m) != k:
                    continue
                after = counts[t] - before - 1
                bef, aft = effects[(t, key[0])]
                c = fv.num[key] + (before - k) * bef + (after - (m - k)) * aft
                c = c + _others(plan, effects, key[0], t, j, reference=keep, ref_pos=pa + k)
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
                 ("decode1", 0): "before the layers", ("decode1", 1): "head",
                 ("optimizer", -1): "step"}.get((stage, seg), f"segment {seg}")
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


def gcd_int(a: int, b: int) -> int:
    while b:
        a, b = b, a % b
    return a


def moment_of(c) -> Moment:
    """A candidate (stage, label, monomials, den, numerators) as a Moment, its integers over their common divisor."""
    stage, label, monos, den, num = c
    nums = {}
    for ci, cat in enumerate(CATEGORIES):
        row = tuple(int(x) for x in num[ci])
        if any(row):
            nums[cat] = row
    g = 0
    for row in nums.values():
        for x in row:
            g = gcd_int(g, abs(x))
    g = gcd_int(g, den) or 1
    return Moment(stage, label, monos, den // g, {c: tuple(x // g for x in r) for c, r in nums.items()})


