"""The docs name only code that exists: every backticked `path/file.py` and every backticked dotted name under
estimator., tracer., offline. or bench. in docs/*.md and README.md resolves to a file, module or attribute."""
from __future__ import annotations

import importlib
import importlib.util
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = sorted((ROOT / "docs").glob("*.md")) + [ROOT / "README.md"]
TIERS = ("estimator", "tracer", "offline", "bench")
SPAN = re.compile(r"`([^`\n]+)`")
PATH = re.compile(r"(?<![\w./-])((?:[\w.-]+/)*[\w-]+\.py)\b")
DOTTED = re.compile(r"(?<![\w./-])((?:%s)(?:\.\w+)+)" % "|".join(TIERS))


def _names() -> list[tuple[str, str, str]]:
    """(doc, kind, name) for every path and dotted name inside backticks."""
    out = set()
    for doc in DOCS:
        for span in SPAN.findall(doc.read_text()):
            for p in PATH.findall(span):
                out.add((doc.name, "path", p))
            for d in DOTTED.findall(span):
                if not d.endswith(".py"):
                    out.add((doc.name, "dotted", d))
    return sorted(out)


# files of other projects, cited as sources (docs/presets.md names where each preset's config.json came from)
EXTERNAL = {"python/mlc_llm/model/model_preset.py", "src/maxtext/checkpoint_conversion/utils/hf_model_configs.py",
            "gemma3_presets.py", "config.py"}


def _path_exists(p: str) -> bool:
    if p in EXTERNAL or (ROOT / p).is_file():
        return True
    top = p.split("/")[0]
    if "/" in p and not (ROOT / top).is_dir():   # an installed package's source, e.g. torch/optim/adam.py
        spec = importlib.util.find_spec(top)
        return spec is not None and spec.submodule_search_locations is not None and \
            (Path(next(iter(spec.submodule_search_locations))).parent / p).is_file()
    # a bare file name or a path relative to its package (`derive.py`, `profile/poly.py`): somewhere in the tree
    return any(True for _ in ROOT.glob(f"*/**/{p}")) or any(True for _ in ROOT.glob(f"*/{p}"))


def _resolves(dotted: str) -> bool:
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ModuleNotFoundError as e:
            if e.name is not None and not ".".join(parts[:i]).startswith(e.name):
                raise  # a package the module needs is missing: that is not the doc's fault
            continue
        for attr in parts[i:]:
            if not hasattr(obj, attr):
                return False
            obj = getattr(obj, attr)
        return True
    return False


NAMES = _names()


def test_the_docs_name_some_code():
    assert sum(k == "path" for _, k, _ in NAMES) > 10 and sum(k == "dotted" for _, k, _ in NAMES) > 10


@pytest.mark.parametrize("doc, kind, name", NAMES, ids=[f"{d}:{n}" for d, _, n in NAMES])
def test_named_code_exists(doc, kind, name):
    if kind == "path":
        assert _path_exists(name), f"{doc}: `{name}` is no file in the repository"
    else:
        assert _resolves(name), f"{doc}: `{name}` is no module or attribute"
