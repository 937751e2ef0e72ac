"""Test-session settings: derived inventories and profiles go to a temporary cache, never the user's."""
from __future__ import annotations

import os

import pytest
from hypothesis import settings

# `bash .ci/run` sets HYPOTHESIS_PROFILE=ci: the property tests draw the same examples on every run, so a CI result
# is the code's, not the draw's. Run pytest directly (no profile) and each run draws new examples, to find bugs.
settings.register_profile("ci", derandomize=True, database=None)
if os.environ.get("HYPOTHESIS_PROFILE"):
    settings.load_profile(os.environ["HYPOTHESIS_PROFILE"])


SLOW = os.environ.get("WILLITFIT_SLOW", "") == "1"


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: the slow tier, run with WILLITFIT_SLOW=1 (each test derives a profile)")
    config.addinivalue_line("markers", "replays: derivations replay their siblings, as outside the tests (WILLITFIT_REPLAYS)")


def pytest_collection_modifyitems(config, items):
    """Tests marked slow are skipped, saying how to run them, unless WILLITFIT_SLOW=1."""
    if SLOW:
        return
    skip = pytest.mark.skip(reason="slow tier: run with WILLITFIT_SLOW=1")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True, scope="session")
def _private_profile_cache(tmp_path_factory):
    """WILLITFIT_CACHE points at a fresh directory for the whole session; shipped data/profiles stay read-only."""
    import os

    mp = pytest.MonkeyPatch()
    # WILLITFIT_TEST_CACHE keeps what a session derived, to see which profiles the shipped set lacks
    mp.setenv("WILLITFIT_CACHE", os.environ.get("WILLITFIT_TEST_CACHE") or str(tmp_path_factory.mktemp("wcache")))
    # a page's unpriced advice rows are not derived in the background unless a test asks (pages/_derive.py): a
    # derivation of a real preset would take a core for minutes under every AppTest that shows "What to change"
    mp.setenv("WILLITFIT_PRICE_ADVICE", "0")
    # a derivation traces the class asked for alone (tracer.derive.replays_on): the replayed siblings' hooks and
    # probe forwards were about half of each derivation's work, in tests that check something else; the tests of
    # the replays, and those that read a sibling a derivation left, are marked `replays` (below)
    mp.setenv("WILLITFIT_REPLAYS", "0")
    yield
    mp.undo()


@pytest.fixture(autouse=True)
def _replays_where_marked(request, monkeypatch):
    """A test (or module) marked `replays` derives as users do: each derivation replays its siblings (grad_accum 2,
    full and selective checkpointing) from its traces, checked against one traced step each."""
    if request.node.get_closest_marker("replays"):
        monkeypatch.setenv("WILLITFIT_REPLAYS", "1")


@pytest.fixture(autouse=True, scope="session")
def _background_derivations_end_before_the_session():
    """An app page derives a missing profile in a thread (pages/_derive.py); a test that left one running must not
    let the interpreter exit under it (torch aborts a process that exits with a thread inside it)."""
    yield
    import threading

    for thread in threading.enumerate():
        if ":derive:" in thread.name:
            thread.join(timeout=1800)


@pytest.fixture(autouse=True)
def _no_background_derivation_outlives_its_test():
    """A page's background derivation (pages/_derive.py) ends with the test that started it, so no other test of
    this worker shares the process with it. One the test did not wait for (tests/test_app_pages.py
    `finish_derivations`) is cancelled first, a profile's (":derive:") as an advice row's (":advice:"): its process
    is killed (a pasted partial config's 32-layer defaults held a teardown for 60 s while it derived)."""
    yield
    import threading

    for thread in threading.enumerate():
        if (":advice:" in thread.name or ":derive:" in thread.name) and getattr(thread, "job", None) is not None:
            thread.job.cancel()
        if ":derive:" in thread.name or ":advice:" in thread.name:
            thread.join(timeout=1800)
