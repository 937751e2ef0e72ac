"""Vision encoders (ViT, DINOv2, SigLIP and CLIP vision towers): sized by their image, priced exactly.

Tiny configs (tests/data/tiny/t-vit.json, t-dinov2.json: hidden 64, 4 heads, MLP 128, 32- and 28-pixel images in
4-pixel patches) with their parameters counted by hand; `estimate` at an image size its profile was never fit at
equals a full-depth trace of that image's tokens, stage by stage, to the byte; bad sizes and unmodelled image models
are refused in one line.

    python -m pytest tests/test_vision.py -q
"""
from __future__ import annotations

import json
import math
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from estimator import vision
from estimator.spec import Workload

TINY = Path(__file__).parent / "data" / "tiny"
ROOT = Path(__file__).resolve().parents[1]


def _config(name: str, **overrides) -> dict:
    cfg = json.loads((TINY / f"t-{name}.json").read_text())
    cfg.update(overrides)
    return cfg


def _model(name: str, **overrides):
    from estimator.model import from_hf_config

    return from_hf_config(_config(name, **overrides), f"t-{name}")


# ---------------------------------------------------------------- parameters, counted by hand

def test_vit_parameters_are_counted_exactly():
    # ViTForImageClassification, hidden 64, 5 layers, MLP 128, 3 x 32 x 32 images in 4 x 4 patches, 2 labels:
    #   patch conv 3*4*4*64 + 64 = 3136; CLS token 64; position embeddings (8*8 + 1) * 64 = 4160
    #   per layer: q, k, v, o 4 * (64*64 + 64) = 16640; fc1 64*128 + 128 = 8320; fc2 128*64 + 64 = 8256;
    #              two LayerNorms 2 * 128 = 256                                   -> 33472, x 5 = 167360
    #   final LayerNorm 128; classifier 64*2 + 2 = 130                            -> 174978
    # Inference runs ViTModel: no classifier (-130), its pooler 64*64 + 64 (+4160) -> 179008
    m = _model("vit")
    assert m.params == 174978
    assert m.inventory.built_as == "ViTForImageClassification" and m.layers == 5
    assert vision.geometry(m) == {"image_size": 32, "patch_size": 4, "num_channels": 3, "extra_tokens": 1,
                                  "num_labels": 2, "base_params": 179008, "unreached": [], "unreached_read": "step"}
    assert vision.params(m, Workload(mode="infer")) == 179008


def test_dinov2_parameters_are_counted_exactly():
    # Dinov2ForImageClassification, hidden 64, 5 layers, mlp_ratio 2 (MLP 128), 28-pixel images in 4-pixel patches:
    #   patch conv 3136; CLS token 64; mask token 64; position embeddings (7*7 + 1) * 64 = 3200
    #   per layer: norm1 128, attention 16640, layer_scale1 64, norm2 128, fc1 8320, fc2 8256, layer_scale2 64
    #                                                                             -> 33600, x 5 = 168000
    #   final LayerNorm 128; classifier on [CLS, mean of patches]: 2*64*2 + 2 = 258 -> 174850; Dinov2Model: 174592
    m = _model("dinov2")
    assert m.params == 174850
    assert vision.geometry(m)["extra_tokens"] == 1 and vision.geometry(m)["base_params"] == 174592
    assert vision.geometry(m)["unreached"] == [[1, 64]]  # the mask token: no gradient in a classification step


def test_register_tokens_are_read_from_the_model():
    # DINOv2 with registers (t-dinov2reg.json: 4 register tokens, 3 layers): CLS + 4 registers beside the patches
    m = _model("dinov2reg")
    assert vision.geometry(m)["extra_tokens"] == 5
    assert vision.sized(m, Workload(image_size=36)).seq == 9 * 9 + 5


# ---------------------------------------------------------------- sizes in the model's own terms

