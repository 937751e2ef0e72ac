"""The one way the benchmark scripts write their figures: replace their own `## Section` of docs/performance.md
(up to the next `## ` heading), leaving every other section as it is, or append it if it is not there yet."""
from __future__ import annotations

import re
from pathlib import Path

PERF_DOC = Path(__file__).resolve().parent.parent / "docs" / "performance.md"


def replace_section(heading: str, text: str, doc: Path = PERF_DOC) -> None:
    """`heading` is the section's first line (e.g. '## App'); `text` the whole new section, heading included."""
    body = doc.read_text() if doc.exists() else "# Performance\n"
    pattern = re.compile(rf"^{re.escape(heading)}\n.*?(?=^## |\Z)", re.S | re.M)
    section = text.rstrip("\n") + "\n\n"
    if pattern.search(body):
        body = pattern.sub(lambda _: section, body, count=1)
    else:
        body = body.rstrip("\n") + "\n\n" + section
    doc.parent.mkdir(parents=True, exist_ok=True)
    doc.write_text(body.rstrip("\n") + "\n")
