"""Imports go one way, and evaluating an estimate never imports torch, transformers, DuckDB or Streamlit."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


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
        "from estimator.spec import Workload\n"
        "m = from_hf_config(load_config('llama-3.1-8b')[1], 'llama-3.1-8b', derive=False)\n"
        "e = estimate(m, Workload(batch=2), options=Options(derive=False))\n"
        "max_batch(m, Workload(), __import__('estimator.spec').spec.Parallel(), 80 * 2**30, Options(derive=False))\n")
    assert not {"torch", "transformers", "duckdb", "streamlit"} & mods


def test_estimator_never_imports_bench_or_the_app():
    for path in (ROOT / "estimator").rglob("*.py"):
        text = path.read_text()
        assert "import bench" not in text and "from bench" not in text, path
        assert "streamlit" not in text and "from pages" not in text, path