def test_image_size_becomes_tokens_per_image():
    vit, dino = _model("vit"), _model("dinov2")
    assert vision.sized(vit, Workload()).seq == 8 * 8 + 1          # the config's 32 pixels
    assert vision.sized(vit, Workload(image_size=40)).seq == 10 * 10 + 1
    assert vision.sized(dino, Workload(image_size=56)) == Workload(image_size=56, seq=14 * 14 + 1)
    with pytest.raises(ValueError, match=r"^image_size: 30 is not a multiple of t-vit's patch size 4 .* use 28 or 32$"):
        vision.sized(vit, Workload(image_size=30))


def test_a_run_rows_tokens_are_kept():
    # image_size is no run column: a row's seq holds its tokens per image, and they price it as they are
    vit = _model("vit")
    assert vision.sized(vit, Workload(seq=101)) == Workload(seq=101, image_size=40)
    assert vision.sized(vit, Workload(seq=64)) == Workload(seq=64, image_size=0)   # 63 patches: a 7 x 9 rectangle
    with pytest.raises(ValueError, match=r"^seq: 1 tokens per image leave no patch"):
        vision.sized(vit, Workload(seq=1))


def test_a_text_model_refuses_an_image_size():
    from estimator.model import from_hf_config

    llama = from_hf_config(_config("llama"), "t-llama")
    assert vision.sized(llama, Workload(seq=100)).seq == 100
    with pytest.raises(ValueError, match=r"^image_size: applies to vision encoders and to Qwen2-VL.s, LLaVA-NeXT.s and "
                                         r"Pixtral.s families with --images; t-llama \(llama\) is sized by seq"):
        vision.sized(llama, Workload(image_size=224))


def test_unmodelled_image_model_is_refused_in_one_line_without_torch(tmp_path):
    # DiNAT has an image-classification model willitfit does not model, and MobileViT one whose derivation was
    # refused (families.VISION_REFUSED): both refused from transformers' source read as text, before torch is
    # imported, the second with its reason
    from estimator.families import VISION_TYPES

    code = ("import sys\nfrom tracer.model_types import check_model_type\n"
            "for t in ('dinat', 'mobilevit'):\n"
            "    try:\n        check_model_type({'model_type': t})\n    except ValueError as e:\n        print(e)\n"
            "assert 'torch' not in sys.modules\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines() == [
        "model_type: 'dinat' is an image model willitfit does not model yet; the vision encoders it models are "
        f"{', '.join(VISION_TYPES)} (docs/architectures.md)",
        "model_type: 'mobilevit' is not priced: its derivation's check found memory that is no polynomial in the "
        "image's h x w grid units (a copy of a feature map padded or unfolded: terms in h + w): MobileViT unfolds its "
        "feature maps into patches"]
    assert "convnext" in VISION_TYPES and "mobilevit" not in VISION_TYPES


def test_batch_one_keeps_a_patch_gradient_through_the_optimizer_step():
    # Traced, and so in the shipped ViT-H/14 profile: at batch 1 the optimizer stage holds one more bf16 tensor of
    # patches x hidden (2 * p * 1280 bytes) than the batch >= 2 polynomial's line through batches 2 and 3 gives (a
    # size-1 batch dimension lets autograd keep a gradient as a view where batch 2 computes a new, smaller one), so on
    # tiny images batch 1 holds more than batch 2. Measured on the tiny ViT too: 128 bytes per patch at hidden 64.
    from estimator.estimate import Options, estimate
    from estimator.model import from_hf_config
    from estimator.presets import load_config

    name, cfg = load_config("vit-huge-patch14")
    m = from_hf_config(cfg, name, derive=False)
    for pixels, patches in ((14, 1), (28, 4)):
        opt = {b: dict(estimate(m, Workload(batch=b, image_size=pixels), options=Options(derive=False)).stages)[
            "optimizer"].tensor_bytes for b in (1, 2, 3)}
        assert opt[1] > opt[2] < opt[3]
        assert opt[1] - (2 * opt[2] - opt[3]) == 2 * patches * 1280


# ---------------------------------------------------------------- the CLI

