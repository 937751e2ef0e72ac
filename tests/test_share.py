"""The shared measurement dataset (bench/share/): push, pull, browse against a local directory and fsspec's in-process
memory filesystem as the remote. No network: the hub's upload is the one function not run here (an uploader stands in).
"""
from __future__ import annotations

import hashlib
import json
import threading
import uuid
from pathlib import Path

import duckdb
import fsspec
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from bench.__main__ import main
from bench.share import pull as pull_mod
from bench.share import remote
from bench.share.pull import browse_db, pull, refresh
from bench.share.push import push
from bench.share.remote import ShareError
from bench.store import db
from bench.store.ingest import ingest_files
from rowfactory import make_row


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def rows(*batches, **kw) -> list[dict]:
    return [make_row(batch=b, **kw) for b in batches]


def stored_ids(db_path) -> set[str]:
    if not Path(db_path).exists():
        return set()
    with db.connect(db_path, read_only=True) as con:
        return {r for (r,) in con.execute("SELECT run_id FROM runs").fetchall()}


def pulls(db_path) -> list[tuple]:
    with db.connect(db_path, read_only=True) as con:
        return con.execute("SELECT dataset, file, sha256, rows, inserted FROM pulls ORDER BY file").fetchall()


@pytest.fixture
def local(tmp_path, monkeypatch) -> str:
    monkeypatch.setenv("WILLITFIT_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv(remote.ENV, raising=False)
    return str(tmp_path / "remote")


@pytest.fixture
def memory(tmp_path, monkeypatch):
    monkeypatch.setenv("WILLITFIT_CACHE", str(tmp_path / "cache"))
    url = f"memory://share-{uuid.uuid4().hex}"
    yield url
    fs, root = fsspec.core.url_to_fs(url)
    if fs.exists(root):
        fs.rm(root, recursive=True)


def remote_files(url: str, folder: str) -> list[str]:
    fs, root = fsspec.core.url_to_fs(url)
    return sorted(p.rsplit("/", 1)[-1] for p in fs.ls(f"{root}/{folder}", detail=False))


def write_remote(url: str, rel: str, data: bytes) -> None:
    fs, root = fsspec.core.url_to_fs(url)
    fs.makedirs(f"{root}/{rel}".rsplit("/", 1)[0], exist_ok=True)
    fs.pipe_file(f"{root}/{rel}", data)


def read_remote(url: str, rel: str) -> bytes:
    fs, root = fsspec.core.url_to_fs(url)
    return fs.cat_file(f"{root}/{rel}")


# ---------------------------------------------------------------- push, then pull

@pytest.mark.parametrize("kind", ["local", "memory"])
def test_push_then_pull_brings_every_row_and_records_its_file(kind, request, tmp_path):
    url = request.getfixturevalue(kind)
    good = rows(1, 2, 3)
    report = push([write_jsonl(tmp_path / "runs.jsonl", good)], url)
    assert report.uploaded and report.rows == 3 and report.duplicates == 0
    assert remote_files(url, "contributions") == [f"{report.name}.parquet"]
    assert remote_files(url, "manifest") == [f"{report.name}.json"]  # no temporary name left behind
    data = read_remote(url, f"contributions/{report.name}.parquet")
    manifest = json.loads(read_remote(url, f"manifest/{report.name}.json"))
    assert manifest["sha256"] == hashlib.sha256(data).hexdigest() and report.name.endswith(manifest["sha256"][:16])
    assert manifest["rows"] == 3 and manifest["schema_version"] == db.HEAD_VERSION
    assert manifest["file"] == f"contributions/{report.name}.parquet" and manifest["contributor"] == "tests"

    db_path = tmp_path / "local.duckdb"
    got = pull(url, db_path)
    assert got.skipped == [] and got.inserted == 3 and len(got.pulled) == 1
    assert stored_ids(db_path) == {r["run_id"] for r in good}
    (ds, file, sha, n, inserted), = pulls(db_path)
    assert (ds, file, sha, n, inserted) == (url.rstrip("/"), manifest["file"], manifest["sha256"], 3, 3)
    with db.connect(db_path, read_only=True) as con:
        origin = dict(con.execute("SELECT run_id, file FROM pulled_runs").fetchall())
    assert origin == {r["run_id"]: manifest["file"] for r in good}
    # the downloaded file sits in the willitfit cache, byte for byte
    cached = pull_mod.cache_root(remote.parse_dataset(url)) / manifest["file"]
    assert cached.read_bytes() == data


def test_pull_twice_adds_no_duplicates_and_a_new_contribution_only_its_new_rows(local, tmp_path):
    push([write_jsonl(tmp_path / "a.jsonl", rows(1, 2))], local)
    db_path = tmp_path / "local.duckdb"
    assert pull(local, db_path).inserted == 2
    again = pull(local, db_path)
    assert again.inserted == 0 and again.pulled == [] and again.already == 1
    # a second contribution overlapping the first: only the new run_id is inserted
    push([write_jsonl(tmp_path / "b.jsonl", rows(2, 3))], local)
    third = pull(local, db_path)
    assert third.already == 1 and third.inserted == 1 and [(n, i) for _, n, i in third.pulled] == [(2, 1)]
    assert len(stored_ids(db_path)) == 3 and len(pulls(db_path)) == 2


def test_rows_already_ingested_locally_are_duplicates_not_errors(local, tmp_path):
    path = write_jsonl(tmp_path / "runs.jsonl", rows(1, 2))
    db_path = tmp_path / "local.duckdb"
    assert ingest_files([path], db_path).inserted == 2
    push([path], local)
    got = pull(local, db_path)
    assert got.skipped == [] and got.inserted == 0 and pulls(db_path)[0][3:] == (2, 0)


def test_two_contributors_pushing_at_once_lose_no_file_and_no_row(local, tmp_path):
    files = [write_jsonl(tmp_path / f"c{i}.jsonl", rows(*range(10 * i + 1, 10 * i + 6), contributor=f"c{i}"))
             for i in range(4)]
    barrier, reports, errors = threading.Barrier(len(files)), [], []

    def contribute(path):
        try:
            barrier.wait()
            reports.append(push([path], local))
        except Exception as e:  # noqa: BLE001 - surfaced by the assert below
            errors.append(e)

    threads = [threading.Thread(target=contribute, args=(f,)) for f in files]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == [] and all(r.uploaded for r in reports)
    assert len(remote_files(local, "contributions")) == len(files) == len(remote_files(local, "manifest"))
    db_path = tmp_path / "local.duckdb"
    got = pull(local, db_path)
    assert got.skipped == [] and got.inserted == 20 and len(stored_ids(db_path)) == 20


def test_push_validates_as_ingest_does_and_uploads_nothing_on_an_invalid_row(local, tmp_path):
    bad = rows(1, 2) + [{**make_row(batch=3), "optimizer": "adamx"}]
    report = push([write_jsonl(tmp_path / "ok.jsonl", rows(5)), write_jsonl(tmp_path / "bad.jsonl", bad)], local)
    assert not report.uploaded and report.n_rejected == 1
    (file, line, reason), = report.rejected
    assert file.endswith("bad.jsonl") and line == 3 and reason.startswith("optimizer: 'adamx' not allowed")
    assert not Path(local).exists()  # nothing was written to the remote
    report = push([tmp_path / "missing.jsonl"], local)
    assert not report.uploaded and "no such file" in report.rejected[0][2]


def test_push_merges_files_into_one_contribution_and_drops_repeated_run_ids(local, tmp_path):
    a = write_jsonl(tmp_path / "a.jsonl", rows(1, 2))
    b = write_jsonl(tmp_path / "b.jsonl", rows(2, 3))
    report = push([a, b], local)
    assert report.uploaded and report.rows == 3 and report.duplicates == 1
    assert len(remote_files(local, "contributions")) == 1


def test_bad_dataset_address_is_one_line_naming_the_field_before_any_work(tmp_path, monkeypatch):
    monkeypatch.delenv(remote.ENV, raising=False)
    path = tmp_path / "never-read.jsonl"  # missing: the address is checked first
    for url, expected in ((None, "dataset: not set; set WILLITFIT_DATASET"), ("ftp://host/x", "scheme 'ftp://'"),
                          ("hf://models/a/b", "is not hf://datasets/<org>/<name>"), ("s3://", "names no bucket")):
        with pytest.raises(ValueError, match="^dataset: ") as e:
            push([path], url)
        assert expected in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(ValueError, match="^dataset: no"):
        pull(None, tmp_path / "x.duckdb")
    with pytest.raises(ShareError, match="^dataset: no such directory"):
        pull(str(tmp_path / "nowhere"), tmp_path / "x.duckdb")
    assert not (tmp_path / "x.duckdb").exists()


def test_hub_push_needs_a_token_and_the_network_and_sends_one_pull_request(tmp_path, monkeypatch):
    path = write_jsonl(tmp_path / "runs.jsonl", rows(1))
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    with pytest.raises(ShareError, match="^HF_TOKEN: not set"):
        push([path], "hf://datasets/org/runs")
    monkeypatch.setenv("HF_TOKEN", "hf_test")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ShareError, match="^HF_HUB_OFFLINE: set"):
        push([path], "hf://datasets/org/runs")
    monkeypatch.delenv("HF_HUB_OFFLINE")
    sent = []

    def fake_upload(ds, name, parquet, manifest, token):  # stands in for remote.upload_hf (create_commit, create_pr)
        sent.append((ds.repo_id, name, parquet, json.loads(manifest), token))
        return "https://huggingface.co/datasets/org/runs/discussions/1"

    report = push([path], "hf://datasets/org/runs", uploader=fake_upload)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")   # and a pull from the hub says why it cannot, before any request
    with pytest.raises(ShareError, match="^HF_HUB_OFFLINE: set, so hf://datasets/org/runs cannot be read"):
        pull("hf://datasets/org/runs", tmp_path / "local.duckdb")
    assert not (tmp_path / "local.duckdb").exists()
    (repo_id, name, parquet, manifest, token), = sent
    assert report.uploaded and report.where.endswith("/discussions/1") and (repo_id, token) == ("org/runs", "hf_test")
    assert manifest["sha256"] == hashlib.sha256(parquet).hexdigest() and manifest["file"] == f"contributions/{name}.parquet"


