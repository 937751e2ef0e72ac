"""A profile bank shared beyond one machine: inventories and profiles, content-addressed, read through fsspec.

    WILLITFIT_PROFILES=/shared/willitfit-profiles          # a directory (a team's NFS share)
    WILLITFIT_PROFILES=hf://datasets/<org>/<name>           # a Hugging Face dataset (huggingface_hub's fsspec)
    WILLITFIT_PROFILES=s3://bucket/willitfit                # an object store (s3fs), or memory:// in tests

Layout: `<url>/<config hash[:16]>/inventory.json` and `<url>/<config hash[:16]>/<profile key>.json`, the same as the
shipped `data/profiles/` and the local cache (estimator.store), so a bank is a cache many machines share: a fleet
of app servers or a team derives each (model, workload class) once. `estimator.store` asks the bank after the
shipped set and the local cache, before deriving, and keeps what it gets in the local cache; `python -m bench
derive --push/--pull` moves files to and from it.

A bank's files are untrusted input: size-capped, parsed as JSON (never executed or unpickled), checked to be what
their address says (a profile's config hash and class must hash to the key it was asked under; see
`estimator.store`), and a file that fails is skipped with one line. A push never overwrites: a path that exists
with other bytes is a conflict, reported, and the bank keeps the first.
"""
from __future__ import annotations

import os
import uuid

import fsspec

ENV_VAR = "WILLITFIT_PROFILES"
MAX_FILE_BYTES = 64 << 20   # the largest shipped profile is a few MB; anything far larger is not one


class BankError(ValueError):
    """The bank could not be read or written (one line naming WILLITFIT_PROFILES and the cause)."""


def url() -> str | None:
    """The bank's URL from WILLITFIT_PROFILES, or None when no bank is configured."""
    return os.environ.get(ENV_VAR, "").strip() or None


def _fs(bank_url: str):
    try:
        return fsspec.core.url_to_fs(bank_url)
    except (ImportError, ValueError) as e:  # an unknown protocol, or its package (s3fs, gcsfs) missing
        raise BankError(f"{ENV_VAR}: cannot open {bank_url!r} ({e})") from None


def fetch(bank_url: str, h16: str, name: str) -> str | None:
    """The text of `<bank>/<h16>/<name>`, or None if the bank does not hold it."""
    fs, root = _fs(bank_url)
    path = f"{root.rstrip('/')}/{h16}/{name}"
    try:
        with fs.open(path, "rb") as f:
            data = f.read(MAX_FILE_BYTES + 1)
    except FileNotFoundError:
        return None
    except OSError as e:
        raise BankError(f"{ENV_VAR}: cannot read {path} ({type(e).__name__}: {e})") from None
    if len(data) > MAX_FILE_BYTES:
        raise BankError(f"{ENV_VAR}: {path} is larger than {MAX_FILE_BYTES >> 20} MiB; not a willitfit profile")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        raise BankError(f"{ENV_VAR}: {path} is not UTF-8 text") from None


def put(bank_url: str, h16: str, name: str, text: str) -> str:
    """Write one file to the bank unless it is there: 'added', 'same' (identical bytes) or 'conflict' (other bytes
    under the same address: the bank keeps the first). The file appears whole: written beside, then moved."""
    fs, root = _fs(bank_url)
    folder = f"{root.rstrip('/')}/{h16}"
    path = f"{folder}/{name}"
    existing = fetch(bank_url, h16, name)
    if existing is not None:
        return "same" if existing == text else "conflict"
    tmp = f"{folder}/.{name}.{uuid.uuid4().hex}.tmp"
    try:
        fs.makedirs(folder, exist_ok=True)
        with fs.open(tmp, "wb") as f:
            f.write(text.encode("utf-8"))
        fs.mv(tmp, path)
    except OSError as e:
        raise BankError(f"{ENV_VAR}: cannot write {path} ({type(e).__name__}: {e})") from None
    return "added"


def listing(bank_url: str, h16: str) -> list[str]:
    """File names the bank holds for one config (inventory.json and profile keys), sorted."""
    fs, root = _fs(bank_url)
    try:
        entries = fs.ls(f"{root.rstrip('/')}/{h16}", detail=False)
    except FileNotFoundError:
        return []
    except OSError as e:
        raise BankError(f"{ENV_VAR}: cannot list {root}/{h16} ({type(e).__name__}: {e})") from None
    return sorted(n for n in (e.rstrip("/").rsplit("/", 1)[-1] for e in entries)
                  if n.endswith(".json") and not n.startswith("."))