def _cli(*args: str) -> subprocess.CompletedProcess:
    """The CLI's run, its stderr less the progress lines ("[i/n] ...": reading a model's parameters the first time
    in a session), so a test of the one-line error does not depend on which test read the model first."""
    out = subprocess.run([sys.executable, "-m", "estimator", *args], cwd=ROOT, capture_output=True, text=True,
                         timeout=300)
    out.stderr = "".join(x for x in out.stderr.splitlines(keepends=True) if not x.startswith("["))
    return out


def test_cli_has_an_image_size_flag_and_refuses_seq_for_a_vision_model():
    from estimator.cli import build_parser

    assert "--image-size" in build_parser().format_help()
    cfg = str(TINY / "t-vit.json")
    out = _cli("--model", cfg, "--seq", "100")
    assert out.returncode == 2 and out.stderr.strip() == (
        "python -m estimator: error: seq: t-vit is a vision encoder, sized by --image-size (pixels), not --seq")
    out = _cli("--model", cfg, "--image-size", "30", "--no-derive")
    assert out.returncode == 2 and out.stderr.strip().startswith("python -m estimator: error: image_size: 30 is not")
    assert len(out.stderr.strip().splitlines()) == 1


def test_cli_refuses_an_unmodelled_image_model(tmp_path):
    cfg = tmp_path / "pvt.json"
    cfg.write_text(json.dumps({"model_type": "pvt", "hidden_sizes": [8, 16], "depths": [1, 1]}))
    out = _cli("--model", str(cfg))
    assert out.returncode == 2 and out.stderr.strip().startswith(
        "python -m estimator: error: model_type: 'pvt' is not priced: its code fails on images other than")


# ---------------------------------------------------------------- estimate == full-depth trace

def _check_estimate_equals_trace(config: dict, workload: Workload) -> None:
    """`estimate` at `workload.image_size` (its profile derived by the tracer at token counts of its own choosing:
    256, 512, 768 and a verify size near 1000) gives every stage's tensor bytes equal to a full-depth trace of that
    many tokens per image (bench.trace.cases.trace_case), to the byte."""
    from bench.trace.cases import trace_case
    from estimator.estimate import estimate
    from estimator.model import from_hf_config

    model = from_hf_config(config, "tiny")
    est = estimate(model, workload)
    tower = config.get("vision_config")   # SigLIP, CLIP: the one note says the text tower is not built
    spatial = tuple(n for n in est.notes if n.startswith("attention: ") and n.endswith("priced as it runs"))
    naflex = tuple(n for n in est.notes if n.startswith(f"scope: {config['model_type']}'s NaFlex processor is taken "
                                                        "with max_num_patches = the image's patch count"))
    assert naflex or config["model_type"] != "siglip2", est.notes
    assert est.notes == spatial + ((f"scope: {config['model_type']} is priced as its vision tower alone ({model.inventory.built_as}"
                          f" on its {config['model_type']}_vision_model); the checkpoint's text tower is not built",)
                         if tower else ()) + naflex, est.notes
    assert est.workload.seq == vision.tokens(model, workload.image_size or vision.geometry(model)["image_size"])
    row = trace_case(config, "tiny", replace(est.workload, image_size=0))
    stages = ("load", "forward", "backward", "optimizer") if workload.mode == "train" else ("load", "prefill")
    got = {name: b.tensor_bytes for name, b in est.stages if name in stages}
    assert got == {name: row[f"{name}_peak_alloc_bytes"] for name in stages}


def test_vit_training_estimate_equals_a_full_depth_trace_at_an_unfitted_image_size():
    # 40 pixels: 10 x 10 patches + CLS = 101 tokens, a size the fit never traced; 3 layers (traced whole)
    _check_estimate_equals_trace(_config("vit", num_hidden_layers=3), Workload(batch=2, image_size=40))


def test_dinov2_inference_estimate_equals_a_full_depth_trace_at_an_unfitted_image_size():
    # DINOv2 always interpolates its position embeddings: 36 pixels, 9 x 9 patches + CLS = 82 tokens
    _check_estimate_equals_trace(_config("dinov2", num_hidden_layers=3), Workload(mode="infer", batch=3,
                                                                                 image_size=36))


