"""Families: model types grouped for reporting and for the fitted activation constant k (one k per family).

Memory is never computed per family (profiles are derived from each model's own code); this grouping only
decides which runs are pooled in a calibration and how the app groups architectures. A model type not listed is
its own family. This is the one table: code reads families from here. SQL mirrors it in the `v_runs` view's `family` column
(bench/store/schema.sql; the migrations that wrote the view, 003-005, are history and stay as they were);
tests/test_db.py checks the view against this table.
"""
from __future__ import annotations

FAMILIES = {
    "llama": "llama", "mistral": "llama", "qwen2": "llama", "qwen3": "llama",
    "gemma": "gemma", "gemma2": "gemma",
    "phi3": "llama",
    "gpt2": "gpt2", "gpt_neox": "gpt_neox", "falcon": "falcon", "opt": "opt",
    "mixtral": "moe", "qwen2_moe": "moe", "qwen3_moe": "moe",
    "deepseek_v2": "deepseek", "deepseek_v3": "deepseek",
    "bert": "bert",
}
# The vision encoders willitfit models (tracer.vision: pixel values in, sized by image_size): a model type whose
# image-classification model runs one transformer encoder over patch tokens (plus CLS, distillation or register
# tokens its embeddings add). SigLIP's, CLIP's and MetaCLIP-2's configs hold the tower in their vision_config.
# DeiT's distillation token, BEiT's and Data2Vec-Vision's relative position bias, I-JEPA's and ViT-MSN's plain ViT
# encoders are all read from the model; each is checked against full-depth traces (tests/test_vision.py).
VISION_TYPES = ("vit", "dinov2", "dinov2_with_registers", "siglip", "clip", "metaclip_2", "deit", "beit",
                "data2vec-vision", "ijepa", "vit_msn", "siglip2")
# NaFlex encoders (SigLIP2): patches in, (b, max_num_patches, C x P x P), with a pixel mask and each sample's grid
# (spatial_shapes, read on the host). A square image of S px is (S / P)^2 patches, the processor's max_num_patches
# taken as that count (its default 256: 256-px images at 16-px patches), so nothing is padded (tracer.vision).
NAFLEX_TYPES = ("siglip2",)
# Vision models without patch tokens (tracer.vision "spatial"): conv nets and hierarchical encoders whose feature
# maps shrink stage by stage. Their size is counted in grid units of their total stride (32 pixels for all of these),
# times their attention window where they have one (Swin: every stage a whole number of windows): on images of h x w
# units every tensor holds a whole multiple of h * w positions, so memory is a polynomial in the area h * w.
SPATIAL_VISION_TYPES = ("resnet", "convnext", "convnextv2", "regnet", "poolformer", "pvt_v2", "segformer",
                        "swiftformer", "bit", "mobilenet_v1", "mobilenet_v2", "efficientnet", "focalnet", "swin",
                        "swinv2", "donut-swin", "textnet", "hgnet_v2")
# Of those, the ones sized by their units per side n (square images only). BiT, MobileNet and EfficientNet pad copies
# of their feature maps (TensorFlow's "same" padding), FocalNet its patch embeddings' input, and Swin's windowed
# attention holds a term of the same kind: (n u + p)^2 elements, no polynomial in the area n^2 but one in n (their
# derivations in area units were refused by the check at a thin rectangle). None attends over the whole map, which
# would make memory quartic in n. HGNet-V2's stem pads its feature map by one row and column before a pooling
# (HGNetV2Embeddings: F.pad(..., (0, 1, 0, 1))): the same kind of term.
SIDE_GRID_TYPES = ("bit", "mobilenet_v1", "mobilenet_v2", "efficientnet", "focalnet", "swin", "swinv2", "donut-swin",
                   "hgnet_v2")
VISION_TYPES += SPATIAL_VISION_TYPES
_HW = ("its derivation's check found memory that is no polynomial in the image's h x w grid units (a copy of a "
       "feature map padded or unfolded: terms in h + w)")
