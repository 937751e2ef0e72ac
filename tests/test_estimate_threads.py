"""Estimates from many threads at once (an app server's sessions) get each its own answer.

The evaluator memoises per workload class (profiles, stage plans), and the memoised objects are shared by every
caller in the process; nothing per call may be written onto them. The k form (Options(activation_k=...)) is the
path whose bytes depend on batch x seq inside a breakdown: before the house's one evaluation path, its sizes
were written onto a shared memoised object, so two threads could read each other's.
"""
from __future__ import annotations

import itertools
from concurrent.futures import ThreadPoolExecutor

from estimator.estimate import Options, clear_caches, estimate
from estimator.model import from_hf_config
from estimator.presets import load_config
from estimator.spec import Parallel, Workload

SIZES = [(b, s) for b in (1, 2, 3, 5, 8) for s in (128, 512, 2048, 4096)]
OPTIONS = (Options(derive=False), Options(derive=False, activation_k=17.0))


def _case(model, b, s, opts):
    e = estimate(model, Workload(batch=b, seq=s), Parallel(), opts)
    return e.stages, e.total_bytes, e.peak_moment


def test_threads_get_the_sequential_answers():
    model = from_hf_config(load_config("llama-3.2-1b")[1], "llama-3.2-1b", derive=False)
    cases = [(b, s, o) for (b, s), o in itertools.product(SIZES, OPTIONS)]
    clear_caches()
    expected = {c: _case(model, *c) for c in cases}
    # the k form really depends on the sizes inside a breakdown: otherwise this test could not fail
    k_acts = {expected[(b, s, OPTIONS[1])][0][1][1].activations for b, s in SIZES}
    assert len(k_acts) == len({b * s for b, s in SIZES}) > 1
    for _ in range(3):
        clear_caches()  # every round starts cold, so threads also race to fill the memos
        work = cases * 6
        with ThreadPoolExecutor(max_workers=8) as pool:
            got = list(pool.map(lambda c: (c, _case(model, *c)), work))
        wrong = [c for c, answer in got if answer != expected[c]]
        assert not wrong, f"{len(wrong)} of {len(got)} threaded estimates differ, e.g. {wrong[:3]}"
