"""Cold estimates: how long `python -m estimator` takes for a workload nobody has estimated before.

    python scripts/bench_cold.py                       # the whole grid (an hour or more on 2 cores); writes
                                                       # docs/bench_cold.json and the "## Cold estimates" section
                                                       # of docs/performance.md
    python scripts/bench_cold.py --limit 2             # the first two pairs, printed only
    python scripts/bench_cold.py --only 'olmo2|qlora'  # pairs whose name matches the regex
    python scripts/bench_cold.py --list                # the grid, no runs

Each (model, knob combination) pair of the fixed grid (scripts/bench_cold_grid.py: at least 40, none shipped in
data/profiles/; a shipped one is refused before anything runs) runs in a fresh process, `python -m estimator
--model M <flags> --json`, with an empty WILLITFIT_CACHE temp dir, no WILLITFIT_PROFILES bank and HF_HUB_OFFLINE=1:
what a user waits for on first use (the inventory of a non-preset model, the profile's derivation, the estimate,
the GPU verdict, max batch / seq and, on OOM, the advice rows). Wall time is perf_counter around the process; CPU
time the getrusage(RUSAGE_CHILDREN) user + system delta. A pair past --timeout is killed (its process group) and
recorded as timed out. The issue's targets ("Exact and instant"): median <= 1 s, p95 <= 3 s, max <= 5 s, wall and
CPU alike; the report says "missed" where missed.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import re
import resource
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import replace
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from estimator import cli, knobs, store  # noqa: E402
from estimator.estimate import profile_where, traced_class  # noqa: E402
from tracer import forked  # noqa: E402  (how many processes a derivation traces in; imports no torch)
from estimator.model import from_hf_config  # noqa: E402
from estimator.presets import load_config  # noqa: E402
from scripts.bench_cold_grid import CONFIG_DIR, GRID, NON_PRESET_TYPES, Pair  # noqa: E402
from scripts.perf_doc import replace_section  # noqa: E402

SECTION = "## Cold estimates"
RESULTS = ROOT / "docs" / "bench_cold.json"
TARGETS_S = {"median": 1.0, "p95": 3.0, "max": 5.0}
DEFAULT_TIMEOUT_S = 600


def parse_pair(pair: Pair):
    """(Workload, Parallel) of a pair's flags, parsed as the CLI parses them (no model loaded, nothing derived);
    ValueError naming the field for a bad combination, SystemExit(2) for a flag argparse refuses."""
    args = cli.build_parser().parse_args(pair.argv())
    return knobs.workload_from_args(args), cli.parallel_from_args(args)


def shipped_where(pair: Pair) -> str | None:
    """'shipped' when the profile the pair's estimate evaluates is in data/profiles/ (the pair is not cold), else
    None. A preset's inventory is shipped: `profile_where` answers exactly (with the attention estimate() runs).
    A non-preset model has no inventory yet: its traced class is checked as given and with eager attention."""
    w, p = parse_pair(pair)
    config = load_config(pair.model_arg)[1]
    if pair.model not in NON_PRESET_TYPES:
        return "shipped" if profile_where(from_hf_config(config, pair.model, derive=False), w, p) == "shipped" \
            else None
    for attention in dict.fromkeys((w.attention, "eager")):
        tw, tp, _ = traced_class(replace(w, attention=attention), p)
        if store.where(config, key=store.profile_key(tw, tp)) == "shipped":
            return "shipped"
    return None


def write_configs() -> None:
    """config.json of each NON_PRESET_TYPES model from transformers' own config class (offline)."""
    from transformers import AutoConfig

    CONFIG_DIR.mkdir(parents=True, exist_ok=True)
    for t in NON_PRESET_TYPES:
        text = json.dumps(AutoConfig.for_model(t).to_dict(), indent=2, sort_keys=True) + "\n"
        (CONFIG_DIR / f"{t}.json").write_text(text)
        print(f"wrote {CONFIG_DIR / f'{t}.json'}")


def _child_cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def run_pair(pair: Pair, timeout_s: float) -> dict:
    """One cold estimate in a fresh process: wall, CPU, exit code, and what it answered."""
    with tempfile.TemporaryDirectory(prefix="bench-cold-") as cache:
        env = {k: v for k, v in os.environ.items() if k != "WILLITFIT_PROFILES"}
        env.update(WILLITFIT_CACHE=cache, HF_HUB_OFFLINE="1", PYTHONPATH=str(ROOT))
        cmd = [sys.executable, "-m", "estimator", *pair.argv()]
        cpu0, t0 = _child_cpu_s(), time.perf_counter()
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                start_new_session=True)  # its own process group: a timeout kills all of it
        timed_out = False
        try:
            out, err = proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            timed_out = True
            os.killpg(proc.pid, signal.SIGKILL)
            out, err = proc.communicate()
        wall, cpu = time.perf_counter() - t0, _child_cpu_s() - cpu0
    row = {"name": pair.name, "model": pair.model, "flags": list(pair.flags), "categories": list(pair.categories),
           "wall_s": round(wall, 3), "cpu_s": round(cpu, 3), "rc": proc.returncode, "timed_out": timed_out}
    if proc.returncode == 0 and not timed_out:
        row.update(_answer(json.loads(out)))
    else:
        row["error"] = (err.strip().splitlines() or ["(no stderr)"])[-1][:300]
    return row


