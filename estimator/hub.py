"""Fetch one model's config.json from the Hugging Face hub, for the app's "Hugging Face model id" input and the
CLI's `--model org/name[@revision]`.

    >>> from estimator.hub import fetch_config
    >>> cfg = fetch_config("Qwen/Qwen2.5-0.5B")                 # needs network, or a cached copy
    >>> cfg = fetch_config("Qwen/Qwen2.5-0.5B", revision="v1")   # a branch, tag or commit

This is the only place willitfit reaches a model hub, and only when a user asks for it. It downloads config.json
alone (a few KB of JSON: never weights, never code, no trust_remote_code) through huggingface_hub's
`hf_hub_download` (huggingface_hub/file_download.py), so it behaves like every other Hugging Face tool:

- `HF_TOKEN` (or a token saved by `hf auth login`) is sent, which gated repos (meta-llama/*) need;
- `HF_ENDPOINT` points it at a mirror; `revision` picks a branch, tag or commit;
- the file lands in the shared cache (`HF_HUB_CACHE`, else `HF_HOME/hub`, else ~/.cache/huggingface/hub) and is
  served from there when the hub cannot be reached;
- `HF_HUB_OFFLINE=1` means no request at all: the cached copy or a clear error;
- a hub that cannot be reached fails fast: when nothing is cached huggingface_hub retries a dead network with
  backoff (1 + 2 + 4 + 8 + 8 s, utils/_http.py), so the hub's host is first probed with one TCP connection
  (`reachable`, a few seconds at most; skipped behind an HTTP(S) proxy) and, if it does not answer, only the
  cache is read.

It imports no torch (huggingface_hub does not), so the estimator's CLI uses it; `bench.hub` re-exports it.

huggingface_hub reads these variables once, when it is imported; they are read here at each call (and passed to
it) so that a long-running app or a test sees their current values. The downloaded file is size-checked
(`MAX_CONFIG_BYTES`) before it is read and parsed with the same parser as an uploaded file
(`estimator.presets.parse_config_text`). The estimator stays offline-pure: it only ever sees the parsed dict.
"""
from __future__ import annotations

import os
import re
import socket
from pathlib import Path
from urllib.parse import urlsplit

from estimator.presets import MAX_CONFIG_BYTES, parse_config_text

HUB_URL = "https://huggingface.co"
FILENAME = "config.json"
DEFAULT_REVISION = "main"
DEFAULT_TIMEOUT_S = 10.0
PROBE_TIMEOUT_S = 3.0
PROXY_VARS = ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy")
# huggingface_hub.utils._validators.validate_repo_id: "[namespace/]name", each part of letters, digits,
# '-', '_', '.', at most 96 characters, not starting or ending with '-' or '.', and no '--' or '..'.
# Stricter than the hub on one point: ASCII only, so nothing odd ever reaches the URL.
_PART = r"[A-Za-z0-9](?:[A-Za-z0-9._-]{0,94}[A-Za-z0-9])?"
MODEL_ID_RE = re.compile(rf"^(?:{_PART}/)?{_PART}$")
# A git branch, tag or commit as the hub names them in /resolve/{revision}/ (e.g. main, v1.0, refs/pr/3, a sha).
REVISION_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9._/-]{0,254}$")
_TRUE_VALUES = {"1", "on", "yes", "true"}  # huggingface_hub/constants.py _is_true


class OfflineError(RuntimeError):
    """The hub could not be reached (no network, HF_HUB_OFFLINE set, timeout, DNS, TLS) and no cached copy."""


def validate_model_id(model_id: str) -> str:
    """Return the id stripped of surrounding blanks, or raise ValueError saying what a valid id looks like."""
    text = model_id.strip() if isinstance(model_id, str) else ""
    if not MODEL_ID_RE.fullmatch(text) or "--" in text or ".." in text:
        raise ValueError(f"model id: {str(model_id)[:100]!r} is not a Hugging Face model id; expected "
                         "'org/name' (letters, digits, '-', '_', '.'; at most 96 characters each), "
                         "e.g. 'Qwen/Qwen2.5-0.5B'")
    return text