def test_siglip2_naflex_estimate_equals_a_full_depth_trace_at_batch_two_and_past_the_fit():
    """SigLIP2 (NaFlex: patches, a pixel mask and each sample's grid in; tests/data/tiny/t-siglip2.json, 64 patches
    of 4 px) interpolates its position grid per sample in a Python loop (tracer.loop_marks.naflex_step, on a GPU's
    branch); backward's first two samples to run are kept and batch 2 is fit apart (families.batch_two_apart): 40 px
    (100 patches) at batch 2 and batch 5, sizes the fit never traced."""
    from tracer import loop_marks
    import transformers.models.siglip2.modeling_siglip2 as s2

    assert loop_marks._naflex_source_ok(s2.Siglip2VisionEmbeddings)
    for batch in (2, 5):
        _check_estimate_equals_trace(_config("siglip2"), Workload(batch=batch, image_size=40))
    assert type(s2.Siglip2VisionEmbeddings.__dict__["resize_positional_embeddings"]).__name__ == "staticmethod"


@pytest.mark.slow
@pytest.mark.parametrize("workload", [Workload(batch=1, image_size=36), Workload(mode="infer", batch=3, image_size=44),
                                      Workload(batch=3)])   # the config's own 32 px: 64 patches
def test_siglip2_more_sizes_and_inference(workload):
    _check_estimate_equals_trace(_config("siglip2"), workload)


@pytest.mark.slow  # derives 5-layer profiles (reduced depth 3 and 4, extended to 5): a minute of CPU
@pytest.mark.parametrize("name, workload", [
    ("vit", Workload(batch=4, image_size=48)),                                     # 145 tokens
    ("vit", Workload(batch=1)),                                                    # the config's own 32 pixels
    ("vit", Workload(batch=2, image_size=40, recipe="fp32", precision="fp32")),    # memory-efficient attention
    ("vit", Workload(batch=2, image_size=40, method="lora")),
    ("dinov2", Workload(batch=2, image_size=36)),
    ("dinov2", Workload(batch=3)),                                                 # 28 pixels: no interpolation
    ("dinov2reg", Workload(batch=2, image_size=36)),                               # 81 patches + CLS + 4 registers
], ids=["vit-48", "vit-native", "vit-fp32", "vit-lora", "dinov2-36", "dinov2-native", "dinov2reg-36"])
def test_five_layer_estimates_equal_full_depth_traces(name, workload):
    _check_estimate_equals_trace(_config(name), workload)


SIGLIP = {"model_type": "siglip",   # 64 pixels: its own 16 x 16 grid is 256 tokens, a size the fit traces
          "vision_config": {"hidden_size": 64, "num_hidden_layers": 3, "num_attention_heads": 4,
                            "intermediate_size": 128, "image_size": 64, "patch_size": 4},
          "text_config": {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
                          "intermediate_size": 64, "vocab_size": 100}}
CLIP = {"model_type": "clip", "projection_dim": 16,
        "vision_config": {"hidden_size": 64, "num_hidden_layers": 3, "num_attention_heads": 4,
                          "intermediate_size": 128, "image_size": 32, "patch_size": 4, "projection_dim": 16},
        "text_config": {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
                        "intermediate_size": 64, "vocab_size": 100, "bos_token_id": 0, "eos_token_id": 1,
                        "pad_token_id": 1}}


@pytest.mark.slow
@pytest.mark.parametrize("config, workload", [
    (SIGLIP, Workload(batch=2, image_size=40)), (SIGLIP, Workload(mode="infer", batch=2, image_size=40)),
    (SIGLIP, Workload(batch=3)),
    (CLIP, Workload(batch=2, image_size=40)), (CLIP, Workload(mode="infer", batch=2, image_size=40)),
], ids=["siglip-train", "siglip-infer", "siglip-native", "clip-train", "clip-infer"])
def test_siglip_and_clip_towers_equal_full_depth_traces(config, workload):
    # SigLIP adds no CLS token (100 tokens at 40 pixels), CLIP one (101); training builds the image-classification
    # model on the vision_config's tower, inference the tower alone (SiglipVisionModel, CLIPVisionModel). SigLIP's
    # own 64 pixels are 256 tokens, a size the fit traces: there it traces a 8 x 32 rectangle, which interpolates
    # as every other fitted size does (tracer.vision.interpolating); the estimate at the real, square 64 pixels,
    # which adds the embeddings as they are, equals its trace
    _check_estimate_equals_trace(config, workload)


