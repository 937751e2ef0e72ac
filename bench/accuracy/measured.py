"""The measured tier's own checks, for docs/accuracy.md: what was measured, whether the verdict called each OOM,
and the device overhead fitted on measured rows with leave-one-model-out figures.

    from bench.accuracy import measured
    lines = measured.section(db_path)     # markdown lines; [] when the database holds no measured row

The verdict check uses every measured row, OOM rows included (report.load_runs drops those): the estimate's
device bytes (reserved + CUDA context and kernel images + NCCL) against the memory the row's GPU reported
(`gpu_total_bytes`, cudaMemGetInfo's total), as the verdict sets them against each other.
"""
from __future__ import annotations

import re
import statistics

import pandas as pd

from bench.accuracy import calibrate
from bench.accuracy.report import driver_reserve, row_estimate
from bench.store import db
from bench.store.rows import compute_run_id
from bench.store.app_data import comparable_allocated_bytes
from estimator.store import ProfileMissing
from estimator.units import GiB

FIRST_CASE = re.compile(r"reused process: case 1 of this worker")


def measured_runs(db_path=None, wait_s: float = db.DEFAULT_WAIT_S) -> pd.DataFrame:
    """Every measured row, OOM rows included."""
    return db.fetch_runs({"source": ["measured"]}, db_path=db_path, limit=None, wait_s=wait_s)


def _fresh(row: dict) -> bool:
    """Measured as the first (or only) case of its process: no kernels loaded by earlier cases in its NVML."""
    notes = row.get("notes") or ""
    return "reused process" not in notes or bool(FIRST_CASE.search(notes))


def overhead_bytes(row: dict) -> int | None:
    """What the device held beyond the caching allocator at the reserved peak (context + kernel images), in the
    frame of cudaMemGetInfo's total: NVML's used minus the driver's reserve, minus the reserved peak."""
    used, reserved = row.get("nvml_used_bytes"), row.get("peak_reserved_bytes")
    if row.get("oom") or not isinstance(used, (int, float)) or not isinstance(reserved, (int, float)) or used != used:
        return None
    return int(used) - driver_reserve(row) - int(reserved)


def _estimates(runs: pd.DataFrame) -> list[tuple[dict, object]]:
    """(row, estimate) for each row whose class has a profile on disk (nothing is derived here)."""
    out = []
    for row in runs.to_dict("records"):
        try:
            out.append((row, row_estimate(row, calibrate.model_from_row(row), derive=False)))
        except (ProfileMissing, ValueError, TypeError):
            continue
    return out


STAGES = ("load", "forward", "backward", "optimizer", "prefill", "decode")


def stage_gaps(row: dict, est) -> dict[str, int]:
    """{stage: the row's allocated peak in that stage minus the estimate's (`Estimate.allocated_at`: its tensors
    and cuBLAS workspaces)} for each stage the row measured and the estimate has."""
    have = dict(est.stages)
    out = {}
    for stage in STAGES:
        v = row.get(f"{stage}_peak_alloc_bytes")
        if stage in have and isinstance(v, (int, float)) and v == v and v > 0:
            out[stage] = int(v) - est.allocated_at(stage)
    return out


def _stage_gaps(pairs) -> list[str]:
    """Per (mode, stage) over the rows that ran: the spread of measured minus estimated allocated bytes."""
    gaps: dict[tuple[str, str], list[tuple[int, str]]] = {}
    for row, est in pairs:
        if not row.get("oom"):
            for stage, g in stage_gaps(row, est).items():
                gaps.setdefault((row["mode"], stage), []).append((g, row["model_name"]))
    if not gaps:
        return []
    lines = ["Each measured row that ran, each stage it measured: its allocated peak (`torch.cuda.max_memory_allocated`"
             " over the stage) minus the estimate's for that stage (`Estimate.allocated_at`: tensors plus the stage's "
             "cuBLAS workspaces, none at load, one in inference, two in training; bench.accuracy.measured.stage_gaps)."
             " Positive: the GPU allocated more. MB = 10^6 bytes.", "",
             "| mode | stage | rows | min MB | median MB | max MB (model) |", "|---|---|---:|---:|---:|---|"]
    order = {s: i for i, s in enumerate(STAGES)}
    for (mode, stage), v in sorted(gaps.items(), key=lambda kv: (kv[0][0] != "train", order[kv[0][1]])):
        v.sort()
        lines.append(f"| {mode} | {stage} | {len(v)} | {v[0][0] / 1e6:+.3f} | {statistics.median(g for g, _ in v) / 1e6:+.3f}"
                     f" | {v[-1][0] / 1e6:+.3f} ({v[-1][1]}) |")
    return lines + [""]


