"""The shared measurement dataset's address, layout and transport: where contributions live and how bytes move.

A dataset is addressed by a URL (`WILLITFIT_DATASET` or `--dataset`):

    hf://datasets/<org>/<name>    a Hugging Face dataset (push opens a pull request; pull reads the main branch)
    s3://bucket/prefix, gs://...  an object store, through fsspec (s3fs / gcsfs must be installed)
    memory://name                 fsspec's in-process memory filesystem (tests)
    /some/dir or file:///some/dir a local or mounted directory

Layout, append-only: one parquet file per contribution and, written after it, one manifest naming it.

    contributions/<utc-timestamp>-<sha256 prefix>.parquet
    manifest/<utc-timestamp>-<sha256 prefix>.json   {"file", "sha256", "rows", "schema_version", ...}

The name is content-addressed (the prefix is the parquet file's sha256), so two contributors pushing at once
write different files and never overwrite each other, and there is no shared index file to race on: readers
list `manifest/`. Everything read from a dataset is untrusted: sizes are bounded before reading, manifests are
parsed strictly, nothing is executed or unpickled.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import uuid
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

import fsspec

from bench.hub import hub_offline

ENV = "WILLITFIT_DATASET"
CONTRIBUTIONS = "contributions"
MANIFESTS = "manifest"
SCHEMA_VERSION_FIELD = "schema_version"
MAX_MANIFEST_BYTES = 64 * 1024
MAX_MANIFESTS = 100_000
NAME_RE = re.compile(r"^(\d{8}T\d{12}Z)-([0-9a-f]{16})$")   # <utc timestamp, microseconds>-<sha256 prefix>
SHA_RE = re.compile(r"^[0-9a-f]{64}$")
HF_RE = re.compile(r"^hf://datasets/([A-Za-z0-9][A-Za-z0-9._-]{0,95})/([A-Za-z0-9][A-Za-z0-9._-]{0,95})/?$")
FSSPEC_SCHEMES = ("s3", "gs", "gcs", "memory", "file")
ALLOWED = "hf://datasets/<org>/<name>, s3://bucket/path, gs://bucket/path, memory://path or a local directory"
MANIFEST_KEYS = {"file", "sha256", "rows", SCHEMA_VERSION_FIELD, "created_at", "contributor", "tool_version"}


class ShareError(RuntimeError):
    """The dataset cannot be reached or written (network, permissions, missing token); one line, no traceback."""


@dataclass(frozen=True)
class Dataset:
    url: str      # as given (trailing slash removed)
    kind: str     # 'hf' | 'fsspec' | 'local'
    repo_id: str = ""  # hf: '<org>/<name>'

    @property
    def key(self) -> str:
        """A directory name for this dataset's local cache: readable slug + hash of the URL."""
        slug = re.sub(r"[^A-Za-z0-9._-]+", "-", self.url)[-48:].strip("-.") or "dataset"
        return f"{slug}-{hashlib.sha256(self.url.encode()).hexdigest()[:12]}"


def parse_dataset(url: str | None) -> Dataset:
    """A Dataset for `url`, or ValueError naming the field and what is allowed (before any slow work)."""
    text = url.strip() if isinstance(url, str) else ""
    if not text:
        raise ValueError(f"dataset: not set; set {ENV} or pass --dataset ({ALLOWED})")
    if len(text) > 1024 or any(ord(c) < 32 for c in text):
        raise ValueError(f"dataset: {text[:60]!r} is not a dataset address; use {ALLOWED}")
    scheme = text.split("://", 1)[0].lower() if "://" in text else ""
    text = text.rstrip("/") or "/"
    if scheme and len(text) <= len(scheme) + 3:
        raise ValueError(f"dataset: {text!r} names no bucket or path; use {ALLOWED}")
    if text.startswith("hf://"):
        m = HF_RE.fullmatch(text)
        if not m or ".." in text:
            raise ValueError(f"dataset: {text[:80]!r} is not hf://datasets/<org>/<name>")
        return Dataset(text, "hf", f"{m.group(1)}/{m.group(2)}")
    if scheme and scheme not in FSSPEC_SCHEMES:
        raise ValueError(f"dataset: scheme {scheme + '://'!r} not supported; use {ALLOWED}")
    if scheme in ("", "file"):
        return Dataset(text, "local")
    return Dataset(text, "fsspec")


def dataset_from_env(url: str | None = None) -> Dataset:
    """`url` if given, else $WILLITFIT_DATASET, parsed (ValueError naming `dataset` when unset or malformed)."""
    return parse_dataset(url if url else os.environ.get(ENV, ""))


