"""Qwen2-VL's family whole (families.GRID_VLM_TYPES): images of any size as patches on a grid, read on the host.

    inputs = grid_inputs(model, workload, "cpu", per_image, image_token)   # what Qwen2VLProcessor hands the model
    with host_values.host_values(), grid_step(model):   # tracer.vlm.step_context, around every traced step
        model(**inputs)

These models take pixel values as a (patches, C x T x P x P) matrix and `image_grid_thw`, each image's (t, h, w) in
patches, and merge spatial_merge_size^2 patches into one token. Their code reads the grid and the token types on the
host before the first matmul; the inputs carry their values (tracer.host_values), so the model's own code runs. Three
of those host computations loop over images or samples (transformers.vision_utils.get_vision_position_ids and
get_vision_window_index, get_vision_interpolation_indices_and_weights (Qwen3-VL), the model's `get_rope_index`): on
a GPU each iteration allocates a few small integer tensors of one image's or one sample's size, freed at once. A
loop whose length is the batch makes the step's operations change with the batch, which no profile can fit, so
`grid_step` runs each of them on the host values and allocates its outputs once, as single device tensors, with
their values: the outputs are what the step holds (the (3, b, s) int64 positions, the window index); the loop's own
temporaries, each under one sample's size and dead before the vision tower's first layer, are not counted.

The vision tower's attention: under FlashAttention-2 (`--attention flash`) transformers makes one varlen call per
layer over every image's tokens (Qwen2VLVisionAttention: `cu_seq_lens_q=cu_seqlens`), which keeps its output and
logsumexp over the packed tokens; `PACKED` is that call on fake tensors (SDPA's flash kernel over the packed tokens:
the same output and logsumexp, tracer.kernels_sdpa). Under SDPA or eager it runs one call per image (and per window)
and concatenates them (`torch.split(..., lengths.tolist())`): a loop over the batch again, refused in one line
(estimator.vision.check_images) where asked for; the CLI and the app take flash when no attention is given.
"""
from __future__ import annotations

import contextlib
import sys

import torch
from torch._subclasses.fake_tensor import FakeTensor, unset_fake_temporarily
from torch.utils._mode_utils import no_dispatch
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

from estimator import vision as vision_sizes
from estimator.families import (GRID_IMAGE_SIZE, GRID_MERGE_INPUT, GRID_NO_TOKEN_TYPES, GRID_PATCH_IMAGES,
                                GRID_VLM_TYPES)
from tracer import host_values

PACKED = "willitfit_flash_varlen"   # an attention implementation whose name says flash: transformers' varlen branch
HOST_SIDE = ("get_vision_position_ids", "get_vision_window_index", "get_vision_interpolation_indices_and_weights",
             "get_vision_frame_index", "get_vision_temporal_merge_index",   # Kimi-K2.5's
             "get_vision_pixel_shuffle_index")   # Muse-Glimmer's
# the vision tower's class names end so (Qwen3-Omni's thinker: Qwen3OmniMoeVisionEncoder)
TOWERS = ("VisionTransformerPretrainedModel", "VisionModel", "VisionEncoder")


def is_grid(cfg) -> bool:
    """A model of Qwen2-VL's family: images of any size as patches on a grid (families.GRID_VLM_TYPES)."""
    return getattr(cfg, "model_type", None) in GRID_VLM_TYPES


def grid_geometry(cfg) -> dict:
    """patch_size, temporal_patch_size, spatial_merge_size and channels of a grid model's vision tower (the merge size
    its processor hands per image where the config names none: GRID_MERGE_INPUT)."""
    vc = cfg.vision_config
    kernel = getattr(vc, "merge_kernel_size", None)   # Kimi-K2.5's (kh, kw); square here
    if kernel is not None and len(set(kernel)) != 1:
        raise ValueError(f"model_type: {cfg.model_type!r}'s merge_kernel_size {tuple(kernel)} is not square; its "
                         "images are priced on square merges only")
    merge = GRID_MERGE_INPUT.get(cfg.model_type) or getattr(vc, "spatial_merge_size", None) or \
        getattr(vc, "merge_size", None) or (kernel[0] if kernel else None)   # merge_size: Muse-Glimmer's name
    if not merge:
        raise ValueError(f"model_type: {cfg.model_type!r}'s vision_config names no merge size (spatial_merge_size, "
                         "merge_size or merge_kernel_size); its images cannot be sized")
    temporal = getattr(vc, "temporal_patch_size", None) or getattr(vc, "patch_temporal", None) or 1
    return {"patch_size": int(vc.patch_size), "temporal_patch_size": int(temporal),
            "spatial_merge_size": int(merge),
            "num_channels": int(getattr(vc, "in_channels", None) or getattr(vc, "num_channels", 3) or 3)}


