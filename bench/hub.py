"""The hub fetcher lives in estimator.hub (it needs huggingface_hub, not torch, so the estimator's CLI uses it);
re-exported here for the app and bench callers."""
from __future__ import annotations

from estimator.hub import (MODEL_ID_RE, REVISION_RE, OfflineError, config_url, fetch_config, hub_cache_dir,
                           hub_endpoint, hub_offline, reachable, split_model_ref, validate_model_id,
                           validate_revision)

__all__ = ["OfflineError", "MODEL_ID_RE", "REVISION_RE", "config_url", "fetch_config", "hub_cache_dir",
           "hub_endpoint", "hub_offline", "reachable", "split_model_ref", "validate_model_id", "validate_revision"]
