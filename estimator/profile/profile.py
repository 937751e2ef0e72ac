"""A memory profile: every moment of a step that can hold its peak, as exact polynomials per category.

A `Profile` belongs to one model config and one workload class (the workload less its sizes: batch, seq,
generated tokens, world size). It is derived from traces of the real transformers code on fake tensors
(`tracer.derive`) and evaluated here in pure Python/NumPy: no torch, no transformers.

Each `Moment` is one tick of the traced step that can be the peak for some sizes (the others are dominated and
dropped when the profile is derived), extended from the reduced-depth traces to the model's full depth, with one
polynomial per category (weights, gradients, optimizer states, activations, the optimizer step's temporaries,
KV cache, communication buffers, other: inputs and buffers). The live bytes of a stage at given sizes is the
largest total over that stage's moments. Sliding-window and chunked-attention models are piecewise in s: a
`Piece` holds the moments valid for s in (s_lo, s_hi].

A LoRA profile derived with the rank as a variable (its class says "lora_rank": "r") has monomials in r too
(estimator.profile.poly); `Profile.at_rank` folds one rank into the coefficients, exactly, and what it returns is
evaluated like any other profile.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from functools import cached_property

import numpy as np

from estimator.profile.poly import MASK_ALIGNMENT, Poly, exponents, rank_degree, s_factor, without_rank

FORMAT = 2  # 2: per-stage flat arrays (1: a list of moment objects)
CATEGORIES = ("weights", "gradients", "optimizer_states", "activations", "optimizer_step", "kv_cache",
              "comm_buffers", "other")
TRAIN_STAGES = ("load", "forward", "backward", "optimizer")
INFER_STAGES = ("load", "prefill", "decode1", "decode")  # decode1: the first generated token; decode: the g-th
# (g >= 2, the polynomial's g). Reported together as the "decode" stage.
RANK_MARK = "r"  # a rank-variable profile's workload_class["lora_rank"] (Profile.at_rank)


@dataclass(frozen=True)
class Moment:
    """One tick that can be a stage's peak: its stage, where it is (a readable label), and bytes per category."""

    stage: str
    label: str                       # e.g. "backward, layer 15 (last), tick 42": where the moment is in the step
    monomials: tuple                 # exponent tuples over poly.VARIABLES, shared by every category
    den: int
    num: dict                        # category -> tuple of integer numerators (absent: 0)

    def poly(self, category: str) -> Poly:
        return Poly(self.monomials, tuple(self.num.get(category, (0,) * len(self.monomials))), self.den)

    def bytes_at(self, b: int, s: int, g: int = 0, n: int = 1) -> dict[str, int]:
        return dict(zip(CATEGORIES, self.exact(b, s, g, n)))

    @cached_property
    def _padded(self) -> bool:
        """Whether a monomial carries m, l or q (poly: kernels' padding of s), which need s_factor. A monomial in r
        is refused: a rank-variable profile is evaluated after `Profile.at_rank` (never with r silently 1)."""
        if any(rank_degree(m) for m in self.monomials):
            raise ValueError("profile: a rank-variable LoRA moment is evaluated at a rank (Profile.at_rank)")
        return any(any(exponents(m)[4:]) for m in self.monomials)

    @cached_property
    def _int_matrix(self):
        """(C, m) int64 numerators, or None if any is too large for int64 arithmetic."""
        rows = [self.num.get(c, (0,) * len(self.monomials)) for c in CATEGORIES]
        biggest = max((abs(x) for r in rows for x in r), default=0)
        return np.array(rows, dtype=np.int64) if biggest < 1 << 62 else None, max(biggest, 1)

    def exact(self, b: int, s: int, g: int = 0, n: int = 1) -> list[int]:
        """Bytes per category (in CATEGORIES order), exact integers (floored where 1/n divides unevenly)."""
        if self._padded:
            mono = [b ** m[0] * s ** m[1] * g ** m[2] * s_factor(m, s) for m in self.monomials]
        else:
            mono = [b ** m[0] * s ** m[1] * g ** m[2] for m in self.monomials]
        inv = [m[3] for m in self.monomials]
        mat, biggest = self._int_matrix
        if mat is not None and not any(inv) and biggest * max(mono) * len(mono) < 1 << 62:  # no int64 overflow
            return [int(x) // self.den for x in mat @ np.array(mono, dtype=np.int64)]
        out = []
        top = max(inv)
        # 1/n terms over a common denominator n**top: integers only (as exact as Fractions, and fast)
        scale = [n ** (top - e) * v for v, e in zip(mono, inv)]
        den = self.den * n ** top
        for c in CATEGORIES:
            nums = self.num.get(c)
            if nums is None:
                out.append(0)
                continue
            total = sum(x * v for x, v in zip(nums, scale))
            if top:  # truncated toward zero, as the fit's rational value is
                out.append(total // den if total >= 0 else -((-total) // den))
            else:
                out.append(total // den)
        return out


@dataclass(frozen=True, eq=True)
class Piece:
    """Moments valid for s_lo < s <= s_hi and b_lo <= b <= b_hi (a bound None: no upper bound), and, where `align`
    is set, for s a multiple of 16 ("aligned") or not ("unaligned"): a step that hands CUDA's memory-efficient
    attention a mask copies it (one more tensor, one more tick) only where s is unaligned (poly.mask_width).

    Stored per stage as flat data (what the JSON holds and what NumPy reads in one call): the stage's monomials,
    and per moment its label, denominator and its numerators flattened as [category][monomial]. `Moment` objects
    are built only when asked for (the winning moment of an estimate, tools, tests)."""

    s_lo: int
    s_hi: int | None
    stage_data: dict            # stage -> {"monomials": [[..]], "labels": [..], "dens": [..], "nums": [[..]]}
    b_lo: int = 1
    b_hi: int | None = None
    align: str | None = None    # None: every s; "aligned": s % 16 == 0; "unaligned": the others

    def covers(self, b, s):
        """Whether (b, s) falls in this piece: a bool for ints, an element-wise mask for NumPy arrays (the sweep)."""
        ok = (s > self.s_lo) & (b >= self.b_lo)
        if self.s_hi is not None:
            ok = ok & (s <= self.s_hi)
        if self.b_hi is not None:
            ok = ok & (b <= self.b_hi)
        if self.align is not None:  # a piece split by the mask copy's alignment (tracer.derive)
            ok = ok & ((s % MASK_ALIGNMENT == 0) == (self.align == "aligned"))
        return ok

    @staticmethod
    def from_moments(s_lo, s_hi, moments, b_lo=1, b_hi=None, align=None) -> "Piece":
        data: dict = {}
        for m in moments:
            d = data.setdefault(m.stage, {"monomials": [list(x) for x in m.monomials], "labels": [], "dens": [],
                                          "nums": []})
            d["labels"].append(m.label)
            d["dens"].append(m.den)
            d["nums"].append([x for c in CATEGORIES for x in m.num.get(c, (0,) * len(m.monomials))])
        return Piece(s_lo, s_hi, data, b_lo, b_hi, align)

    def moment(self, stage: str, k: int) -> Moment:
        memo = self.__dict__.setdefault("_moment_memo", {})  # a frozen dataclass: the memo bypasses __setattr__
        hit = memo.get((stage, k))
        if hit is None:
            hit = memo[(stage, k)] = self._build_moment(stage, k)
        return hit

    def _build_moment(self, stage: str, k: int) -> Moment:
        d = self.stage_data[stage]
        monos = tuple(tuple(x) for x in d["monomials"])
        m = len(monos)
        flat = d["nums"][k]
        num = {c: tuple(flat[i * m:(i + 1) * m]) for i, c in enumerate(CATEGORIES) if any(flat[i * m:(i + 1) * m])}
        return Moment(stage, d["labels"][k], monos, d["dens"][k], num)

    def at_rank(self, r: int) -> "Piece":
        """This piece with r substituted: every monomial m * r^k folds into m with its numerators times r^k (integers:
        exact). A piece without r is returned as it is."""
        data = {}
        for st, d in self.stage_data.items():
            monos = [tuple(x) for x in d["monomials"]]
            if not any(rank_degree(m) for m in monos):
                data[st] = d
                continue
            free = [without_rank(m) for m in monos]   # (1, b*s, r*b*s) -> (1, b*s, b*s): one monomial
            out = list(dict.fromkeys(free))
            where = [out.index(m) for m in free]
            power = [r ** rank_degree(m) for m in monos]
            nums = _fold(d["nums"], where, power, len(monos), len(out))
            data[st] = {"monomials": [list(m) for m in out], "labels": d["labels"], "dens": d["dens"], "nums": nums}
        return Piece(self.s_lo, self.s_hi, data, self.b_lo, self.b_hi, self.align)

    @cached_property
    def moments(self) -> tuple[Moment, ...]:
        return tuple(self.moment(st, k) for st, d in self.stage_data.items() for k in range(len(d["labels"])))

    @cached_property
    def _arrays(self):
        """Per stage: (moment positions within the stage, monomials, float tensor [moment, category, monomial])."""
        out = {}
        for st, d in self.stage_data.items():
            monos = tuple(tuple(x) for x in d["monomials"])
            arr = np.asarray(d["nums"], dtype=float).reshape(len(d["dens"]), len(CATEGORIES), len(monos))
            arr /= np.asarray(d["dens"], dtype=float)[:, None, None]
            out[st] = (list(range(len(d["dens"]))), monos, arr)
        return out


def _fold(rows: list, where: list[int], power: list[int], k: int, width: int) -> list:
    """Each row of numerators (category-major, k monomials per category) folded onto `width` monomials: the i-th
    monomial's numerator times power[i] added at where[i]. In int64 where no sum can overflow (shipped numerators
    stay under 2^42, r^k under 2^17 for the ranks asked), else in Python's integers: the same integers either way."""
    n_cat = len(CATEGORIES)
    try:
        arr = np.asarray(rows, dtype=np.int64).reshape(len(rows), n_cat, k)
    except (OverflowError, ValueError, TypeError):
        arr = None
    if arr is not None and (not arr.size or int(np.abs(arr).max()) * max(power, default=1) * k < 2 ** 62):
        move = np.zeros((k, width), dtype=np.int64)
        move[np.arange(k), where] = 1
        return ((arr * np.asarray(power, dtype=np.int64)) @ move).reshape(len(rows), n_cat * width).tolist()
    out = []
    for flat in rows:
        row = [0] * (n_cat * width)
        for c in range(n_cat):
            for i in range(k):
                row[c * width + where[i]] += flat[c * k + i] * power[i]
        out.append(row)
    return out


@dataclass(frozen=True)
class Profile:
    """Everything estimate() needs to know about how one model's step uses memory, for one workload class."""

    config_hash: str
    model_type: str
    workload_class: dict             # the Workload fields that define the class (sizes left out)
    parallel_class: dict             # strategy (and what else the traced parallel setting fixes)
    layers: int                      # full depth the moments are extended to
    pieces: tuple[Piece, ...]
    provenance: dict = field(default_factory=dict)  # torch/transformers versions, kernels, traces, seconds, ...

    def piece_for(self, b: int, s: int) -> Piece:
        for p in self.pieces:
            if p.covers(b, s):
                return p
        ends = [p.s_hi for p in self.pieces if p.s_hi is not None]
        if ends and all(p.s_hi is not None for p in self.pieces) and s > max(ends):
            raise ValueError(f"seq: {s} is past {max(ends)}, where this profile ends (an attention window beyond the "
                             "model's context: memory past it was not derived); use seq <= " + str(max(ends)))
        if any(p.align == "aligned" and replace(p, align=None).covers(b, s) for p in self.pieces):
            up = -(-s // MASK_ALIGNMENT) * MASK_ALIGNMENT
            raise ValueError(f"seq: {s} is not a multiple of {MASK_ALIGNMENT}, the only seqs this profile prices there "
                             f"(its loss chunks are whole on them, and CUDA's attention copies its mask on the others; "
                             f"docs/recipes.md); use seq {up}")
        raise ValueError(f"seq: batch {b}, seq {s} is outside every piece of this profile")

    @property
    def rank_variable(self) -> bool:
        """Whether the LoRA rank is a variable of this profile (derived so: its class says "lora_rank": "r")."""
        return self.workload_class.get("lora_rank") == RANK_MARK

    def at_rank(self, r: int) -> "Profile":
        """The profile at LoRA rank r: r folded into every coefficient (`Piece.at_rank`), the class naming r. A profile
        without the rank variable (one per rank, or not LoRA) is returned as it is."""
        if not self.rank_variable:
            return self
        if isinstance(r, bool) or not isinstance(r, int) or r < 1:
            raise ValueError(f"lora_rank: {r!r}; a rank-variable profile is evaluated at an integer rank >= 1")
        memo = self.__dict__.setdefault("_rank_memo", {})  # a frozen dataclass: the memo bypasses __setattr__
        hit = memo.get(r)
        if hit is None:
            if len(memo) >= 64:  # an app session trying ranks one by one: keep the memory bounded
                memo.clear()
            hit = memo[r] = Profile(self.config_hash, self.model_type, {**self.workload_class, "lora_rank": r},
                                    self.parallel_class, self.layers, tuple(p.at_rank(r) for p in self.pieces),
                                    self.provenance)
        return hit

    @property
    def stages(self) -> tuple[str, ...]:
        return TRAIN_STAGES if self.workload_class.get("mode", "train") == "train" else INFER_STAGES

    # -- JSON -----------------------------------------------------------------------------------------
    def to_json(self) -> str:
        return json.dumps({
            "format": FORMAT, "config_hash": self.config_hash, "model_type": self.model_type,
            "workload_class": self.workload_class, "parallel_class": self.parallel_class, "layers": self.layers,
            "provenance": self.provenance,
            "pieces": [{"s_lo": p.s_lo, "s_hi": p.s_hi, "b_lo": p.b_lo, "b_hi": p.b_hi, "stages": p.stage_data,
                        **({"align": p.align} if p.align else {})} for p in self.pieces],
        }, separators=(",", ":"), sort_keys=True)

    @staticmethod
    def from_json(text: str) -> "Profile":
        """Parse a profile file; it is data we wrote or shipped, but still checked: a bad file is one error."""
        try:
            d = json.loads(text)
            if d.get("format") != FORMAT:
                raise ValueError(f"format {d.get('format')!r}, expected {FORMAT}")
            pieces = tuple(Piece(int(p["s_lo"]), None if p["s_hi"] is None else int(p["s_hi"]), p["stages"],
                                 int(p["b_lo"]), None if p["b_hi"] is None else int(p["b_hi"]), p.get("align"))
                           for p in d["pieces"])
            for p in pieces:
                if p.align not in (None, "aligned", "unaligned"):
                    raise ValueError(f"align {p.align!r}")
                for st, sd in p.stage_data.items():
                    width = len(CATEGORIES) * len(sd["monomials"])
                    if (st not in TRAIN_STAGES + INFER_STAGES or len(sd["labels"]) != len(sd["dens"]) != len(sd["nums"])
                            or any(not isinstance(x, int) or x < 1 for x in sd["dens"])
                            or any(len(row) != width for row in sd["nums"])):
                        raise ValueError(f"stage {st!r} is malformed")
            return Profile(str(d["config_hash"]), str(d["model_type"]), dict(d["workload_class"]),
                           dict(d["parallel_class"]), int(d["layers"]), pieces, dict(d.get("provenance", {})))
        except (KeyError, TypeError, ValueError, json.JSONDecodeError) as e:
            raise ValueError(f"profile: not a valid willitfit profile ({e})") from None