# Image-classification types tried and refused, with why (one line each; the others are "not modelled yet").
VISION_REFUSED = {
    "mobilevit": _HW + ": MobileViT unfolds its feature maps into patches",
    "mobilevitv2": _HW + ": MobileViT unfolds its feature maps into patches",
    "cvt": _HW,
    "pvt": "its code fails on images other than its config's size (a position-embedding reshape)",
    "levit": "its code runs only at its config's image size (attention biases sized for that grid), so no profile "
             "in the image size can be fit",
    "hiera": "its code runs only at its config's image size (position embeddings sized for that grid), so no "
             "profile in the image size can be fit",
    "pp_lcnet": "its image-classification class takes no labels (PPLCNetForImageClassification returns no loss), so "
                "it has no training step to price",
}
# Vision-language models priced whole with their images (tracer.vlm): the image-text-to-text model (vision tower,
# projector, language model) runs `images` images per sample at its config's image size, each one a fixed number of
# image tokens inside the sequence (read from the model's own get_image_features on the meta device), so memory stays a
# polynomial in (batch, seq) per image count. Pixel values in one (images, 3, H, W) tensor, image tokens placed in
# input_ids where the model scatters its features (masked_scatter on the image token id). Others of the kind keep a
# text-only step (a scope note says so) or are refused.
# Qwen2-VL's family takes images of any size as patches on a grid (pixel values (patches, C x T x P x P) and
# image_grid_thw, merged spatial_merge_size^2 patches to a token) and reads the grid, its 3D positions and its per-image
# attention segments on the host (tracer.host_values); an image's side in pixels (--image-size, a multiple of
# patch_size x spatial_merge_size; 0: GRID_IMAGE_SIZE) is then part of the profile's class.
# GLM-OCR runs the same code (transformers copies it from Qwen2-VL's). GLM-4.1V/4.5V (glm4v, glm4v_moe, glm46v) do
# too, and their vision embeddings compare every patch with every image's end (Glm4vVisionEmbeddings: `seq_ids`, an
# (images x patches) bool tensor): a batch^2 term at a fixed image size, which their derivation fits on three batches
# (BATCH_SQUARED_VLM_TYPES; tracer.derive.BATCH_SQUARED_REGIONS). HyperCLOVA X Vision v2 (Qwen2.5-VL's tower), EXAONE-4.5 (a copy of it with
# fewer key/value heads than query heads) and MiniMax-M3-VL (Qwen2-VL's inputs, its own tower) run the same inputs and
# host-side helpers, as does Cosmos-3-Edge (Qwen2-VL's inputs and merger; a SigLIP-style tower whose learned position
# grid is interpolated per image: tracer.vlm_loop.positions_step). LFM3-VL does too; its tower's short convolution
# runs per image (Lfm3VlVisionShortConv: a loop over torch.split by image, in every convolution layer), run op for op
# with its iterations marked (tracer.loop_marks.unshuffle_step).
# Kimi-K2.5 takes the grid too (its MoonViT: patches as small images, GRID_PATCH_IMAGES; merge_kernel_size 2 x 2),
# every per-image loop of its tower a host-side index computation (tracer.vlm_grid.HOST_SIDE).
# VideoLLaMA3 takes Qwen2-VL's grid and host-side helpers with each image's merge size as an input of its own
# (image_merge_sizes: its image processor hands 1, GRID_MERGE_INPUT), and un-shuffles the tower's output per image in
# a Python loop, run op for op with its iterations marked (tracer.loop_marks.unshuffle_step).
BATCH_SQUARED_DECODE_TYPES = ("rwkv",)   # a (b, b, hidden) tensor in each decoding step (batch_squared)
BATCH_SQUARED_VLM_TYPES = ("glm4v", "glm4v_moe", "glm46v", "glmga")   # glmga: GLM-4.6V's config and class again
GRID_VLM_TYPES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe", "glm_ocr", "hyperclovax_vision_v2", "exaone4_5",
                  "minimax_m3_vl", "cosmos3_edge", "video_llama_3", "lfm3_vl", "kimi_k25", "muse_glimmer",
                  "paddleocr_vl", "muse_spark", "qwen3_omni_moe_thinker", "cosmos3_omni", *BATCH_SQUARED_VLM_TYPES)
