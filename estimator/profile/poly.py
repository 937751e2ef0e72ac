"""Exact polynomials in the workload's sizes: the form every traced moment's live bytes takes.

Every tensor of a transformer step has numel = (a product of batch b, sequence s or the cache length, and
model constants), so the bytes live at one moment of a step are a polynomial in the sizes with rational
coefficients: b*s (activations), s^2 and b*s^2 (eager attention scores, materialised masks), b (per-sequence
scalars), constants (weights, optimizer states). Decoding adds g, the tokens generated so far (the KV cache grows
by b*g). FSDP/ZeRO add 1/n, the shard of each parameter on one of n ranks.

Two more quantities are functions of s, not free variables, for CUDA's memory-efficient attention kernel
(attention.cpp, torch's meta kernel `_efficient_attention_forward`):
- `m`: it copies an attention mask into a (b, h, s, 16 * ceil(s / 16)) tensor where s % 16 != 0 and passes an
  aligned one through uncopied (`preprocess_mask`): m = 16 * ceil(s / 16) where s % 16 != 0, else 0 (no copy);
- `l`: its logsumexp, saved for backward, has 32 * ceil(s / 32) rows per head: l = 32 * ceil(s / 32).
A step that calls it holds s*m, b*s*m, l, b*l bytes: polynomials in (b, s, m, l), not in (b, s) alone (a step with
a mask is a different list of ticks on aligned s: the profile splits there, see profile.Piece).

A third one is for Mamba-2's chunked state-space scan (mamba_ssm's `_mamba_chunk_scan_combined_fwd`, the kernel
transformers calls on a GPU; tracer.kernels_ssm): its per-chunk tensors (dA_cumsum and dt of (b, heads, chunks,
chunk), the chunk states (b, chunks, heads, head_dim, state), the CB matrices (b, chunks, groups, chunk, chunk))
are sized by the chunk count, so a prefill holds b*q and q bytes with
- `q`: s rounded up to the model's scan chunk, q = chunk * ceil(s / chunk).
The chunk is the model's (a config value, 256 in the released Mamba-2 models), so a monomial in q carries it: an
8-tuple whose eighth entry is the chunk, not an exponent (`scan_monomials`).

LoRA adds r, the adapters' rank: every adapter tensor is linear in r (A is r x in, B is out x r, their gradients
and optimizer states, the (b, s, r) product x @ A^T that autograd saves), so a LoRA step's bytes are
P0(b, s, ...) + r * P1(b, s, ...), and one profile answers every rank (`RANK_MONOMIALS`; tracer.derive fits them
from a second traced rank and checks a third). r is a constant of the workload, never swept: a profile is
evaluated after `profile.Profile.at_rank` has folded r into its coefficients. Its exponent is a monomial's ninth
entry (`R_INDEX`, after q's chunk, which is 1 there where the monomial has no q); it is not one of VARIABLES, which
are what an evaluated (folded) profile's monomials are over.

Monomials are exponent tuples over VARIABLES; a 4-tuple has none of m, l, q and a 6-tuple no q (the profiles
written before they existed).
"""
from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction
from functools import lru_cache

VARIABLES = ("b", "s", "g", "inv_n", "m", "l", "q")   # batch, sequence (prompt), generated tokens, 1 / world
# size, padded mask width, logsumexp rows, s padded to the scan chunk (m, l, q: functions of s, see the docstring)
MASK_ALIGNMENT = 16                          # attention.cpp preprocess_mask: mem_eff_alignment
LSE_ALIGNMENT = 32                           # _efficient_attention_forward: logsumexp rows, ceil(M / 32) * 32

