"""The house's tiers (docs/architecture.md): imports go one way, read from the source with `ast`.

    estimator (evaluator: Python + NumPy)  <-  tracer (derivation: torch, transformers)  <-  offline (allocator
    replay, calibration fits, peers)  <-  bench (DuckDB, measure, published, accuracy)  <-  app.py + pages

A module may import its own tier and the tiers below it, never one above; no circle between modules; no
function-local import of a project module except the one lazy hand-over from the profile store to the derivation
(`estimator.store._derivation`); no private name (`_x`) imported from another module; evaluating an estimate never
loads torch, transformers, DuckDB or Streamlit.
"""
from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TIERS = ("estimator", "tracer", "offline", "bench", "pages")  # lowest first; app.py sits with pages
LAZY_ALLOWED = {("estimator.store", "tracer")}  # the one hand-over: a profile missing from disk is derived
MAX_LINES = 500


def _modules() -> dict[str, Path]:
    mods = {"app": ROOT / "app.py"}
    for top in TIERS:
        for path in (ROOT / top).rglob("*.py"):
            parts = path.relative_to(ROOT).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            mods[name] = path
    return mods


def _tier(module: str) -> int:
    top = module.split(".")[0]
    return TIERS.index("pages" if top == "app" else top)


def _imports(path: Path, package: str):
    """(target module, node, is function-local, imported names) for each import of a project module."""
    tree = ast.parse(path.read_text())
    local_nodes = set()
    for fn in ast.walk(tree):
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            local_nodes.update(id(n) for n in ast.walk(fn))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, node, id(node) in local_nodes, ()
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(up + ([base] if base else []))
            yield base, node, id(node) in local_nodes, tuple(a.name for a in node.names)


def _graph():
    mods = _modules()
    edges = []
    for name, path in mods.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for target, node, local, names in _imports(path, package):
            if target.split(".")[0] not in (*TIERS, "app"):
                continue
            # `from estimator import store` names a module; `from estimator.spec import Workload` a name
            if not names:
                edges.append((name, target, local, node.lineno, ()))
            for n in names:
                if f"{target}.{n}" in mods:
                    edges.append((name, f"{target}.{n}", local, node.lineno, ()))
                else:
                    edges.append((name, target, local, node.lineno, (n,)))
    return mods, edges


def test_no_import_runs_up_a_tier():
    _, edges = _graph()
    up = [f"{a}:{line} -> {b}" for a, b, _, line, _ in edges if _tier(b) > _tier(a)
          and not any(a == x and b.startswith(y) for x, y in LAZY_ALLOWED)]
    assert not up, "imports from a lower tier to a higher one:\n" + "\n".join(up)


def test_no_circle_between_modules():
    mods, edges = _graph()
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for a, b, local, _, _ in edges:
        if b in mods and a != b and not local:
            graph[a].add(b)
    # a package's __init__ importing its own submodules is how packages re-export; not a circle of the design
    for a in graph:
        graph[a] = {b for b in graph[a] if not b.startswith(a + ".")}
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        stack.append(m)
        for n in sorted(graph[m]):
            if state.get(n) == 1:
                return stack[stack.index(n):] + [n]
            if n not in state and (cycle := visit(n)):
                return cycle
        stack.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state and (cycle := visit(m)):
            raise AssertionError("import circle: " + " -> ".join(cycle))


def test_no_function_local_import_of_a_project_module_but_the_one_hand_over():
    _, edges = _graph()
    local = sorted({f"{a}:{line} -> {b}" for a, b, is_local, line, _ in edges if is_local
                    and not any(a == x and b.startswith(y) for x, y in LAZY_ALLOWED)})
    assert not local, "function-local imports of project modules:\n" + "\n".join(local)
    assert any(a == "estimator.store" and b.startswith("tracer") and is_local for a, b, is_local, _, _ in edges)


def test_no_private_name_crosses_a_module():
    _, edges = _graph()
    private = sorted({f"{a}:{line} imports {n} from {b}" for a, b, _, line, names in edges
                      for n in names if n.startswith("_") and not n.startswith("__")})
    assert not private, "\n".join(private)


def test_no_module_over_500_lines_outside_tests():
    mods = _modules()
    long = {name: n for name, path in mods.items() if (n := len(path.read_text().splitlines())) > MAX_LINES}
    scripts = {p.name: n for p in (ROOT / "scripts").glob("*.py") if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long and not scripts, {**long, **scripts}


def _loaded_after(code: str) -> set[str]:
    out = subprocess.run([sys.executable, "-c", code + "\nimport sys; print(' '.join(sorted(sys.modules)))"],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return set(out.stdout.split())


def test_an_estimate_from_shipped_profiles_imports_no_torch():
    mods = _loaded_after(
        "from estimator.presets import load_config\n"
        "from estimator.model import from_hf_config\n"
        "from estimator.estimate import estimate, Options\n"
        "from estimator.search import max_batch, advice\n"
        "from estimator.sweep import sweep_points\n"
        "from estimator import cli\n"
        "from estimator.spec import Workload, Parallel\n"
        "m = from_hf_config(load_config('llama-3.1-8b')[1], 'llama-3.1-8b', derive=False)\n"
        "e = estimate(m, Workload(batch=2), options=Options(derive=False))\n"
        "max_batch(m, Workload(), Parallel(), 80 * 2**30, Options(derive=False))\n")
    assert not {"torch", "transformers", "duckdb", "streamlit", "tracer", "offline", "bench"} & mods


def test_the_tier_test_sees_a_planted_upward_import(tmp_path, monkeypatch):
    """The graph reader is not vacuous: an estimator module importing bench is found."""
    fake = tmp_path / "estimator"
    fake.mkdir()
    (fake / "bad.py").write_text("def f():\n    from bench import db\n")
    edges = list(_imports(fake / "bad.py", "estimator"))
    assert [(t, local) for t, _, local, _ in edges] == [("bench", True)]
    assert _tier("estimator.bad") < _tier("bench.store.db")