def configured() -> str | None:
    """$WILLITFIT_DATASET when set (not validated), else None."""
    return os.environ.get(ENV, "").strip() or None


def filesystem(ds: Dataset):
    """(fsspec filesystem, root path) of the dataset; hf:// goes through huggingface_hub's HfFileSystem."""
    try:
        return fsspec.core.url_to_fs(ds.url)
    except (ImportError, ValueError) as e:  # an fsspec backend that is not installed (s3fs, gcsfs)
        raise ShareError(f"dataset: cannot open {ds.url} ({str(e).splitlines()[0][:160]})") from None


def contribution_name(sha256: str, now: datetime | None = None) -> str:
    """'<UTC yyyymmddTHHMMSSffffffZ>-<first 16 hex of sha256>' for a contribution's bytes."""
    now = now or datetime.now(timezone.utc)
    return f"{now.strftime('%Y%m%dT%H%M%S%fZ')}-{sha256[:16]}"


def manifest_bytes(name: str, sha256: str, rows: int, schema_version: int, contributor: str | None,
                   tool_version: str | None) -> bytes:
    record = {"file": f"{CONTRIBUTIONS}/{name}.parquet", "sha256": sha256, "rows": rows,
              SCHEMA_VERSION_FIELD: schema_version, "created_at": datetime.now(timezone.utc).isoformat(),
              "contributor": contributor, "tool_version": tool_version}
    return (json.dumps(record, sort_keys=True) + "\n").encode()


@dataclass(frozen=True)
class Manifest:
    name: str            # '<timestamp>-<sha prefix>'
    file: str            # 'contributions/<name>.parquet'
    sha256: str
    rows: int
    schema_version: int


def parse_manifest(name: str, data: bytes, head_version: int) -> Manifest:
    """Check one untrusted manifest; ValueError with one line naming the field and what is allowed."""
    if len(data) > MAX_MANIFEST_BYTES:
        raise ValueError(f"manifest: {len(data)} bytes; at most {MAX_MANIFEST_BYTES}")
    try:
        rec = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError):
        raise ValueError("manifest: not a JSON object (malformed or not UTF-8)") from None
    if not isinstance(rec, dict):
        raise ValueError("manifest: not a JSON object")
    unknown = sorted(set(rec) - MANIFEST_KEYS)
    if unknown:
        raise ValueError(f"manifest: unknown key {unknown[0][:40]!r}; allowed {', '.join(sorted(MANIFEST_KEYS))}")
    if rec.get("file") != f"{CONTRIBUTIONS}/{name}.parquet":
        raise ValueError(f"file: {str(rec.get('file'))[:80]!r} must be {CONTRIBUTIONS}/{name}.parquet "
                         "(the manifest's own name)")
    sha = rec.get("sha256")
    if not isinstance(sha, str) or not SHA_RE.fullmatch(sha) or not name.endswith(sha[:16]):
        raise ValueError("sha256: must be 64 lowercase hex digits starting with the file name's prefix")
    rows, version = rec.get("rows"), rec.get(SCHEMA_VERSION_FIELD)
    if type(rows) is not int or rows < 1:
        raise ValueError(f"rows: must be an integer >= 1, got {str(rows)[:40]!r}")
    if type(version) is not int or version < 1:
        raise ValueError(f"{SCHEMA_VERSION_FIELD}: must be an integer >= 1, got {str(version)[:40]!r}")
    if version > head_version:
        raise ValueError(f"{SCHEMA_VERSION_FIELD}: {version} is newer than this willitfit's {head_version}; "
                         "update willitfit to read it")
    return Manifest(name, rec["file"], sha, rows, version)


def check_readable(ds: Dataset) -> None:
    """ShareError (one line) when the dataset cannot be read at all: the hub while offline, a missing directory."""
    if ds.kind == "hf" and hub_offline():
        raise ShareError(f"HF_HUB_OFFLINE: set, so {ds.url} cannot be read; unset it to pull from the hub")
    if ds.kind == "local":
        fs, root = filesystem(ds)
        if not fs.isdir(root):
            raise ShareError(f"dataset: no such directory {root}")


