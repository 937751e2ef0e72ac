"""A derivation's candidate ticks (tracer.ticks._candidates) against the counter's own stage peaks."""
from __future__ import annotations

import numpy as np
import pytest

from estimator.profile.profile import CATEGORIES

pytest.importorskip("torch")

from tracer.counters import Timeline  # noqa: E402
from tracer.extend import STEP_MAX  # noqa: E402
from tracer.ticks import _candidates  # noqa: E402


def _timeline(events: list[tuple[int, int, str]], marks: tuple) -> Timeline:
    """Ticks 1..n: (kind +1/-1, bytes, category) each; tick 0 is the empty start."""
    n = len(events)
    kind = np.zeros(n + 1, dtype=np.int8)
    nbytes = np.zeros(n + 1, dtype=np.int64)
    cat = np.zeros(n + 1, dtype=np.int8)
    for t, (k, b, c) in enumerate(events, start=1):
        kind[t], nbytes[t], cat[t] = k, b, CATEGORIES.index(c)
    return Timeline(kind, nbytes, cat, np.arange(n + 1), marks, ())


def _step_max(tl: Timeline) -> int:
    ticks = _candidates(tl, train=True)
    return int(ticks.values[ticks.keys.index(STEP_MAX)].sum())


def test_an_optimizer_step_that_allocates_nothing_peaks_at_its_entry():
    """Plain SGD updates in place: its stage's only events free the gradients (zero_grad). The counter's stage peak
    is the entry, gradients alive (counters.mark_stage); the profile's was the stage's end, one gradient copy low."""
    events = [(1, 100, "weights"),                                # load
              (1, 40, "activations"), (1, 100, "gradients"),      # forward, backward
              (-1, 40, "activations"),
              (-1, 100, "gradients")]                             # optimizer: zero_grad(set_to_none=True)
    tl = _timeline(events, ((1, "load"), (2, "forward"), (4, "backward"), (5, "optimizer")))
    assert _step_max(tl) == 200


def test_an_optimizer_step_that_allocates_peaks_at_its_largest_tick():
    events = [(1, 100, "weights"), (1, 40, "activations"), (1, 100, "gradients"), (-1, 40, "activations"),
              (1, 200, "optimizer_states"), (1, 30, "activations"), (-1, 30, "activations"), (-1, 100, "gradients")]
    tl = _timeline(events, ((1, "load"), (2, "forward"), (4, "backward"), (8, "optimizer")))
    assert _step_max(tl) == 430
