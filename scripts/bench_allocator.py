"""Time the caching-allocator model: replay of a synthetic 1,000,000-event allocation stream on one core.

    python scripts/bench_allocator.py            # print the figures and write them into docs/performance.md
    python scripts/bench_allocator.py --no-write # print only
    python scripts/bench_allocator.py --events 200000 --repeats 1 --no-write   # quicker

The stream imitates training steps (a seeded generator, no data needed): weights and optimizer state allocated
once; per step a forward that allocates activations (stack-like lifetimes, some freed early), a backward that
frees them in reverse while allocating and freeing gradients and temporaries, and an optimizer update. Sizes:
about 55% small (<= 1 MiB, the small pool), 30% in (1 MiB, 10 MiB) and 15% above, log-uniform within each
band. Each figure is the median of --repeats timed runs after one burn-in replay of a 50,000-event prefix
(imports, first allocations); `time.perf_counter`. Target: a 1,000,000-event replay in < 2 s. The
`## Allocator replay` section of docs/performance.md is replaced; the file's other sections are left as they are.
"""
from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from scripts.perf_doc import replace_section  # noqa: E402
from estimator.alloc_conf import parse_alloc_conf  # noqa: E402
from offline.allocator.replay import oom_capacity, replay  # noqa: E402
from offline.allocator.stream import Stream  # noqa: E402
from estimator.units import GiB, MiB  # noqa: E402

SECTION = "## Allocator replay"
LOAD_AT_START = os.getloadavg()[0]


def _sizes(rng: np.random.Generator, n: int) -> np.ndarray:
    """Request sizes: 55% in [16 B, 1 MiB], 30% in (1 MiB, 10 MiB), 15% in [10 MiB, 256 MiB], log-uniform."""
    band = rng.choice(3, size=n, p=[0.55, 0.30, 0.15])
    lo = np.array([16, MiB + 1, 10 * MiB])[band]
    hi = np.array([MiB, 10 * MiB - 1, 256 * MiB])[band]
    return np.exp(rng.uniform(np.log(lo), np.log(hi))).astype(np.int64)


def synthetic_stream(n_events: int, seed: int = 0) -> Stream:
    """A training-like stream of exactly n_events events (see the module docstring)."""
    rng = np.random.default_rng(seed)
    kinds, handles, sizes, stages = [], [], [], []
    live: dict[int, int] = {}
    next_handle = 0
    pool = iter(_sizes(rng, 4 * n_events + 1000).tolist())

    def alloc(stage: int, size: int | None = None) -> int:
        nonlocal next_handle
        h = next_handle
        next_handle += 1
        size = next(pool) if size is None else size
        live[h] = size
        kinds.append(0), handles.append(h), sizes.append(size), stages.append(stage)
        return h

    def free(h: int, stage: int) -> None:
        kinds.append(1), handles.append(h), sizes.append(live.pop(h)), stages.append(stage)

    for _ in range(200):                          # weights and optimizer state: live to the end
        alloc(0)
    while len(kinds) < n_events:
        acts = []
        for _ in range(int(rng.integers(300, 600))):          # forward
            acts.append(alloc(1))
            if len(acts) > 2 and rng.random() < 0.3:           # a temporary freed soon after
                free(acts.pop(-2), 1)
        grads = []
        while acts:                                            # backward: activations die in reverse
            free(acts.pop(), 2)
            t = alloc(2)
            if rng.random() < 0.5:
                free(t, 2)
            else:
                grads.append(t)
        for g in grads:                                         # optimizer step, then gradients freed
            free(g, 3)
    n = n_events
    # cut at n events: frees whose alloc fell beyond the cut cannot exist (allocs come first), so the prefix is valid
    return Stream(np.array(kinds[:n], np.int8), np.array(handles[:n], np.int64), np.array(sizes[:n], np.int64),
                  np.array(stages[:n], np.int16), ("weights", "forward", "backward", "optimizer"),
                  {"source": "synthetic", "generator": "scripts/bench_allocator.py", "seed": seed})


def _time(fn, repeats: int) -> tuple[float, object]:
    """Median wall seconds over `repeats` calls, and the last result."""
    return _time_cpu(fn, repeats)[0::2]