def _gib(x: float) -> str:
    return f"{x / GiB:.2f}"


def _overview(runs: pd.DataFrame) -> list[str]:
    gpus = ", ".join(sorted(set(runs["gpu_name"].dropna())))
    versions = sorted({f"torch {r.torch_version}, transformers {r.transformers_version}, driver {r.driver_version}"
                       for r in runs.itertuples()})
    by = runs.assign(alloc=runs["alloc_conf"].fillna("").replace("", "default"))
    table = by.groupby(["model_name", "mode", "alloc"]).agg(rows=("run_id", "size"), oom=("oom", "sum"))
    lines = ["| model | mode | allocator | rows | of which OOM |", "|---|---|---|---:|---:|"]
    lines += [f"| {m} | {mode} | {a} | {r.rows} | {int(r.oom)} |" for (m, mode, a), r in table.iterrows()]
    return [f"{len(runs)} measured rows ({int(runs['oom'].sum())} OOM) on {gpus}; {'; '.join(versions)}. "
            "Made with `python scripts/measure_plan.py` (one worker process per model and allocator setting, "
            "`--reuse-process`, docs/measuring.md); the rows are in `data/measured/`.", "", *lines, ""]


_OOM = re.compile(r"Tried to allocate ([\d.]+) ([GMK]iB).*?Of the allocated memory ([\d.]+) ([GMK]iB) is allocated by "
                  r"PyTorch, and ([\d.]+) ([GMK]iB) is reserved by PyTorch but unallocated", re.S)
_UNIT = {"KiB": 2**10, "MiB": 2**20, "GiB": 2**30}


def oom_need(message) -> tuple[int, int, int] | None:
    """From torch's OOM message: (bytes the tensors needed = allocated + the failed request, bytes reserved but
    unallocated at that moment, the rounding of the first: torch prints two decimals), or None when it does not
    say."""
    m = _OOM.search(message) if isinstance(message, str) else None  # None or NaN: no message stored
    if m is None:
        return None
    b = [float(m.group(i)) * _UNIT[m.group(i + 1)] for i in (1, 3, 5)]
    rounding = 0.005 * (_UNIT[m.group(2)] + _UNIT[m.group(4)])
    return int(b[1] + b[0]), int(b[2]), int(rounding)


