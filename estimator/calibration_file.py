"""Read the activation-constant calibrations that `python -m bench calibrate --save` exports.

The estimator never imports bench or DuckDB: bench writes the fits to a JSON file (default
`data/calibration.json`, overridable with the WILLITFIT_CALIBRATION environment variable) and this module reads
it. File format (version 1):

    {"version": 1,
     "calibrations": [
       {"family": "llama",                 # estimator.families.FAMILIES value
        "k": 23.7, "k_ci_low": 23.1, "k_ci_high": 24.3,   # k of k*b*s*h*L*bytes and its 95% CI
        "residual_std_bytes": 1.9e8,       # std of (measured - fitted) activation bytes
        "n_points": 42,                    # runs the fit used
        "created_at": "2025-06-01T12:00:00",  # ISO 8601, UTC
        "context_bytes": 5.6e8,            # optional: fitted CUDA context constant, or null
        "attention": "sdpa",               # optional: sdpa | flash | eager, or null = fitted over all
        "checkpointing": "none"}           # optional: none | full | selective, or null = fitted over all
     ]}

Unknown keys in an entry are ignored (bench may add fit diagnostics such as r2); missing or invalid required
keys raise ValueError naming the key.
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

from estimator.families import FAMILIES
from estimator.presets import DATA_DIR
from estimator.spec import ATTENTION, CHECKPOINTING

SEED_K = 12.0  # seed 000's flat activation constant: activations = 12 * b*s*h*L*bytes
DEFAULT_PATH = DATA_DIR / "calibration.json"
ENV_VAR = "WILLITFIT_CALIBRATION"
VERSION = 1
MAX_FILE_BYTES = 1 << 22  # a few hundred fits are a few hundred KB
Z_95 = 1.96               # two-sided 95% normal quantile for the prediction interval
MISSING_HINT = "no calibration saved yet; run the Calibrate page or `python -m bench calibrate --save`"


def _finite(name: str, value, allow_none: bool = False) -> float | None:
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"calibration.{name}: must be a finite number, got {value!r}")
    return float(value)


@dataclass(frozen=True)
class CalibrationEntry:
    """One fitted activation constant k for a model family (and optionally one attention/checkpointing mode)."""

    family: str
    k: float
    k_ci_low: float
    k_ci_high: float
    residual_std_bytes: float
    n_points: int
    created_at: datetime
    context_bytes: float | None = None
    attention: str | None = None
    checkpointing: str | None = None

    def __post_init__(self) -> None:
        families = sorted(set(FAMILIES.values()))
        if self.family not in families:
            raise ValueError(f"calibration.family: {self.family!r} is not allowed; choose one of {', '.join(families)}")
        for name in ("k", "k_ci_low", "k_ci_high", "residual_std_bytes"):
            _finite(name, getattr(self, name))
        if self.k <= 0:
            raise ValueError(f"calibration.k: {self.k} must be > 0")
        if not self.k_ci_low <= self.k <= self.k_ci_high:
            raise ValueError(f"calibration.k_ci_low: interval [{self.k_ci_low}, {self.k_ci_high}] must contain k={self.k}")
        if self.residual_std_bytes < 0:
            raise ValueError(f"calibration.residual_std_bytes: {self.residual_std_bytes} must be >= 0")
        if isinstance(self.n_points, bool) or not isinstance(self.n_points, int) or self.n_points < 1:
            raise ValueError(f"calibration.n_points: must be an integer >= 1, got {self.n_points!r}")
        if not isinstance(self.created_at, datetime):
            raise ValueError(f"calibration.created_at: must be a datetime, got {self.created_at!r}")
        if _finite("context_bytes", self.context_bytes, allow_none=True) is not None and self.context_bytes < 0:
            raise ValueError(f"calibration.context_bytes: {self.context_bytes} must be >= 0")
        for name, allowed in (("attention", ATTENTION), ("checkpointing", CHECKPOINTING)):
            value = getattr(self, name)
            if value is not None and value not in allowed:
                raise ValueError(f"calibration.{name}: {value!r} is not allowed; choose one of {', '.join(allowed)} or null")

    def applies_to(self, attention: str | None, checkpointing: str | None) -> bool:
        """An entry fitted over all modes (null) applies to any; a specific one only to its own."""
        return ((self.attention is None or attention is None or self.attention == attention)
                and (self.checkpointing is None or checkpointing is None or self.checkpointing == checkpointing))

    def interval(self, total_bytes: int) -> tuple[int, int]:
        """95% prediction interval of a total whose activations use this k: total -/+ 1.96 * residual std."""
        half = Z_95 * self.residual_std_bytes
        return int(total_bytes - half), int(math.ceil(total_bytes + half))


def _entry(d: dict) -> CalibrationEntry:
    if not isinstance(d, dict):
        raise ValueError(f"calibration.calibrations: each entry must be a JSON object, got {type(d).__name__}")
    for key in ("family", "k", "k_ci_low", "k_ci_high", "residual_std_bytes", "n_points", "created_at"):
        if key not in d:
            raise ValueError(f"calibration.{key}: missing in an entry of family {d.get('family', '?')!r}")
    try:
        created = datetime.fromisoformat(str(d["created_at"]))
    except ValueError:
        raise ValueError(f"calibration.created_at: {d['created_at']!r} is not an ISO 8601 timestamp") from None
    return CalibrationEntry(
        family=d["family"], k=d["k"], k_ci_low=d["k_ci_low"], k_ci_high=d["k_ci_high"],
        residual_std_bytes=d["residual_std_bytes"], n_points=d["n_points"], created_at=created,
        context_bytes=d.get("context_bytes"), attention=d.get("attention"), checkpointing=d.get("checkpointing"))


def calibration_path(path: str | Path | None = None) -> Path:
    return Path(path or os.environ.get(ENV_VAR) or DEFAULT_PATH)


def load_entries(path: str | Path | None = None) -> tuple[CalibrationEntry, ...]:
    """Every entry of the calibration file; ValueError with MISSING_HINT when there is none."""
    p = calibration_path(path)
    if not p.is_file():
        raise ValueError(f"calibration: {MISSING_HINT} ({p} does not exist)")
    if p.stat().st_size > MAX_FILE_BYTES:
        raise ValueError(f"calibration: {p} is larger than {MAX_FILE_BYTES} bytes; not a calibration file")
    try:
        doc = json.loads(p.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"calibration: {p} is not valid JSON ({e.msg} at line {e.lineno})") from None
    if not isinstance(doc, dict) or doc.get("version") != VERSION or not isinstance(doc.get("calibrations"), list):
        raise ValueError(f"calibration: {p} must be an object with version={VERSION} and a 'calibrations' list")
    entries = tuple(_entry(d) for d in doc["calibrations"])
    if not entries:
        raise ValueError(f"calibration: {MISSING_HINT} ({p} holds no fits)")
    return entries


def load_calibration(path: str | Path | None = None, attention: str | None = None,
                     checkpointing: str | None = None) -> dict[str, CalibrationEntry]:
    """family -> the entry to use for a workload with this attention/checkpointing (None = any).

    Among the entries that apply, the most specific wins (a fit for exactly this attention and checkpointing
    beats one fitted over all modes), then the newest."""
    best: dict[str, CalibrationEntry] = {}

    def rank(e: CalibrationEntry):
        return ((e.attention is not None) + (e.checkpointing is not None), e.created_at)

    for e in load_entries(path):
        if e.applies_to(attention, checkpointing) and (e.family not in best or rank(e) > rank(best[e.family])):
            best[e.family] = e
    return best


def entry_for(family: str, attention: str, checkpointing: str, path: str | Path | None = None) -> CalibrationEntry:
    """The calibration for one family and mode, or ValueError saying which families/modes the file has."""
    table = load_calibration(path, attention, checkpointing)
    if family not in table:
        have = ", ".join(sorted(f"{e.family}({e.attention or 'any'}/{e.checkpointing or 'any'})"
                                for e in load_entries(path)))
        raise ValueError(f"calibration: no fit for family {family!r} with attention={attention}, "
                         f"checkpointing={checkpointing}; the file has {have}. Run `python -m bench calibrate "
                         f"--family {family} --save` on runs of that kind")
    return table[family]
