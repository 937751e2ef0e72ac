"""Vision-language models priced whole with their images (tracer/vlm.py, `--images N`).

A tiny LLaVA (tests/data/tiny/t-llava.json: a 5-layer Llama of hidden 128, a 3-layer CLIP vision tower of hidden 64 on
32-pixel images in 8-pixel patches, 16 image tokens per image) has its parameters counted by hand; its estimate with
images, at sizes its profile was never fit at, equals a full-depth trace stage by stage, to the byte; images for a
model that takes none and a sequence too short for the images' tokens are refused in one line. Tiny SmolVLM, Idefics2
and BLIP-2 configs (models that read their inputs' values on the host) count their image tokens as a real forward
does and equal full-depth traces.

    python -m pytest tests/test_vlm.py -q                 # WILLITFIT_SLOW=1 adds LoRA, inference, checkpointing
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from estimator.spec import Workload
from traced import assert_equals_trace

TINY = Path(__file__).parent / "data" / "tiny"
ROOT = Path(__file__).resolve().parents[1]
SLOW = pytest.mark.skipif(not os.environ.get("WILLITFIT_SLOW"), reason="slow tier: WILLITFIT_SLOW=1")


def _config(name: str = "llava") -> dict:
    return json.loads((TINY / f"t-{name}.json").read_text())


def _model():
    from estimator.model import from_hf_config

    return from_hf_config(_config(), "t-llava")


def test_tiny_llava_is_counted_whole_by_hand():
    # Llama text model, vocab 512, hidden 128, 5 layers, 4 heads / 2 KV heads of 32, MLP 352, untied head:
    #   embeddings 512*128 = 65536; head 65536; per layer q 16384, k 8192, v 8192, o 16384, gate/up/down 3 * 45056,
    #   two RMSNorms 256 -> 184576, x 5 = 922880; final norm 128                                    -> 1,054,080
    # CLIP vision tower, hidden 64, 3 layers, MLP 128, 32-px images in 8-px patches (16 patches + CLS):
    #   patch conv 3*8*8*64 = 12288 (no bias); CLS 64; positions 17*64 = 1088; pre- and post-LayerNorm 2 * 128;
    #   per layer q, k, v, o 4 * (64*64 + 64) = 16640, fc1 8320, fc2 8256, two LayerNorms 256 -> 33472, x 3 = 100416
    #                                                                                                -> 114,112
    # projector 64 -> 128 -> 128: (64*128 + 128) + (128*128 + 128)                                   -> 24,832
    m = _model()
    assert m.params == 1_054_080 + 114_112 + 24_832
    assert m.inventory.built_as == "LlavaForConditionalGeneration" and m.layers == 5
    # LLaVA's default feature strategy drops the CLS token: 16 image tokens per image
    assert {k: v for k, v in m.inventory.extra["vlm"].items() if k != "unreached"} == {
        "image_size": 32, "num_channels": 3, "image_tokens": 16, "image_token_id": 511}


def test_lora_counts_the_vision_towers_adapters_as_peft_does():
    # PEFT matches q_proj / v_proj anywhere: the 5 text layers (q 128->128, v 128->64) and the 3 CLIP layers (64->64)
    m = _model()
    w = Workload(method="lora", lora_rank=8, images=1, seq=40)
    assert m.inventory.trainable_params(w) == 8 * (5 * ((128 + 128) + (128 + 64)) + 3 * 2 * (64 + 64))


def test_qlora_quantizes_the_vision_towers_linears_as_transformers_loads_them():
    # BitsAndBytesConfig converts every nn.Linear but the output embedding (transformers get_keys_to_not_convert):
    # the 3 CLIP layers' q, k, v, out_proj (64 x 64) and fc1/fc2 (64 x 128) and the projector's 64->128, 128->128
    from dataclasses import replace as dc_replace

    from estimator import components as comp

    inv = _model().inventory
    w = Workload(method="qlora")
    text_only = dc_replace(inv, extra={k: v for k, v in inv.extra.items() if k != "vlm"})
    tower = [(64, 64)] * 12 + [(128, 64), (64, 128)] * 3 + [(128, 64), (128, 128)]   # (out, in)
    expect = sum(fo * fi * 2 - comp.quantized_matrix_bytes(fo, fi, "nf4", True) for fo, fi in tower)
    assert comp.base_weight_bytes(text_only, w) - comp.base_weight_bytes(inv, w) == expect
    gptq = Workload(mode="infer", weight_format="gptq-4bit")   # GPTQ quantizes the language model's blocks only
    assert comp.base_weight_bytes(text_only, gptq) == comp.base_weight_bytes(inv, gptq)


def test_images_are_part_of_the_profile_class_and_zero_keeps_every_old_key():
    from estimator import store
    from estimator.spec import Parallel

    text, one, two = (store.workload_class(Workload(images=n)) for n in (0, 1, 2))
    assert "images" not in text and one["images"] == 1 and two["images"] == 2
    keys = {store.profile_key(Workload(images=n), Parallel()) for n in (0, 1, 2)}
    assert len(keys) == 3


def test_a_run_row_with_images_is_not_stored():
    from bench.trace.cases import unstorable
    from estimator.spec import Parallel

    assert unstorable(Parallel(), Workload(images=1)).startswith("out: a run row has no images column")
    assert unstorable(Parallel(), Workload()) is None


def test_bad_images_are_refused_in_one_line():
    from estimator.estimate import estimate
    from estimator.model import from_hf_config
    from estimator.spec import Parallel

    m = _model()
    with pytest.raises(ValueError, match=r"^seq: 40 tokens cannot hold 3 image\(s\) of 16 tokens each \(32x32 px\); "
                                         r"use a seq over 48$"):
        estimate(m, Workload(images=3, seq=40))
    text = from_hf_config(json.loads((TINY / "t-llama.json").read_text()), "t-llama")
    with pytest.raises(ValueError, match=r"^images: t-llama \(llama\) is not priced with images; the vision-language"):
        estimate(text, Workload(images=1), Parallel())
    with pytest.raises(ValueError, match="images: 2000 is out of range"):
        Workload(images=2000)


def test_a_vlm_whose_image_path_fails_on_its_config_is_priced_text_only():
    # Gemma-3 pools its patches to mm_tokens_per_image: 8 x 8 patches to 10 x 10 tokens makes a pooling stride of 0
    # (transformers' own default Gemma3Config does the same at 224 px): refused with images, priced without them
    from estimator.estimate import estimate
    from estimator.model import from_hf_config

    m = from_hf_config({**_config("gemma3vl"), "mm_tokens_per_image": 100}, "t-gemma3-bad")
    assert "vlm" not in m.inventory.extra and m.inventory.extra["vlm_refused"] == "stride should not be zero"
    with pytest.raises(ValueError, match=r"^images: t-gemma3-bad's vision tower fails on its own config's image size "
                                         r"\(stride should not be zero\); only a text-only step"):
        estimate(m, Workload(images=1, seq=100))


def _check(workload: Workload, sizes, name: str = "llava", parallel=None) -> None:
    from estimator.spec import Parallel

    assert_equals_trace(_config(name), f"t-{name}", workload, sizes, parallel or Parallel())


def test_training_with_an_image_equals_a_full_depth_trace():
    # fit at seqs the derivation chooses (3 and 4 of the 5 layers), checked at sizes it never traced
    _check(Workload(images=1), ((3, 100), (1, 17)))


def test_the_longest_sequence_search_starts_past_the_images():
    from estimator import search
    from estimator.estimate import estimate
    from estimator.spec import Parallel

    m, w = _model(), Workload(images=1, batch=2)           # 16 image tokens: the shortest seq is 17

    def total(s):
        return estimate(m, replace(w, seq=s)).total_bytes

    found = search.max_seq(m, w, Parallel(), total(200), limit=1000)
    assert 200 <= found <= 1000 and total(found) <= total(200) < total(found + 1)
    assert search.max_seq(m, w, Parallel(), total(17) - 1, limit=1000) == 0
    assert search.max_seq(m, w, Parallel(), total(17), limit=1000) >= 17
    assert search.max_seq(m, w, Parallel(), 1 << 50, limit=16) == 0   # no room for text after the image


def test_a_text_only_step_of_a_vlm_says_how_to_price_its_images():
    from estimator.vision import image_words, scope_notes

    m = _model()
    assert scope_notes(m, Workload(images=1)) == ()
    assert scope_notes(m, Workload()) == ("scope: llava is built whole (LlavaForConditionalGeneration) and the step is "
                                          "text-only; --images N prices N images per sample (vision tower, projector "
                                          "and image tokens)",)
    assert image_words(m, Workload(images=2, seq=100)) == "2 images of 32x32 px (32 image tokens) per sample"


@SLOW
def test_the_step_with_images_holds_more_than_the_text_only_one():
    from estimator.estimate import estimate

    m = _model()
    text, images = (estimate(m, Workload(images=n, batch=2, seq=100)) for n in (0, 1))
    def peak(e):
        return max(st.tensor_bytes for _, st in e.stages)

    assert peak(images) > peak(text)
    assert not any(n.startswith("scope:") for n in images.notes)
    assert any("--images N prices N images" in n for n in text.notes)


@SLOW
@pytest.mark.parametrize("workload, sizes", [
    (Workload(images=2, method="lora", lora_targets=("q_proj", "v_proj")), ((2, 333), (5, 70))),
    (Workload(images=1, mode="infer", gen_tokens=5), ((1, 77), (3, 300))),
    (Workload(images=1, checkpointing="full"), ((4, 500),)),
    (Workload(images=3, recipe="amp", loss="chunked", loss_chunks=4), ((2, 256),)),
])
def test_more_workloads_with_images_equal_full_depth_traces(workload, sizes):
    _check(workload, sizes)


def test_swapped_optimizers_count_only_the_parameters_the_step_reaches():
    # LLaVA reads CLIP's second-to-last layer: the last one and the post-LayerNorm get no gradient, no state
    # (tracer.vlm.unreached, on the meta device); a fused or SGD step priced from the traced foreach AdamW profile
    # must leave them out to equal the trace
    inv = _model().inventory
    assert [n for n, _, _ in inv.extra["vlm"]["unreached"]].count("q_proj.weight") == 1
    _check(Workload(images=1, optimizer_impl="fused"), ((2, 50),))
    _check(Workload(images=1, optimizer="sgd-momentum"), ((2, 50),))


def test_a_text_only_step_of_a_multimodal_preset_prices_no_state_for_its_vision_tower():
    # gemma-3-12b built whole: a text-only step never reaches its 0.42B-parameter vision tower and projector, so a
    # swapped optimizer's step must not subtract their temporaries (it left -842,581,728 B of temporaries before)
    from estimator.estimate import estimate
    from estimator.model import from_hf_config
    from estimator.presets import load_config

    name, cfg = load_config("gemma-3-12b")
    est = estimate(from_hf_config(cfg, name), Workload(optimizer_impl="fused", batch=1, seq=1))
    assert all(v >= 0 for _, b in est.stages for v in b.as_dict().values())


@SLOW
def test_text_only_swaps_and_lora_on_the_tower_equal_traces():
    _check(Workload(optimizer_impl="fused"), ((2, 50),))
    _check(Workload(images=1, method="lora", optimizer_impl="forloop", lora_targets=("q_proj", "v_proj", "fc1")),
           ((2, 50),))


@SLOW
def test_fsdp_with_images_equals_a_traced_rank():
    # FSDP2 wraps the language model's layers and the root (vision tower and projector included): rank 0 of 4, at a
    # world the fit did not use (it fits n = 2 and 4 at one size each, checks 8)
    from estimator.spec import Parallel

    _check(Workload(images=1), ((2, 90),), parallel=Parallel(strategy="fsdp", gpus=4))


@SLOW
@pytest.mark.parametrize("workload, sizes", [
    (Workload(images=1), ((3, 100), (2, 700))),                       # both sides of its 512-token window
    (Workload(images=2, mode="infer", gen_tokens=4), ((2, 150),)),
])
def test_gemma3_with_images_and_token_types_equals_full_depth_traces(workload, sizes):
    # t-gemma3vl.json: a 6-layer Gemma-3 text model (sliding window 512) and a 2-layer SigLIP tower, 16 image tokens
    # (8 x 8 patches pooled to 4 x 4); its token_type_ids make the image tokens attend both ways (tracer.vlm)
    _check(workload, sizes, "gemma3vl")


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "estimator", *args], capture_output=True, text=True, cwd=ROOT,
                          timeout=600)


def test_cli_names_the_images_and_refuses_a_short_seq(tmp_path):
    cfg = str(TINY / "t-llava.json")
    _model()   # its inventory in this session's cache (the CLI inherits WILLITFIT_CACHE): --no-derive reads it there
    out = _cli("--model", cfg, "--images", "4", "--seq", "60", "--no-derive")
    assert out.returncode == 2
    assert out.stderr.strip().splitlines()[-1] == ("python -m estimator: error: seq: 60 tokens cannot hold 4 image(s) "
                                                   "of 16 tokens each (32x32 px); use a seq over 64")
    assert "--images N" in _cli("--help").stdout


# Models whose image path reads values on the host (families.HOST_VLM_TYPES): SmolVLM (Idefics3's code: pixels stacked
# per sample, padding images dropped by a boolean index, pixel shuffle by scale_factor 2), Idefics2 (a perceiver
# resampler of 8 latents) and BLIP-2 (a Q-Former of 8 queries, its all-ones mask checked with `.all()`)
# LLaVA-NeXT's family (families.LOOP_VLM_TYPES, tracer.vlm_loop): a 64-px image in 32-px tiles of 4 x 4 patches is the
# base tile and a 2 x 2 grid: 16 + 8 x 8 tokens and one newline per row of 8 -> 88
# Llama-4: a 32-px tile of 4 x 4 patches pixel-shuffled by 0.5 -> 4 tokens (its CLS row dropped); Pixtral's towers
# (Mistral-3, LightOnOCR): a 64-px image of 8 x 8 patches merged 2 x 2 -> 16
HOST = {"smolvlm": 4, "idefics2": 8, "blip2": 8, "ovis2": 4, "llava_next": 88, "llava_next_video": 88,
        "llava_onevision": 88, "llama4": 4, "mistral3": 16, "lighton_ocr": 16,
        "llava_pixtral": 16,   # tiny config -> tokens per image (LLaVA with Pixtral's tower: 4 x 4 16-px patches)
        "lfm2_vl": 64, "mistral_large4": 16}   # LFM2-VL: a 512-px tile of 16 x 16 32-px patches, unshuffled 2 x 2


@pytest.mark.parametrize("name", sorted(HOST))
def test_host_value_vlms_count_the_tokens_a_real_forward_makes(name):
    # the tokens read on the meta device (a fake mode with host values) against the model's own forward on real CPU
    # tensors: its features' rows for one image
    import torch
    from transformers import AutoConfig, AutoModelForImageTextToText

    from estimator.model import from_hf_config
    from tracer import vlm

    cfg = _config(name)
    assert from_hf_config(cfg, f"t-{name}").inventory.extra["vlm"]["image_tokens"] == HOST[name]
    hf = AutoConfig.for_model(**cfg)
    torch.manual_seed(0)
    model = AutoModelForImageTextToText.from_config(hf).eval()
    kwargs = vlm.image_kwargs(model, 1, 1, "cpu")
    kwargs["pixel_values"] = torch.rand_like(kwargs["pixel_values"]) + 0.5   # a real image: nonzero pixels
    if "pixel_attention_mask" in kwargs:
        kwargs["pixel_attention_mask"] = torch.ones_like(kwargs["pixel_attention_mask"])
    with torch.no_grad():
        out = (getattr(model, "get_image_features", None) or model.model.get_image_features)(**kwargs)
    if getattr(out, "pooler_output", None) is None and getattr(out, "last_hidden_state", None) is not None:
        # Llama-4: its forward projects every row of the tower's output (vision_flat) into one token
        assert out.last_hidden_state.numel() // out.last_hidden_state.shape[-1] == HOST[name]
        return
    feats = getattr(out, "pooler_output", out)
    rows = sum(int(t.numel()) for t in ([feats] if torch.is_tensor(feats) else feats))
    assert rows // model.get_input_embeddings().embedding_dim == HOST[name]


@SLOW   # 95 s on 2 cores; the default tier keeps its token count against a real forward (above), and its loops' marks
@pytest.mark.parametrize("workload, sizes", [   # are LFM3-VL's and SigLIP2's (tests/test_vlm_grid.py, test_vision.py)
    (Workload(images=1), ((2, 100), (5, 90), (1, 80))),
    (Workload(images=2), ((3, 200), (1, 150))),
    (Workload(images=1, method="lora"), ((2, 90), (4, 100))),
    (Workload(images=1, mode="infer", gen_tokens=3), ((2, 100), (5, 80))),
])
def test_lfm2_vl_with_naflex_images_equals_full_depth_traces(workload, sizes):
    """LFM2-VL: SigLIP2's NaFlex tower (its per-image position grids) and a projection per image in a Python loop
    (tracer.loop_marks), one 512-px tile per image; batch 2 fit apart with one image per sample."""
    _check(workload, sizes, "lfm2_vl")


@SLOW   # 85 s on CI's 2 cores; the default tier keeps the stacked route's token count against a real forward (above)
def test_a_host_value_vlm_with_stacked_images_equals_full_depth_traces():
    _check(Workload(images=2), ((3, 100),), "smolvlm")


@SLOW
@pytest.mark.parametrize("name, workload, sizes", [
    ("idefics2", Workload(images=1), ((2, 90),)),
    ("blip2", Workload(images=1), ((3, 61),)),
    ("smolvlm", Workload(images=1, method="lora"), ((2, 129),)),
    ("smolvlm", Workload(images=3, mode="infer", gen_tokens=4), ((2, 77),)),
    ("idefics2", Workload(images=2, checkpointing="full"), ((3, 200),)),
    ("blip2", Workload(images=1, method="lora"), ((4, 50),)),
    # Ovis2: each image wrapped in three visual indicator tokens, whose embeddings it writes by a boolean index
    ("ovis2", Workload(images=2), ((3, 64),)),
    # Mistral-Large-4: Mistral-3's Pixtral tower on a DeepSeek-V3.2-style sparse-attention MoE (families.PIXTRAL_VLM_TYPES)
    ("mistral_large4", Workload(images=1, attention="flash"), ((3, 120), (1, 70))),
])
def test_more_host_value_vlm_workloads_equal_full_depth_traces(name, workload, sizes):
    _check(workload, sizes, name)


def test_image_features_narrower_than_the_text_model_are_refused_in_one_line():
    # Ovis2's and Janus's default configs: visual embeddings of another width than the text model's, which their
    # forward would scatter by element count; a config whose parts disagree prices no images
    from estimator.estimate import estimate
    from estimator.model import from_hf_config

    m = from_hf_config({**_config("ovis2"), "hidden_size": 64}, "t-ovis2-bad")
    assert "vlm" not in m.inventory.extra and "image features are 64 wide and its text embeddings 128" in \
        m.inventory.extra["vlm_refused"]
    with pytest.raises(ValueError, match=r"^images: t-ovis2-bad's vision tower fails on its own config's image size"):
        estimate(m, Workload(images=1, seq=100))
    ovis = from_hf_config(_config("ovis2"), "t-ovis2")   # 4 tokens and 3 indicators per image: seq must exceed 14
    with pytest.raises(ValueError, match=r"^seq: 14 tokens cannot hold"):
        estimate(ovis, Workload(images=2, seq=14))


def test_aya_vision_counts_its_pixel_shuffled_tokens_and_leaves_the_pooling_head_unreached():
    # Aya Vision: a SigLIP tower read at its last hidden state (its attention-pooling head and post-layernorm get no
    # gradient), 2 x 2 pixel shuffle into a SwiGLU projector: 4 x 4 patches of the tiny config's 32 px image -> 4
    # tokens. Its default config builds no vision tower (1152 wide with 14 heads), so coverage cannot show it.
    from estimator.model import from_hf_config

    v = from_hf_config(_config("aya_vision"), "t-aya_vision").inventory.extra["vlm"]
    assert (v["image_size"], v["image_tokens"]) == (32, 4)
    assert {u[0].split(".")[0] for u in v["unreached"]} >= {"head", "post_layernorm"}


@SLOW
@pytest.mark.parametrize("workload, sizes", [
    (Workload(images=1), ((3, 100), (1, 17))),
    (Workload(images=2, mode="infer", gen_tokens=3), ((2, 90),)),
    (Workload(images=1, method="lora", lora_targets=("q_proj", "v_proj")), ((2, 64),)),
])
def test_aya_vision_with_images_equals_full_depth_traces(workload, sizes):
    _check(workload, sizes, "aya_vision")


# LLaVA-NeXT's family (families.LOOP_VLM_TYPES): each image's tile features packed in a Python loop over the images
# (tracer.vlm_loop), whose ticks are keyed per iteration (tracer.ticks)

def test_a_per_image_loop_has_the_same_ticks_at_any_number_of_images():
    # a synthetic run: 2 allocations, then a loop whose iterations each keep an output and free a temporary, then
    # one more allocation; with 1, 2 and 5 iterations the keys are the same and the loop's ticks are the last
    # iteration's (every output before it still held)
    import numpy as np

    from tracer.counters import Timeline
    from tracer.ticks import LOOP_INDEX, _candidates

    def run(n: int):
        kind, nbytes, loops = [0, 1, 1], [0, 100, 10], []
        for i in range(n):
            loops.append((len(kind) - 1, i))
            kind += [1, 1, -1]   # an output (kept), a temporary, the temporary freed
            nbytes += [7, 3, 3]
        loops.append((len(kind) - 1, None))
        kind += [1]
        nbytes += [50]
        T = len(kind)
        tl = Timeline(np.array(kind, np.int8), np.array(nbytes, np.int64), np.full(T, 4, np.int8),
                      np.arange(T, dtype=np.int64), ((T - 1, "prefill"),), (), tuple(loops))
        return _candidates(tl, train=False)

    ticks = {n: run(n) for n in (1, 2, 5)}
    assert ticks[1].keys == ticks[2].keys == ticks[5].keys
    loop = [i for i, k in enumerate(ticks[5].keys) if k[-1] >= LOOP_INDEX]
    assert len(loop) == 1   # the temporary's tick, of the last iteration
    for n, t in ticks.items():
        assert int(t.values[loop[0]].sum()) == 110 + 7 * n + 3


def test_a_per_image_loop_vlm_with_an_image_equals_a_full_depth_trace():
    # tiny LLaVA-NeXT: 64-px images of 5 tiles (88 tokens), at batch sizes (1, 3) the fit never used: 1 and 3 loop
    # iterations
    _check(Workload(images=1), ((3, 300), (1, 170)), "llava_next")


def test_llava_onevision_prices_one_image_per_sample():
    from estimator.estimate import estimate
    from estimator.model import from_hf_config

    m = from_hf_config(_config("llava_onevision"), "t-llava_onevision")
    assert (m.inventory.extra["vlm"]["image_size"], m.inventory.extra["vlm"]["image_tokens"]) == (64, 88)
    with pytest.raises(ValueError, match=r"^images: t-llava_onevision is priced with 1 image per sample \(2 asked\)"):
        estimate(m, Workload(images=2, seq=400))


@SLOW
@pytest.mark.parametrize("name, workload, sizes", [
    ("llava_onevision", Workload(images=1), ((3, 300), (1, 170))),
    ("llava_next_video", Workload(images=1), ((3, 300),)),
    ("llava_next", Workload(images=2), ((3, 400),)),
    ("llava_next", Workload(images=1, method="lora"), ((2, 200),)),
    ("llava_next", Workload(images=1, checkpointing="full"), ((3, 250),)),
    ("llava_next", Workload(images=2, mode="infer", gen_tokens=4), ((3, 300),)),
    ("llava_onevision", Workload(images=1, method="lora", lora_targets=("q_proj", "v_proj")), ((4, 180),)),
    # other image sizes: 32 px (a 1 x 2 pinpoint, unpadded to 4 x 4: 36 tokens), 130 px (OneVision's 3 x 3: 172)
    ("llava_next", Workload(images=2, image_size=32), ((3, 200), (1, 90))),
    ("llava_onevision", Workload(images=1, image_size=130, mode="infer", gen_tokens=3), ((2, 300),)),
])
def test_more_per_image_loop_vlm_workloads_equal_full_depth_traces(name, workload, sizes):
    _check(workload, sizes, name)


@SLOW
def test_without_the_loop_marks_a_per_image_loop_vlm_is_refused():
    # the marks are what makes the step one polynomial: without them its ticks differ with the number of images
    import contextlib

    from estimator.model import from_hf_config
    from tracer import derive, vlm_loop

    cfg = _config("llava_next")
    m = from_hf_config(cfg, "t-llava_next")
    original = vlm_loop.loop_step
    vlm_loop.loop_step = lambda model, counter: contextlib.nullcontext()
    try:
        with pytest.raises(ValueError, match="runs other operations"):
            derive.derive_profile(cfg, Workload(images=1), config_hash=m.config_hash)
    finally:
        vlm_loop.loop_step = original


@pytest.mark.parametrize("name", ["llava_next", "llava_onevision"])
def test_tiled_image_tokens_at_any_size_match_the_models_own_forward(name):
    # estimator.vision.tiled_tokens (arithmetic: pinpoint, unpadding, OneVision's cap, newlines) against the tokens
    # the model's get_image_features makes on real CPU tensors, for square images that pick every kind of grid
    import torch
    from transformers import AutoConfig, AutoModelForImageTextToText

    from estimator.model import from_hf_config
    from estimator.vision import tiled_tokens
    from tracer import vlm

    cfg = _config(name)
    t = from_hf_config(cfg, f"t-{name}").inventory.extra["vlm"]["tiles"]
    torch.manual_seed(0)
    model = AutoModelForImageTextToText.from_config(AutoConfig.for_model(**cfg)).eval()
    get = model.model.get_image_features
    for px in (8, 20, 32, 40, 64, 75, 96, 130, 200):
        kwargs = vlm.image_kwargs(model, 1, 1, "cpu", px)
        with torch.no_grad():
            feats = get(**kwargs).pooler_output
        rows = sum(int(x.shape[0]) for x in feats)
        assert tiled_tokens(name, t, px) == rows, px


def test_a_tiled_vlms_image_size_is_its_class_and_prices_its_tokens():
    from dataclasses import replace as _replace

    from estimator import store
    from estimator.model import from_hf_config
    from estimator.vision import check_images, image_tokens, sized

    m = from_hf_config(_config("llava_next"), "t-llava_next")
    w = sized(m, Workload(images=1, seq=400))
    assert w.image_size == 64 and image_tokens(m, w) == 88
    big = sized(m, _replace(w, image_size=96))   # a 3 x 3 grid's pinpoint is not offered: 64 x 64, cut to a square
    assert image_tokens(m, big) == 16 + 8 * 9
    assert store.workload_class(w) != store.workload_class(_replace(w, image_size=32))
    with pytest.raises(ValueError, match=r"^seq: 50 tokens cannot hold 1 image\(s\) of 88 tokens each \(64x64 px\)"):
        check_images(m, _replace(w, seq=50))
    with pytest.raises(ValueError, match=r"^image_size: t-llava_next's images are sized with --images N"):
        sized(m, Workload(image_size=64))


# Llama-4 (Scout, Maverick): its vision tower on 336-px tiles (its processor cuts an image into up to 16 tiles and a
# global one), each tile pixel-shuffled into 144 tokens and projected in the forward itself

def test_llama4_with_images_equals_a_full_depth_trace():
    _check(Workload(images=2), ((3, 100), (1, 40)), "llama4")


@SLOW
@pytest.mark.parametrize("workload, sizes", [
    (Workload(images=1, method="lora"), ((2, 64),)),
    (Workload(images=3, mode="infer", gen_tokens=4), ((2, 90),)),
    (Workload(images=1, checkpointing="full"), ((3, 50),)),
])
def test_more_llama4_workloads_with_images_equal_full_depth_traces(workload, sizes):
    _check(workload, sizes, "llama4")


# Pixtral's tower (Mistral-3, LightOnOCR): each image its own grid of patches, two loops over the images (their 2D
# positions, the patch merger's unfold) marked per iteration (tracer.vlm_loop), attention as FlashAttention-2's varlen

def test_mistral3_with_an_image_equals_a_full_depth_trace():
    _check(Workload(images=1, attention="flash"), ((3, 120), (1, 70)), "mistral3")


def test_pixtral_under_sdpa_is_refused_in_one_line_and_its_sizes_are_checked():
    from dataclasses import replace as _replace

    from estimator.estimate import estimate
    from estimator.model import from_hf_config
    from estimator.vision import image_tokens, sized

    m = from_hf_config(_config("mistral3"), "t-mistral3")
    with pytest.raises(ValueError, match=r"^attention: under sdpa t-mistral3's vision tower masks every image's "
                                         r"patches against every other's"):
        estimate(m, Workload(images=1, seq=100))
    w = sized(m, Workload(images=2, seq=100, attention="flash"))
    assert w.image_size == 64 and image_tokens(m, w) == 2 * (16 + 4)   # 4 x 4 tokens and a break token per row
    assert image_tokens(m, _replace(w, image_size=96)) == 2 * (36 + 6)
    with pytest.raises(ValueError, match=r"^image_size: 70 is not a multiple of t-mistral3's 16-px merged patch"):
        sized(m, _replace(w, image_size=70))
    with pytest.raises(ValueError, match=r"^seq: 40 tokens cannot hold 2 image\(s\) of 16 tokens each"):
        estimate(m, _replace(w, seq=40))


def test_the_cli_prices_a_pixtral_model_under_flash_and_says_so():
    from estimator.cli import grid_attention
    from estimator.model import from_hf_config

    m = from_hf_config(_config("mistral3"), "t-mistral3")
    w, note = grid_attention(m, Workload(images=1, seq=100), given=False)
    assert w.attention == "flash" and note.startswith("attention: flash") and "masks every image's patches" in note
    assert grid_attention(m, Workload(images=1, seq=100), given=True) == (Workload(images=1, seq=100), None)
    assert grid_attention(m, Workload(images=0, seq=100), given=False)[1] is None


@SLOW
@pytest.mark.parametrize("name, workload, sizes", [
    ("lighton_ocr", Workload(images=1, attention="flash"), ((3, 120), (1, 70))),
    # LLaVA with Pixtral's tower (Pixtral-12B's checkpoints): the positions loop alone, no patch merger
    ("llava_pixtral", Workload(images=2, attention="flash"), ((3, 120), (1, 70))),
    ("mistral3", Workload(images=2, attention="flash", image_size=96), ((3, 200),)),
    ("mistral3", Workload(images=1, attention="flash", method="lora"), ((2, 90),)),
    ("mistral3", Workload(images=1, attention="flash", checkpointing="full"), ((3, 90),)),
    ("mistral3", Workload(images=2, attention="flash", mode="infer", gen_tokens=3), ((3, 120),)),
    ("lighton_ocr", Workload(images=1, attention="flash", image_size=32, method="lora",
                             lora_targets=("q_proj", "v_proj")), ((4, 60),)),
])
def test_more_pixtral_workloads_equal_full_depth_traces(name, workload, sizes):
    _check(workload, sizes, name)