# ---------------------------------------------------------------- untrusted remote files

def two_contributions(url: str, tmp_path) -> tuple[str, str]:
    a = push([write_jsonl(tmp_path / "a.jsonl", rows(1, 2))], url).name
    b = push([write_jsonl(tmp_path / "b.jsonl", rows(3, 4))], url).name
    return a, b


def test_a_corrupted_remote_parquet_is_skipped_in_one_line_and_the_rest_pulls(memory, tmp_path):
    a, b = two_contributions(memory, tmp_path)
    data = bytearray(read_remote(memory, f"contributions/{a}.parquet"))
    for i in range(len(data) // 2, len(data) // 2 + 16):  # flip bytes in the middle
        data[i] ^= 0xFF
    write_remote(memory, f"contributions/{a}.parquet", bytes(data))
    db_path = tmp_path / "local.duckdb"
    got = pull(memory, db_path)
    (file, reason), = got.skipped
    assert file == f"contributions/{a}.parquet" and reason.startswith("sha256: ") and "\n" not in reason
    assert stored_ids(db_path) == {r["run_id"] for r in rows(3, 4)}   # nothing from the corrupt file
    assert [p[1] for p in pulls(db_path)] == [f"contributions/{b}.parquet"]
    assert not (pull_mod.cache_root(remote.parse_dataset(memory)) / f"contributions/{a}.parquet").exists()


def test_a_manifest_that_does_not_match_its_file_is_skipped(local, tmp_path):
    a, b = two_contributions(local, tmp_path)
    manifest = json.loads(read_remote(local, f"manifest/{a}.json"))
    manifest["sha256"] = manifest["sha256"][:16] + "0" * 48  # same name prefix, wrong digest
    write_remote(local, f"manifest/{a}.json", json.dumps(manifest).encode())
    db_path = tmp_path / "local.duckdb"
    got = pull(local, db_path)
    assert [f for f, _ in got.skipped] == [f"contributions/{a}.parquet"] and "manifest says" in got.skipped[0][1]
    assert stored_ids(db_path) == {r["run_id"] for r in rows(3, 4)}


@pytest.mark.parametrize("change, expected", [
    (lambda m: b"{not json", "manifest: not a JSON object"),
    (lambda m: json.dumps({**m, "rows": 5}).encode(), "rows: the file holds 2, the manifest says 5"),
    (lambda m: json.dumps({**m, "file": "contributions/other.parquet"}).encode(), "file: "),
    (lambda m: json.dumps({**m, "schema_version": 999}).encode(), "schema_version: 999 is newer"),
    (lambda m: json.dumps({**m, "run": "import os"}).encode(), "manifest: unknown key 'run'"),
])
def test_a_malformed_manifest_is_skipped_with_its_reason(local, tmp_path, change, expected):
    a, _ = two_contributions(local, tmp_path)
    manifest = json.loads(read_remote(local, f"manifest/{a}.json"))
    write_remote(local, f"manifest/{a}.json", change(manifest))
    db_path = tmp_path / "local.duckdb"
    got = pull(local, db_path)
    (file, reason), = got.skipped
    assert a in file and expected in reason and "\n" not in reason
    assert stored_ids(db_path) == {r["run_id"] for r in rows(3, 4)}


def publish_raw(url: str, table_rows: list[dict], tmp_path) -> str:
    """A contribution written around push (as a hostile or buggy client could): valid sha and manifest."""
    src = tmp_path / "raw.parquet"
    pq.write_table(pa.Table.from_pylist(table_rows), src)
    data = src.read_bytes()
    sha = hashlib.sha256(data).hexdigest()
    name = remote.contribution_name(sha)
    write_remote(url, f"contributions/{name}.parquet", data)
    write_remote(url, f"manifest/{name}.json", remote.manifest_bytes(name, sha, len(table_rows), 1, None, None))
    return name


def test_a_pulled_row_with_an_invalid_field_refuses_the_whole_file(local, tmp_path):
    _, b = two_contributions(local, tmp_path)
    good = rows(7, 8)
    name = publish_raw(local, good + [{**make_row(batch=9), "optimizer": "adamx"}], tmp_path)
    db_path = tmp_path / "local.duckdb"
    got = pull(local, db_path)
    (file, reason), = got.skipped
    assert file == f"contributions/{name}.parquet"
    assert reason.startswith("row 3: optimizer: 'adamx' not allowed") and "whole file is refused" in reason
    assert not stored_ids(db_path) & {r["run_id"] for r in good}   # not even its valid rows
    assert len(stored_ids(db_path)) == 4


def test_unknown_columns_and_a_forged_run_id_are_refused(local, tmp_path):
    name = publish_raw(local, [{**make_row(batch=1), "run_id": "f" * 64}], tmp_path)
    other = publish_raw(local, [{**make_row(batch=2), "payload": "x"}], tmp_path)
    got = pull(local, tmp_path / "local.duckdb")
    reasons = dict(got.skipped)
    assert "run_id" in reasons[f"contributions/{name}.parquet"]
    assert "unknown column(s) 'payload'" in reasons[f"contributions/{other}.parquet"]
    assert got.inserted == 0


def test_a_parquet_without_its_manifest_yet_is_not_read(local, tmp_path):
    a, _ = two_contributions(local, tmp_path)
    fs, root = fsspec.core.url_to_fs(local)
    fs.rm(f"{root}/manifest/{a}.json")   # as if the contributor's manifest had not landed yet
    got = pull(local, tmp_path / "local.duckdb")
    assert got.skipped == [] and len(got.pulled) == 1 and got.inserted == 2


def test_a_failure_while_recording_a_file_leaves_the_database_unchanged(local, tmp_path, monkeypatch):
    two_contributions(local, tmp_path)
    db_path = tmp_path / "local.duckdb"
    with db.connect(db_path):
        pass
    monkeypatch.setattr(pull_mod, "utcnow", lambda: (_ for _ in ()).throw(RuntimeError("disk full")))
    with pytest.raises(RuntimeError):
        pull(local, db_path)
    assert stored_ids(db_path) == set() and pulls(db_path) == []
    monkeypatch.undo()
    monkeypatch.setenv("WILLITFIT_CACHE", str(tmp_path / "cache"))
    assert pull(local, db_path).inserted == 4   # served from the cache, nothing lost


# ---------------------------------------------------------------- browse, and the commands

def test_browse_db_holds_the_cached_contributions_and_is_rebuilt_when_they_change(memory, tmp_path):
    ds = remote.parse_dataset(memory)
    path, report = browse_db(ds)
    assert report.skipped == [] and db.count_runs(path) == 0
    two_contributions(memory, tmp_path)
    assert browse_db(ds)[0] == path   # nothing fetched yet: the same file
    assert refresh(memory).skipped == []
    new_path, _ = browse_db(ds)
    assert new_path != path and not path.exists() and db.count_runs(new_path) == 4
    with duckdb.connect(str(new_path), read_only=True) as con:
        assert con.execute("SELECT count(*) FROM pulls").fetchone()[0] == 2


def test_push_and_pull_commands(local, tmp_path, capsys):
    good = write_jsonl(tmp_path / "runs.jsonl", rows(1, 2))
    assert main(["push", str(good), "--dataset", local]) == 0
    assert capsys.readouterr().out.startswith("pushed 2 row(s)")
    bad = write_jsonl(tmp_path / "bad.jsonl", [{**make_row(), "batch": -1}])
    assert main(["push", str(bad), "--dataset", local]) == 2
    err = capsys.readouterr().err
    assert f"{bad}:1: batch: " in err and "nothing uploaded" in err
    assert main(["push", str(good), "--dataset", "ftp://x"]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        f"dataset: scheme 'ftp://' not supported; use {remote.ALLOWED}"]
    db_path = tmp_path / "local.duckdb"
    assert main(["pull", "--dataset", local, "--db", str(db_path)]) == 0
    assert capsys.readouterr().out.startswith("pulled 1 file(s): inserted 2 row(s)")
    name = publish_raw(local, [{**make_row(batch=9), "optimizer": "adamx"}], tmp_path)
    assert main(["pull", "--dataset", local, "--db", str(db_path)]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"skipped contributions/{name}.parquet: row 1: optimizer:")
