"""GPU presets (data/gpus.json -> estimator.gpus) and model presets (data/models/*.json) load and hold together."""
from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest

from estimator.gpus import GiB, GPU, GPUS_PATH, get_gpu, gpu_from_dict, gpu_names, gpu_to_dict, load_gpus
from estimator.presets import MODELS_DIR, parse_config_text, preset_names

GPUS = load_gpus()
MiB = 2**20


def test_there_are_at_least_twenty_gpus():
    assert len(GPUS) >= 20


@pytest.mark.parametrize("name", sorted(GPUS))
def test_gpu_round_trips_through_a_dict(name):
    gpu = GPUS[name]
    d = gpu_to_dict(gpu)
    assert json.loads(json.dumps(d)) == d          # plain JSON types only
    assert gpu_from_dict(d) == gpu


@pytest.mark.parametrize("name", sorted(GPUS))
def test_gpu_memory_is_in_a_sane_range(name):
    # Smallest preset is a 12 GB RTX 3060, largest a 256 GB MI325X; anything outside is a unit slip.
    assert 8 * GiB <= GPUS[name].memory_bytes <= 300 * GiB


@pytest.mark.parametrize("name", sorted(GPUS))
def test_nvidia_driver_memory_is_whole_mib(name):
    # nvidia-smi reports memory.total in MiB, so a byte count that is not a multiple of 2**20 was mistyped.
    gpu = GPUS[name]
    if gpu.vendor == "nvidia" and gpu.memory_source == "driver":
        assert gpu.memory_bytes % MiB == 0
        assert gpu.memory_reported.startswith(f"{gpu.memory_bytes // MiB} MiB")


def test_h100_capacity_is_what_nvidia_smi_reports():
    # nvidia-smi on an H100 SXM shows "81559MiB" as memory.total: 81559 * 2**20 bytes, not 80 * 10**9.
    assert get_gpu("h100-sxm-80gb").memory_bytes == 81559 * MiB == 85_520_809_984
    assert get_gpu("a100-sxm-80gb").memory_bytes == 81920 * MiB
    assert get_gpu("h200-sxm-141gb").memory_bytes == 143771 * MiB
    assert get_gpu("rtx-4090").memory_bytes == 24564 * MiB


def test_names_and_display_names_are_unique():
    names = [g.name for g in GPUS.values()]
    displays = [g.display_name.lower() for g in GPUS.values()]
    assert len(set(names)) == len(names)
    assert len(set(displays)) == len(displays)
    assert not set(names) & set(displays)


def test_lookup_is_case_insensitive_by_name_or_display_name():
    assert get_gpu("H100-SXM-80GB") is get_gpu("h100-sxm-80gb")
    assert get_gpu("nvidia l4") is get_gpu("l4")
    assert get_gpu("  NVIDIA GeForce RTX 4090 ") is get_gpu("rtx-4090")


def test_unknown_gpu_error_names_the_field_and_lists_every_choice_when_nothing_is_close():
    with pytest.raises(ValueError) as err:
        get_gpu("xyzzy")
    message = str(err.value)
    assert message.startswith("gpu: unknown GPU 'xyzzy'; choose one of ")
    for name in gpu_names():
        assert name in message


@pytest.mark.parametrize("spelling, name", [("a100-80gb", "a100-sxm-80gb"), ("rtx4090", "rtx-4090"),
                                            ("4090", "rtx-4090"), ("H100", "h100-sxm-80gb"),
                                            ("RTX_3090", "rtx-3090"), ("A100 40GB", "a100-sxm-40gb"),
                                            ("h200", "h200-sxm-141gb"), ("NVIDIA A6000", "rtx-a6000")])
def test_common_spellings_resolve(spelling, name):
    assert get_gpu(spelling) is get_gpu(name)


@pytest.mark.parametrize("typed, meant", [("a100", {"a100-sxm-40gb", "a100-sxm-80gb", "a100-pcie-80gb"}),
                                          ("v100", {"v100-sxm2-16gb", "v100-sxm2-32gb"}),
                                          ("rtx-4091", {"rtx-4090"}), ("h900", {"h100-sxm-80gb"})])
def test_an_unknown_gpu_answers_did_you_mean(typed, meant):
    with pytest.raises(ValueError) as err:
        get_gpu(typed)
    message = str(err.value)
    assert message.startswith(f"gpu: unknown GPU {typed!r}; did you mean ") and "\n" not in message
    assert all(m in message for m in meant)