def grid_side(cfg, image_size: int = 0) -> int:
    """Merged tokens per side of a square image of `image_size` px (0: GRID_IMAGE_SIZE); ValueError naming image_size
    where it is no multiple of patch_size x spatial_merge_size (estimator.vision.grid_side)."""
    g = grid_geometry(cfg)
    return vision_sizes.grid_side(cfg.model_type, g["patch_size"], g["spatial_merge_size"],
                                  image_size or GRID_IMAGE_SIZE)


def grid_inputs(model, workload, device: str, per_image: int, image_token: int, clone_labels: bool = True) -> dict:
    """What Qwen2-VL's processor hands its model for `images` square images of workload.image_size px per sample:
    pixel_values (patches, C x T x P x P) in the weights' dtype (each image repeated over the temporal patch, as
    Qwen2VLImageProcessor does), image_grid_thw (b x images, 3) = (1, h, w) patches, input_ids with each image's
    per_image tokens followed by one text token (its vision_end), and mm_token_type_ids (1 on image tokens), which the
    model reads on the host (get_rope_index) like image_grid_thw: all four carry their values (VideoLLaMA3 and LFM3-VL
    take no token types, GRID_NO_TOKEN_TYPES; VideoLLaMA3 takes image_merge_sizes, GRID_MERGE_INPUT). A derivation fits
    above the seq the images take (tracer.vlm.seq_floor): the positions and Qwen3-VL's deepstack read where the image
    tokens are, so a shorter seq is refused here too."""
    g = grid_geometry(model.config)
    side = grid_side(model.config, workload.image_size) * g["spatial_merge_size"]   # patches per side
    b, s, n = workload.batch, workload.seq, workload.images
    if s <= vision_sizes.grid_layout(n, per_image):
        raise ValueError(f"seq: {s} tokens cannot hold {n} image(s) of {per_image} tokens each; use a seq over "
                         f"{vision_sizes.grid_layout(n, per_image)}")
    with unset_fake_temporarily(), no_dispatch():
        gen = torch.Generator().manual_seed(0)
        vocab = model.get_input_embeddings().num_embeddings
        ids = torch.randint(0, max(1, min(image_token, vocab)), (b, s), generator=gen)
        types = torch.zeros(b, s, dtype=torch.long)
        for i in range(n):
            start = 1 + i * (per_image + 1)
            ids[:, start:start + per_image] = image_token
            types[:, start:start + per_image] = 1
        grid = torch.tensor([[1, side, side]] * (b * n), dtype=torch.long)
    dtype = next(model.parameters()).dtype
    width = g["num_channels"] * g["temporal_patch_size"] * g["patch_size"] ** 2
    patches = (b * n * side * side, *((g["num_channels"], g["patch_size"], g["patch_size"])
                                      if model.config.model_type in GRID_PATCH_IMAGES else (width,)))

    def known(values):
        return host_values.on_device(values, device)

    out = {"input_ids": known(ids), "pixel_values": torch.empty(patches, dtype=dtype, device=device),
           "image_grid_thw": known(grid)}
    if model.config.model_type in GRID_MERGE_INPUT:   # VideoLLaMA3: each image's merge size
        with unset_fake_temporarily(), no_dispatch():
            merges = torch.full((b * n,), g["spatial_merge_size"], dtype=torch.long)
        out["image_merge_sizes"] = known(merges)
    if model.config.model_type not in GRID_NO_TOKEN_TYPES:
        out["mm_token_type_ids"] = known(types)
    if workload.mode == "train":
        out["labels"] = known(ids) if clone_labels else out["input_ids"]
    return out


def keeps_state(config: dict, workload) -> bool:
    """Whether a training step leaves state on the model that the next step's forward runs beside: a grid model's
    step with images sets `rope_deltas` on its inner model (Qwen2VLModel.compute_3d_position_ids, kept for
    generation), which the next step replaces only after its vision tower has run (16 B per sample at that peak,
    found where a tiny Qwen3-VL's forward peaks in its tower). A derivation then traces its first step too
    (tracer.ticks.prime_names), as run_traced does."""
    return bool(workload.images) and config.get("model_type") in GRID_VLM_TYPES