# ViT-like encoders read the same way: DeiT (CLS + distillation token; its image-classification mapping names two
# classes, told apart by config.architectures, which a config built from defaults lacks), BEiT and Data2Vec-Vision
# (relative position bias, layer scale, mean pooling; Data2Vec-Vision reads its drop-path rates with .item() in its
# constructor, which the tracer runs outside fake mode), I-JEPA and ViT-MSN (plain ViT encoders), MetaCLIP-2 (CLIP's
# tower in its vision_config, whose base class AutoModel does not list).
VIT_LIKE = {"hidden_size": 64, "num_hidden_layers": 5, "num_attention_heads": 4, "intermediate_size": 128,
            "image_size": 32, "patch_size": 4, "num_channels": 3}
METACLIP2 = {"model_type": "metaclip_2", "vision_config": dict(VIT_LIKE, num_hidden_layers=3),
             "text_config": CLIP["text_config"]}


def test_deit_builds_its_trainable_class_and_counts_its_distillation_token():
    from estimator.model import from_hf_config

    cfg = dict(VIT_LIKE, model_type="deit", num_hidden_layers=3)
    m = from_hf_config(cfg, "t-deit")
    assert m.inventory.built_as == "DeiTForImageClassification"      # takes labels; the WithTeacher class does not
    assert vision.geometry(m)["extra_tokens"] == 2                     # CLS + distillation
    assert vision.sized(m, Workload(image_size=40)).seq == 10 * 10 + 2
    named = from_hf_config(dict(cfg, architectures=["DeiTForImageClassificationWithTeacher"]), "t-deit")
    assert named.inventory.built_as == "DeiTForImageClassification"   # a distilled checkpoint fine-tunes the same
    _check_estimate_equals_trace(cfg, Workload(batch=2, image_size=40))


def test_a_relative_position_bias_is_refused_in_one_line(tmp_path):
    # BEiT's relative position bias index lives on the host, cached per grid: not priced, said before any tracing
    cfg = tmp_path / "beit.json"
    cfg.write_text(json.dumps(dict(VIT_LIKE, model_type="beit", use_relative_position_bias=True)))
    out = _cli("--model", str(cfg))
    assert out.returncode == 2 and out.stderr.strip() == (
        "python -m estimator: error: use_relative_position_bias: beit with use_relative_position_bias true is not "
        "priced (its relative position bias index is built and cached on the host per image grid, which a trace "
        "cannot tell from GPU memory); set it false to price the encoder without it")


@pytest.mark.slow  # 5-layer profiles derived at reduced depth, then extended: about a minute each
@pytest.mark.parametrize("config, workload", [
    (dict(VIT_LIKE, model_type="deit"), Workload(batch=2, image_size=40)),
    (dict(VIT_LIKE, model_type="deit"), Workload(mode="infer", batch=3, image_size=36)),
    (dict(VIT_LIKE, model_type="beit"), Workload(batch=2, image_size=40)),
    (dict(VIT_LIKE, model_type="data2vec-vision"), Workload(batch=2, image_size=40)),
    (dict(VIT_LIKE, model_type="ijepa"), Workload(batch=2, image_size=40)),
    (dict(VIT_LIKE, model_type="vit_msn"), Workload(batch=2, image_size=40, method="lora")),
    (METACLIP2, Workload(batch=2, image_size=40)), (METACLIP2, Workload(mode="infer", batch=2, image_size=40)),
], ids=["deit-train", "deit-infer", "beit-train", "data2vec-vision", "ijepa", "vit_msn-lora",
        "metaclip_2-train", "metaclip_2-infer"])
def test_vit_like_encoders_equal_full_depth_traces(config, workload):
    _check_estimate_equals_trace(config, workload)


