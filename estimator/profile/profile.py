"""A memory profile: every moment of a step that can hold its peak, as exact polynomials per category.

A `Profile` belongs to one model config and one workload class (the workload less its sizes: batch, seq,
generated tokens, world size). It is derived from traces of the real transformers code on fake tensors
(`estimator.profile.derive`) and evaluated here in pure Python/NumPy: no torch, no transformers.

Each `Moment` is one tick of the traced step that can be the peak for some sizes (the others are dominated and
dropped when the profile is derived), extended from the reduced-depth traces to the model's full depth, with one
polynomial per category (weights, gradients, optimizer states, activations, the optimizer step's temporaries,
KV cache, communication buffers, other: inputs and buffers). The live bytes of a stage at given sizes is the
largest total over that stage's moments. Sliding-window and chunked-attention models are piecewise in s: a
`Piece` holds the moments valid for s in (s_lo, s_hi].
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from fractions import Fraction
from functools import cached_property

import numpy as np

from estimator.profile.poly import Poly

FORMAT = 1
CATEGORIES = ("weights", "gradients", "optimizer_states", "activations", "optimizer_step", "kv_cache",
              "comm_buffers", "other")
TRAIN_STAGES = ("load", "forward", "backward", "optimizer")
INFER_STAGES = ("load", "prefill", "decode1", "decode")  # decode1: the first generated token; decode: the g-th
# (g >= 2, the polynomial's g). Reported together as the "decode" stage.


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
    def _int_matrix(self):
        """(C, m) int64 numerators, or None if any is too large for int64 arithmetic."""
        rows = [self.num.get(c, (0,) * len(self.monomials)) for c in CATEGORIES]
        biggest = max((abs(x) for r in rows for x in r), default=0)
        return np.array(rows, dtype=np.int64) if biggest < 1 << 62 else None, max(biggest, 1)

    def exact(self, b: int, s: int, g: int = 0, n: int = 1) -> list[int]:
        """Bytes per category (in CATEGORIES order), exact integers (floored where 1/n divides unevenly)."""
        mono = [b ** m[0] * s ** m[1] * g ** m[2] for m in self.monomials]
        inv = [m[3] for m in self.monomials]
        mat, biggest = self._int_matrix
        if mat is not None and not any(inv) and biggest * max(mono) * len(mono) < 1 << 62:  # no int64 overflow
            return [int(x) // self.den for x in mat @ np.array(mono, dtype=np.int64)]
        out = []
        for c in CATEGORIES:
            nums = self.num.get(c)
            if nums is None:
                out.append(0)
                continue
            if any(inv):
                total = sum(Fraction(x * v, n ** e) for x, v, e in zip(nums, mono, inv) if x)
                out.append(int(total / self.den) if total >= 0 else -int(-total / self.den))
            else:
                out.append(sum(x * v for x, v in zip(nums, mono)) // self.den)
        return out


@dataclass(frozen=True)
class Piece:
    """Moments valid for s_lo < s <= s_hi and b_lo <= b <= b_hi (a bound None: no upper bound)."""

    s_lo: int
    s_hi: int | None
    moments: tuple[Moment, ...]
    b_lo: int = 1
    b_hi: int | None = None

    @cached_property
    def _arrays(self):
        """Per stage: (moment indices, float coefficient tensor [moment, category, monomial]) for fast search."""
        out = {}
        for st in {m.stage for m in self.moments}:
            idx = [i for i, m in enumerate(self.moments) if m.stage == st]
            mono = self.moments[idx[0]].monomials
            arr = np.zeros((len(idx), len(CATEGORIES), len(mono)))
            for k, i in enumerate(idx):
                m = self.moments[i]
                for c, nums in m.num.items():
                    arr[k, CATEGORIES.index(c)] = np.asarray(nums, dtype=float) / m.den
            out[st] = (idx, mono, arr)
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
            if s > p.s_lo and (p.s_hi is None or s <= p.s_hi) and b >= p.b_lo and (p.b_hi is None or b <= p.b_hi):
                return p
        raise ValueError(f"seq: batch {b}, seq {s} is outside every piece of this profile")

    @property
    def stages(self) -> tuple[str, ...]:
        return TRAIN_STAGES if self.workload_class.get("mode", "train") == "train" else INFER_STAGES

    # -- JSON -----------------------------------------------------------------------------------------
    def to_json(self) -> str:
        return json.dumps({
            "format": FORMAT, "config_hash": self.config_hash, "model_type": self.model_type,
            "workload_class": self.workload_class, "parallel_class": self.parallel_class, "layers": self.layers,
            "provenance": self.provenance,
            "pieces": [{"s_lo": p.s_lo, "s_hi": p.s_hi, "b_lo": p.b_lo, "b_hi": p.b_hi, "moments": [
                {"stage": m.stage, "label": m.label, "monomials": [list(x) for x in m.monomials], "den": m.den,
                 "num": {c: list(v) for c, v in m.num.items()}} for m in p.moments]} for p in self.pieces],
        }, separators=(",", ":"), sort_keys=True)

    @staticmethod
    def from_json(text: str) -> "Profile":
        """Parse a profile file; it is data we wrote or shipped, but still checked: a bad file is one error."""
        try:
            d = json.loads(text)
            if d.get("format") != FORMAT:
                raise ValueError(f"format {d.get('format')!r}, expected {FORMAT}")
            pieces = tuple(Piece(int(p["s_lo"]), None if p["s_hi"] is None else int(p["s_hi"]), tuple(
                Moment(str(m["stage"]), str(m["label"]), tuple(tuple(int(e) for e in x) for x in m["monomials"]),
                       int(m["den"]), {str(c): tuple(int(v) for v in nums) for c, nums in m["num"].items()})
                for m in p["moments"]), int(p["b_lo"]), None if p["b_hi"] is None else int(p["b_hi"]))
                for p in d["pieces"])
            for p in pieces:
                for m in p.moments:
                    if m.den < 1 or any(c not in CATEGORIES or len(v) != len(m.monomials) for c, v in m.num.items()):
                        raise ValueError(f"moment {m.label!r} is malformed")
            return Profile(str(d["config_hash"]), str(d["model_type"]), dict(d["workload_class"]),
                           dict(d["parallel_class"]), int(d["layers"]), pieces, dict(d.get("provenance", {})))
        except (KeyError, TypeError, ValueError, json.JSONDecodeError) as e:
            raise ValueError(f"profile: not a valid willitfit profile ({e})") from None