# Monomials as exponent tuples over VARIABLES.
ONE, B, S, BS, S2, BS2 = (0, 0, 0, 0), (1, 0, 0, 0), (0, 1, 0, 0), (1, 1, 0, 0), (0, 2, 0, 0), (1, 2, 0, 0)
G, BG, INV_N = (0, 0, 1, 0), (1, 0, 1, 0), (0, 0, 0, 1)
B2 = (2, 0, 0, 0)                                   # a (images x patches) tensor at a fixed image size (GLM-4.1V)
STEP_MONOMIALS = (ONE, B, S, BS, S2, BS2)           # a training step or a prefill
DECODE_MONOMIALS = STEP_MONOMIALS + (G, BG)         # one decoding step after g generated tokens
SM, BSM = (0, 1, 0, 0, 1, 0), (1, 1, 0, 0, 1, 0)
MASK_MONOMIALS = (SM, BSM)                          # a padded mask copy: (b or 1) x h x s x m
M, BM = (0, 0, 0, 0, 1, 0), (1, 0, 0, 0, 1, 0)
# ... and where the queries are a fixed number (an encoder-decoder model's cross-attention over the encoder's s keys at
# a fixed target length t): (b or 1) x h x t x m
FIXED_QUERY_MASK_MONOMIALS = (M, BM)
L, BL = (0, 0, 0, 0, 0, 1), (1, 0, 0, 0, 0, 1)
LSE_MONOMIALS = (L, BL)                             # the efficient kernel's logsumexp: b x h x l
R_INDEX = 8                                         # r's exponent in a monomial: after the 7 and q's chunk


def scan_monomials(chunk: int, blocks: bool = False) -> tuple:
    """q and b*q for a scan of this chunk (q's exponent, then the chunk the monomial is evaluated with). `blocks`: a
    loop over blocks whose last one is s - q + chunk wide (MiniMax's lightning attention, tracer.time_loop), whose
    (b, heads, r, r) products add s*q, q^2 and their b-multiples."""
    if not isinstance(chunk, int) or chunk < 1:
        raise ValueError(f"chunk: {chunk!r} is not allowed; a scan chunk is a positive integer")
    out = ((0, 0, 0, 0, 0, 0, 1, chunk), (1, 0, 0, 0, 0, 0, 1, chunk))
    if blocks:
        out += ((0, 1, 0, 0, 0, 0, 1, chunk), (1, 1, 0, 0, 0, 0, 1, chunk), (0, 0, 0, 0, 0, 0, 2, chunk),
                (1, 0, 0, 0, 0, 0, 2, chunk))
    return out


def scan_chunk(m: tuple) -> int:
    """The chunk a monomial in q rounds s up to (1 where it has no q: q would be s itself)."""
    return m[7] if len(m) > 7 else 1


def scan_padded(s: int, chunk: int) -> int:
    """q at sequence length s: s rounded up to a multiple of the chunk."""
    return s + (-s) % chunk


def mask_width(s: int) -> int:
    """m at sequence length s: the padded width of the mask copy, 0 where s is aligned (no copy)."""
    return 0 if s % MASK_ALIGNMENT == 0 else s + (-s) % MASK_ALIGNMENT


def lse_rows(s: int) -> int:
    """l at sequence length s."""
    return s + (-s) % LSE_ALIGNMENT


def s_functions_array(s):
    """(m, l) over a NumPy array of s."""
    import numpy as np

    s = np.asarray(s)
    return np.where(s % MASK_ALIGNMENT == 0, 0, s + (-s) % MASK_ALIGNMENT), s + (-s) % LSE_ALIGNMENT


def exponents(m: tuple) -> tuple[int, ...]:
    """A monomial's seven exponents (b, s, g, inv_n, m, l, q); a 4-tuple has none of m, l, q, a 6-tuple no q; a
    q monomial's eighth entry (its chunk) is no exponent and is left out, nor is r's (rank_degree)."""
    m = tuple(m[:len(VARIABLES)])
    return m + (0,) * (len(VARIABLES) - len(m))


def rank_degree(m: tuple) -> int:
    """The monomial's exponent of r (0 for the 4- and 6-tuples of profiles without a rank variable)."""
    return m[R_INDEX] if len(m) > R_INDEX else 0