# Spatial models (conv nets, hierarchical encoders: families.SPATIAL_VISION_TYPES): no patch tokens; their size is
# counted in grid units of their total stride (32 pixels), read from the model (tracer.vision.grid_unit), and every
# feature map holds a multiple of the h x w units of the image. Traced whole (they have no decoder layer stack).
def _tiny(model_type: str, **extra) -> dict:
    return {"model_type": model_type, "hidden_sizes": [8, 16, 24, 32], "depths": [1, 2, 1, 1], "num_channels": 3,
            **extra}


def test_a_resnet_is_sized_in_grid_units_of_its_total_stride():
    m = _model("resnet")
    assert m.params == sum(_independent_params(_config("resnet")).values())
    assert vision.geometry(m)["patch_size"] == 32 and vision.geometry(m)["extra_tokens"] == 0
    assert vision.geometry(m)["image_size"] == 224          # ResNet's config has none: the checkpoints' 224 pixels
    assert vision.sized(m, Workload()).seq == 7 * 7
    assert vision.size_words(m, 49) == "49 grid units of 32 px"
    with pytest.raises(ValueError, match=r"^image_size: 250 is not a multiple of t-resnet's grid unit \(its total "
                                         r"stride\) 32 \(its feature maps would be padded .*; use 224 or 256$"):
        vision.sized(m, Workload(image_size=250))


def _independent_params(config: dict) -> dict:
    import torch
    from transformers import AutoConfig, AutoModelForImageClassification

    cfg = AutoConfig.for_model(config["model_type"], **{k: v for k, v in config.items() if k != "model_type"})
    with torch.device("meta"):
        model = AutoModelForImageClassification.from_config(cfg)
    return {"all": sum(p.numel() for p in model.parameters())}


def test_resnet_training_estimate_equals_a_full_depth_trace():
    # 256 pixels: 8 x 8 units of 32 pixels, a size the fit (256 units and up) never traced (inference at the default
    # 224 pixels: the slow tier's spatial cases)
    _check_estimate_equals_trace(_config("resnet"), Workload(batch=4, image_size=256))


def test_a_conv_nets_config_states_its_sizes_in_its_own_fields():
    # what a checkpoint's config.json sizes a conv net by: stages (depths, widths), or multipliers of a fixed list
    from estimator.model import defaulted_sizes

    assert defaulted_sizes(_config("resnet")) == []
    assert defaulted_sizes({"model_type": "swin", "embed_dim": 96, "depths": [2, 2, 6, 2]}) == []
    assert defaulted_sizes({"model_type": "efficientnet", "width_coefficient": 2.0, "depth_coefficient": 3.1}) == []
    assert defaulted_sizes({"model_type": "mobilenet_v2"}) == ["depth_multiplier"]
    assert defaulted_sizes({"model_type": "convnext", "depths": [3, 3, 9, 3]}) == ["hidden_sizes"]


def test_a_conv_net_refuses_lora_in_one_line():
    out = _cli("--model", str(TINY / "t-resnet.json"), "--method", "lora")
    assert out.returncode == 2 and out.stderr.strip() == (
        "python -m estimator: error: lora_targets: q_proj, v_proj match no Linear module of resnet; it has no Linear "
        "module in its layers to adapt (a conv net: use --method full)")


@pytest.mark.slow  # each traced whole at 11 sizes: 10-40 s
@pytest.mark.parametrize("config, workload", [
    (_config("resnet"), Workload(mode="infer", batch=2)),
    (_config("convnext"), Workload(batch=2, image_size=96)), (_config("convnext"), Workload(mode="infer", batch=3)),
    (_tiny("convnextv2"), Workload(batch=3, image_size=160)),
    (_tiny("regnet", embedding_size=8, groups_width=8), Workload(batch=2, image_size=192)),
    (_tiny("poolformer"), Workload(batch=2, image_size=128)),
    (_tiny("pvt_v2", num_attention_heads=[1, 1, 2, 2], sr_ratios=[8, 4, 2, 1]), Workload(batch=2, image_size=160)),
    (_tiny("segformer", num_attention_heads=[1, 1, 2, 2]), Workload(mode="infer", batch=2, image_size=96)),
    (_tiny("swiftformer", embed_dims=[8, 16, 24, 32]), Workload(batch=2, image_size=96)),
    ({"model_type": "textnet", "stem_out_channels": 8, "hidden_sizes": [8, 8, 16, 16, 32], "depths": [3, 4, 4, 4]},
     Workload(batch=2, image_size=672)),   # its config's 640 px plus one unit; channels from stem_num_channels
], ids=["resnet-infer-224", "convnext-train", "convnext-infer", "convnextv2", "regnet", "poolformer", "pvt_v2", "segformer",
        "swiftformer", "textnet"])