def _answer(r: dict) -> dict:
    advice = r.get("advice", [])
    prof = r.get("profile") or {}
    return {"device_bytes": r["device_bytes"], "verdict": r.get("verdict"), "max_batch": r.get("max_batch"),
            "advice_rows": len(advice), "advice_priced": sum(1 for a in advice if a["priced"]),
            "advice_unpriced": [a["title"] for a in advice if not a["priced"]],
            "profile_traces": prof.get("traces"), "profile_seconds": prof.get("seconds"), "notes": len(r["notes"])}


def nearest_rank(values: list[float], q: float) -> float:
    """The q-quantile by nearest rank (the smallest value with at least q of the values at or below it)."""
    xs = sorted(values)
    return xs[max(0, math.ceil(q * len(xs)) - 1)]


def summary(rows: list[dict]) -> dict:
    """median / p95 / max of wall and CPU over every pair (a timed-out pair counts with its time at the kill)."""
    out = {}
    for what in ("wall_s", "cpu_s"):
        xs = [r[what] for r in rows]
        out[what] = {"median": statistics.median(xs), "p95": nearest_rank(xs, 0.95), "max": max(xs)}
    return out


PROBE_ITERATIONS = 10_000_000


def speed_probe_s() -> float:
    """CPU seconds one core takes for a fixed pure-Python loop (PROBE_ITERATIONS additions), best of 3: how fast
    this machine runs the interpreter today, so that runs on different days (or shared machines) compare."""
    best = math.inf
    for _ in range(3):
        t, x = time.process_time(), 0
        for i in range(PROBE_ITERATIONS):
            x += i
        best = min(best, time.process_time() - t)
    return round(best, 3)


