"""estimator.store: where profiles come from (shipped, cached, derived) and what a stale cache file does."""
from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from estimator import store
from estimator.estimate import Options, estimate, traced_class
from estimator.model import from_hf_config
from estimator.presets import load_config
from estimator.seq2seq import decodes_eager_only
from estimator.profile.profile import Profile
from estimator.spec import Parallel, Workload


def test_a_cached_profile_of_an_older_format_is_not_an_error(monkeypatch, tmp_path):
    # A profile written by an older willitfit (format 1) in the user's cache must not break an estimate: it is
    # treated as missing (derived again when deriving is allowed), while a broken *shipped* file still raises.
    monkeypatch.setenv("WILLITFIT_CACHE", str(tmp_path))
    store.clear_memo()
    name, cfg = load_config("llama-3.2-1b")
    w = Workload(method="lora", lora_rank=48, attention="eager", batch=1, seq=64)  # a class not shipped
    tw, tp, _ = traced_class(w, Parallel())
    key = store.profile_key(tw, tp)
    assert store.where(cfg, key=key) != "shipped"
    d = tmp_path / store.config_hash(cfg)[:16]
    d.mkdir(parents=True)
    (d / f"{key}.json").write_text(json.dumps({"format": 1, "moments": []}))
    with pytest.raises(store.ProfileMissing, match="^profile: 'llama-3.2-1b' has no profile on disk"):
        estimate(from_hf_config(cfg, name, derive=False), w, Parallel(), Options(derive=False))
    store.clear_memo()


def test_a_cached_profile_a_later_tracer_fix_changed_is_derived_again(monkeypatch, tmp_path):
    """A selective-checkpointing profile cached before the tracer gave the wrapped attention its mask
    (store.TRACER_REVISION 2) is not read: derived again where deriving is allowed; one derived since is read."""
    monkeypatch.setenv("WILLITFIT_CACHE", str(tmp_path))
    store.clear_memo()
    name, cfg = load_config("llama-3.2-1b")
    shipped = store.stored_profile(cfg, Workload(checkpointing="selective"), Parallel(), name=name, derive=False)
    w = Workload(checkpointing="selective", attention="eager", batch=1, seq=64)   # a class not shipped
    tw, tp, _ = traced_class(w, Parallel())
    key = store.profile_key(tw, tp)
    assert store.where(cfg, key=key) != "shipped"
    d = tmp_path / store.config_hash(cfg)[:16]
    d.mkdir(parents=True)
    old = Profile(shipped.config_hash, shipped.model_type, store.workload_class(tw), shipped.parallel_class,
                  shipped.layers, shipped.pieces, {k: v for k, v in shipped.provenance.items() if k != "tracer_revision"})
    (d / f"{key}.json").write_text(old.to_json())
    assert store.outdated(old)
    with pytest.raises(store.ProfileMissing, match="^profile: 'llama-3.2-1b' has no profile on disk"):
        estimate(from_hf_config(cfg, name, derive=False), w, Parallel(), Options(derive=False))
    new = replace(old, provenance={**old.provenance, "tracer_revision": store.TRACER_REVISION})
    (d / f"{key}.json").write_text(new.to_json())
    store.clear_memo()
    assert not store.outdated(new)
    assert estimate(from_hf_config(cfg, name, derive=False), w, Parallel(), Options(derive=False)).stages
    store.clear_memo()


def test_every_preset_ships_the_classes_the_property_tests_draw():
    # "Ship one for every preset": training (full fine-tuning and LoRA on PEFT's targets) and inference, each a
    # profile file in data/profiles/, so that estimate() never traces for a preset's common workloads (and the
    # hypothesis tests, which draw every preset, never derive: scripts/ship_profiles.py fills the gaps).
    from estimator.presets import preset_names
    from strategies import attention, lora_targets, model

    missing = []
    for name in preset_names():
        m = model(name)
        kinds = [Workload(attention=attention(m)),
                 Workload(attention=attention(m), method="lora", lora_targets=lora_targets(m))]
        if m.causal:   # T5's decoding is priced under eager attention (estimator.seq2seq.decodes_eager_only)
            kinds.append(Workload(mode="infer", attention="eager" if decodes_eager_only(m.config)
                                  else attention(m)))
        for w in kinds:
            tw, tp, _ = traced_class(w, Parallel())
            key = store.stored_key(m.config, tw, tp, ship=True)  # LoRA: rank-free, else a per-rank file
            if key is None or store.where(m.config, key=key) != "shipped":
                missing.append(f"{name}: {w.mode} {w.method}")
    assert not missing, "not shipped (python scripts/ship_profiles.py): " + ", ".join(missing)