def test_spatial_models_equal_full_depth_traces(config, workload):
    _check_estimate_equals_trace(config, workload)


# Sized by units per side (families.SIDE_GRID_TYPES): TensorFlow "same" padding and Swin's windows hold terms in the
# side n, so the profile is a polynomial in n (square images only).
SWIN = {"model_type": "swin", "embed_dim": 8, "depths": [1, 1, 2, 1], "num_heads": [1, 1, 2, 2], "window_size": 7,
        "image_size": 224}


BIT = {"model_type": "bit", "embedding_size": 32, "hidden_sizes": [128, 256, 384, 512], "depths": [1, 1, 1, 1]}  # GroupNorm(32)


def test_a_padding_conv_net_is_sized_by_its_units_per_side():
    m = from_hf_config_tiny(BIT)
    assert vision.geometry(m)["grid"] == "side" and vision.geometry(m)["patch_size"] == 32
    assert vision.sized(m, Workload(image_size=256)).seq == 8                 # 8 units per side, not 64
    assert vision.sized(m, Workload(seq=7)).image_size == 224
    assert vision.size_words(m, 8) == "8 x 8 grid units of 32 px"
    _check_estimate_equals_trace(BIT, Workload(batch=3, image_size=160))


def from_hf_config_tiny(config: dict):
    from estimator.model import from_hf_config

    return from_hf_config(config, "tiny")


@pytest.mark.slow  # two Swin derivations: half a minute
def test_swin_on_a_one_window_image_is_an_upper_bound_said_in_a_note():
    # Swin's unit is its stride x window, 224 pixels: at 224 its last stage is one window, which Swin does not shift
    from bench.trace.cases import trace_case
    from estimator.estimate import estimate

    m = from_hf_config_tiny(SWIN)
    assert vision.geometry(m)["patch_size"] == 224 and vision.geometry(m)["window"] == 7
    est = estimate(m, Workload(batch=2, image_size=224))
    assert est.workload.seq == 1 and any(n.startswith("image_size: at 224 px tiny's last stage is a single 7 x 7 "
                                                      "window") for n in est.notes)
    row = trace_case(SWIN, "tiny", replace(est.workload, image_size=0))
    for name, b in est.stages:
        if name in ("load", "forward", "backward", "optimizer"):
            # above the trace, never below: 0.19% of the forward here (12,544 B), 0.06% on the default Swin-T
            assert 0 <= b.tensor_bytes - row[f"{name}_peak_alloc_bytes"] <= 0.002 * b.tensor_bytes, name
    _check_estimate_equals_trace(SWIN, Workload(batch=2, image_size=448))   # two units per side: exact


@pytest.mark.slow
@pytest.mark.parametrize("config, workload", [
    (_tiny("mobilenet_v1", depth_multiplier=0.25), Workload(batch=2, image_size=96)),
    (_tiny("mobilenet_v2", depth_multiplier=0.25), Workload(mode="infer", batch=2, image_size=128)),
    ({"model_type": "efficientnet", "width_coefficient": 1.0, "depth_coefficient": 1.0, "hidden_dim": 1280,
      "image_size": 224},   # EfficientNet-B0
     Workload(batch=2, image_size=160)),
    (_tiny("focalnet", embed_dim=8), Workload(batch=2, image_size=96)),
    (dict(SWIN, model_type="swinv2"), Workload(batch=2, image_size=672)),
    (dict(SWIN, model_type="donut-swin"), Workload(mode="infer", batch=2, image_size=448)),
    ({"model_type": "hgnet_v2"}, Workload(batch=2, image_size=160)),   # its stem pads one row and column
], ids=["mobilenet_v1", "mobilenet_v2", "efficientnet", "focalnet", "swinv2", "donut-swin", "hgnet_v2"])
def test_side_sized_models_equal_full_depth_traces(config, workload):
    _check_estimate_equals_trace(config, workload)