# grid models whose forward takes no mm_token_type_ids (their positions are 1D or read from the grid alone)
GRID_NO_TOKEN_TYPES = ("video_llama_3", "lfm3_vl", "kimi_k25", "qwen3_omni_moe_thinker")
# grid models whose pixel values are one small image per patch, (patches, C, P, P), their tower's patch embedding a
# convolution over it (Kimi-K2.5's MoonViT, PaddleOCR-VL's SigLIP), not the flattened (patches, C x T x P x P) rows
# of Qwen2-VL's processor
GRID_PATCH_IMAGES = ("kimi_k25", "paddleocr_vl")
# grid models whose vision config names no spatial_merge_size: the merge size their image processor hands per image
# (VideoLlama3ImageProcessor.merge_size, transformers 5.23; its video processor's 2 is for videos)
GRID_MERGE_INPUT = {"video_llama_3": 1}
GRID_IMAGE_SIZE = 448   # px: a multiple of 28 (Qwen2/2.5-VL's 14-px patches x 2) and of 32 (Qwen3-VL's 16 x 2)
# Text models whose forward reads its token ids on the host (XLM and FlauBERT: `lengths.max().item()` of the non-pad
# tokens per row; FSMT: `padding_mask.any()`; T5Gemma-2: a mask built from its ids with `nonzero`; X-MOD: its language
# ids, which route every token to its language's adapter by a boolean index): their ids carry their values
# (tracer.host_values), as a tokenizer's ids do on a GPU.
HOST_VALUE_TYPES = ("xlm", "flaubert", "fsmt", "t5gemma2", "xmod")
# Vision-language models whose image path reads values on the host: BLIP-2's Q-Former asks whether its all-ones mask
# is all ones (`padding_mask.all()`, to skip it), Idefics2/3 and SmolVLM drop all-zero padding images by a boolean
# index and split the features per sample by counts they read. Their steps run with host values (tracer.host_values)
# and nonzero pixels; Idefics2/3 and SmolVLM take them stacked per sample, (b, images, C, H, W) with a
# pixel_attention_mask, as their processors hand them (each image one tile of the vision tower's image_size).
# Ovis2 wraps each image's tokens in visual indicator tokens (its processor: <IMG_START>, the image's tokens,
# <IMG_GRID>, <IMG_END> for a one-tile image) and asks of each indicator id whether the ids hold it (`mask.any()`)
# before writing its embedding there: INDICATOR_TOKENS per image, beside the image's own tokens in the seq.
STACKED_VLM_TYPES = ("idefics2", "idefics3", "smolvlm")
INDICATOR_TOKENS = {"ovis2": 3}
# LLaVA-NeXT's family cuts each image into tiles (the best of its image_grid_pinpoints) and packs each image's tile
# features in a Python loop over the images (`pack_image_features`), reading each image's size on the host: the loop's
# ticks are keyed per iteration (tracer.vlm_loop), each image a square of two tiles a side (its default image).
LOOP_VLM_TYPES = ("llava_next", "llava_next_video", "llava_onevision")
# Pixtral's tower (Mistral-3, LightOnOCR; Mistral-Large-4: Mistral-3's classes on a DeepSeek-V3.2-style sparse-attention
# MoE text model) takes each image at its own size and loops over the images twice (their 2D
# positions, the patch merger's unfold): marked per iteration too (tracer.vlm_loop), its attention under
# FlashAttention-2's varlen call (under SDPA or eager it masks every image's patches against every other's: a mask
# quadratic in the images). Each image's rows of tokens end with a break token ([IMG_BREAK], the last [IMG_END]). LLaVA
# with a Pixtral vision_config (Pixtral-12B) is priced the same way (tracer.vlm_loop.is_pixtral reads its config).
PIXTRAL_VLM_TYPES = ("mistral3", "lighton_ocr", "mistral_large4")
# LFM2-VL: SigLIP2's NaFlex tower (tracer.loop_marks.naflex_step) and a projection per image in a Python loop (marked
# the same way), priced with one tile per image: its processor's 512-px tile (tile_size), 1024 patches of 16 px, 256
# tokens after the 2 x 2 pixel unshuffle; an image larger than a tile, which the processor cuts into tiles and a
# thumbnail, is not priced (its default image is one tile).
NAFLEX_VLM_TYPES = ("lfm2_vl",)
NAFLEX_VLM_IMAGE_SIZE = 512
HOST_VLM_TYPES = ("blip-2", *STACKED_VLM_TYPES, *INDICATOR_TOKENS, *LOOP_VLM_TYPES, *PIXTRAL_VLM_TYPES,
                  *NAFLEX_VLM_TYPES)
