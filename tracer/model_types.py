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


from estimator.families import VISION_REFUSED, VISION_TYPES

MAPPING = "CONFIG_MAPPING_NAMES"
SOURCES = ("auto_mappings.py", "configuration_auto.py")   # where transformers 5 builds the mapping, in order
# modeling_auto.py's task mappings: an image-classification type with neither a causal- nor a masked-LM model, and not
# one of the vision encoders modelled (tracer.vision), is refused before transformers is imported
IMAGE_MAPPING = "MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES"
TEXT_MAPPINGS = ("MODEL_FOR_CAUSAL_LM_MAPPING_NAMES", "MODEL_FOR_MASKED_LM_MAPPING_NAMES")


@lru_cache(maxsize=1)
def known_model_types() -> frozenset[str] | None:
    """The model types of the installed transformers' CONFIG_MAPPING_NAMES, or None where its source is unreadable."""
    return _read_keys(SOURCES, MAPPING)


@lru_cache(maxsize=1)
def unmodelled_image_types() -> frozenset[str]:
    """Image-classification model types that have no causal- or masked-LM model and are no vision encoder willitfit
    models (empty where the source is unreadable: tracer.meta.model_class then refuses them)."""
    image = _read_keys(("modeling_auto.py",), IMAGE_MAPPING) or frozenset()
    text = frozenset().union(*(_read_keys(("modeling_auto.py",), m) or frozenset() for m in TEXT_MAPPINGS))
    known = known_model_types() or frozenset()   # a (type, (class, class)) entry's inner pair is no model type
    return frozenset((image & known) - text - set(VISION_TYPES))


def _read_keys(sources: tuple[str, ...], mapping: str) -> frozenset[str] | None:
    try:
        spec = importlib.util.find_spec("transformers")   # finds the package without running it
        keys: set[str] = set()
        for root in list(spec.submodule_search_locations or []) if spec else []:
            for name in sources:
                path = Path(root) / "models" / "auto" / name
                if path.is_file():
                    keys |= _mapping_keys(path.read_text(encoding="utf-8"), mapping)
        return frozenset(keys) or None
    except (ImportError, OSError, SyntaxError, ValueError):
        return None


def _mapping_keys(source: str, mapping: str = MAPPING) -> set[str]:
    """String keys of the dict and (key, value) pair literals in the module's top-level statements that assign or
    update CONFIG_MAPPING_NAMES (`X = OrderedDict([...])`, `X.update({...})`, `X = OrderedDict(**{...}, **X)`)."""
    keys: set[str] = set()
    for node in ast.parse(source).body:
        if isinstance(node, ast.Assign):
            hit = any(isinstance(tg, ast.Name) and tg.id == mapping for tg in node.targets)
        elif isinstance(node, ast.AnnAssign):
            hit = isinstance(node.target, ast.Name) and node.target.id == mapping
        elif isinstance(node, ast.Expr) and isinstance(node.value, ast.Call):
            f = node.value.func
            hit = isinstance(f, ast.Attribute) and f.attr == "update" and isinstance(f.value, ast.Name) and \
                f.value.id == mapping
        else:
            hit = False
        if not hit:
            continue
        for sub in ast.walk(node):
            if isinstance(sub, ast.Dict):
                keys |= {k.value for k in sub.keys if isinstance(k, ast.Constant) and isinstance(k.value, str)}
            elif isinstance(sub, ast.Tuple) and len(sub.elts) == 2 and isinstance(sub.elts[0], ast.Constant) and \
                    isinstance(sub.elts[0].value, str) and (isinstance(sub.elts[1], ast.Tuple) or (
                        isinstance(sub.elts[1], ast.Constant) and isinstance(sub.elts[1].value, str))):
                keys.add(sub.elts[0].value)   # ("deit", ("DeiTFor...", "DeiTFor...WithTeacher")) names one type
    return keys


def check_model_type(config: dict) -> None:
    """Refuse, in one line naming the field, a config whose model_type the installed transformers does not have
    (the same wording as tracer.meta.hf_config)."""
    mt = config.get("model_type")
    if not isinstance(mt, str) or not mt:
        raise ValueError("model_type: missing; a config.json names its model_type")
    known = known_model_types()
    if mt in unmodelled_image_types():
        if mt in VISION_REFUSED:
            raise ValueError(f"model_type: {mt!r} is not priced: {VISION_REFUSED[mt]}")
        raise ValueError(f"model_type: {mt!r} is an image model willitfit does not model yet; the vision encoders it "
                         f"models are {', '.join(VISION_TYPES)} (docs/architectures.md)")
    if known is None:
        return
    why = unknown_type(config, known, _version())
    if why:
        raise ValueError(why)


def unknown_type(config: dict, known, version: str) -> str | None:
    """The one-line refusal of a config whose model_type is not among `known` (the installed transformers' types,
    version `version`), or None: one wording for this module's check (read from transformers' source) and
    tracer.config_check's (transformers' own mapping)."""
    mt = config.get("model_type")
    if mt in known:
        return None
    if config.get("auto_map"):
        return (f"model_type: {mt!r} is not in transformers; its config points to the model's own remote code "
                "(auto_map), which willitfit never runs (no trust_remote_code)")
    return (f"model_type: transformers {version} does not know {mt!r} (it knows {len(known)} model types; "
            "docs/architectures.md lists the causal- and masked-LM ones and how each fares)")


def _version() -> str:
    try:
        return importlib.metadata.version("transformers")
    except importlib.metadata.PackageNotFoundError:
        return "(installed)"