def _time_cpu(fn, repeats: int) -> tuple[float, float, object]:
    """Median wall and CPU (this process) seconds over `repeats` calls, and the last result."""
    wall, cpu, out = [], [], None
    for _ in range(repeats):
        c0, t0 = time.process_time(), time.perf_counter()
        out = fn()
        wall.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    return statistics.median(wall), statistics.median(cpu), out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--events", type=int, default=1_000_000, help="events in the synthetic stream")
    ap.add_argument("--repeats", type=int, default=3, help="timed runs per figure (median reported)")
    ap.add_argument("--no-write", action="store_true", help="print only; leave docs/performance.md alone")
    args = ap.parse_args()

    t0 = time.perf_counter()
    stream = synthetic_stream(args.events)
    t_gen = time.perf_counter() - t0
    small = Stream(stream.kind[:50_000], stream.handle[:50_000], stream.nbytes[:50_000], stream.stage[:50_000],
                   stream.stage_names, stream.meta)
    replay(small)                                               # burn-in
    configs = {"default": parse_alloc_conf(""), "expandable_segments:True": parse_alloc_conf(
        "expandable_segments:True"), "max_split_size_mb:128,roundup_power2_divisions:4": parse_alloc_conf(
        "max_split_size_mb:128,roundup_power2_divisions:4")}
    rows = []
    for name, cfg in configs.items():
        t, t_cpu, r = _time_cpu(lambda: replay(stream, cfg), args.repeats)
        rows.append((name, t, t_cpu, r))
        print(f"{name}: {t:.3f} s wall, {t_cpu:.3f} s CPU; peak allocated "
              f"{r.overall.peak_allocated_bytes / GiB:.3f} GiB, reserved {r.overall.peak_reserved_bytes / GiB:.3f} GiB")
    t_save, _ = _time(lambda: stream.save("/tmp/bench_allocator_stream.npz"), 1)
    t_load, _ = _time(lambda: Stream.load("/tmp/bench_allocator_stream.npz"), args.repeats)
    n_oom = min(args.events, 100_000)
    sub = Stream(stream.kind[:n_oom], stream.handle[:n_oom], stream.nbytes[:n_oom], stream.stage[:n_oom],
                 stream.stage_names, stream.meta)
    t_cap, cap = _time(lambda: oom_capacity(sub), 1)
    print(f"generate {t_gen:.2f} s, save {t_save:.2f} s, load+validate {t_load:.3f} s, "
          f"oom_capacity on {n_oom:,} events {t_cap:.2f} s -> {cap / GiB:.3f} GiB")
    if not args.no_write:
        replace_section(SECTION, _section(args, stream, rows, t_load, n_oom, t_cap, cap))
        print("wrote the section", SECTION, "of docs/performance.md")


def _section(args, stream, rows, t_load, n_oom, t_cap, cap) -> str:
    n = len(stream)
    small = float(np.mean(stream.nbytes[stream.kind == 0] <= MiB))
    lines = [SECTION, "",
             f"Measured by `python scripts/bench_allocator.py` on CPython {platform.python_version()}, NumPy "
             f"{np.__version__}, one core of 2 (x86_64; CPU = `time.process_time` of this process); median of {args.repeats} runs after a burn-in, "
             f"`time.perf_counter`. 1-minute load average when it started: {LOAD_AT_START:.1f} (other processes "
             f"share these cores, which slows every figure).", "",
             f"Stream: {n:,} synthetic training-like events ({int((stream.kind == 0).sum()):,} allocations, "
             f"{small:.0%} of them small, <= 1 MiB; see the script's docstring). Target: replay in < 2 s.", "",
             "| config (PYTORCH_CUDA_ALLOC_CONF) | `replay()` wall | CPU | events/s (wall) | peak allocated | "
             "peak reserved | device allocs |", "|---|---:|---:|---:|---:|---:|---:|"]
    for name, t, t_cpu, r in rows:
        lines.append(f"| `{name}` | {t:.2f} s | {t_cpu:.2f} s | {n / t:,.0f} | "
                     f"{r.overall.peak_allocated_bytes / GiB:.3f} GiB | {r.overall.peak_reserved_bytes / GiB:.3f} GiB "
                     f"| {r.overall.device_allocs:,} |")
    missed = [name for name, t, _, _ in rows if t >= 2.0]
    lines += ["", ("Over the 2 s target (wall) in this run: " + ", ".join(f"`{m}`" for m in missed) + ".")
              if missed else "All under the 2 s target (wall) in this run.", "",
              f"Loading and validating the stream file (`Stream.load`, .npz, every check of "
              f"offline/allocator/stream.py): {t_load:.3f} s. `oom_capacity` (bisection, one replay per step, "
              f"no timeline) on the first {n_oom:,} events: {t_cap:.2f} s, answer {cap / GiB:.3f} GiB."]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