def validate_revision(revision: str | None) -> str:
    """'main' for None or blank; else a branch, tag or commit name, or ValueError saying what one looks like."""
    if revision is None or (isinstance(revision, str) and not revision.strip()):
        return DEFAULT_REVISION
    text = revision.strip() if isinstance(revision, str) else ""
    if not REVISION_RE.fullmatch(text) or ".." in text or text.endswith("/"):
        raise ValueError(f"revision: {str(revision)[:100]!r} is not a branch, tag or commit name; expected letters, "
                         "digits, '.', '_', '-', '/' (e.g. 'main', 'v1.0', 'refs/pr/3' or a 40-digit commit)")
    return text


def hub_offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in _TRUE_VALUES


def hub_endpoint() -> str:
    """HF_ENDPOINT (a mirror) or the public hub, without a trailing slash (huggingface_hub/constants.py)."""
    return (os.environ.get("HF_ENDPOINT", "").strip() or HUB_URL).rstrip("/")


def hub_cache_dir() -> Path | None:
    """HF_HUB_CACHE, else HF_HOME/hub (huggingface_hub/constants.py); None leaves huggingface_hub's default."""
    if os.environ.get("HF_HUB_CACHE", "").strip():
        return Path(os.path.expandvars(os.environ["HF_HUB_CACHE"])).expanduser()
    if os.environ.get("HF_HOME", "").strip():
        return Path(os.path.expandvars(os.environ["HF_HOME"])).expanduser() / "hub"
    return None


def config_url(model_id: str, revision: str | None = None) -> str:
    return f"{hub_endpoint()}/{validate_model_id(model_id)}/resolve/{validate_revision(revision)}/{FILENAME}"


def _offline(model_id: str, revision: str, why: str) -> OfflineError:
    at = "" if revision == DEFAULT_REVISION else f" at revision {revision!r}"
    return OfflineError(f"Could not reach the Hugging Face hub for {model_id!r}{at} ({why}) and no copy is cached; "
                        f"download config.json yourself from {hub_endpoint()}/{model_id} and upload it (or pass its "
                        "path to --model). HF_HUB_OFFLINE=1 reads cached copies only; gated models need HF_TOKEN")


def _one_line(text: str, limit: int = 160) -> str:
    return " ".join(str(text).split())[:limit]


def reachable(timeout: float = PROBE_TIMEOUT_S) -> str | None:
    """None when a TCP connection to the hub's host opens within `timeout` (or a proxy stands between: then
    huggingface_hub decides); else why not, in a few words (DNS, refused, timed out)."""
    if any(os.environ.get(v, "").strip() for v in PROXY_VARS):
        return None
    url = urlsplit(hub_endpoint())
    port = url.port or (443 if url.scheme == "https" else 80)
    try:
        socket.create_connection((url.hostname or "", port), timeout=timeout).close()
    except OSError as e:
        return f"{type(e).__name__}: {_one_line(e, 100)}"
    return None


