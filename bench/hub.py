"""Fetch one model's config.json from the Hugging Face hub, for the app's "Hugging Face model id" input.

    >>> from bench.hub import fetch_config
    >>> cfg = fetch_config("Qwen/Qwen2.5-0.5B")     # needs network; raises OfflineError without it

This is the only place willitfit reaches a model hub, and only when a user asks for it in the app. It
downloads config.json alone (a few KB of JSON: never weights, never code, no trust_remote_code) and parses
it with the same size-bounded parser as an uploaded file (`estimator.presets.parse_config_text`).
The estimator stays offline-pure: it only ever sees the parsed dict.

HF_HUB_OFFLINE=1 is honoured as huggingface_hub does (huggingface_hub/constants.py: any of 1/ON/YES/TRUE),
so an offline machine gets the clear message at once instead of a network timeout.
"""
from __future__ import annotations

import os
import re
import socket
import urllib.error
import urllib.request

from estimator.presets import MAX_CONFIG_BYTES, parse_config_text

HUB_URL = "https://huggingface.co"
DEFAULT_TIMEOUT_S = 10.0
# huggingface_hub.utils._validators.validate_repo_id: "[namespace/]name", each part of letters, digits,
# '-', '_', '.', at most 96 characters, not starting or ending with '-' or '.', and no '--' or '..'.
# Stricter than the hub on one point: ASCII only, so nothing odd ever reaches the URL.
_PART = r"[A-Za-z0-9](?:[A-Za-z0-9._-]{0,94}[A-Za-z0-9])?"
MODEL_ID_RE = re.compile(rf"^(?:{_PART}/)?{_PART}$")
_TRUE_VALUES = {"1", "on", "yes", "true"}


class OfflineError(RuntimeError):
    """The hub could not be reached (no network, HF_HUB_OFFLINE set, timeout, DNS, TLS)."""


def validate_model_id(model_id: str) -> str:
    """Return the id stripped of surrounding blanks, or raise ValueError saying what a valid id looks like."""
    text = model_id.strip() if isinstance(model_id, str) else ""
    if not MODEL_ID_RE.fullmatch(text) or "--" in text or ".." in text:
        raise ValueError(f"model id: {str(model_id)[:100]!r} is not a Hugging Face model id; expected "
                         "'org/name' (letters, digits, '-', '_', '.'; at most 96 characters each), "
                         "e.g. 'Qwen/Qwen2.5-0.5B'")
    return text


def hub_offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in _TRUE_VALUES


def config_url(model_id: str) -> str:
    return f"{HUB_URL}/{validate_model_id(model_id)}/resolve/main/config.json"


def _offline(model_id: str, why: str) -> OfflineError:
    return OfflineError(f"Could not reach the Hugging Face hub for {model_id!r} ({why}); "
                        f"download config.json yourself from {HUB_URL}/{model_id} and upload it")


def fetch_config(model_id: str, timeout: float = DEFAULT_TIMEOUT_S) -> dict:
    """Download and parse `model_id`'s config.json.

    Raises ValueError for a malformed id, a model the hub does not serve (missing, gated or private) or a
    file that is not a config.json; OfflineError when the hub cannot be reached.
    """
    model_id = validate_model_id(model_id)
    if hub_offline():
        raise _offline(model_id, "HF_HUB_OFFLINE is set")
    request = urllib.request.Request(config_url(model_id), headers={"User-Agent": "willitfit"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            # Read one byte past the limit so an oversized file is refused instead of silently truncated.
            body = response.read(MAX_CONFIG_BYTES + 1)
    except urllib.error.HTTPError as e:
        if e.code in (401, 403, 404):
            raise ValueError(f"model id: the hub has no public config.json for {model_id!r} (HTTP {e.code}: "
                             "missing, gated or private); download config.json yourself and upload it") from None
        raise _offline(model_id, f"HTTP {e.code}") from None
    except (urllib.error.URLError, socket.timeout, TimeoutError, OSError) as e:
        raise _offline(model_id, str(getattr(e, "reason", e))[:120] or type(e).__name__) from None
    if len(body) > MAX_CONFIG_BYTES:
        raise ValueError(f"model: {model_id!r} config.json is larger than {MAX_CONFIG_BYTES} bytes; not a config.json")
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError:
        raise ValueError(f"model: {model_id!r} config.json is not UTF-8 text") from None
    return parse_config_text(text)


__all__ = ["OfflineError", "MODEL_ID_RE", "config_url", "fetch_config", "hub_offline", "validate_model_id"]
