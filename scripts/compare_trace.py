"""Compare traced rows (JSONL from `python -m bench trace --out`) with the analytic estimate, stage by stage.

    python scripts/compare_trace.py runs.jsonl

Prints the relative error of the analytic per-stage peak (without CUDA overhead) against each traced stage peak.
"""
import json, sys
from estimator.model import from_hf_config
from estimator.estimate import estimate
from estimator.spec import Workload
from dataclasses import fields
wf = {f.name for f in fields(Workload)}
for line in open(sys.argv[1]):
    r = json.loads(line)
    kw = {k: r[k] for k in wf if r.get(k) is not None}
    kw["lora_targets"] = tuple(kw["lora_targets"].split(",")) if kw.get("lora_targets") else ("q_proj","v_proj")
    if kw.get("mode") == "infer": kw.pop("grad_accum", None)
    try:
        w = Workload(**kw)
    except ValueError as e:
        print("skip", e); continue
    m = from_hf_config(json.loads(r["config_json"]) if isinstance(r["config_json"], str) else r["config_json"], r["model_name"])
    e = estimate(m, w)
    parts = []
    for st, b in e.stages:
        t = r.get(f"{st}_peak_alloc_bytes")
        a = b.total - b.overhead
        if t: parts.append(f"{st}:{(a-t)/t*100:+.1f}%")
    tot = r["peak_alloc_bytes"]; a = e.total_bytes - e.components.overhead
    print(f"{r['model_name']:13s} {w.mode} {w.method:4s} {w.recipe:4s} {w.attention:5s} ck={w.checkpointing:9s} peak err {(a-tot)/tot*100:+6.2f}%  ", " ".join(parts))
