"""Which model types the installed transformers knows, read without importing it (no torch): a fast refusal.

    check_model_type({"model_type": "nope"})   # ValueError in one line, in milliseconds

Importing transformers imports torch (seconds); a config whose `model_type` transformers does not have is refused
before that, from the keys of `CONFIG_MAPPING_NAMES` in the installed transformers' own
`models/auto/auto_mappings.py` and `configuration_auto.py`, read as text (`ast`). `tracer.meta.hf_config` keeps
the authoritative check (with transformers imported); where the source cannot be read here, this check passes and
that one decides.
"""
from __future__ import annotations

import ast
import importlib.metadata
import importlib.util
from functools import lru_cache
from pathlib import Path


MAPPING = "CONFIG_MAPPING_NAMES"
SOURCES = ("auto_mappings.py", "configuration_auto.py")   # where transformers 5 builds the mapping, in order


@lru_cache(maxsize=1)
def known_model_types() -> frozenset[str] | None:
    """The model types of the installed transformers' CONFIG_MAPPING_NAMES, or None where its source is unreadable."""
    try:
        spec = importlib.util.find_spec("transformers")   # finds the package without running it
        keys: set[str] = set()
        for root in list(spec.submodule_search_locations or []) if spec else []:
            for name in SOURCES:
                path = Path(root) / "models" / "auto" / name
                if path.is_file():
                    keys |= _mapping_keys(path.read_text(encoding="utf-8"))
        return frozenset(keys) or None
    except (ImportError, OSError, SyntaxError, ValueError):
        return None


def _mapping_keys(source: str) -> set[str]:
    """String keys of the dict and (key, value) pair literals in the module's top-level statements that assign or
    update CONFIG_MAPPING_NAMES (`X = OrderedDict([...])`, `X.update({...})`, `X = OrderedDict(**{...}, **X)`)."""
    keys: set[str] = set()
    for node in ast.parse(source).body:
        if isinstance(node, ast.Assign):
            hit = any(isinstance(tg, ast.Name) and tg.id == MAPPING for tg in node.targets)
        elif isinstance(node, ast.AnnAssign):
            hit = isinstance(node.target, ast.Name) and node.target.id == MAPPING
        elif isinstance(node, ast.Expr) and isinstance(node.value, ast.Call):
            f = node.value.func
            hit = isinstance(f, ast.Attribute) and f.attr == "update" and isinstance(f.value, ast.Name) and \
                f.value.id == MAPPING
        else:
            hit = False
        if not hit:
            continue
        for sub in ast.walk(node):
            if isinstance(sub, ast.Dict):
                keys |= {k.value for k in sub.keys if isinstance(k, ast.Constant) and isinstance(k.value, str)}
            elif isinstance(sub, ast.Tuple) and len(sub.elts) == 2 and all(
                    isinstance(e, ast.Constant) and isinstance(e.value, str) for e in sub.elts):
                keys.add(sub.elts[0].value)
    return keys


def check_model_type(config: dict) -> None:
    """Refuse, in one line naming the field, a config whose model_type the installed transformers does not have
    (the same wording as tracer.meta.hf_config)."""
    mt = config.get("model_type")
    if not isinstance(mt, str) or not mt:
        raise ValueError("model_type: missing; a config.json names its model_type")
    known = known_model_types()
    if known is None or mt in known:
        return
    if config.get("auto_map"):
        raise ValueError(f"model_type: {mt!r} is not in transformers; its config points to the model's own remote "
                         "code (auto_map), which willitfit never runs (no trust_remote_code)")
    raise ValueError(f"model_type: transformers {_version()} does not know {mt!r} (it knows {len(known)} model "
                     "types; docs/architectures.md lists the causal- and masked-LM ones and how each fares)")


def _version() -> str:
    try:
        return importlib.metadata.version("transformers")
    except importlib.metadata.PackageNotFoundError:
        return "(installed)"
