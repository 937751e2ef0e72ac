"""Check one untrusted run row against `bench.store.rows.COLUMNS` before it may reach the database.

`validate_row(raw)` returns `(row, [])` with every column present (missing ones as None) and values
coerced to their Python types, or `(None, errors)` with one short message per problem, each naming the
field and what is allowed: "optimizer: 'adamx' not allowed; choose one of adamw, adam, ...".

Rows come from JSONL (typed values), CSV (every value a string: numeric strings are coerced, an empty
cell is missing) and Parquet (typed values). Empty or blank strings mean "missing" in every format, so a
row exported to CSV and ingested again is the same row.
"""
from __future__ import annotations

import functools
import json
import math
import numbers
import re
from datetime import datetime, timezone

from bench.store.rows import BY_NAME, COLUMNS, STAGES, canonical_json, compute_run_id
from estimator.alloc_conf import parse_alloc_conf

_INT_TEXT = re.compile(r"\s*[+-]?\d{1,19}\s*")        # 19 digits covers int64; longer is a unit mistake
_CONTROL = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f]")  # tab, newline and CR are allowed in notes
_TRUE, _FALSE = {"true", "1", "t", "yes"}, {"false", "0", "f", "no"}
MAX_TIMESTAMP_LEN = 40


class _Invalid(ValueError):
    """One field's problem; the message is the user-facing error."""


def _show(value) -> str:
    """A short repr for error messages (a huge value must not make a huge error)."""
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _bound(x) -> str:
    return str(int(x)) if float(x).is_integer() else str(x)


def _check_range(col, x):
    if not col.lo <= x <= col.hi:
        raise _Invalid(f"{col.name}: {_show(x)} out of range; allowed {_bound(col.lo)}..{_bound(col.hi)}")
    return x


def _as_int(col, v):
    if type(v) is int and col.lo <= v <= col.hi:  # the common case, checked without ABC machinery
        return v
    if isinstance(v, numbers.Integral) and not isinstance(v, bool):
        return _check_range(col, int(v))
    if isinstance(v, str) and _INT_TEXT.fullmatch(v):
        return _check_range(col, int(v))
    raise _Invalid(f"{col.name}: must be an integer, got {_show(v)}")


def _as_float(col, v):
    if isinstance(v, str):
        try:
            v = float(v)
        except ValueError:
            raise _Invalid(f"{col.name}: must be a number, got {_show(v)}") from None
    if isinstance(v, bool) or not isinstance(v, numbers.Real) or not math.isfinite(v):
        raise _Invalid(f"{col.name}: must be a finite number, got {_show(v)}")
    return _check_range(col, float(v))


def _as_bool(col, v):
    if isinstance(v, bool):
        return v
    if isinstance(v, int) and v in (0, 1):
        return bool(v)
    if isinstance(v, str) and v.strip().lower() in _TRUE | _FALSE:
        return v.strip().lower() in _TRUE
    raise _Invalid(f"{col.name}: must be true or false, got {_show(v)}")


def _as_text(col, v):
    if not isinstance(v, str):
        raise _Invalid(f"{col.name}: must be text, got {_show(v)}")
    if col.allowed and v in col.allowed:  # an enum value is short and printable by construction
        return v
    if len(v) > col.max_len:
        raise _Invalid(f"{col.name}: {len(v)} characters; at most {col.max_len}")
    if col.allowed:
        raise _Invalid(f"{col.name}: {_show(v)} not allowed; choose one of {', '.join(col.allowed)}")
    if _CONTROL.search(v):
        raise _Invalid(f"{col.name}: contains control characters; only printable text, tab and newline")
    return v


def _reject_constant(name):
    raise ValueError(f"{name} is not valid JSON")


def _unique_keys(pairs):
    obj = dict(pairs)
    if len(obj) != len(pairs):
        raise ValueError("duplicate keys")
    return obj


def parse_json_text(text: str):
    """json.loads that refuses NaN/Infinity and duplicate keys (both silently lossy in Python's default)."""
    return json.loads(text, parse_constant=_reject_constant, object_pairs_hook=_unique_keys)


# Small: entries hold up to 2 x MAX_JSON characters each. One config_json repeats over a model's runs.
@functools.lru_cache(maxsize=64)
def _canonical_json_text(text: str) -> tuple[str | None, object]:
    """(canonical text, None) for a JSON object or array; (None, the parsed value) for anything else."""
    value = parse_json_text(text)
    return (canonical_json(value), None) if isinstance(value, (dict, list)) else (None, value)


