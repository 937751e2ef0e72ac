"""Qwen2-VL's family priced whole with its images (tracer/vlm_grid.py, tracer/host_values.py, `--images N --image-size
PX --attention flash`).

Tiny Qwen2.5-VL / Qwen2-VL / Qwen3-VL configs (tests/data/tiny/t-qwen25vl.json, t-qwen2vl.json, t-qwen3vl.json: a
5-layer text model of hidden 128, a 3-4 layer vision tower of hidden 64 in 14- or 16-px patches merged 2 x 2) read
their image grids and token types on the host; the inputs carry their values, the host loops run once, and the
estimate equals a full-depth trace to the byte at sizes the fit never used. A tiny XLM, which reads its token ids on
the host (families.HOST_VALUE_TYPES), too.

    python -m pytest tests/test_vlm_grid.py -q            # WILLITFIT_SLOW=1 adds Qwen2-VL, Qwen3-VL, LoRA, inference
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, Phase, given, note, settings
from hypothesis import strategies as st
from torch._subclasses.fake_tensor import DynamicOutputShapeException, FakeTensorMode

from estimator.spec import Parallel, Workload
from tracer.host_values import SMALL, host_values, known, value_of
from traced import assert_equals_trace

TINY = Path(__file__).parent / "data" / "tiny"
SLOW = pytest.mark.skipif(not os.environ.get("WILLITFIT_SLOW"), reason="slow tier: WILLITFIT_SLOW=1")


def _config(name: str = "qwen25vl") -> dict:
    return json.loads((TINY / f"t-{name}.json").read_text())


def _model(name: str = "qwen25vl"):
    from estimator.model import from_hf_config

    return from_hf_config(_config(name), f"t-{name}")


def test_fake_tensors_carry_the_values_the_host_knows():
    fm = FakeTensorMode(allow_non_fake_inputs=True)
    real_grid = torch.tensor([[1, 4, 6], [1, 2, 2]])
    real_mask = torch.tensor([[1, 1, 0, 0, 0], [0, 1, 1, 1, 0]]).bool()
    with fm:
        grid = known(torch.empty(2, 3, dtype=torch.long), real_grid)
        mask = known(torch.empty(2, 5, dtype=torch.bool), real_mask)
    with fm, host_values():
        assert grid.tolist() == [[1, 4, 6], [1, 2, 2]]
        sizes = (grid.prod(-1) // 4).tolist()               # get_image_features' split sizes
        assert sizes == [6, 1]
        lengths = torch.repeat_interleave(grid[:, 1] * grid[:, 2], grid[:, 0])   # data-dependent shape: from values
        assert lengths.shape == (2,) and value_of(lengths).tolist() == [24, 4]
        r = torch.arange(10)                                # integer factories carry values
        kept = r[r % 3 != 0]
        assert kept.shape == (6,) and value_of(kept).tolist() == [1, 2, 4, 5, 7, 8]
        assert value_of(torch.tensor([r[2], r[5]])).tolist() == [2, 5]   # torch.tensor of tensors with values
        z = torch.zeros(3, dtype=torch.long)
        z[1] = 7
        assert value_of(z).tolist() == [0, 7, 0]
        z[2] = torch.empty((), dtype=torch.long)            # written from an unknown value: no longer known
        assert value_of(z) is None and value_of(z[0]) is None
        hidden = torch.empty(2, 5, 8)                       # x[mask] with a known mask, unknown x: the mask's nonzero
        assert hidden[mask].shape == (5, 8)
        assert value_of(torch.ones(SMALL + 1)) is None       # floats past SMALL elements never seeded
        assert value_of(torch.empty(3)) is None              # nor an empty's
    with fm, host_values():
        x = torch.empty(4)
        with pytest.raises(DynamicOutputShapeException):    # no values: the fake tensor's own failure
            x.nonzero()


def test_a_text_model_that_reads_its_token_ids_is_priced_with_their_values():
    # XLM reads lengths.max().item() of its non-pad tokens (families.HOST_VALUE_TYPES): exact at a size no fit used
    cfg = {"model_type": "xlm", "vocab_size": 512, "emb_dim": 64, "n_layers": 2, "n_heads": 4,
           "max_position_embeddings": 512}
    assert_equals_trace(cfg, "t-xlm", Workload(attention="eager"), ((3, 100),), Parallel())


@SLOW
def test_xmod_routes_its_tokens_to_one_language_adapter_with_their_values():
    # X-MOD: per-sample language ids (a small float factory times the default language's index) select each token's
    # adapter by a boolean index; no default language in the config: the tracer takes its first (all the same size)
    cfg = {"model_type": "xmod", "vocab_size": 512, "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
           "intermediate_size": 128, "max_position_embeddings": 514, "languages": ["en_XX", "de_DE"]}
    assert_equals_trace(cfg, "t-xmod", Workload(), ((3, 100),), Parallel())


def test_small_float_factories_carry_their_values_and_large_ones_do_not():
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    from tracer import host_values

    with FakeTensorMode(), host_values.host_values():
        small = 3 * torch.ones(4)
        large = torch.ones(host_values.SMALL + 1)
        assert host_values.value_of(small).tolist() == [3.0] * 4 and host_values.value_of(large) is None
        assert (small == 3).all().item()


def test_image_tokens_are_the_mergers_rows_on_a_real_forward():
    # the arithmetic (side / (patch x merge))^2 against the model's own vision tower on real CPU tensors
    from transformers import AutoConfig, AutoModelForImageTextToText

    from tracer.vlm import image_tokens

    cfg = _config()
    hf = AutoConfig.for_model(cfg["model_type"], **{k: v for k, v in cfg.items() if k != "model_type"})
    torch.manual_seed(0)
    model = AutoModelForImageTextToText.from_config(hf).eval()
    side = 168 // 14
    grid = torch.tensor([[1, side, side]] * 2)
    pixels = torch.randn(2 * side * side, 3 * 2 * 14 * 14)
    with torch.no_grad():
        out = model.model.get_image_features(pixels, grid)
    rows = sum(t.shape[0] for t in out.pooler_output)
    assert rows == 2 * image_tokens(model, image_size=168) == 2 * 36


def test_the_inventory_says_how_an_image_becomes_tokens():
    m = _model()
    v = m.inventory.extra["vlm"]
    assert v["grid"] == {"patch_size": 14, "temporal_patch_size": 2, "spatial_merge_size": 2, "num_channels": 3}
    assert v["image_size"] == 448 and v["image_tokens"] == 256 and v["image_token_id"] == 500


def test_image_size_is_part_of_a_grid_models_class_and_checked_in_one_line():
    from estimator import store
    from estimator.estimate import estimate
    from estimator.vision import image_words, sized

    m = _model()
    w = Workload(images=2, attention="flash", seq=200)
    assert sized(m, w).image_size == 448                   # the default image
    a, b = (store.workload_class(sized(m, Workload(images=1, image_size=s, attention="flash"))) for s in (168, 224))
    assert a["image_size"] == 168 and b["image_size"] == 224
    assert "image_size" not in store.workload_class(Workload())   # every old key kept
    assert image_words(m, Workload(images=2, image_size=168, seq=200)) == \
        "2 images of 168x168 px (72 image tokens) per sample"
    bad = [(Workload(images=1, seq=300), r"^attention: under sdpa t-qwen25vl's vision tower runs one attention call "),
           (Workload(images=1, seq=300, attention="flash", checkpointing="selective"), r"^checkpointing: selective"),
           (Workload(images=1, seq=300, attention="flash", image_size=170),
            r"^image_size: 170 is not a multiple of t-qwen25vl's 28-px merged patch .*; use 168 or 196$"),
           (Workload(image_size=168, attention="flash"), r"^image_size: t-qwen25vl's images are sized with --images"),
           (Workload(images=2, seq=73, attention="flash", image_size=168),
            r"^seq: 73 tokens cannot hold 2 image\(s\) of 36 tokens each \(168x168 px\); use a seq over 74$")]
    for workload, message in bad:
        with pytest.raises(ValueError, match=message):
            estimate(m, workload, Parallel())


def _check(workload: Workload, sizes, name: str = "qwen25vl") -> None:
    assert_equals_trace(_config(name), f"t-{name}", workload, sizes, Parallel())


def test_training_with_images_equals_a_full_depth_trace():
    # 168 px: 6 x 6 merged tokens, Qwen2.5-VL's 4 x 4 windows padded; fit at the derivation's own sizes
    _check(Workload(images=2, image_size=168, attention="flash"), ((2, 200), (3, 150)))


def test_a_batch_squared_term_is_fit_on_three_batches():
    """GLM-4.1V's vision embeddings hold an (images x patches) bool tensor (`seq_ids`), 64 b^2 bytes here: the b >= 2
    region fits batches 2, 3 and 4 with a b^2 monomial (tracer.derive.BATCH_SQUARED_REGIONS), exact at batch 6."""
    _check(Workload(images=1, image_size=112, attention="flash"), ((6, 150),), "glm4v")   # (with b and s linear: 128 B
    # off at the b >= 2 region's check, batch 4, so no profile)


def test_a_per_image_position_grid_loop_is_keyed_per_image():
    """Cosmos-3-Edge interpolates its learned position grid once per image, in a Python loop (tracer.loop_marks
    .positions_step, on a GPU's branch: no fp32 copy of the grid): the iterations keyed, the step one polynomial in
    the batch again; two images per sample at batches the fit never used."""
    from tracer import vlm_loop
    import transformers.models.cosmos3_edge.modeling_cosmos3_edge as ce

    assert vlm_loop._positions_source_ok(ce.Cosmos3EdgeVisionEmbeddings)
    _check(Workload(images=2, image_size=128, attention="flash"), ((3, 140), (1, 90)), "cosmos3_edge")
    assert type(ce.Cosmos3EdgeVisionEmbeddings.__dict__["resize_positional_embeddings"]).__name__ == "staticmethod"
    assert ce.Cosmos3EdgeVisionEmbeddings.resize_positional_embeddings.__qualname__.startswith("Cosmos3Edge")


def test_the_copied_per_image_loops_are_transformers_own():
    """tracer.loop_marks runs VideoLLaMA3's un-shuffle, LFM3-VL's short convolution and LFM2-VL's and PaddleOCR-VL's
    projections op for op only while transformers' source is the one copied; their traces are checked below (LFM3-VL,
    PaddleOCR-VL), in tests/test_vlm.py (LFM2-VL) and in the slow tier."""
    from tracer import loop_marks
    import transformers.models.lfm3_vl.modeling_lfm3_vl as lf
    import transformers.models.video_llama_3.modeling_video_llama_3 as vl

    import transformers.models.lfm2_vl.modeling_lfm2_vl as l2
    import transformers.models.paddleocr_vl.modeling_paddleocr_vl as po

    assert loop_marks._paddle_source_ok(po.PaddleOCRProjector)
    assert loop_marks._unshuffle_source_ok(vl.VideoLlama3VisionModel)
    assert loop_marks._shortconv_source_ok(lf.Lfm3VlVisionShortConv)
    assert loop_marks._project_source_ok(l2.Lfm2VlModel)


@SLOW
def test_a_per_image_unshuffle_loop_is_keyed_per_image():
    """VideoLLaMA3 hands each image's merge size as an input (image_merge_sizes, families.GRID_MERGE_INPUT) and
    un-shuffles its tower's output per image in a Python loop (tracer.loop_marks.unshuffle_step): the iterations keyed,
    two images per sample at batches the fit never used; the patched method is put back after the step."""
    import transformers.models.video_llama_3.modeling_video_llama_3 as vl

    _check(Workload(images=2, image_size=128, attention="flash"), ((3, 200), (1, 150)), "video_llama_3")
    assert vl.VideoLlama3VisionModel.pixel_unshuffle.__qualname__.startswith("VideoLlama3")


def test_grid_geometry_reads_each_familys_names():
    """merge_size and patch_temporal (Muse-Glimmer, Muse-Spark), merge_kernel_size (Kimi-K2.5), a merge size handed
    per image (VideoLLaMA3): the same geometry (tracer.vlm_grid.grid_geometry); their traces are checked in the slow
    tier and below."""
    from transformers import AutoConfig

    from tracer.vlm_grid import grid_geometry

    def geometry(name):
        g = grid_geometry(AutoConfig.for_model(**_config(name)))
        return g["patch_size"], g["spatial_merge_size"], g["temporal_patch_size"]
    assert geometry("muse_glimmer") == (14, 2, 2)
    assert geometry("muse_spark") == (14, 2, 2)
    assert geometry("kimi_k25") == (14, 2, 1)
    assert geometry("video_llama_3") == (16, 1, 1)
    assert geometry("qwen25vl") == (14, 2, 2)


def test_a_thinker_that_inherits_its_rope_index_has_it_run_on_the_host():
    """Qwen3-Omni's thinker inherits get_rope_index from a mixin and names its tower Qwen3OmniMoeVisionEncoder: both are
    found (tracer.vlm_grid), so its per-sample and per-image index loops run on the host values; its traces against
    full-depth ones are in the slow tier."""
    import torch
    from transformers import AutoConfig, AutoModelForImageTextToText

    from tracer import vlm_grid

    with torch.device("meta"):
        model = AutoModelForImageTextToText.from_config(AutoConfig.for_model(**_config("qwen3_omni_thinker")))
    owners = vlm_grid._rope_owners(model)   # the inner model, whose forward calls it, and the outer one
    assert [type(m).__name__ for m in owners] == ["Qwen3OmniMoeThinkerForConditionalGeneration",
                                                  "Qwen3OmniMoeThinkerModel"]
    towers = [type(m).__name__ for m in model.modules() if type(m).__name__.endswith(vlm_grid.TOWERS)]
    assert towers == ["Qwen3OmniMoeVisionEncoder"]
    with vlm_grid.grid_step(model):
        assert all(hasattr(m.__dict__["get_rope_index"], "__wrapped__") for m in owners)
    assert not any("get_rope_index" in m.__dict__ for m in owners)


def test_patches_as_small_images_and_host_side_index_loops():
    """Kimi-K2.5's MoonViT takes each patch as a small image (pixel values (patches, C, P, P): families
    .GRID_PATCH_IMAGES) and computes every per-image index on the host (its frame index and temporal merge index join
    tracer.vlm_grid.HOST_SIDE); merge_kernel_size 2 x 2 and a DeepSeek-V3 text model: two images per sample exact at
    batches the fit never used."""
    _check(Workload(images=2, image_size=112, attention="flash"), ((3, 200), (1, 150)), "kimi_k25")


def test_per_image_convolutions_in_every_conv_layer_are_keyed_and_batch_two_is_fit_apart():
    """LFM3-VL convolves each image's grid in a Python loop in every convolution layer of its tower (tracer.loop_marks
    .unshuffle_step), each grid copy saved for backward, which frees them chain by chain: the first two chains to run
    are kept, the rest dropped and checked to hold less. One image per sample runs two chains at batch 2, three and
    more above, so batch 2 is fit apart (families.batch_two_apart): exact at batch 2 and past the fit's batches."""
    import transformers.models.lfm3_vl.modeling_lfm3_vl as lf

    _check(Workload(images=1, image_size=128, attention="flash"), ((2, 120), (5, 100), (1, 90)), "lfm3_vl")
    assert lf.Lfm3VlVisionShortConv.forward.__qualname__.startswith("Lfm3Vl")


