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


@pytest.fixture(autouse=True, scope="session")
def _private_profile_cache(tmp_path_factory):
    """WILLITFIT_CACHE points at a fresh directory for the whole session; shipped data/profiles stay read-only."""
    import os

    mp = pytest.MonkeyPatch()
    # WILLITFIT_TEST_CACHE keeps what a session derived, to see which profiles the shipped set lacks
    mp.setenv("WILLITFIT_CACHE", os.environ.get("WILLITFIT_TEST_CACHE") or str(tmp_path_factory.mktemp("wcache")))
    yield
    mp.undo()