def test_a_cached_inventory_of_an_older_version_is_read_again(monkeypatch, tmp_path):
    # An inventory cached by an older willitfit lacks fields this one reads (whether transformers runs the model
    # with SDPA): it is read again from a meta-device build, not trusted (Gemma-2 would be priced with SDPA).
    monkeypatch.setenv("WILLITFIT_CACHE", str(tmp_path))
    store.clear_memo()
    cfg = {"model_type": "gemma2", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
           "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 256}
    fresh = store.inventory(cfg, "t-gemma2")
    path = tmp_path / store.config_hash(cfg)[:16] / "inventory.json"
    data = json.loads(path.read_text())
    assert data["sdpa"] is False and not fresh.supports_sdpa
    del data["sdpa"]
    path.write_text(json.dumps(data))
    store.clear_memo()
    assert not store.inventory(cfg, "t-gemma2").supports_sdpa
    assert "sdpa" in json.loads(path.read_text())
    store.clear_memo()


def test_a_vlm_inventory_cached_under_another_route_is_read_again(monkeypatch, tmp_path):
    # a vision-language model whose images an older willitfit refused (its type then in no route: text-only steps)
    # is read again once this version prices its images another way (estimator.families.vlm_route)
    monkeypatch.setenv("WILLITFIT_CACHE", str(tmp_path))
    store.clear_memo()
    cfg = json.loads((Path(__file__).parent / "data" / "tiny" / "t-smolvlm.json").read_text())
    assert store.inventory(cfg, "t-smolvlm").extra["vlm"]["image_tokens"] == 4
    path = tmp_path / store.config_hash(cfg)[:16] / "inventory.json"
    data = json.loads(path.read_text())
    assert data["vlm_route"] == "stacked"
    old = {k: v for k, v in data.items() if k not in ("vlm", "vlm_route")}
    path.write_text(json.dumps({**old, "vlm_refused": "not enough values to unpack (expected 5, got 4)"}))
    store.clear_memo()
    assert store.inventory(cfg, "t-smolvlm").extra["vlm"]["image_tokens"] == 4
    assert json.loads(path.read_text())["vlm_route"] == "stacked"
    store.clear_memo()


def test_a_model_that_fails_on_fake_tensors_is_refused_in_one_line(monkeypatch, tmp_path):
    # e.g. transformers' grouped_mm experts take bf16 inputs only: a Mixtral under the amp recipe raised a RuntimeError
    # from inside the derivation (found by tests/test_exact_random.py); the CLI and the app show one line instead
    pytest.importorskip("torch")
    from tracer import derive

    def fails(*a, **k):
        raise RuntimeError("Expected inputs of BF16 type but got mat_a.dtype=torch.float32\nmore lines")

    monkeypatch.setenv("WILLITFIT_CACHE", str(tmp_path))
    monkeypatch.setattr(derive, "derive_profiles", fails)
    store.clear_memo()
    cfg = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
           "num_attention_heads": 4, "vocab_size": 128}
    with pytest.raises(ValueError, match=r"^trace: 'tiny' cannot run this workload class on fake tensors \(Expected "
                                         r"inputs of BF16 type but got mat_a.dtype=torch.float32\)"):
        store.profile(cfg, Workload(recipe="amp"), Parallel(), name="tiny")
    store.clear_memo()


def test_reading_an_inventory_holds_the_tracer_lock(monkeypatch):
    # tracer entry points run under TRACER_LOCK (app sessions derive in threads); read_inventory lost its
    # @serialized once when a helper was inserted above it
    pytest.importorskip("torch")
    from tracer import TRACER_LOCK, meta

    owned = []
    real = meta.hf_config

    def spy(config):
        owned.append(TRACER_LOCK._is_owned())
        return real(config)

    monkeypatch.setattr(meta, "hf_config", spy)
    meta.read_inventory({"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                         "num_attention_heads": 4, "vocab_size": 128})
    assert owned == [True]
