"""Which sizes a derivation traces (tracer.derive): the pieces of s between a model's attention windows, the seqs each
piece is fit and verified at, and the step they keep (a loss's chunks, CUDA's padding, context parallelism's split)."""
from __future__ import annotations

from fractions import Fraction

from estimator.profile import poly
from estimator.scans import LIGHTNING_KEY, chunked_scan
from estimator.spec import Workload, loss_seq_step
from tracer.depth import text_config

# Decode windows traced per inference point. The first decoding step is its own stage ("decode1": a sliding-window
# cache still holds the whole prompt then, and crops it); steps g >= 2 are fit in g from windows 2 and 3.
GEN_TOKENS = 3
UNITS = (256, 128, 64, 32, 16, 8)  # sequence steps tried, largest first (32 and up keep CUDA padded shapes exact)
# Config keys whose values are attention windows: memory bends in s there (a sliding-window mask or cache, chunked
# attention). Data, not code per family: a key that changes nothing only splits the fit in two exact pieces.
WINDOW_KEYS = ("sliding_window", "sliding_window_size", "attention_chunk_size", "window_size", "local_window_size",
               "attention_window", "attention_window_size")   # the last: RecurrentGemma's local attention


def pieces_for(hf_config, max_positions: int, infer: bool, step: int = 8, multiple: int = 1,
               units: tuple[int, ...] = UNITS, floor: int = 0) -> list[tuple[int, int | None, tuple[int, ...], int]]:
    """(s_lo, s_hi, fit seqs, verify seq) per piece of s, split at the config's attention window sizes (and, where
    the step hands CUDA's memory-efficient attention a mask, at s's alignment: `_derive_pieces`); the verify seq a
    multiple of `step` where one is free (`chunk_step`); every seq a multiple of `multiple` (context parallelism:
    2 x cp); every seq above `floor` (a grid VLM's images and their end tokens: tracer.vlm.seq_floor)."""
    # transformers keeps a sliding window's mask implicit while kv_length < window (masking_utils
    # `_ignore_causal_mask_sdpa`): s = window is already the other side, so the cut is window - 1
    blocks = {v for v in _block_values(hf_config) if 1 < v < max_positions}
    cuts = sorted({v - 1 for v in _window_values(hf_config) if 1 < v < max_positions} | blocks)
    # a window past the context (EXAONE-4.5's default 4096 over 2048 positions): the profile ends before it
    end = min((v - 1 for v in _window_values(hf_config) if v > max_positions), default=None)
    # a piece too narrow to hold four sizes is merged into the next one (the verification says if that is exact);
    # a block's cut never is (the step runs other operations on its two sides: merged, the fit's seqs would all lie
    # on one side and nothing would check the other), so a block too short to fit is refused below
    gen = GEN_TOKENS if infer else 0
    cuts = [c for c in cuts if c > floor]
    cuts = [c for i, c in enumerate(cuts)
            if c in blocks or c - (cuts[i - 1] if i else floor) - gen >= 4 * UNITS[-1]]
    bounds = [floor, *cuts]
    out = []
    for k, lo in enumerate(bounds):
        hi = bounds[k + 1] if k + 1 < len(bounds) else end
        cap = min(hi if hi is not None else max_positions, max_positions) - gen
        unit = next((u for u in units if lo + 4 * u <= cap), None)
        if unit is None and hi in blocks:
            raise ValueError(f"seq: the piece of s from {lo + 1} to {hi} (a loop over blocks of {min(blocks)} "
                             f"positions) is too short to derive a profile in; a block_size of {4 * UNITS[-1] + gen} "
                             "or more is")
        if unit is None:
            raise ValueError(f"seq: the model's context ({max_positions} positions) is too short to derive a profile")
        out.append((lo, hi, *choose_seqs(lo, unit, step=step, multiple=multiple)))
    if not out:
        raise ValueError(f"seq: the model's context ({max_positions} positions) is too short to derive a profile")
    return out


ALIGNS = {None: lambda s: True, "aligned": lambda s: s % poly.MASK_ALIGNMENT == 0,
          "unaligned": lambda s: s % poly.MASK_ALIGNMENT != 0}