def test_a_per_image_projector_loop_takes_each_patch_as_an_image():
    """PaddleOCR-VL's tower takes each patch as a small image (families.GRID_PATCH_IMAGES) and its projector merges
    and projects each image in a Python loop (tracer.loop_marks, pinned in backward: batch 2 fit apart): one image
    per sample exact at batch 2 and past the fit's batches."""
    import transformers.models.paddleocr_vl.modeling_paddleocr_vl as po

    _check(Workload(images=1, image_size=112, attention="flash"), ((2, 120), (5, 100)), "paddleocr_vl")
    assert po.PaddleOCRProjector.forward.__qualname__.startswith("PaddleOCR")


@SLOW
@pytest.mark.parametrize("name, workload, sizes", [
    ("paddleocr_vl", Workload(images=2, image_size=112, attention="flash", method="lora"), ((3, 200), (1, 150))),
    # Muse-Spark: Muse-Glimmer's tower on a sliding-window MoE text model (a 64-token window: two pieces of s)
    ("muse_spark", Workload(images=2, image_size=112, attention="flash"), ((3, 200), (1, 150))),
    # Qwen3-Omni's thinker: its rope index inherited, its tower a "VisionEncoder", no token types (images only)
    ("qwen3_omni_thinker", Workload(images=2, image_size=128, attention="flash"), ((3, 200), (1, 150))),
    ("qwen3_omni_thinker", Workload(images=1, image_size=128, attention="flash", method="lora"), ((1, 90), (4, 100))),
    ("qwen3_omni_thinker", Workload(images=1, image_size=128, attention="flash", mode="infer", gen_tokens=3),
     ((2, 100), (5, 80))),
    # Cosmos-3-Omni: Qwen3-VL's tower and text model under its own class (its default config's parts disagree, 3584
    # vs 4096 wide: a consistent tiny one here)
    ("cosmos3_omni", Workload(images=2, image_size=128, attention="flash"), ((3, 200), (1, 150))),
    ("lfm3_vl", Workload(images=2, image_size=128, attention="flash"), ((3, 200), (1, 150))),
    ("muse_glimmer", Workload(images=2, image_size=112, attention="flash"), ((3, 200), (1, 150))),
    ("muse_glimmer", Workload(images=1, image_size=112, attention="flash", mode="infer", gen_tokens=3),
     ((2, 100), (5, 80))),
    ("kimi_k25", Workload(images=1, image_size=112, attention="flash", method="lora"), ((1, 90), (4, 100))),
    ("kimi_k25", Workload(images=1, image_size=112, attention="flash", mode="infer", gen_tokens=3), ((2, 100), (5, 80))),
    ("lfm3_vl", Workload(images=1, image_size=128, attention="flash", method="lora"), ((2, 90), (4, 100))),
    ("lfm3_vl", Workload(images=1, image_size=128, attention="flash", mode="infer", gen_tokens=3), ((2, 100), (5, 80))),
    ("cosmos3_edge", Workload(images=1, image_size=128, attention="flash", method="lora"), ((1, 90), (4, 60))),
    ("video_llama_3", Workload(images=1, image_size=128, attention="flash", method="lora"), ((1, 90), (4, 100))),
    ("video_llama_3", Workload(images=1, image_size=128, attention="flash", mode="infer", gen_tokens=3),
     ((2, 100), (5, 80))),
    ("glm4v", Workload(images=2, image_size=112, attention="flash", method="lora"), ((2, 200), (6, 150))),
    ("glm4v", Workload(images=1, image_size=112, attention="flash", mode="infer", gen_tokens=3), ((2, 200), (6, 150))),
    ("glm4v_moe", Workload(images=1, image_size=112, attention="flash"), ((2, 200), (6, 150))),
    ("qwen2vl", Workload(images=2, image_size=112, attention="flash"), ((2, 80), (3, 150))),
    ("qwen3vl", Workload(images=2, image_size=128, attention="flash"), ((2, 80), (3, 150))),   # deepstack: whole
    ("qwen25vl", Workload(images=1, image_size=112, attention="flash", method="lora",
                          lora_targets=("q_proj", "v_proj")), ((2, 60), (3, 150))),
    ("qwen25vl", Workload(images=1, image_size=112, attention="flash", mode="infer", gen_tokens=5),
     ((2, 60), (3, 150))),
    ("qwen25vl", Workload(images=1, image_size=112, attention="flash", checkpointing="full"), ((2, 60), (3, 150))),
    # a swapped optimizer counts every parameter's states by formula (no `unreached` for a grid model: its step reaches
    # them all, which this checks against the trace)
    ("qwen25vl", Workload(images=1, image_size=112, attention="flash", optimizer="sgd-momentum"), ((2, 60),)),
    ("qwen25vl", Workload(images=1, image_size=112, attention="flash", optimizer_impl="fused"), ((2, 60),)),
])
def test_more_grid_models_and_workloads_equal_full_depth_traces(name, workload, sizes):
    _check(workload, sizes, name)