VLM_TYPES = ("llava", "vipllava", "video_llava", "paligemma", "internvl", "qianfan_ocr", "cohere2_vision", "aya_vision",
             "llama4", "gemma3", "pp_chart2table", "deepseek_vl", "janus", "deepseek_vl_hybrid", *GRID_VLM_TYPES,
             *HOST_VLM_TYPES)

# Audio-language models priced whole with their audio (tracer.audio): the audio encoder, its projector and the language
# model run `audios` clips per sample, each one window of log-mel features as the model's feature extractor hands it
# over (16 kHz audio, a 10 ms hop, every frame valid), each a fixed number of audio tokens inside the sequence where
# the model scatters its audio features (the audio token id). Whisper's feature extractor (30-s windows: 3000 frames,
# twice a Whisper-style encoder's max_source_positions) serves Qwen2-Audio, Qwen2.5-Omni's thinker, Voxtral, Audio
# Flamingo 3, Music Flamingo and GLM-ASR; Nemotron-3.5-Transcribe's (Parakeet's: the same hop) hands over (frames,
# mels); Fun-ASR-Nano's stacks num_stacked_frames (7) frames of 80 bins every 6th (low frame rate: 500 frames of 560
# per 30 s, feature_extraction_fun_asr_nano); Granite-Speech's stacks 2 (1500 of 160). Qwen3-ASR takes Whisper's
# features, but its default config's audio output (3584 wide) does not match its text model (2048): refused there, a
# checkpoint's config.json matches them. Granite-Speech's default projector does not take its encoder's width (its own
# forward fails on its defaults).
AUDIO_TYPES = ("qwen2_audio", "qwen2_5_omni_thinker", "voxtral", "audioflamingo3", "musicflamingo", "glmasr",
               "nemo_speechlm", "fun_asr_nano", "qwen3_asr", "granite_speech", "granite_speech_plus")
# The version of the audio path an inventory was read with (its `audio_route`): a cached inventory of another one is
# read again (estimator.store), so a refusal cached by an older version does not outlive the fix. Bump it when
# tracer.audio changes what an inventory says.
AUDIO_ROUTE = "1"
# (frames per 30-s clip, frames first) where a clip is not Whisper's (mels, 3000)
AUDIO_FEATURES = {"nemo_speechlm": (3000, True), "fun_asr_nano": (500, True), "granite_speech": (1500, True),
                  "granite_speech_plus": (1500, True)}