def _verdicts(pairs) -> list[str]:
    """Each row's verdict against whether it ran out of memory on the GPU."""
    table = {(v, oom): 0 for v in ("fits", "tight", "oom") for oom in (False, True)}
    wrong = []
    for row, est in pairs:
        total = row.get("gpu_total_bytes")
        if not isinstance(total, (int, float)):
            continue
        v = est.verdict(int(total))
        table[v, bool(row["oom"])] += 1
        if v == "tight" or (v == "oom") != bool(row["oom"]):
            wrong.append((row, est, int(total), v))
    needs = [(comparable_allocated_bytes(est, "measured"), oom_need(row.get("oom_message")))
             for row, est in pairs if row["oom"]]
    needs = [(a, n[0], n[2]) for a, n in needs if n is not None]
    below = [(a, n) for a, n, r in needs if a < n - r]  # the failing request proves the peak was at least n
    n = sum(table.values())
    out = [f"Each of the {n} measured rows with a profile on disk, OOM rows included: the verdict from the estimate "
           "(device bytes against the memory the GPU reported, `gpu_total_bytes`) against what the GPU did. "
           "'tight': the tensors fit but the allocator's cache, as estimated, does not; the allocator then frees "
           "its cached blocks and retries, so fragmentation decides.", "",
           "| verdict | ran | ran out of memory |", "|---|---:|---:|"]
    out += [f"| {v} | {table[v, False]} | {table[v, True]} |" for v in ("fits", "tight", "oom")]
    if needs:
        worst = max((n - a) / n for a, n in below) if below else 0.0
        tail = f"; below it in {len(below)}, by at most {worst:.2%}." if below else "."
        out += ["", "An OOM row's message proves a lower bound on its true peak: the bytes allocated when the request "
                "failed plus the request. The estimate here includes the stage's cuBLAS workspaces, as in the "
                f"measured-allocated tier. On {len(needs)} OOM rows the estimate's allocated peak was at or above "
                f"that bound (within the message's two decimals) in {len(needs) - len(below)}{tail}"]
    if wrong:
        out += ["", "The rows called tight or called wrongly:", "",
                "| model | mode | method | recipe | ckpt | batch | seq | verdict | GPU said | estimate: allocated / "
                "device (GiB) | GPU memory (GiB) | measured: allocated / reserved peak (GiB) |",
                "|---|---|---|---|---|---:|---:|---|---|---:|---:|---:|"]
        for row, est, total, v in wrong:
            said = f"OOM in {row['oom_stage']}" if row["oom"] else "ran"
            need = oom_need(row.get("oom_message")) if row["oom"] else None
            if need is not None:  # what torch said it needed, and what its cache held that could not serve it
                said += f" (tensors needed {_gib(need[0])}; {_gib(need[1])} reserved but unusable)"
            out.append(f"| {row['model_name']} | {row['mode']} | {row['method']} | {row['recipe']} | "
                       f"{row['checkpointing']} | {row['batch']} | {row['seq']} | {v} | {said} | "
                       f"{_gib(comparable_allocated_bytes(est, 'measured'))} / {_gib(est.device_bytes)} | {_gib(total)} | "
                       f"{_gib(row['peak_alloc_bytes'] or 0)} / {_gib(row['peak_reserved_bytes'] or 0)} |")
    return [*out, ""]


def _overhead_loo(pairs) -> list[str]:
    """The device overhead beyond the allocator fitted on the other models' fresh-process training rows, applied
    to each held-out model's rows: its device error with that constant in place of the shipped one."""
    fresh = [(r, overhead_bytes(r)) for r, _ in pairs if r["mode"] == "train" and _fresh(r)]
    fresh = [(r, o) for r, o in fresh if o is not None]
    models = sorted({r["model_name"] for r, _ in fresh})
    if len(models) < 2:
        return ["Fewer than two models have fresh-process training rows: no leave-one-model-out fit.", ""]
    lines = ["| held-out model | constant from the others (MiB) | its rows | median abs error, device | worst |",
             "|---|---:|---:|---:|---:|"]
    for held in models:
        others = [o for r, o in fresh if r["model_name"] != held]
        const = int(statistics.median(others))
        errs = []
        for row, est in pairs:
            if row["model_name"] != held or row["oom"] or not row.get("nvml_used_bytes"):
                continue
            pred = row_estimate(row, calibrate.model_from_row(row), derive=False, cuda_context_bytes=const).device_bytes
            truth = row["nvml_used_bytes"] - driver_reserve(row)
            errs.append(abs(pred - truth) / truth)
        if errs:
            lines.append(f"| {held} | {const / 2**20:.1f} | {len(errs)} | {statistics.median(errs):.1%} | "
                         f"{max(errs):.1%} |")
    values = sorted({o for _, o in fresh})
    spread = (f"every one of them {values[0]:,} B" if len(values) == 1 else
              f"from {values[0]:,} to {values[-1]:,} B")
    return [f"`data/cuda_context.json` carries one constant fitted on measured rows: the Hopper 'step' entry, what "
            f"the device held beyond the caching allocator (NVML used, less the driver's reserve that "
            f"cudaMemGetInfo's total leaves out, minus the reserved peak) in the {len(fresh)} "
            f"training rows that were the first case of their process ({spread}). Left out one model at a time, "
            "the constant from the other models prices the held-out model's device bytes as follows (the "
            "estimate's reserved bytes are the shipped ones; nothing else is refitted):", "", *lines, ""]


