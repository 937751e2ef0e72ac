"""`python -m tracer.derive_job`: derive one profile into the user's cache in a process of its own.

The app's background derivations run here (pages/_derive.py), not in a thread of the server: in a process with no
other thread a derivation's traces can fork (tracer.forked: W cores at once), torch's global state and the
tracer's memory stay out of the server, and cancelling a derivation is ending its process.

Reads one JSON object on stdin: {"config": {...}, "name": "...", "workload": {...}, "parallel": {...}}, the class
`estimator.estimate.evaluated_class` names, each as `estimator.spec.spec_dict` writes it (with context parallelism
both derived CP ranks' profiles, with a traced pipeline every rank's, one after the other: store.class_ranks).
Writes one JSON line on stdout per trace ({"done", "total", "message"}), then {"ok": true, "where": ...} when the
profile is on disk, or
{"error": "..."}, the one line a refused derivation raises (ValueError). Anything else is a crash: its traceback on
stderr, exit status 1.
"""
from __future__ import annotations

import json
import sys

from estimator import knobs, store
from estimator.spec import Parallel


_OUT = sys.stdout  # this process's messages only: anything else printed (a library's print) goes to stderr


def _say(msg: dict) -> None:
    _OUT.write(json.dumps(msg, separators=(",", ":")) + "\n")
    _OUT.flush()


def main() -> int:
    sys.stdout = sys.stderr
    job = json.loads(sys.stdin.read())
    if not isinstance(job, dict) or not {"config", "name", "workload", "parallel"} <= set(job):
        _say({"error": "job: one JSON object with config, name, workload and parallel"})
        return 2
    try:
        w = knobs.workload_from_row(job["workload"])
        p = Parallel(**job["parallel"])
        ranks = store.class_ranks(p)   # a pipeline's or a CP group's ranks: each a profile of its own
        for r in ranks:
            label = f"{'cp' if p.cp > 1 else 'pp'} rank {r}: " if len(ranks) > 1 else ""
            store.profile(job["config"], w, p, name=str(job["name"]), derive=True, pp_rank=r,
                          progress=lambda done, total, message, label=label: _say(
                              {"done": done, "total": total, "message": label + message}))
    except ValueError as e:
        _say({"error": " ".join(str(e).split())})
        return 0
    _say({"ok": True})
    return 0


if __name__ == "__main__":
    sys.exit(main())