def _on_host(fn):
    """`fn` run on its arguments' host values, its outputs then allocated once each on the device (with their
    values, integer ones): see the module docstring."""
    def wrapped(*args, **kwargs):
        leaves, spec = tree_flatten((args, kwargs))
        if any(isinstance(t, FakeTensor) and host_values.value_of(t) is None for t in leaves):
            return fn(*args, **kwargs)   # a value the host does not know: the function's own failure says so
        real_args, real_kwargs = tree_unflatten([host_values.value_of(t) if isinstance(t, FakeTensor) else t
                                                 for t in leaves], spec)
        with unset_fake_temporarily(), no_dispatch():
            real = fn(*real_args, **real_kwargs)
        device = next((t.device for t in leaves if isinstance(t, torch.Tensor)), torch.device("cpu"))

        def allocate(r):
            if not isinstance(r, torch.Tensor):
                return r
            t = torch.empty(r.shape, dtype=r.dtype, device=device)
            return host_values.known(t, r) if not r.is_floating_point() else t
        return tree_map(allocate, real)
    wrapped.__wrapped__ = fn
    return wrapped


def _rope_owners(model) -> list:
    """The modules whose get_rope_index the step calls: the inner Qwen2VLModel (under PEFT's wrapper too), or the
    model whose class inherits it (Qwen3-Omni's thinker, from its pretrained-model mixin)."""
    return [module for module in model.modules()
            if any("get_rope_index" in c.__dict__ for c in type(module).__mro__)]


@contextlib.contextmanager
def grid_step(model):
    """The host computations that loop over images or samples, run on the host values with their outputs
    allocated once (`_on_host`); the vision tower's attention as FlashAttention-2's packed varlen call where the
    workload asked for flash (`register_packed`, set by the runner)."""
    owners = _rope_owners(model)
    modules = {sys.modules[type(m).__module__] for m in model.modules() if type(m).__name__.endswith(TOWERS)}
    saved = []
    try:
        for mod in modules:
            for name in HOST_SIDE:
                fn = getattr(mod, name, None)
                if fn is not None and not hasattr(fn, "__wrapped__"):
                    saved.append((mod, name, fn))
                    setattr(mod, name, _on_host(fn))
        for owner in owners:
            owner.get_rope_index = _on_host(type(owner).get_rope_index.__get__(owner))
        yield
    finally:
        for mod, name, fn in saved:
            setattr(mod, name, fn)
        for owner in owners:
            if "get_rope_index" in owner.__dict__:
                del owner.get_rope_index


def _packed_attention(module, query, key, value, attention_mask=None, scaling=None, dropout=0.0, **kwargs):
    """FlashAttention-2's varlen call over every image's tokens as one (1, heads, tokens, dim) attention: its output
    and logsumexp are what the varlen kernel keeps (values differ: the images do not attend to each other there).
    Fewer key/value heads than query heads (EXAONE-4.5's tower) stay unrepeated, as flash_attn_varlen
    takes them (SDPA's flash kernel with enable_gqa: tracer.kernels_sdpa)."""
    out = torch.nn.functional.scaled_dot_product_attention(query, key, value, scale=scaling, dropout_p=dropout,
                                                           enable_gqa=key.shape[1] != query.shape[1])
    return out.transpose(1, 2), None


def check_attention(cfg, workload) -> None:
    """One line where the vision tower's attention would loop over the images (SDPA, eager), or where selective
    checkpointing would wrap the attention this module replaces (estimator.vision.grid_refusal)."""
    refused = vision_sizes.grid_refusal(cfg.model_type, workload)
    if refused:
        raise ValueError(refused)


def register_packed() -> None:
    """Register (once) the packed attention with transformers under PACKED."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, AttentionInterface

    if PACKED not in ALL_ATTENTION_FUNCTIONS:
        AttentionInterface.register(PACKED, _packed_attention)


def use_packed_attention(model) -> None:
    """The vision tower's config runs PACKED (its text model keeps the workload's implementation)."""
    register_packed()
    for module in model.modules():
        cfg = getattr(module, "config", None)
        if type(module).__name__.endswith(TOWERS) and cfg is not None:
            cfg._attn_implementation = PACKED