def choose_seqs(lo: int, unit: int, extra: tuple = (), align: str | None = None,
                step: int = 8, multiple: int = 1) -> tuple[tuple[int, ...], int]:
    """(fit seqs, verify seq) of a piece starting above lo, for the monomials in s the fit solves for: 1, s, s^2 and
    `extra` (s*m, l: CUDA's memory-efficient attention; q: a chunked scan; see estimator.profile.poly), on the
    seqs of `align`.
    Without extra: lo + u, 2u, 3u. With: the nearest seqs of the alignment at or below those, then more, downwards
    from lo + 3u, each one that tells the monomials further apart. The verify seq lies past them, in (lo + 3u,
    lo + 4u], with a remainder mod 32 that no fitted seq has (so a fit that holds on one alignment only is caught),
    a multiple of `step` where one is free (a chunked loss splits s into `step` chunks: `chunk_step`), else of the
    largest power of two below it that is; with a step above 8 the fit seqs are its multiples where they tell the
    monomials apart. `multiple`: only seqs that are multiples of it (context parallelism's 2 x cp chunks)."""
    aligned = ALIGNS[align]

    def member(x):
        return aligned(x) and x % multiple == 0
    funcs = list(dict.fromkeys([(0, 0, 0, 0), (0, 1, 0, 0), (0, 2, 0, 0), *[(0, *m[1:]) for m in extra]]))

    def row(s):
        return [Fraction(poly.monomial_value(f, (1, s, 0, 1))) for f in funcs]

    # a chunked loss's chunks are whole on multiples of step: fit there first (the unaligned class has none)
    def prefer(x):
        return member(x) and (step <= 8 or align == "unaligned" or x % step == 0)

    first = [next((x for x in range(lo + k * unit, lo, -1) if prefer(x)), None) for k in (1, 2, 3)]
    cands = [x for x in first if x is not None] + [x for x in range(lo + 3 * unit, lo, -1) if prefer(x)] + \
        [x for x in range(lo + 3 * unit, lo, -1) if member(x)]
    seqs, rows = [], []
    for x in cands:
        if x not in seqs and _rank(rows + [row(x)]) > len(rows):
            seqs.append(x)
            rows.append(row(x))
            if len(seqs) == len(funcs):
                break
    if len(seqs) < len(funcs):
        raise ValueError(f"seq: the piece of s above {lo} is too narrow to tell CUDA's attention padding apart; no "
                         "exact profile can be derived")
    seqs.sort()
    used = {x % poly.LSE_ALIGNMENT for x in seqs}
    whole = [x for x in range(lo + 4 * unit, max(seqs), -1) if member(x)]
    free = [x for x in whole if x % poly.LSE_ALIGNMENT not in used] or whole
    if step > 8 and not any(x % step == 0 for x in free):
        free = whole  # a step of 32 or more: every multiple has remainder 0 mod 32, like the fitted seqs
    steps = sorted({step, 8, 4, 2, 1}, reverse=True)
    return tuple(seqs), next(x for st in steps for x in free if x % st == 0)


def chunk_step(workload: Workload, hf_config) -> int:
    """What the verify seq should be a multiple of (estimator.spec.loss_seq_step, on the config's text sizes)."""
    cfg = text_config(hf_config)
    return loss_seq_step(workload, getattr(cfg, "vocab_size", None), getattr(cfg, "hidden_size", None))


def _rank(rows: list[list[Fraction]]) -> int:
    rows = [r[:] for r in rows]
    rank = 0
    for col in range(len(rows[0]) if rows else 0):
        pivot = next((r for r in range(rank, len(rows)) if rows[r][col] != 0), None)
        if pivot is None:
            continue
        rows[rank], rows[pivot] = rows[pivot], rows[rank]
        for r in range(rank + 1, len(rows)):
            f = rows[r][col] / rows[rank][col]
            rows[r] = [x - f * y for x, y in zip(rows[r], rows[rank])]
        rank += 1
    return rank


def _block_values(cfg) -> list[int]:
    """A loop over blocks of positions (MiniMax's lightning attention, tracer.time_loop) runs once up to its block and
    is marked per iteration past it. The first iteration differs from the others (its carried state is zeros, with no
    gradient: its block decay is not saved), so the kept second-to-last iteration is the first up to two blocks, and
    up to three it starts beside the first's locals: four pieces, cut at one, two and three blocks."""
    scan = chunked_scan(cfg)
    return [k * scan[1] for k in (1, 2, 3)] if scan and scan[0] == LIGHTNING_KEY else []


def _window_values(cfg) -> list[int]:
    vals = []
    for c in (cfg, getattr(cfg, "text_config", None)):
        if c is None:
            continue
        for k, v in vars(c).items():
            if k in WINDOW_KEYS and isinstance(v, int) and not isinstance(v, bool):
                vals.append(v)
    return vals


def max_positions(hf_config) -> int:

    cfg = text_config(hf_config)
    # max_target_positions: a speech model's decoder (Whisper: 448), which its seq sizes (tracer.seq2seq)
    for key in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length", "max_target_positions"):
        v = getattr(cfg, key, None)
        if isinstance(v, int) and v > 0:
            return v
    return 1 << 17