def _as_json(col, v):
    if isinstance(v, str):
        if len(v) > col.max_len:
            raise _Invalid(f"{col.name}: {len(v)} characters of JSON; at most {col.max_len}")
        try:
            text, v = _canonical_json_text(v)
        except json.JSONDecodeError as e:  # its message, then where (str(e) cut at 60 characters lost the column)
            raise _Invalid(f"{col.name}: not valid JSON ({e.msg[:60]} at column {e.colno})") from None
        except (ValueError, RecursionError) as e:
            raise _Invalid(f"{col.name}: not valid JSON ({str(e)[:60]})") from None
        if text is not None:
            if len(text) > col.max_len:
                raise _Invalid(f"{col.name}: {len(text)} characters of JSON; at most {col.max_len}")
            return text
    if not isinstance(v, (dict, list)):
        raise _Invalid(f"{col.name}: must be a JSON object or array, got {_show(v)}")
    try:
        text = canonical_json(v)
    except (TypeError, ValueError, RecursionError) as e:
        raise _Invalid(f"{col.name}: not JSON-serialisable ({str(e)[:60]})") from None
    if len(text) > col.max_len:
        raise _Invalid(f"{col.name}: {len(text)} characters of JSON; at most {col.max_len}")
    return text


def _as_timestamp(col, v):
    if isinstance(v, str):
        if len(v) > MAX_TIMESTAMP_LEN:
            raise _Invalid(f"{col.name}: {len(v)} characters; an ISO-8601 time is at most {MAX_TIMESTAMP_LEN}")
        try:
            v = datetime.fromisoformat(v.strip())
        except ValueError:
            raise _Invalid(f"{col.name}: {_show(v)} is not an ISO-8601 time, e.g. 2025-01-31T12:00:00Z") from None
    if not isinstance(v, datetime):
        raise _Invalid(f"{col.name}: must be an ISO-8601 time, got {_show(v)}")
    if v.tzinfo is not None:  # stored as UTC without a zone
        v = v.astimezone(timezone.utc).replace(tzinfo=None)
    return v


_COERCE = {"int": _as_int, "bytes": _as_int, "float": _as_float, "bool": _as_bool,
           "text": _as_text, "json": _as_json, "timestamp": _as_timestamp}


# (column, coerce function, required-and-not-computed) in column order, built once
_PLAN = tuple((col, _COERCE[col.kind], col.required and col.name != "run_id") for col in COLUMNS)
_STAGE_PEAKS = tuple((f"{st}_peak_{kind}_bytes", f"peak_{kind}_bytes") for kind in ("alloc", "reserved")
                     for st in STAGES)


def _cross_checks(row: dict) -> list[str]:
    """Invariants between fields of an otherwise well-typed row."""
    errors = []
    oom = row["oom"]
    if row["oom_stage"] is not None and not oom:
        errors.append("oom_stage: set, but oom is false; leave it empty or set oom true")
    peak, total = row["peak_alloc_bytes"], row["gpu_total_bytes"]
    if peak is not None and total is not None and peak > total and not oom:
        errors.append(f"peak_alloc_bytes: {peak} exceeds gpu_total_bytes {total} in a run that did not OOM")
    for stage_name, overall_name in _STAGE_PEAKS:
        stage, overall = row[stage_name], row[overall_name]
        if stage is not None and overall is not None and stage > overall:
            errors.append(f"{stage_name}: {stage} exceeds {overall_name} {overall}")
    if row["alloc_conf"] is not None:
        try:
            parse_alloc_conf(row["alloc_conf"])  # as torch parses PYTORCH_CUDA_ALLOC_CONF
        except ValueError as e:
            errors.append(f"alloc_conf: {e}")
    return errors


def validate_row(raw: dict) -> tuple[dict | None, list[str]]:
    """(row with every column, []) if `raw` is a valid run row, else (None, errors)."""
    if not isinstance(raw, dict):
        return None, [f"row: must be an object of column: value, got {_show(raw)}"]
    unknown = [k for k in raw if k not in BY_NAME]
    errors = []
    if unknown:
        shown = ", ".join(_show(k) for k in unknown[:5]) + (" ..." if len(unknown) > 5 else "")
        errors.append(f"unknown column(s) {shown}; allowed columns are those of bench.store.rows.COLUMNS")
    row = {}
    for col, coerce, required in _PLAN:
        v = raw.get(col.name)
        if v is None or (type(v) is str and (not v or v.isspace())):  # missing (inlined: hot loop)
            row[col.name] = None
            if required:  # run_id is not: it is computed when absent
                errors.append(f"{col.name}: required; missing")
            continue
        try:
            row[col.name] = coerce(col, v)
        except _Invalid as e:
            errors.append(str(e))
            row[col.name] = None
    if errors:
        return None, errors
    errors = _cross_checks(row)
    expected = compute_run_id(row)
    if row["run_id"] is None:
        row["run_id"] = expected
    elif row["run_id"] != expected:
        errors.append(f"run_id: {_show(row['run_id'])} does not match the row's content; expected {expected} "
                      "(bench.store.rows.compute_run_id) or leave it empty")
    return (None, errors) if errors else (row, [])