def times_rank(m: tuple) -> tuple:
    """The monomial m * r: its seven exponents, q's chunk (1 where it has no q), then r's exponent."""
    return exponents(m) + (scan_chunk(m), rank_degree(m) + 1)


def without_rank(m: tuple) -> tuple:
    """The monomial with r's exponent dropped (its 7 exponents, and q's chunk where it has q)."""
    e = exponents(m)
    return e + ((scan_chunk(m),) if e[6] else ())


# LoRA's rank-linear terms: r (A, B, their gradients and states), b*r, s*r, b*s*r (x @ A^T: (b, s, r), its
# gradient), and where they occur g*r, b*g*r (decoding) and r/n (FSDP shards the adapters too)
RANK_MONOMIALS = tuple(times_rank(m) for m in (ONE, B, S, BS))
RANK_DECODE_MONOMIALS = tuple(times_rank(m) for m in (G, BG))
RANK_INV_N = times_rank(INV_N)


def s_factor(m: tuple, s: int) -> int:
    """The monomial's factor from m, l and q at sequence length s (1 where it has none)."""
    if len(m) <= 4 or not any(m[4:len(VARIABLES)]):
        return 1
    e = exponents(m)
    return mask_width(s) ** e[4] * lse_rows(s) ** e[5] * scan_padded(s, scan_chunk(m)) ** e[6]


def s_factor_array(m: tuple, s):
    """s_factor over a NumPy array of s (floats)."""
    import numpy as np

    s = np.asarray(s)
    e = exponents(m)
    if not any(e[4:]):
        return np.ones(s.shape, dtype=float)
    w, rows = (x.astype(float) for x in s_functions_array(s))
    q = (s + (-s) % scan_chunk(m)).astype(float)
    return w ** e[4] * rows ** e[5] * q ** e[6]


def seq_degree(m: tuple) -> int:
    """The monomial's degree in the sequence length (m, l and q count as s: they are s rounded up)."""
    e = exponents(m)
    return e[1] + e[4] + e[5] + e[6]


def monomial_name(m: tuple[int, ...]) -> str:
    names = [v if v != "q" else f"q{scan_chunk(m)}" for v in VARIABLES]
    parts = [v if e == 1 else f"{v}^{e}" for v, e in zip(names, exponents(m)) if e]
    k = rank_degree(m)
    parts += ["r" if k == 1 else f"r^{k}"] if k else []
    return "*".join(parts) or "1"


def monomial_value(m: tuple[int, ...], point: tuple) -> Fraction | int:
    """Value of a monomial at a point (b, s, g, inv_n[, r]); inv_n is a Fraction; m and l are read from s; r is 1
    where the point has none."""
    out = 1
    for e, x in zip(m[:4], point):
        if e:
            out = out * x ** e
    r = rank_degree(m)
    if r:
        out = out * point[4] ** r
    return out * s_factor(m, point[1])


def _solve(matrix: list[list[Fraction]], rhs: list[list[Fraction]]) -> list[list[Fraction]]:
    """Solve A X = R exactly (Gauss-Jordan over Fractions); A square and invertible; R has several columns."""
    n = len(matrix)
    a = [row[:] + r[:] for row, r in zip(matrix, rhs)]
    for col in range(n):
        pivot = next((r for r in range(col, n) if a[r][col] != 0), None)
        if pivot is None:
            raise ValueError("sizes: the traced sizes do not determine the polynomial (singular design)")
        a[col], a[pivot] = a[pivot], a[col]
        p = a[col][col]
        a[col] = [x / p for x in a[col]]
        for r in range(n):
            if r != col and a[r][col] != 0:
                f = a[r][col]
                a[r] = [x - f * y for x, y in zip(a[r], a[col])]
    return [row[n:] for row in a]


