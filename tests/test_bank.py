"""The shared profile bank (estimator.bank, WILLITFIT_PROFILES): a directory or fsspec URL many machines read.

The shipped set is hidden (store.SHIPPED_DIR pointed at an empty directory) so that a preset's profile must come
from the bank; the bank holds copies of the shipped files, so the estimate it gives is known: the shipped one.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import fsspec
import pytest

from bench.__main__ import main as bench_main
from estimator import bank, store
from estimator.estimate import Options, clear_caches, estimate
from estimator.model import from_hf_config
from estimator.presets import config_hash, load_config
from estimator.spec import Parallel, Workload

MODEL = "llama-3.2-1b"
SHIPPED = store.SHIPPED_DIR  # the real shipped set, before a test hides it
W = Workload(batch=2, seq=1024)


@pytest.fixture()
def shipped_answer():
    clear_caches()
    cfg = load_config(MODEL)[1]
    est = estimate(from_hf_config(cfg, MODEL, derive=False), W, Parallel(), Options(derive=False))
    return cfg, est


@pytest.fixture()
def no_shipped(monkeypatch, tmp_path):
    """Nothing shipped, an empty cache: what is not in the bank must be derived."""
    empty = tmp_path / "shipped"
    empty.mkdir()
    monkeypatch.setattr(store, "SHIPPED_DIR", empty)
    monkeypatch.setenv("WILLITFIT_CACHE", str(tmp_path / "cache"))
    clear_caches()
    yield tmp_path
    clear_caches()


def _copy_shipped(cfg, dest: Path) -> Path:
    h16 = config_hash(cfg)[:16]
    shutil.copytree(SHIPPED / h16, dest / h16)
    return dest / h16


def test_an_estimate_comes_from_a_directory_bank_and_is_kept_in_the_cache(shipped_answer, tmp_path, monkeypatch):
    cfg, expected = shipped_answer
    bank_dir = tmp_path / "bank"
    _copy_shipped(cfg, bank_dir)
    monkeypatch.setattr(store, "SHIPPED_DIR", tmp_path / "nothing-shipped")
    monkeypatch.setenv("WILLITFIT_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv(bank.ENV_VAR, str(bank_dir))
    clear_caches()
    got = estimate(from_hf_config(cfg, MODEL, derive=False), W, Parallel(), Options(derive=False))
    assert got.stages == expected.stages
    assert store.where(cfg) == "cache"  # the inventory fetched once, kept locally
    clear_caches()


def test_a_memory_filesystem_bank(shipped_answer, no_shipped, monkeypatch):
    cfg, expected = shipped_answer
    h16 = config_hash(cfg)[:16]
    real = SHIPPED / h16
    url = f"memory://bank-{no_shipped.name}"
    for f in real.glob("*.json"):
        assert bank.put(url, h16, f.name, f.read_text()) == "added"
    monkeypatch.setenv(bank.ENV_VAR, url)
    got = estimate(from_hf_config(cfg, MODEL, derive=False), W, Parallel(), Options(derive=False))
    assert got.total_bytes == expected.total_bytes


def test_without_the_bank_the_same_estimate_is_missing(shipped_answer, no_shipped):
    cfg, _ = shipped_answer
    with pytest.raises(store.ProfileMissing):
        from_hf_config(cfg, MODEL, derive=False)


def test_a_file_that_is_not_what_its_address_says_is_skipped(shipped_answer, no_shipped, monkeypatch):
    cfg, _ = shipped_answer
    folder = _copy_shipped(cfg, no_shipped / "bank")
    key = store.profile_key(W, Parallel())
    prof = json.loads((folder / f"{key}.json").read_text())
    prof["workload_class"]["lora_rank"] = 64  # another class's numbers under this class's address
    (folder / f"{key}.json").write_text(json.dumps(prof))
    monkeypatch.setenv(bank.ENV_VAR, str(no_shipped / "bank"))
    heard = []
    model = from_hf_config(cfg, MODEL, derive=False)  # the inventory is fine
    with pytest.raises(store.ProfileMissing):
        store.profile(cfg, W, Parallel(), name=MODEL, derive=False, progress=lambda d, t, m: heard.append(m))
    assert any("skipped" in m and key in m for m in heard), heard
    assert model.params > 0


def test_garbage_and_oversized_files_are_refused_in_one_line(tmp_path, monkeypatch):
    folder = tmp_path / "bank" / "0123456789abcdef"
    folder.mkdir(parents=True)
    (folder / "x.json").write_bytes(b"\xff\xfe not text")
    with pytest.raises(bank.BankError, match="not UTF-8"):
        bank.fetch(str(tmp_path / "bank"), "0123456789abcdef", "x.json")
    monkeypatch.setattr(bank, "MAX_FILE_BYTES", 8)
    (folder / "y.json").write_text("{" + " " * 20 + "}")
    with pytest.raises(bank.BankError, match="larger than"):
        bank.fetch(str(tmp_path / "bank"), "0123456789abcdef", "y.json")
    assert bank.fetch(str(tmp_path / "bank"), "0123456789abcdef", "absent.json") is None


def test_put_never_overwrites(tmp_path):
    url = str(tmp_path / "bank")
    assert bank.put(url, "0123456789abcdef", "k.json", "{}") == "added"
    assert bank.put(url, "0123456789abcdef", "k.json", "{}") == "same"
    assert bank.put(url, "0123456789abcdef", "k.json", '{"other": 1}') == "conflict"
    assert fsspec.open(f"{url}/0123456789abcdef/k.json", "r").open().read() == "{}"
    assert bank.listing(url, "0123456789abcdef") == ["k.json"]


def test_an_unknown_protocol_is_one_line():
    with pytest.raises(bank.BankError, match="WILLITFIT_PROFILES"):
        bank.fetch("nosuchproto://x", "0123456789abcdef", "inventory.json")


def test_derive_push_then_pull_moves_the_files(shipped_answer, tmp_path, monkeypatch, capsys):
    cfg, expected = shipped_answer
    url = str(tmp_path / "bank")
    args = ["derive", "--model", MODEL, "--mode", "train", "--method", "full", "--quiet"]
    assert bench_main(args + ["--push", url]) == 0  # shipped: nothing to trace, only copied
    assert "added" in capsys.readouterr().out
    assert bench_main(args + ["--push", url]) == 0
    assert "same" in capsys.readouterr().out
    monkeypatch.setattr(store, "SHIPPED_DIR", tmp_path / "nothing-shipped")
    monkeypatch.setenv("WILLITFIT_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv(bank.ENV_VAR, raising=False)
    clear_caches()
    assert bench_main(args + ["--pull", url]) == 0
    monkeypatch.delenv(bank.ENV_VAR, raising=False)  # --pull set it for its own process; the cache answers now
    clear_caches()
    got = estimate(from_hf_config(cfg, MODEL, derive=False), W, Parallel(), Options(derive=False))
    assert got.stages == expected.stages
    clear_caches()
