"""What is generated from the workload's one declaration (`estimator.spec.Workload`, each field a `Knob`).

- `add_flags` / `workload_from_args`: the CLI's workload flags (`--lora-rank`, `--no-double-quant`, ...);
- `workload_values` / `workload_from_row`: a run row (or a published row) read back into a Workload, every
  declared field, empty cells taking the defaults;
- `declared()`: (name, kind, default, Knob) per field, for bench's row columns and the app's widgets;
- `applies`: whether a field means something for a mode and method (the app shows only those).

Adding a knob: declare it in `Workload` (with its cross-field rules in `__post_init__`), teach the tracer what it
does (tracer.recipes), and test it. The CLI, the row columns, the database column (bench.store.db adds it), the grid,
the published mapping and the app's inputs follow from here (docs/architecture.md).
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass, fields
from functools import lru_cache

from estimator.spec import SIZE_FIELDS, Knob, Workload, knob_of  # noqa: F401  (SIZE_FIELDS: one declaration, spec)


@dataclass(frozen=True)
class Declared:
    name: str
    kind: str        # 'choice' | 'int' | 'bool' | 'multi' (a tuple of names)
    default: object
    knob: Knob

    @property
    def flag(self) -> str:
        """The CLI flag: --lora-rank; a field that defaults to true is turned off with --no-<name>."""
        base = self.name.replace("_", "-")
        return f"--no-{base}" if self.kind == "bool" and self.default else f"--{base}"


def _kind(default, k: Knob) -> str:
    if isinstance(default, bool):
        return "bool"
    if isinstance(default, int):
        return "int"
    if isinstance(default, tuple):
        return "multi"
    if k.choices:
        return "choice"
    raise TypeError(f"a workload field needs choices, an int, a bool or a tuple default, got {default!r}")


@lru_cache(maxsize=1)
def declared() -> tuple[Declared, ...]:
    """Every workload field in declaration order (the declaration never changes: built once)."""
    return tuple(Declared(f.name, _kind(f.default, knob_of(f)), f.default, knob_of(f)) for f in fields(Workload))


CLASS_FIELDS = tuple(d.name for d in declared() if d.name not in SIZE_FIELDS)


def applies(d: Declared, mode: str, method: str, vision: bool = False, vlm: bool = False,
            seq2seq: bool = False, grid: bool = False, audio: bool = False, speech: bool = False) -> bool:
    """Whether field `d` means something for this mode and method, on a text model or a vision encoder (`vision`:
    sized by image_size, not seq; it generates nothing), a vision-language model (`vlm`: it takes images; `grid`: of
    any size, Qwen2-VL's, LLaVA-NeXT's and Pixtral's families), an audio-language model (`audio`: it takes audio clips),
    an encoder-decoder model (`seq2seq`: its decoder's tokens in training) or a speech one whose encoder takes any
    length (`speech`: its audio's seconds); others keep their defaults."""
    if vision and d.name == "gen_tokens":
        return False
    return {"all": True, "train": mode == "train", "infer": mode == "infer",
            "adapter": mode == "train" and method != "full",
            "frozen": mode == "infer" or method != "full",
            "text": not vision, "vision": vision, "vlm": vlm, "audio": audio, "speech": speech, "image": vision or grid,
            "seq2seq": seq2seq and mode == "train"}[d.knob.applies]


def add_flags(parser: argparse.ArgumentParser) -> None:
    """One flag per workload field, its help and choices from the declaration."""
    for d in declared():
        k = d.knob
        if d.kind == "bool":
            parser.add_argument(d.flag, dest=d.name, action="store_false" if d.default else "store_true",
                                help=k.help)
        elif d.kind == "int":
            parser.add_argument(d.flag, dest=d.name, type=int, default=d.default, metavar="N",
                                help=f"{k.help} ({k.lo}..{k.hi}, default {d.default})")
        elif d.kind == "multi":
            parser.add_argument(d.flag, dest=d.name, default=",".join(d.default), metavar="A,B",
                                help=f"{k.help} (default {','.join(d.default)})")
        else:
            metavar = "|".join(k.choices) if len(k.choices) <= 8 else "|".join(k.choices[:6]) + "|..."
            parser.add_argument(d.flag, dest=d.name, choices=k.choices, default=d.default, metavar=metavar,
                                help=f"{k.help}; one of {', '.join(k.choices)} (default {d.default})")


def _names(text: str) -> tuple[str, ...]:
    return tuple(t.strip() for t in str(text).split(",") if t.strip())


def workload_from_args(args: argparse.Namespace) -> Workload:
    """The Workload the parsed flags describe (ValueError naming the field for a bad combination)."""
    kw = {d.name: getattr(args, d.name) for d in declared()}
    kw.update({d.name: _names(kw[d.name]) for d in declared() if d.kind == "multi"})
    return Workload(**kw)


def _present(v) -> bool:
    """A value that is set (a DataFrame row has NaN or pandas.NA where the database has NULL)."""
    if v is None or (isinstance(v, str) and not v):
        return False
    try:
        return bool(v == v)  # NaN is not equal to itself
    except TypeError:        # pandas.NA: its comparison is NA, whose truth is undefined
        return False


def workload_values(row: dict) -> dict:
    """The declared workload fields a row states, typed (DuckDB hands back numpy integers, or floats where a
    column has NULLs); fields the row leaves empty are absent."""
    out = {}
    for d in declared():
        v = row.get(d.name)
        if not _present(v):
            continue
        if d.kind == "int":
            out[d.name] = int(v)
        elif d.kind == "bool":
            out[d.name] = bool(v)
        elif d.kind == "multi":
            out[d.name] = _names(v)
        else:
            out[d.name] = str(v)
    return out


def workload_from_row(row: dict) -> Workload:
    """The Workload a run row describes (inverse of `spec_dict`); empty columns take Workload's defaults.
    Raises ValueError, naming the field, for a value Workload does not allow."""
    return Workload(**workload_values(row))