@lru_cache(maxsize=64)
def _pseudo_inverse(monomials: tuple, points: tuple) -> tuple[tuple[Fraction, ...], ...]:
    """(M^T M)^-1 M^T for the design matrix M[point][monomial], exact; with as many points as monomials it is
    M^-1. Least squares over exact data is exact interpolation whenever the data is a polynomial of this form."""
    m = [[Fraction(monomial_value(mono, p)) for mono in monomials] for p in points]
    k = len(monomials)
    mtm = [[sum(m[r][i] * m[r][j] for r in range(len(points))) for j in range(k)] for i in range(k)]
    mt = [[m[r][i] for r in range(len(points))] for i in range(k)]
    return tuple(tuple(row) for row in _solve(mtm, mt))


def fit_columns(monomials: tuple, points: list[tuple], values) -> tuple[list[list[int]], int]:
    """Fit every column of `values` (points x columns, integers) at once, exactly.

    Returns (numerators[monomial][column], den): coefficient = numerator / den, with one common denominator.
    Raises ValueError naming the first column that its polynomial does not reproduce at every point."""
    pinv = _pseudo_inverse(tuple(monomials), tuple(points))
    den = 1
    for row in pinv:
        for x in row:
            den = den * x.denominator // _gcd(den, x.denominator)
    p_int = [[int(x * den) for x in row] for row in pinv]
    cols = [[int(v) for v in col] for col in zip(*[list(r) for r in values])]  # per column: values over points
    nums = [[sum(pr * v for pr, v in zip(p_row, col)) for col in cols] for p_row in p_int]
    mvals = [[monomial_value(m, pt) for m in monomials] for pt in points]
    for j, col in enumerate(cols):
        for pt, mv, v in zip(points, mvals, col):
            if sum(nums[i][j] * mv[i] for i in range(len(monomials))) != den * v:
                raise ValueError(f"fit: column {j} is not a polynomial of this form in the sizes (at {pt})")
    return nums, den


def fit_exact(monomials: tuple, points: list[tuple], values: list[list[int]]) -> list[list[Fraction]]:
    """Coefficients (one list per value column) of the polynomial over `monomials` through every point.

    values[p][j] is column j's value at points[p]. Raises ValueError if a column is not reproduced exactly at
    every point by its fitted polynomial (the data is not such a polynomial)."""
    pinv = _pseudo_inverse(tuple(monomials), tuple(points))
    ncols = len(values[0])
    coeffs = [[sum(pinv[i][p] * values[p][j] for p in range(len(points))) for i in range(len(monomials))]
              for j in range(ncols)]
    for p, point in enumerate(points):
        mv = [monomial_value(mono, point) for mono in monomials]
        for j in range(ncols):
            if sum(c * x for c, x in zip(coeffs[j], mv)) != values[p][j]:
                raise ValueError("fit: the traced bytes are not a polynomial of this form in the sizes")
    return coeffs


@dataclass(frozen=True)
class Poly:
    """sum(num[i] * monomial[i]) // den: integer numerators over one common denominator."""

    monomials: tuple
    num: tuple[int, ...]
    den: int = 1

    @staticmethod
    def from_fractions(monomials: tuple, coeffs: list[Fraction]) -> "Poly":
        den = 1
        for c in coeffs:
            den = den * c.denominator // _gcd(den, c.denominator)
        return Poly(tuple(monomials), tuple(int(c * den) for c in coeffs), den)

    def __call__(self, b: int, s: int, g: int = 0, n: int = 1, r: int = 1) -> int:
        total = 0
        for m, c in zip(self.monomials, self.num):
            if c:
                v = c * (b ** m[0]) * (s ** m[1]) * (g ** m[2])
                v = v * s_factor(m, s) * r ** rank_degree(m)
                total += v if not m[3] else Fraction(v, n ** m[3])
        return int(total // self.den) if not isinstance(total, Fraction) else int(total / self.den)


def _gcd(a: int, b: int) -> int:
    while b:
        a, b = b, a % b
    return a


def clear_caches() -> None:
    """Forget the memoised results (a cold estimate computes them again)."""
    _pseudo_inverse.cache_clear()
