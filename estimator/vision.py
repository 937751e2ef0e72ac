"""Vision encoders' sizes in their own terms: an image size in pixels becomes the step's tokens per image (and, for
a multimodal checkpoint, which part of it an estimate covers: `scope_notes`).

    w = sized(model, Workload(image_size=518))     # -> seq = (518 // 14)^2 + 1 = 1370 tokens (DINOv2-g)

A vision encoder's profile is a polynomial in tokens per image, s = p + extra (tracer.vision): p = (image_size //
patch_size)^2 patches of a square image, extra the CLS and register tokens its embeddings add, both read from the
model by the inventory (`Inventory.extra["vision"]`). Only image sizes that are a multiple of the patch size are
priced: the pixels past the last whole patch (a 384-pixel SigLIP image in 14-pixel patches leaves 6) are read by no
patch, but the input tensor still holds them, b x channels x (H^2 - (n * patch)^2) elements that are no polynomial
in the tokens; such a size is refused in one line naming the nearest multiples.
"""
from __future__ import annotations

import math
from dataclasses import replace

from estimator import audio
from estimator.families import GRID_IMAGE_SIZE, INDICATOR_TOKENS, NAFLEX_TYPES, VLM_TYPES
from estimator.model import Model
from estimator.spec import Workload

# LLaVA-OneVision: one image per sample is cut into tiles; several are sent as one tile each (tracer.vlm_loop)
ONE_IMAGE_TYPES = ("llava_onevision",)


def geometry(model: Model) -> dict | None:
    """The inventory's vision part (image_size, patch_size, num_channels, extra_tokens, num_labels, base_params), or
    None for a text model."""
    v = model.inventory.extra.get("vision")
    return v if isinstance(v, dict) else None


def is_vision(model: Model) -> bool:
    return geometry(model) is not None


def is_spatial(model: Model) -> bool:
    """A vision model without patch tokens (a conv net, a hierarchical encoder): sized in grid units, not patches."""
    v = geometry(model)
    return v is not None and v.get("grid") in ("spatial", "side")


def by_side(model: Model) -> bool:
    """A spatial model sized by its grid units per side (square images; families.SIDE_GRID_TYPES)."""
    v = geometry(model)
    return v is not None and v.get("grid") == "side"


def unit_name(model: Model) -> str:
    """What a vision model's unit is called in messages: its patch size, or a spatial model's grid unit."""
    if not is_spatial(model):
        return "patch size"
    return "grid unit (its total stride x its window)" if geometry(model).get("window") else \
        "grid unit (its total stride)"


def size_words(model: Model, seq: int) -> str:
    """What a vision step's seq counts, in words: "197 tokens each", or a spatial model's "64 grid units of 32 px"."""
    if by_side(model):
        return f"{seq:,} x {seq:,} grid units of {geometry(model)['patch_size']} px"
    if is_spatial(model):
        return f"{seq:,} grid units of {geometry(model)['patch_size']} px"
    return f"{seq:,} tokens each"


def traced_depths(prov: dict) -> str:
    """The depths a profile was traced at, for a provenance line: "3/4 layers", or "the whole model"."""
    depths = "/".join(str(len(d)) for d in prov.get("reduced_depths", []) if d)
    return f"{depths} layers" if depths else "the whole model"