@st.composite
def _grid_cases(draw):
    """A tiny grid model and a workload with images: method, recipe, checkpointing, images, image size, mode and
    sizes drawn (the seq past the images' tokens and their end tokens)."""
    name = draw(st.sampled_from(("qwen25vl", "qwen2vl", "qwen3vl")))
    unit = 32 if name == "qwen3vl" else 28
    mode = draw(st.sampled_from(("train", "infer")))
    kw = dict(mode=mode, images=draw(st.integers(1, 2)), image_size=unit * draw(st.integers(2, 6)),
              attention="flash", batch=draw(st.integers(1, 4)))
    if mode == "train":
        kw.update(method=draw(st.sampled_from(("full", "lora"))),   # QLoRA has no trace (bitsandbytes' 4-bit weights)
                  checkpointing=draw(st.sampled_from(("none", "full", "op-sac"))),
                  recipe=draw(st.sampled_from(("pure", "amp"))))
        if kw["method"] != "full":
            kw.update(lora_targets=("q_proj", "v_proj"), lora_rank=draw(st.sampled_from((4, 8, 16))))
    else:
        kw["gen_tokens"] = draw(st.integers(0, 5))
    per = (kw["image_size"] // unit) ** 2 + 1
    kw["seq"] = kw["images"] * per + draw(st.integers(1, 600))
    return name, Workload(**kw)


@SLOW
@settings(max_examples=6, deadline=None, suppress_health_check=list(HealthCheck),
          phases=(Phase.explicit, Phase.reuse, Phase.generate))
@given(_grid_cases())
def test_random_grid_workloads_equal_full_depth_traces(case):
    name, w = case
    note(f"{name} {w}")
    _check(w, ((w.batch, w.seq),), name)


def test_the_cli_prices_a_qwen_vl_under_flash_unless_told_otherwise(capsys):
    import json as json_mod

    from estimator.cli import main

    assert main(["--model", "qwen2.5-vl-7b", "--method", "lora", "--images", "1", "--seq", "1024", "--json"]) == 0
    out = json_mod.loads(capsys.readouterr().out)   # the shipped 448-px class: no derivation
    assert out["workload"]["attention"] == "flash" and out["workload"]["image_size"] == 448
    assert any(n.startswith("attention: flash, FlashAttention-2") for n in out["notes"])
    assert main(["--model", "qwen2.5-vl-7b", "--images", "1", "--seq", "1024", "--attention", "sdpa"]) == 2
    assert "attention: under sdpa qwen2.5-vl-7b's vision tower" in capsys.readouterr().err
    assert main(["--model", "qwen2.5-vl-7b", "--images", "1", "--seq", "1024", "--atten=eager"]) == 2   # abbreviated
    assert "attention: under eager" in capsys.readouterr().err