def _download(model_id: str, revision: str, timeout: float) -> Path:
    """hf_hub_download of config.json, its failures turned into ValueError (the hub answered no) or OfflineError
    (it did not answer). The mapping follows file_download._raise_on_head_call_error and utils/_http.py
    hf_raise_for_status: the hub's X-Error-Code header decides GatedRepo / RepoNotFound / RevisionNotFound /
    EntryNotFound; a dead network, an offline switch or a 5xx with nothing cached ends as LocalEntryNotFoundError."""
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import (GatedRepoError, HfHubHTTPError, LocalEntryNotFoundError,
                                        OfflineModeIsEnabled, RemoteEntryNotFoundError, RepositoryNotFoundError,
                                        RevisionNotFoundError)

    offline = hub_offline()
    unreachable = None if offline else reachable(min(timeout, PROBE_TIMEOUT_S))
    try:
        return Path(hf_hub_download(model_id, FILENAME, revision=revision, cache_dir=hub_cache_dir(),
                                    endpoint=hub_endpoint(), local_files_only=offline or bool(unreachable),
                                    etag_timeout=timeout))
    except GatedRepoError:
        raise ValueError(f"model id: {model_id!r} is gated on the Hugging Face hub; accept its terms on "
                         f"{hub_endpoint()}/{model_id}, then set HF_TOKEN to a token with access "
                         "(or upload its config.json)") from None
    except RepositoryNotFoundError as e:
        status = getattr(e.response, "status_code", None)
        raise ValueError(f"model id: the Hugging Face hub has no model {model_id!r} you can read (HTTP {status}: "
                         "missing, or private; set HF_TOKEN if you have access)") from None
    except RevisionNotFoundError:
        raise ValueError(f"revision: {revision!r} is not a branch, tag or commit of {model_id!r}") from None
    except RemoteEntryNotFoundError:
        raise ValueError(f"model id: {model_id!r} has no config.json at revision {revision!r}; "
                         "it is not a transformers model") from None
    except HfHubHTTPError as e:
        status = getattr(e.response, "status_code", None)
        if status in (401, 403):
            raise ValueError(f"model id: the Hugging Face hub refused {model_id!r} (HTTP {status}); set HF_TOKEN to "
                             "a token with access (or upload its config.json)") from None
        raise _offline(model_id, revision, f"HTTP {status}") from None
    except (LocalEntryNotFoundError, OfflineModeIsEnabled, OSError) as e:
        if unreachable:
            why = unreachable
        elif offline or isinstance(e, OfflineModeIsEnabled) or isinstance(e.__cause__, OfflineModeIsEnabled):
            why = "HF_HUB_OFFLINE is set"
        else:  # the network error huggingface_hub gave up on is the cause of its LocalEntryNotFoundError
            cause = e.__cause__ or e
            why = f"{type(cause).__name__}: {_one_line(cause, 100)}"
        raise _offline(model_id, revision, why) from None
    except Exception as e:
        # huggingface_hub lets its transport's own errors through (a proxy refusing, TLS): the hub was not reached.
        if type(e).__module__.split(".")[0] in ("httpx2", "httpx", "httpcore", "ssl"):
            raise _offline(model_id, revision, f"{type(e).__name__}: {_one_line(e, 100)}") from None
        raise


def split_model_ref(text: str) -> tuple[str, str] | None:
    """'org/name@rev' -> ('org/name', 'rev'); 'org/name' -> ('org/name', 'main'); None for what is not an
    'org/name' id (a preset name, a path). A malformed revision raises ValueError."""
    model_id, _, revision = text.strip().partition("@")
    if "/" not in model_id or not MODEL_ID_RE.fullmatch(model_id) or "--" in model_id or ".." in model_id:
        return None
    return model_id, validate_revision(revision)


def fetch_config(model_id: str, revision: str | None = None, timeout: float = DEFAULT_TIMEOUT_S) -> dict:
    """Download (or read from the cache) and parse `model_id`'s config.json at `revision` (default 'main').

    Raises ValueError for a malformed id or revision, a model the hub does not serve you (missing, gated or
    private), a missing revision, or a file that is not a config.json; OfflineError when the hub cannot be
    reached and no copy is cached.
    """
    model_id = validate_model_id(model_id)
    revision = validate_revision(revision)
    path = _download(model_id, revision, timeout)
    size = path.stat().st_size
    if size > MAX_CONFIG_BYTES:
        raise ValueError(f"model: {model_id!r} config.json is {size:,} bytes, more than {MAX_CONFIG_BYTES:,}; "
                         "not a config.json")
    try:
        text = path.read_bytes().decode("utf-8")
    except UnicodeDecodeError:
        raise ValueError(f"model: {model_id!r} config.json is not UTF-8 text") from None
    return parse_config_text(text)


__all__ = ["OfflineError", "MODEL_ID_RE", "REVISION_RE", "config_url", "fetch_config", "hub_cache_dir",
           "hub_endpoint", "hub_offline", "reachable", "split_model_ref", "validate_model_id", "validate_revision"]