def tokens(model: Model, image_size: int) -> int:
    """Tokens per image of a square `image_size`-pixel image: (image_size // patch)^2 patches plus the extra tokens;
    ValueError naming image_size where it is no multiple of the patch size."""
    v = geometry(model)
    patch = int(v["patch_size"])
    if image_size < patch or image_size % patch:
        lo, hi = max(patch, image_size - image_size % patch), image_size - image_size % patch + patch
        why = ("its feature maps would be padded or cut at some stage, which is not priced exactly" if
               is_spatial(model) else "pixels past the last whole patch are held but read by no patch, which is not "
               "priced exactly")
        raise ValueError(f"image_size: {image_size} is not a multiple of {model.name}'s {unit_name(model)} {patch} "
                         f"({why}); use {lo} or {hi}")
    if by_side(model):   # units per side of a square image: the profile's variable
        return image_size // patch
    return (image_size // patch) ** 2 + int(v["extra_tokens"])


SEQ_UNSET = Workload().seq   # a workload that names no seq (the CLI's and the app's default)


def sized(model: Model, w: Workload) -> Workload:
    """The workload with a vision encoder's size resolved: seq := the tokens per image of image_size; with image_size
    0, of the config's image_size, unless seq is set (not SEQ_UNSET): a run row's seq already holds its tokens per
    image (image_size is no run column, bench.store.rows.NOT_COLUMNS), kept as they are, and image_size is then the
    square image they make (0 for a rectangle of patches, as `python -m bench trace --seq` may trace). A text model
    keeps its seq and refuses an image size."""
    v = geometry(model)
    if v is None and sizable(model):   # a VLM whose images' size is the user's (its class's): resolved, checked
        if not w.images:
            if w.image_size:
                raise ValueError(f"image_size: {model.name}'s images are sized with --images N (0 images: a "
                                 "text-only step has no image size)")
            return w
        size = w.image_size or (GRID_IMAGE_SIZE if grid(model) is not None else int(images_of(model)["image_size"]))
        _per_image(model, replace(w, image_size=size))   # a size its processor would not make: one line
        return replace(w, image_size=size)
    if v is None:
        if w.image_size:
            raise ValueError(f"image_size: applies to vision encoders and to Qwen2-VL's, LLaVA-NeXT's and Pixtral's "
                             f"families with --images; {model.name} ({model.model_type}) is sized by seq")
        return w
    if w.image_size == 0 and w.seq != SEQ_UNSET and by_side(model):
        return replace(w, image_size=w.seq * int(v["patch_size"]))
    if w.image_size == 0 and w.seq != SEQ_UNSET:
        patches = w.seq - int(v["extra_tokens"])
        if patches < 1:
            raise ValueError(f"seq: {w.seq} tokens per image leave no patch ({model.name} adds {v['extra_tokens']} "
                             "tokens of its own); use --image-size")
        side = math.isqrt(patches)
        return replace(w, image_size=side * int(v["patch_size"]) if side * side == patches else 0)
    size = w.image_size or int(v["image_size"])
    return replace(w, image_size=size, seq=tokens(model, size))


def images_of(model: Model) -> dict | None:
    """A vision-language model's images (image_size, num_channels, image_tokens per image, image_token_id), or None:
    the inventory's `vlm` part (tracer.vlm.info)."""
    v = model.inventory.extra.get("vlm")
    return v if isinstance(v, dict) else None


def sizable(model: Model) -> bool:
    """A vision-language model whose images are any size the user picks (`--image-size`): Qwen2-VL's family (grid),
    LLaVA-NeXT's (tiled) and Pixtral's tower (pixtral); the others' images are their config's size."""
    return any(f(model) is not None for f in (grid, tiled, pixtral))


def tiled(model: Model) -> dict | None:
    """A tiled model's geometry (LLaVA-NeXT's family: families.LOOP_VLM_TYPES; tracer.vlm_loop.geometry), or None."""
    v = images_of(model)
    return v.get("tiles") if v is not None else None


def best_resolution(size: tuple[int, int], pinpoints) -> tuple[int, int]:
    """The pinpoint (height, width) an image of `size` (height, width) is resized into: the most of the image kept,
    then the least padding (transformers' image_processing_utils.select_best_resolution, as its processors and the
    models' forwards choose it)."""
    oh, ow = size
    best, most, waste = None, 0, float("inf")
    for h, w in pinpoints:
        scale = min(w / ow, h / oh)
        effective = min(int(ow * scale) * int(oh * scale), ow * oh)
        wasted = w * h - effective
        if effective > most or (effective == most and wasted < waste):
            best, most, waste = (h, w), effective, wasted
    return best


def tiled_tokens(name: str, t: dict, image_size: int) -> int:
    """Tokens one square `image_size`-px image becomes on a tiled model (`t`: tiled()): the base tile's patches, and
    the tile grid's features with the padding cut off (the image's own aspect), shrunk to OneVision's cap where they
    exceed it, plus one newline token per row: pack_image_features and unpad_image in transformers' modeling_llava_next
    and modeling_llava_onevision, as arithmetic (checked against the models' own forward: tests/test_vlm.py)."""
    if image_size < 1:
        raise ValueError(f"image_size: {image_size} is not a size in pixels; {name}'s images are square, e.g. "
                         f"{2 * t['tile']} (two {t['tile']}-px tiles a side)")
    side = t["tile"] // t["patch"]
    h, w = best_resolution((image_size, image_size), t["pinpoints"])
    rows, cols = h // t["tile"] * side, w // t["tile"] * side
    if 1 > cols / rows:      # unpad_image: the original's aspect (1, square) against the grid's
        new = int(round(image_size * (cols / image_size), 7))
        rows -= 2 * ((rows - new) // 2)
    else:
        new = int(round(image_size * (rows / image_size), 7))
        cols -= 2 * ((cols - new) // 2)
    if t.get("max_tiles"):
        ratio = math.sqrt(rows * cols / (t["max_tiles"] * side ** 2))
        if ratio > 1.1:      # OneVision's bilinear interpolation down to about max_tiles tiles' worth
            rows, cols = int(rows // ratio), int(cols // ratio)
    return side * side + rows * (cols + 1)


def grid(model: Model) -> dict | None:
    """A grid model's patch geometry (Qwen2-VL's family: families.GRID_VLM_TYPES), or None."""
    v = images_of(model)
    return v.get("grid") if v is not None else None


def grid_side(name: str, patch: int, merge: int, image_size: int) -> int:
    """Merged tokens per side of a square `image_size`-px image on a grid model of `patch`-px patches merged
    `merge` x `merge`; ValueError naming image_size where the side is no multiple of patch x merge (its processor
    resizes images to those). Shared with the tracer (tracer.vlm_grid)."""
    unit = patch * merge
    if image_size < unit or image_size % unit:
        lo, hi = max(unit, image_size - image_size % unit), image_size - image_size % unit + unit
        raise ValueError(f"image_size: {image_size} is not a multiple of {name}'s {unit}-px merged patch ({patch} px x "
                         f"{merge}; its processor resizes images to those); use {lo} or {hi}")
    return image_size // unit


def grid_layout(images: int, per_image: int) -> int:
    """The tokens a grid model's images take of a sample's seq: each image's tokens and its end token (the
    processor's vision_end); the shortest seq is one more. Shared with the tracer (tracer.vlm, tracer.vlm_grid)."""
    return images * (per_image + 1)


def fixed_layout(model_type: str, images: int, per_image: int, breaks: bool = False) -> int:
    """The tokens a fixed-size model's images take of a sample's seq: each image's tokens and, for Ovis2, the visual
    indicator tokens around them (families.INDICATOR_TOKENS), for Pixtral's tower (`breaks`: Mistral-3, LightOnOCR,
    LLaVA with a Pixtral tower) one break token per row of a square image's tokens; the shortest seq is one more.
    Shared with the tracer (tracer.vlm)."""
    if breaks:
        return images * (per_image + math.isqrt(per_image))
    return images * (per_image + INDICATOR_TOKENS.get(model_type, 0))


def pixtral(model: Model) -> dict | None:
    """A Pixtral-towered model's patch geometry (patch, merge: tracer.vlm_loop.pixtral_geometry), or None."""
    v = images_of(model)
    return v.get("pixtral") if v is not None else None


def pixtral_tokens(name: str, p: dict, image_size: int) -> int:
    """Tokens one square `image_size`-px image becomes on a Pixtral tower with its patch merger: (side / (patch x
    merge))^2; ValueError naming image_size where the side is no multiple of patch x merge."""
    return grid_side(name, p["patch"], p["merge"], image_size) ** 2


def grid_refusal(name: str, w: Workload, masked: bool = False) -> str | None:
    """Why a grid model's step with images is not priced, in one line, or None: its vision tower under SDPA or eager
    (a loop over the images; `masked`, Pixtral's: a mask over every image's patches), selective checkpointing of its
    packed attention. Shared with the tracer (tracer.vlm_grid.check_attention)."""
    if w.attention != "flash" and masked:
        return (f"attention: under {w.attention} {name}'s vision tower masks every image's patches against every "
                "other's (a mask quadratic in the images, which no profile in the batch fits); use --attention flash "
                "(FlashAttention-2's one varlen call per layer, as trainers run it)")
    if w.attention != "flash":
        return (f"attention: under {w.attention} {name}'s vision tower runs one attention call per image (and per "
                "window) and concatenates them, a loop over the batch no profile can fit; use --attention flash "
                "(FlashAttention-2's one varlen call per layer, as trainers run it)")
    if w.checkpointing == "selective":
        return f"checkpointing: selective checkpointing of {name}'s packed vision attention is not priced; use none, " \
               "full or op-sac"
    return None


def grid_tokens(model: Model, image_size: int) -> int:
    """Tokens one square image of `image_size` px becomes on a grid model: (side / (patch x merge))^2."""
    g = grid(model)
    return grid_side(model.name, int(g["patch_size"]), int(g["spatial_merge_size"]), image_size) ** 2


def _per_image(model: Model, w: Workload) -> tuple[int, int]:
    """(side in px, tokens) of one image of this step."""
    v = images_of(model)
    if grid(model) is not None:
        size = w.image_size or GRID_IMAGE_SIZE
        return size, grid_tokens(model, size)
    if tiled(model) is not None and w.image_size:
        return w.image_size, tiled_tokens(model.name, tiled(model), w.image_size)
    if pixtral(model) is not None and w.image_size:
        return w.image_size, pixtral_tokens(model.name, pixtral(model), w.image_size)
    return int(v["image_size"]), int(v["image_tokens"])


def image_words(model: Model, w: Workload) -> str:
    """"1 image of 336x336 px (576 tokens) per sample", or "" for a step without images."""
    v = images_of(model)
    if not w.images or v is None:
        return ""
    n = w.images
    size, tokens = _per_image(model, w)
    return f"{n} image{'s' if n > 1 else ''} of {size}x{size} px ({n * tokens:,} image tokens) per sample"


def image_tokens(model: Model, w: Workload) -> int:
    """The tokens a step's images take of each sample's seq (0 without images): the shortest seq is one more. A grid
    model's images also end with a text token each (the processor's vision_end), Ovis2's with its visual indicator
    tokens (families.INDICATOR_TOKENS), counted here."""
    v = images_of(model)
    if not w.images or v is None:
        return 0
    per = _per_image(model, w)[1]
    return grid_layout(w.images, per) if grid(model) is not None else \
        fixed_layout(model.model_type, w.images, per, breaks=pixtral(model) is not None)


def media_tokens(model: Model, w: Workload) -> int:
    """The tokens a step's images and audio clips take of each sample's seq (`image_tokens` and
    estimator.audio.audio_tokens): the shortest seq is one more."""
    return image_tokens(model, w) + audio.audio_tokens(model, w)


def check_images(model: Model, w: Workload) -> None:
    """One line before any slow work: images for a model that takes none here, or a seq too short for their
    tokens; an audio-language model's audio clips alike (estimator.audio.check_audio)."""
    audio.check_audio(model, w)
    if not w.images:
        return
    v = images_of(model)
    refused = model.inventory.extra.get("vlm_refused")
    if v is None and refused:
        raise ValueError(f"images: {model.name}'s vision tower fails on its own config's image size ({refused}); "
                         "only a text-only step (0 images) is priced")
    if v is None:
        raise ValueError(f"images: {model.name} ({model.model_type}) is not priced with images; the vision-language "
                         f"models that are: {', '.join(VLM_TYPES)} (0 prices a text-only step)")
    refused = grid_refusal(model.name, w) if grid(model) is not None else \
        grid_refusal(model.name, w, masked=True) if pixtral(model) is not None else None
    if refused:
        raise ValueError(refused)
    if model.model_type in ONE_IMAGE_TYPES and w.images > 1:
        raise ValueError(f"images: {model.name} is priced with 1 image per sample ({w.images} asked): its processor "
                         "sends the images of a sample with several as one tile each (batch_num_images), which is not "
                         "priced; 1 prices one image in its tiles")
    tokens = image_tokens(model, w)
    if w.seq <= tokens:
        size, per = _per_image(model, w)
        raise ValueError(f"seq: {w.seq:,} tokens cannot hold {w.images} image(s) of {per:,} tokens each "
                         f"({size}x{size} px); use a seq over {tokens:,}")


def params(model: Model, w: Workload) -> int:
    """Parameters of the model the step builds: the image-classification model for training, the base vision model
    (no classifier; ViT's pooler) for inference."""
    v = geometry(model)
    if v is not None and w.mode == "infer":
        return int(v["base_params"])
    return model.params


def size_notes(model: Model, w: Workload) -> tuple[str, ...]:
    """What an estimate at this image size does not trace: a windowed model (Swin) on a one-unit image, whose last
    stage is then a single window, where Swin runs no shifted windows (SwinLayer.set_shift_and_window_size) while its
    profile is fit on larger images, which do: priced as the shifted step, an upper bound by that stage's rolled
    copies and attention mask (0.06% of the forward peak, backward exact, on the default Swin at 224 px, batch 2)."""
    if w.seq != 1:   # every estimate passes here: the common case returns before reading the inventory
        return ()
    window = (geometry(model) or {}).get("window")
    if not by_side(model) or not window:
        return ()
    return (f"image_size: at {w.image_size} px {model.name}'s last stage is a single {window} x {window} window, where "
            "Swin shifts no windows; priced as the shifted step (an upper bound by that stage's rolled copies and "
            "attention mask)",)


def scope_notes(model: Model, w: Workload = Workload()) -> tuple[str, ...]:
    """What part of a multimodal checkpoint the estimate covers, said out loud: a config whose language model is
    built alone (Aria's text model) leaves the vision tower's weights and the images out; one built
    whole holds the tower's weights; a vision-language model priced with images (families.VLM_TYPES) says so when
    the step has none."""
    inv = model.inventory
    heard = audio.scope_notes(model, w)   # an audio-language model's (estimator.audio)
    if heard is not None:
        return heard
    text_type = inv.extra.get("text_model_type", inv.model_type)
    if text_type == inv.model_type:
        return ()
    if is_vision(model):  # SigLIP, CLIP: the step runs the vision_config's tower (tracer.vision)
        naflex = (f"scope: {inv.model_type}'s NaFlex processor is taken with max_num_patches = the image's patch "
                  "count (nothing padded); one that pads to a larger max_num_patches holds that many (price the image "
                  "size whose patches make that count)",) if inv.model_type in NAFLEX_TYPES else ()
        return (f"scope: {inv.model_type} is priced as its vision tower alone ({inv.built_as} on its "
                f"{text_type}); the checkpoint's text tower is not built",) + naflex
    if images_of(model) is not None:   # priced with its images when asked (--images)
        return () if w.images else (
            f"scope: {inv.model_type} is built whole ({inv.built_as}) and the step is text-only; --images N prices N "
            "images per sample (vision tower, projector and image tokens)",)
    if inv.built_as.endswith("ForConditionalGeneration"):
        return (f"scope: {inv.model_type} is built whole ({inv.built_as}: its vision tower's weights are held) but "
                "the step is text-only: no images, so no vision-tower activations or image tokens",)
    return (f"scope: {inv.model_type} is priced as its language model alone ({inv.built_as}, {text_type}); its "
            "vision tower's weights and the images' activations are not included",)
