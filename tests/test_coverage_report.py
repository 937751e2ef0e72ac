"""scripts/coverage.py's report: the share the issue measures, from rows that say why each type was refused."""
from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

# by path, under a name of its own: "coverage" is also coverage.py's package (pytest-cov imports it)
_SPEC = importlib.util.spec_from_file_location("willitfit_coverage_script",
                                               Path(__file__).resolve().parents[1] / "scripts" / "coverage.py")
coverage = importlib.util.module_from_spec(_SPEC)
sys.modules[_SPEC.name] = coverage
_SPEC.loader.exec_module(coverage)


def test_the_report_counts_the_share_of_types_whose_defaults_build_and_run(tmp_path, monkeypatch):
    rows = [{"model_type": "a", "status": "exact", "params_exact": True, "kind": "causal"},
            {"model_type": "b", "status": "within 1%", "params_exact": True, "kind": "causal"},
            {"model_type": "c", "status": "exact", "params_exact": False, "kind": "causal"},
            {"model_type": "d", "status": "refused", "kind": "causal",
             "reason": "ValueError: model_type: transformers cannot build 'd' on the meta device (x)"},
            {"model_type": "e", "status": "refused", "kind": "causal", "reason": "TypeError: topk(): k is None"},
            {"model_type": "f", "status": "refused", "kind": "causal",
             "reason": "DataDependentOutputException: aten._local_scalar_dense.default"}]
    out, doc = tmp_path / "coverage.jsonl", tmp_path / "architectures.md"
    out.write_text("".join(json.dumps(r) + "\n" for r in rows))
    monkeypatch.setattr(coverage, "OUT", out)
    monkeypatch.setattr(coverage, "DOC", doc)
    coverage.report()
    text = doc.read_text()
    # 2 good (c's parameters are off); d does not build; e's own code fails; f is a refusal that counts against
    assert "Of the 5 types whose defaults transformers builds: 2 (40.0%); of the 4 whose own code also runs on " \
           "them: 50.0% (the target: 90%)." in text
    assert f"| {coverage.CANNOT_BUILD} | 1 | d |" in text and f"| {coverage.OWN_CODE_FAILS} | 1 | e |" in text