def _case_id(row: dict) -> str:
    """The row's run_id as if no GPU were named (bench.store.rows.compute_run_id: the store's one definition of what
    was run): equal for the same case measured on two GPUs. The database gives missing values as NaN; the ids were
    computed on None."""
    clean = {k: (None if isinstance(v, float) and v != v else v) for k, v in row.items()}
    return compute_run_id({**clean, "gpu_name": None})


def _repeats(runs: pd.DataFrame) -> list[str]:
    """The cases measured on more than one GPU: whether their peaks agree to the byte. The allocator's decisions
    depend on the requests alone, not on the card, so a difference says something changed between the runs (the
    tool's load stage, what an earlier case in the same process left in the cache)."""
    groups: dict[tuple, list[dict]] = {}
    for row in runs.to_dict("records"):
        groups.setdefault(_case_id(row), []).append(row)
    pairs = [g for g in groups.values() if len({r["gpu_name"] for r in g}) > 1]
    if not pairs:
        return []
    both = [g for g in pairs if not any(r["oom"] for r in g)]
    alloc = sum(len({r["peak_alloc_bytes"] for r in g}) == 1 for g in both)
    reserved = sum(len({r["peak_reserved_bytes"] for r in g}) == 1 for g in both)
    split = [g for g in pairs if len({bool(r["oom"]) for r in g}) > 1]
    lines = [f"{len(pairs)} cases were measured on more than one GPU (same model, workload, allocator setting, torch "
             f"and transformers). {len(both)} ran on every GPU: the allocated peak was the same to the byte in "
             f"{alloc} and the reserved peak in {reserved}; {len(split)} ran out of memory on one GPU and not on "
             "the larger one. The cases whose peaks differ:", "",
             "| model | workload | batch | seq | GPUs | tool versions | allocated difference (B) | reserved difference "
             "(B) | case i of its process |", "|---|---|---:|---:|---|---|---:|---:|---|"]
    name = lambda r: (f"{r['mode']} {r['method']} {r['recipe']} ckpt={r['checkpointing']}"  # noqa: E731
                      f"{'' if r['mode'] == 'infer' else ' ' + str(r['optimizer_impl'])}")
    for g in both:
        a = [int(r["peak_alloc_bytes"]) for r in g]
        r_ = [int(r["peak_reserved_bytes"]) for r in g]
        if len(set(a)) == 1 and len(set(r_)) == 1:
            continue
        cases = ", ".join(m.group(1) if (m := re.search(r"case (\d+) of this worker", r.get("notes") or "")) else "1"
                          for r in g)
        lines.append(f"| {g[0]['model_name']} | {name(g[0])} | {g[0]['batch']} | {g[0]['seq']} | "
                     f"{' / '.join(r['gpu_name'] for r in g)} | {' / '.join(str(r['tool_version']) for r in g)} | "
                     f"{max(a) - min(a):,} | {max(r_) - min(r_):,} | {cases} |")
    return [*lines, ""]


def section(db_path=None, wait_s: float = db.DEFAULT_WAIT_S) -> list[str]:
    """The measured tier's section of docs/accuracy.md; [] when there is no measured row."""
    runs = measured_runs(db_path, wait_s)
    if runs.empty:
        return []
    pairs = _estimates(runs)
    return ["## Measured tier: what was measured, the verdict at the OOM cliff, and the one fitted constant", "",
            *_overview(runs), *(["### The same case on two GPUs", "", *rep] if (rep := _repeats(runs)) else []),
            *(["### Stage by stage: allocated bytes", "", *gaps] if (gaps := _stage_gaps(pairs)) else []),
            "### Will it fit? The verdict against the GPU", "", *_verdicts(pairs),
            "### Device overhead, leave-one-model-out", "", *_overhead_loo(pairs)]
