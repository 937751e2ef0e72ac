"""The command line both full-size checks share (scripts/hybrid_check.py, scripts/vision_check.py): pick cases by name,
run each with an empty profile cache, print one line per case, exit 1 if any differs or is refused.

    sys.exit(main(__doc__, CASES, run_case, "willitfit-hybrid-", width=34))
"""
from __future__ import annotations

import argparse
import os
import tempfile
from collections.abc import Callable


def main(doc: str, cases: tuple, run_case: Callable[[tuple], tuple[bool, str]], cache_prefix: str, width: int,
         argv=None) -> int:
    """`run_case(case)` returns (equal, the line to print); a case is a tuple whose first item is its name."""
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("--case", action="append", help="a case name (repeatable; default: every case)")
    ap.add_argument("--list", action="store_true", help="list the cases and exit")
    args = ap.parse_args(argv)
    if args.list:
        for c in cases:
            print(c[0])
        return 0
    names = {c[0] for c in cases}
    bad = [n for n in args.case or [] if n not in names]
    if bad:
        ap.error(f"--case: {bad[0]!r} is not a case; choose from {', '.join(sorted(names))}")
    chosen = [c for c in cases if not args.case or c[0] in args.case]
    os.environ["WILLITFIT_CACHE"] = tempfile.mkdtemp(prefix=cache_prefix)   # every profile derived from scratch
    ok = True
    for case in chosen:
        try:
            good, line = run_case(case)
        except ValueError as e:
            good, line = False, f"{case[0]:{width}s} REFUSED  {e}"
        ok &= good
        print(line, flush=True)
    return 0 if ok else 1