def list_manifests(ds: Dataset) -> list[str]:
    """Names ('<timestamp>-<sha prefix>') of the manifests in the dataset, oldest first; other files ignored."""
    check_readable(ds)
    fs, root = filesystem(ds)
    try:
        entries = fs.ls(f"{root.rstrip('/')}/{MANIFESTS}", detail=False)
    except FileNotFoundError:
        return []
    except OSError as e:
        raise ShareError(f"dataset: cannot list {ds.url}/{MANIFESTS} ({str(e).splitlines()[0][:160]})") from None
    names = sorted({p.rsplit("/", 1)[-1].removesuffix(".json") for p in entries if p.endswith(".json")})
    return [n for n in names if NAME_RE.fullmatch(n)][:MAX_MANIFESTS]


def read_bounded(ds: Dataset, rel_path: str, max_bytes: int) -> bytes:
    """The bytes of `rel_path` under the dataset, refusing (ValueError) a file larger than max_bytes before
    reading it; ShareError when it cannot be read."""
    fs, root = filesystem(ds)
    path = f"{root.rstrip('/')}/{rel_path}"
    try:
        size = fs.size(path)
        if size is not None and size > max_bytes:
            raise ValueError(f"{rel_path}: {size} bytes; at most {max_bytes}")
        data = fs.cat_file(path)
    except FileNotFoundError:
        raise ValueError(f"{rel_path}: listed in the manifest but missing from the dataset") from None
    except OSError as e:
        raise ShareError(f"{rel_path}: cannot read ({str(e).splitlines()[0][:160]})") from None
    if len(data) > max_bytes:
        raise ValueError(f"{rel_path}: {len(data)} bytes; at most {max_bytes}")
    return data


def upload_fsspec(ds: Dataset, name: str, parquet: bytes, manifest: bytes) -> None:
    """Write the parquet file, then its manifest; each under a temporary name first and moved into place, so a
    reader never lists a half-written manifest. A name that already exists is never overwritten."""
    fs, root = filesystem(ds)
    root = root.rstrip("/")
    try:
        for folder, suffix, data in ((CONTRIBUTIONS, ".parquet", parquet), (MANIFESTS, ".json", manifest)):
            final = f"{root}/{folder}/{name}{suffix}"
            if fs.exists(final):
                raise ShareError(f"dataset: {folder}/{name}{suffix} already exists; nothing overwritten")
            fs.makedirs(f"{root}/{folder}", exist_ok=True)
            tmp = f"{root}/{folder}/.tmp-{uuid.uuid4().hex}{suffix}.part"
            fs.pipe_file(tmp, data)
            fs.mv(tmp, final)
    except OSError as e:
        raise ShareError(f"dataset: cannot write to {ds.url} ({str(e).splitlines()[0][:160]})") from None


def hf_token() -> str:
    """HF_TOKEN for a push to the hub, or ShareError naming what is missing (checked before any slow work)."""
    if hub_offline():
        raise ShareError("HF_HUB_OFFLINE: set, so nothing can be pushed to the hub; unset it to push")
    token = os.environ.get("HF_TOKEN", "").strip()
    if not token:
        raise ShareError("HF_TOKEN: not set; a push to hf:// needs a token with write access (export HF_TOKEN=hf_...)")
    return token


def upload_hf(ds: Dataset, name: str, parquet: bytes, manifest: bytes, token: str) -> str:  # pragma: no cover
    """One commit adding the parquet file and its manifest, opened as a pull request on the dataset; its URL.
    Needs network: the only function here that tests cannot run."""
    from huggingface_hub import CommitOperationAdd, HfApi
    from huggingface_hub.errors import HfHubHTTPError

    ops = [CommitOperationAdd(f"{CONTRIBUTIONS}/{name}.parquet", parquet),
           CommitOperationAdd(f"{MANIFESTS}/{name}.json", manifest)]
    try:
        info = HfApi(token=token).create_commit(repo_id=ds.repo_id, repo_type="dataset", operations=ops,
                                                commit_message=f"willitfit contribution {name}", create_pr=True)
    except (HfHubHTTPError, OSError) as e:
        raise ShareError(f"dataset: push to {ds.url} failed ({str(e).splitlines()[0][:160]})") from None
    return str(info.pr_url or info.commit_url)


def cache_root(ds: Dataset, base: Path) -> Path:
    """This dataset's directory in the local willitfit cache."""
    return base / "shared" / ds.key


__all__ = ["ALLOWED", "CONTRIBUTIONS", "Dataset", "ENV", "MANIFESTS", "Manifest", "ShareError", "cache_root",
           "check_readable", "configured", "contribution_name", "dataset_from_env", "filesystem", "hf_token", "list_manifests",
           "manifest_bytes", "parse_dataset", "parse_manifest", "read_bounded", "upload_fsspec", "upload_hf"]