def vlm_route(model_type: str) -> str:
    """How this version builds a vision-language model's images ("grid", "stacked", "loop", "pixtral", "host",
    "fixed"; "" for any other type): an inventory records it, and one cached under another route is read again
    (estimator.store), since whether its images are priced, and how, follows the route."""
    if model_type not in VLM_TYPES:
        return ""
    if model_type in GRID_VLM_TYPES:
        return "grid"
    if model_type in STACKED_VLM_TYPES:
        return "stacked"
    if model_type in LOOP_VLM_TYPES:
        return "loop"
    if model_type in PIXTRAL_VLM_TYPES:
        return "pixtral"
    return "host" if model_type in HOST_VLM_TYPES else "fixed"


# Options of those encoders whose memory is not priced: {config key: why}. BEiT's and Data2Vec-Vision's relative
# position bias builds its (tokens + 1)^2 int64 index on the host with an lru_cache per grid (BeitRelativePositionBias.
# generate_relative_position_index: created on the CPU, held across steps, copied to the GPU by each layer's
# indexing), which a trace on fake CPU tensors cannot tell from device memory; such a config is refused in one line.
VISION_UNPRICED = {
    "use_relative_position_bias": "its relative position bias index is built and cached on the host per image grid",
    "use_shared_relative_position_bias": "its shared relative position bias index is built and cached on the host "
                                         "per image grid",
}


def unpriced_vision_option(model_type: str, get) -> str | None:
    """One line for a vision config that sets an option of VISION_UNPRICED (`get(key)` reads the config: a dict's
    .get or getattr on transformers' config), else None."""
    if model_type not in VISION_TYPES:
        return None
    for key, why in VISION_UNPRICED.items():
        if get(key) is True:
            return (f"{key}: {model_type} with {key} true is not priced ({why}, which a trace cannot tell from GPU "
                    "memory); set it false to price the encoder without it")
    return None


def family_of(model_type: str) -> str:
    return FAMILIES.get(model_type, model_type)


# VLMs whose tower loops over the images with a backward that keeps the first two chains to run (tracer.loop_marks
# .mark_backward, pinned: LFM3-VL's short convolutions): with one image per sample, b = 2 runs two chains and b >= 3
# three or more, where the second chain's last tick is followed by the next chain (dropped) instead of the loop's end,
# one candidate tick fewer; b = 2 is then a region of its own (batch_two_apart; tracer.derive.THREE_BATCH_REGIONS)
PINNED_IMAGE_LOOP_TYPES = ("lfm3_vl", "lfm2_vl", "paddleocr_vl")   # LFM2-VL, PaddleOCR-VL: their per-image projections
PINNED_SAMPLE_LOOP_TYPES = ("siglip2",)   # the same, one iteration per sample (SigLIP2's position grids: NAFLEX_TYPES)


def batch_two_apart(config: dict, workload) -> bool:
    """Whether batch 2 is fit apart from batch 3 and up in training (PINNED_IMAGE_LOOP_TYPES with one image per sample,
    PINNED_SAMPLE_LOOP_TYPES always); inference runs no backward, whose loops alone are pinned."""
    model_type = config.get("model_type")
    return workload.mode == "train" and ((model_type in PINNED_IMAGE_LOOP_TYPES and workload.images == 1)
                                         or model_type in PINNED_SAMPLE_LOOP_TYPES)


def batch_squared(config: dict, workload) -> bool:
    """Whether a step's bytes have a batch^2 term: at a fixed image size, GLM-4.1V's vision embeddings hold `seq_ids`,
    an (images x patches) bool tensor (Glm4vVisionEmbeddings), whose images and patches both grow with the batch
    (BATCH_SQUARED_VLM_TYPES); RWKV's decoding mixes the (b, 1, hidden) token with its (b, hidden) shifted state
    (RwkvSelfAttention.extract_key_value, transformers 5.23), which broadcasts to (b, b, hidden)
    (BATCH_SQUARED_DECODE_TYPES). tracer.derive fits it on three batches."""
    model_type = config.get("model_type")
    return (bool(workload.images) and model_type in BATCH_SQUARED_VLM_TYPES) or \
        (workload.mode == "infer" and model_type in BATCH_SQUARED_DECODE_TYPES)
