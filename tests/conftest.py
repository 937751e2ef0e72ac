"""Test-session settings: derived inventories and profiles go to a temporary cache, never the user's."""
from __future__ import annotations

import pytest


@pytest.fixture(autouse=True, scope="session")
def _private_profile_cache(tmp_path_factory):
    """WILLITFIT_CACHE points at a fresh directory for the whole session; shipped data/profiles stay read-only."""
    import os

    mp = pytest.MonkeyPatch()
    # WILLITFIT_TEST_CACHE keeps what a session derived, to see which profiles the shipped set lacks
    mp.setenv("WILLITFIT_CACHE", os.environ.get("WILLITFIT_TEST_CACHE") or str(tmp_path_factory.mktemp("wcache")))
    yield
    mp.undo()
