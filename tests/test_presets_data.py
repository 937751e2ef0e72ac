"""Every model preset (data/models/*.json) is a sound config.json, and builds to the parameter count it had when it
was checked against its public copies (docs/presets.md).

The counts below were read from meta-device builds with transformers 5.23 (no memory, no weights, no network, no
remote code): `AutoConfig.for_model(model_type, **rest)`, then `AutoModelForCausalLM.from_config` on that config, or
on its `text_config` for the multimodal checkpoints shipped nested (gemma3), the whole
image-text-to-text model for LLaVA, Qwen2.5-VL, Qwen3-VL, Llama-4, Mistral-3 and SmolVLM2, and `AutoModel` for
BERT (BertModel with its pooler, as published) and the vision encoders (ViTModel, Dinov2Model, SigLIP's
SiglipVisionModel from its vision_config: the published counts). Tied embeddings count once. An edited preset changes its count and
fails here; a new preset must add its count (and its row in docs/presets.md). The 52 builds take about 4 s on 2
cores once transformers is imported (measured: `python -m pytest -q tests/test_presets_data.py --durations=3`).
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from estimator.families import VISION_TYPES
from estimator.presets import MAX_CONFIG_BYTES, MODELS_DIR, parse_config_text, preset_names

DOCS = Path(__file__).resolve().parent.parent / "docs" / "presets.md"
WHOLE = ("llava", "qwen2_5_vl", "qwen3_vl", "llama4", "mistral3", "smolvlm")   # multimodal presets priced whole with their images

EXPECTED_PARAMS = {
    "bert-large-uncased": 335_141_888,
    "codellama-34b": 33_743_970_304,
    "deepseek-r1-distill-qwen-7b": 7_615_616_512,   # Qwen2.5-Math-7B's architecture, rope_theta 10000
    "deepseek-v2-lite": 15_706_484_224,
    "deepseek-v3": 671_026_404_352,
    "falcon-40b": 41_303_293_952,
    "falcon-7b": 6_921_720_704,
    "galore-llama-7b": 6_738_415_616,
    "gemma-2-2b": 2_614_341_888,
    "gemma-2-9b": 9_241_705_984,
    "gemma-2b": 2_506_172_416,
    "gemma-3-12b": 11_766_034_176,   # text model; the vision tower and projector add 0.42B
    "gemma-3-1b": 999_885_952,
    "gemma-3-27b": 27_009_346_304,   # text model
    "gemma-3-4b": 3_880_263_168,     # text model
    "gemma-7b": 8_537_680_896,
    "gpt-oss-120b": 116_829_156_672,
    "gpt-oss-20b": 20_914_757_184,
    "gpt2": 124_439_808,
    "llama-2-13b": 13_015_864_320,
    "llama-2-70b": 68_976_648_192,
    "llama-2-7b": 6_738_415_616,
    "llama-3-8b": 8_030_261_248,
    "llama-3.1-405b": 405_853_388_800,
    "llama-3.1-70b": 70_553_706_496,
    "llama-3.1-8b": 8_030_261_248,
    "llama-3.2-1b": 1_235_814_400,
    "llama-3.2-3b": 3_212_749_824,
    "llama-4-scout": 108_641_793_536,  # whole: the text model's 107,769,861,120 + its 34-layer ViT and projector
    "llava-1.5-7b": 7_063_427_072,   # whole (AutoModelForImageTextToText): Vicuna-7B + CLIP ViT-L/14-336 + projector
    "qwen2.5-vl-7b": 8_292_166_656,  # whole: its model card's 8.29B (ViT of 32 blocks, windowed, + Qwen2.5-7B)
    "qwen3-vl-8b": 8_767_123_696,    # whole: its model card's 8.77B (ViT of 27 blocks, deepstack, + Qwen3-8B)
    "smolvlm2-500m": 507_482_304,    # whole: SmolLM2-360M + a 12-block 512-px tower + pixel-shuffle connector
    # hybrid and linear-attention LMs (issue "The models people bring in 2026")
    "qwen3-next-80b-a3b": 79_674_391_296,
    "nemotron-h-8b": 8_100_852_736,
    "jamba-1.5-mini": 51_570_323_328,
    "qwen3.5-397b-a17b": 396_346_350_336,   # text model (Qwen3_5MoeForCausalLM from text_config)
    "qwen3.6-35b-a3b": 34_660_610_688,      # text model; Qwen3.5's architecture (model_type qwen3_5_moe)
    # encoder-decoder models, whole (tracer.seq2seq: AutoModelForSeq2SeqLM, Whisper's AutoModelForSpeechSeq2Seq)
    "t5-large": 737_668_096,
    "flan-t5-xl": 2_783_959_040,   # T5 v1.1 XL; transformers 5.23 ties its head (docs/presets.md)
    "whisper-large-v3": 1_543_490_560,
    "mistral-7b": 7_241_732_096,
    "mistral-small-3.1-24b": 24_011_361_280,  # whole: text model 23,572,403,200 + Pixtral tower and projector
    "mixtral-8x7b": 46_702_792_704,
    "opt-1.3b": 1_315_758_080,
    "phi-1_5": 1_418_270_720,
    "phi-2": 2_779_683_840,
    "phi-3-mini": 3_821_079_552,
    "phi-4": 14_659_507_200,
    "pythia-1.4b": 1_414_647_808,
    "stablelm-base-alpha-3b": 3_637_321_728,
    "qwen1.5-moe-a2.7b": 14_315_784_192,
    "qwen2.5-0.5b": 494_032_768,
    "qwen2.5-72b": 72_706_203_648,
    "qwen2.5-7b": 7_615_616_512,
    "qwen3-0.6b": 596_049_920,
    "qwen3-1.7b": 1_720_574_976,
    "qwen3-14b": 14_768_307_200,
    "qwen3-235b-a22b": 235_093_634_560,
    "qwen3-30b-a3b": 30_532_122_624,
    "qwen3-32b": 32_762_123_264,
    "qwen3-4b": 4_022_468_096,
    "qwen3-8b": 8_190_735_360,
    "smollm3-3b": 3_075_098_624,
    "tinyllama-1.1b": 1_100_048_384,
    # vision encoders, counted as published: the base model (AutoModel; SigLIP's vision tower alone)
    "vit-huge-patch14": 632_404_480,            # ViTModel incl. pooler; ViT-H/14 632M (arXiv 2010.11929 Table 1)
    "dinov2-giant": 1_136_480_768,              # Dinov2Model, SwiGLU MLP; ViT-g/14 1.1B (arXiv 2304.07193)
    "siglip-so400m-patch14-224": 427_680_704,   # SiglipVisionModel incl. its attention-pooling head
}

# Keys a preset must never carry: remote code, and a quantized weight format (a separate choice in willitfit).
FORBIDDEN_KEYS = ("auto_map", "quantization_config")


def _read(name: str) -> dict:
    return json.loads((MODELS_DIR / f"{name}.json").read_text())


def test_every_preset_has_an_expected_count_and_no_count_is_stale():
    assert set(EXPECTED_PARAMS) == set(preset_names())


@pytest.mark.parametrize("name", preset_names())
def test_preset_file_is_a_bounded_json_object_with_a_model_type(name):
    path = MODELS_DIR / f"{name}.json"
    assert path.stat().st_size <= MAX_CONFIG_BYTES
    cfg = parse_config_text(path.read_text())  # the same parser as an uploaded or downloaded config.json
    assert isinstance(cfg.get("model_type"), str) and cfg["model_type"]
    for key in FORBIDDEN_KEYS:
        assert key not in cfg and key not in cfg.get("text_config", {}), key
    if "text_config" in cfg:
        assert isinstance(cfg["text_config"].get("model_type"), str)


@pytest.mark.parametrize("name", [n for n in preset_names() if "_willitfit_note" in _read(n)])
def test_a_removed_key_is_named_in_the_note(name):
    note = _read(name)["_willitfit_note"]
    assert "removed" in note and any(key in note for key in FORBIDDEN_KEYS), note


def test_docs_table_lists_every_preset():
    text = DOCS.read_text()
    missing = [n for n in preset_names() if f"| `{n}` |" not in text]
    assert not missing, f"docs/presets.md has no row for {missing}"


@pytest.mark.parametrize("name", preset_names())
def test_meta_build_has_the_expected_parameter_count(name):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")

    cfg = _read(name)
    rest = {k: v for k, v in cfg.items() if k != "model_type" and not k.startswith("_")}
    hf_cfg = transformers.AutoConfig.for_model(cfg["model_type"], **rest)
    if "vision_config" in cfg and cfg["model_type"] in VISION_TYPES:
        hf_cfg = hf_cfg.vision_config
    elif cfg["model_type"] in WHOLE:   # priced whole with its images: counted whole
        pass
    elif "text_config" in cfg:
        hf_cfg = hf_cfg.get_text_config()
    auto = transformers.AutoModel if cfg["model_type"] in ("bert", *VISION_TYPES) else \
        transformers.AutoModelForImageTextToText if cfg["model_type"] in WHOLE else \
        transformers.AutoModelForSpeechSeq2Seq if cfg["model_type"] == "whisper" else \
        transformers.AutoModelForSeq2SeqLM if cfg.get("is_encoder_decoder") else transformers.AutoModelForCausalLM
    with torch.device("meta"):
        model = auto.from_config(hf_cfg, trust_remote_code=False)
    assert sum(p.numel() for p in model.parameters()) == EXPECTED_PARAMS[name]