def _commit() -> str | None:
    """The checkout's commit (with '+changes' when the tree differs from it), or None outside git."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              timeout=30).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                               capture_output=True, text=True, timeout=30).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return (head + ("+changes" if dirty else "")) or None


def _versions() -> dict:
    out = {"python": platform.python_version()}
    for pkg in ("torch", "transformers", "peft", "numpy"):
        try:
            out[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            out[pkg] = None
    return out


def _probe(m: dict) -> str:
    if m.get("speed_probe_s") is None:
        return "no speed probe recorded"
    return (f"this machine's speed probe (`speed_probe_s`: {PROBE_ITERATIONS:,} Python additions on one core, CPU "
            f"seconds, best of 3) read {m['speed_probe_s']:.2f} s")


def report_section(result: dict) -> str:
    m, s = result["machine"], result["summary"]
    lines = [SECTION, "",
             f"Measured by `{result['command']}` at commit {result.get('commit') or '(unknown)'} on {m['cores']} "
             f"CPU cores ({m['platform']}), {m.get('trace_workers', 1)} tracing process(es) per derivation "
             f"(tracer.forked, WILLITFIT_TRACE_WORKERS), "
             f"Python {m['versions']['python']}, torch {m['versions']['torch']}, transformers "
             f"{m['versions']['transformers']}; 1-minute load average {m['load_before'][0]:.2f} before, "
             f"{m['load_after'][0]:.2f} after; {_probe(m)}. Each pair ran `python -m estimator --model M <flags> "
             "--json` in a fresh "
             "process with an empty WILLITFIT_CACHE, no WILLITFIT_PROFILES bank, HF_HUB_OFFLINE=1 "
             f"(scripts/bench_cold_grid.py: {len(result['rows'])} pairs, none shipped); wall is the process's, CPU "
             f"its getrusage user + system; timeout {result['timeout_s']} s per pair. Results: docs/bench_cold.json.",
             "", "| | median | p95 | max |", "|---|---:|---:|---:|"]
    for what, label in (("wall_s", "wall (s)"), ("cpu_s", "CPU (s)")):
        cells = [f"{s[what][k]:.2f} ({'met' if s[what][k] <= TARGETS_S[k] else 'missed'})" for k in TARGETS_S]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    lines.append("| target | " + " | ".join(f"<= {v:g} s" for v in TARGETS_S.values()) + " |")
    n_to = sum(r["timed_out"] for r in result["rows"])
    n_err = sum(1 for r in result["rows"] if r["rc"] != 0 and not r["timed_out"])
    priced = sum(r.get("advice_priced", 0) for r in result["rows"])
    total = sum(r.get("advice_rows", 0) for r in result["rows"])
    lines += ["", f"{len(result['rows']) - n_to - n_err} answered, {n_err} failed, {n_to} timed out. Advice rows "
              f"(shown on OOM; priced only where their profile is on disk, estimator.cli.report): {priced} of "
              f"{total} priced." + _unpriced(result["rows"]), "",
              "| pair | model | wall s | CPU s | result | traces | advice priced |", "|---|---|---:|---:|---|---:|---:|"]
    for r in result["rows"]:
        res = "timed out" if r["timed_out"] else (r.get("verdict") or "answered") if r["rc"] == 0 else \
            f"rc {r['rc']}: {r.get('error', '')[:80]}"
        adv = f"{r['advice_priced']}/{r['advice_rows']}" if r.get("advice_rows") else ""
        lines.append(f"| {r['name']} | {r['model']} | {r['wall_s']:.2f} | {r['cpu_s']:.2f} | {res} | "
                     f"{r.get('profile_traces') or ''} | {adv} |")
    return "\n".join(lines) + "\n"


def _unpriced(rows: list[dict]) -> str:
    """The advice rows left unpriced, by kind (numbers in a row's title read N), most first."""
    kinds = Counter(re.sub(r"\d+(\.\d+)?", "N", t) for r in rows for t in r.get("advice_unpriced", ()))
    if not kinds:
        return ""
    return " Unpriced, by row: " + "; ".join(f"{k} ({n})" for k, n in kinds.most_common()) + "."


def select(only: str | None, limit: int | None) -> list[Pair]:
    pairs = [p for p in GRID if only is None or re.search(only, p.name)]
    return pairs[:limit] if limit else pairs


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S, help="seconds per pair before it is "
                    f"killed and recorded as timed out (default {DEFAULT_TIMEOUT_S})")
    ap.add_argument("--only", metavar="REGEX", help="run the pairs whose name matches (re.search)")
    ap.add_argument("--limit", type=int, metavar="N", help="run the first N selected pairs")
    ap.add_argument("--no-write", action="store_true", help="print only; a partial run (--only/--limit) never "
                    "writes docs/")
    ap.add_argument("--out", type=Path, help="write the results JSON here (a full run: docs/bench_cold.json)")
    ap.add_argument("--list", action="store_true", help="list the grid and exit")
    ap.add_argument("--write-configs", action="store_true", help="write the non-preset config.json files from "
                    "transformers' config classes and exit")
    args = ap.parse_args(argv)
    if args.timeout <= 0 or (args.limit is not None and args.limit < 1):
        ap.error("timeout: must be > 0 seconds; limit: must be >= 1")
    if args.write_configs:
        write_configs()
        return 0
    try:
        pairs = select(args.only, args.limit)
    except re.error as e:
        ap.error(f"only: not a regular expression ({e})")
    if not pairs:
        ap.error(f"only: {args.only!r} matches no pair; --list shows them")
    if args.list:
        for p in pairs:
            print(f"{p.name:<36} {' '.join(p.argv())}")
        return 0
    for p in pairs:  # refuse before anything runs
        if shipped_where(p) == "shipped":
            print(f"bench_cold: error: pair {p.name!r} is shipped in data/profiles/ (not a cold estimate); change it "
                  "in scripts/bench_cold_grid.py", file=sys.stderr)
            return 2
    full = len(pairs) == len(GRID)
    load_before = os.getloadavg()
    probe = speed_probe_s()
    rows = []
    for i, p in enumerate(pairs, 1):
        r = run_pair(p, args.timeout)
        rows.append(r)
        what = "TIMED OUT" if r["timed_out"] else (f"{r.get('verdict') or 'ok'}, advice priced "
                                                   f"{r.get('advice_priced', 0)}/{r.get('advice_rows', 0)}"
                                                   if r["rc"] == 0 else f"rc {r['rc']}: {r.get('error')}")
        print(f"[{i}/{len(pairs)}] {p.name}: {r['wall_s']:.2f} s wall, {r['cpu_s']:.2f} s CPU; {what}", flush=True)
    cmd = " ".join(["python scripts/bench_cold.py", *(argv if argv is not None else sys.argv[1:])])
    result = {"command": cmd, "timeout_s": args.timeout, "targets_s": TARGETS_S,
              "commit": _commit(),
              "machine": {"cores": os.cpu_count(), "trace_workers": forked.workers(), "platform": platform.platform(),
                          "versions": _versions(),
                          "load_before": load_before, "load_after": os.getloadavg(), "speed_probe_s": probe},
              "summary": summary(rows), "rows": rows}
    for what in ("wall_s", "cpu_s"):
        print(what, " ".join(f"{k} {v:.2f} s ({'met' if v <= TARGETS_S[k] else 'missed'})"
                             for k, v in result["summary"][what].items()))
    out = args.out or (RESULTS if full and not args.no_write else None)
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {out}")
    if full and not args.no_write:
        replace_section(SECTION, report_section(result))
        print(f"wrote the {SECTION!r} section of docs/performance.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