def test_every_alias_names_a_gpu_and_none_is_ambiguous():
    import json

    from estimator.gpus import GPUS_PATH
    aliases = {k: v for k, v in json.loads(GPUS_PATH.read_text())["aliases"].items() if not k.startswith("_")}
    assert aliases and all(get_gpu(a).name == n for a, n in aliases.items())


def test_bf16_is_absent_only_on_pre_ampere_hardware():
    without_bf16 = {g.name for g in GPUS.values() if not g.supports_bf16}
    assert without_bf16 == {"t4", "v100-sxm2-16gb", "v100-sxm2-32gb"}


def test_dense_bf16_is_not_a_sparse_figure():
    # Datasheets headline 2:4-sparse numbers (H100 SXM: 1,979); the dense rate is half of that.
    assert get_gpu("h100-sxm-80gb").bf16_dense_tflops == pytest.approx(1979 / 2, abs=0.1)
    assert get_gpu("a100-sxm-80gb").bf16_dense_tflops == 312.0


def _valid_fields(**overrides) -> dict:
    d = gpu_to_dict(get_gpu("l4"))
    d.update(overrides)
    return d


@pytest.mark.parametrize("field, value", [
    ("vendor", "intel"),
    ("memory_source", "guess"),
    ("memory_bytes", 24 * 10**3),          # 24 "GB" typed without the unit
    ("memory_bytes", True),
    ("memory_bytes", 24.0 * GiB),
    ("fp16_dense_tflops", 0.0),
    ("bf16_dense_tflops", -1.0),
    ("memory_bandwidth_gbps", "300"),
    ("name", "NVIDIA L4"),
    ("display_name", " "),
])
def test_invalid_fields_are_rejected_naming_the_field(field, value):
    with pytest.raises(ValueError, match=f"^{field}: "):
        GPU(**_valid_fields(**{field: value}))


def test_unknown_and_missing_keys_are_rejected():
    with pytest.raises(ValueError, match="unknown keys sparse_tflops"):
        gpu_from_dict(_valid_fields(sparse_tflops=242.0))
    d = _valid_fields()
    del d["memory_bytes"]
    with pytest.raises(ValueError, match="missing memory_bytes"):
        gpu_from_dict(d)


def test_gpu_is_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        get_gpu("l4").memory_bytes = 1


def test_load_gpus_returns_a_copy_callers_cannot_corrupt():
    first = load_gpus()
    first.clear()
    assert len(load_gpus()) == len(GPUS)


def test_gpu_file_cites_sources():
    doc = json.loads(GPUS_PATH.read_text())
    assert len(doc["_sources"]) >= 10
    assert all(isinstance(s, str) and s for s in doc["_sources"])


def test_importing_gpus_does_not_import_torch():
    code = "import sys, estimator.gpus; sys.exit('torch' in sys.modules)"
    root = Path(__file__).resolve().parent.parent
    assert subprocess.run([sys.executable, "-c", code], cwd=root).returncode == 0


# ---------------------------------------------------------------- model presets (data/models/*.json)

REQUIRED_PRESETS = {
    "llama-2-7b", "llama-2-13b", "llama-2-70b", "llama-3.1-8b", "llama-3.1-70b", "llama-3.1-405b",
    "llama-3.2-1b", "llama-3.2-3b", "mistral-7b", "mixtral-8x7b", "qwen2.5-0.5b", "qwen2.5-7b", "qwen2.5-72b",
    "gemma-2-9b", "phi-3-mini", "gpt2", "bert-large-uncased", "falcon-7b", "deepseek-v3", "qwen3-0.6b",
    "qwen1.5-moe-a2.7b", "opt-1.3b", "pythia-1.4b", "deepseek-v2-lite",
}


def test_required_model_presets_are_shipped():
    assert REQUIRED_PRESETS <= set(preset_names())


@pytest.mark.parametrize("name", preset_names())
def test_model_preset_parses_and_has_model_type(name):
    cfg = parse_config_text((MODELS_DIR / f"{name}.json").read_text())
    assert isinstance(cfg.get("model_type"), str) and cfg["model_type"]
    # No remote code may ever be needed to build a preset.
    assert "auto_map" not in cfg


def test_deepseek_v3_preset_drops_fp8_quantization_and_says_why():
    cfg = parse_config_text((MODELS_DIR / "deepseek-v3.json").read_text())
    assert "quantization_config" not in cfg
    assert "quantization_config" in cfg["_willitfit_note"]