def test_the_app_asks_a_vision_encoder_for_its_image_size_not_a_sequence_length():
    pytest.importorskip("streamlit")
    from pages import _inputs as ui

    for mode in ("train", "infer"):
        text, image = ui.shown_workload_fields(mode, "full"), ui.shown_workload_fields(mode, "full", vision=True)
        assert "seq" in text and "image_size" not in text
        assert "image_size" in image and "seq" not in image and "gen_tokens" not in image
    assert ui.workload_from_dict({"mode": "train", "method": "full", "image_size": 518, "seq": 99}, vision=True) == \
        Workload(image_size=518)   # seq is not a vision encoder's input: it keeps its default, sized() sets it


def test_a_swapped_optimizer_does_not_count_the_unreached_mask_token():
    """hypothesis found it: DINOv2's mask_token (1 x 1536) is read only with bool_masked_pos, so the traced AdamW
    step gives it no state and no temporary, while the inventory's formulas counted it: fused AdamW's temporaries
    came out at -3,072 bytes. The inventory lists it as unreached (tracer.vision.info) and the formulas skip it."""
    from estimator.estimate import estimate
    from estimator.spec import Parallel, Workload

    from strategies import model

    m = model("dinov2-giant")
    assert m.inventory.extra["vision"]["unreached"] == [[1, 1536]]
    for impl in ("fused", "forloop"):
        opt = dict(estimate(m, Workload(optimizer_impl=impl, batch=2, image_size=14), Parallel()).stages)["optimizer"]
        assert all(v >= 0 for v in opt.as_dict().values())
    fused = dict(estimate(m, Workload(optimizer_impl="fused", batch=2, image_size=14), Parallel()).stages)["optimizer"]
    assert fused.temporaries == 0


def test_a_classifier_that_mean_pools_leaves_the_pooling_head_unreached():
    """hypothesis found it: SigLIP's image classifier mean-pools the last hidden state, so the vision tower's attention-
    pooling head (15,238,352 parameters of so400m) runs in forward and gets no gradient; named by mask_token only, it
    was counted by the swapped optimizer's formulas and fused AdamW's temporaries came out at -30,476,704 bytes.
    The inventory now reads what a step leaves without a gradient from one step on the meta device."""
    import torch
    from transformers import AutoConfig, AutoModelForImageClassification

    from estimator.estimate import estimate
    from estimator.spec import Parallel, Workload
    from strategies import model
    from tracer import vision

    m = model("siglip-so400m-patch14-224")
    assert m.inventory.extra["vision"]["unreached_read"] == "step"
    assert sum(math.prod(s) for s in m.inventory.extra["vision"]["unreached"]) == 15_238_352
    for impl in ("fused", "forloop", "foreach"):
        for size in (14, 224):
            opt = estimate(m, Workload(optimizer_impl=impl, batch=2, image_size=size), Parallel()).stage("optimizer")
            assert min(opt.as_dict().values()) >= 0, (impl, size, opt)
            assert impl != "fused" or opt.temporaries == 0
    tiny = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=16,
                patch_size=8)
    for model_type, missed in (("siglip", 11), ("clip", 2), ("vit", 0)):
        kw = {"vision_config": tiny, "text_config": dict(tiny, vocab_size=64)} if model_type != "vit" else tiny
        with torch.device("meta"):
            built = AutoModelForImageClassification.from_config(AutoConfig.for_model(model_type, **kw))
        shapes, read = vision.unreached_params(built, 16, 3)
        assert (len(shapes), read) == (missed, "step"), model_type
        assert all(p.grad is None for p in built.parameters())   # the probe leaves no gradient behind
