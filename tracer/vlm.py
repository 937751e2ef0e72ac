"""Vision-language models whole: the image-text-to-text model, its images and their tokens (estimator.families.VLM_TYPES).

    tokens = image_tokens(model)                  # image tokens one image becomes (read on the model as built)
    inputs = vlm_inputs(model, workload, "cpu")   # input_ids (b, s) with images x tokens image ids, pixel_values

A step of `workload.images` images per sample at the config's image size: pixel values of shape (b x images, C, H, W)
in the weights' dtype (as transformers' processors hand them over and its docs cast them), and input_ids whose first
positions after one text token are the image token id, images x tokens of them per sample (LLaVA's, PaliGemma's,
InternVL's and Gemma-3's forwards scatter the projected image features there: `masked_scatter` on
`input_ids == image_token_id`). The rest of the sequence is text. Gemma-3 and PaliGemma also get the token_type_ids
their processors return (`TOKEN_TYPES`), which change their attention masks. The vision tower's and projector's activations are
the same for every sequence length, so memory stays a polynomial in (batch, seq) for a fixed image count, and the
derivation needs nothing beyond its (b, s) fit: `images` is part of the profile's class.

Some read their inputs' values on the host (families.HOST_VLM_TYPES): BLIP-2's Q-Former asks whether its all-ones
mask is all ones; Idefics2, Idefics3 and SmolVLM take pixel values stacked per sample (b, images, C, H, W) with a
pixel_attention_mask, drop all-zero padding images by a boolean index and split the features by counts read on the
host; Ovis2 asks of each visual indicator id whether its ids hold it (`_indicated_ids` lays them out). Their steps
run with host values (tracer.host_values): the pixels (nonzero: real images), the mask (all true) and Ovis2's ids
carry their values, as the processor's tensors do on a GPU (`image_kwargs`); on the meta device (their image tokens,
their unreached parameters) they run under a fake mode of their own (`_valued`). DeepSeek-VL-Hybrid also gets each
image at its SAM tower's image size (`high_res_pixel_values`).

Fake tensors hold no values: the placeholder check transformers runs (`torch_compilable_check(n_image_tokens * hidden
== image_features.numel())`, which reads the result on the host with `.item()`) cannot be evaluated on them.
`host_checks_skipped` runs the check's own reduction (its one-byte result is allocated as on a GPU) and skips the host
read; on real tensors it changes nothing. The inputs built here put exactly the right number of image tokens in each
sample, so the check would hold on a GPU.
"""
from __future__ import annotations

import contextlib
import contextvars
import json
from collections import Counter

import torch

from torch._subclasses.fake_tensor import FakeTensorMode, unset_fake_temporarily

from estimator.families import (AUDIO_TYPES, GRID_IMAGE_SIZE, HOST_VALUE_TYPES, HOST_VLM_TYPES, INDICATOR_TOKENS,
                                NAFLEX_VLM_IMAGE_SIZE, NAFLEX_VLM_TYPES, STACKED_VLM_TYPES, VLM_TYPES)
from estimator.vision import fixed_layout, grid_layout, pixtral_tokens
from tracer import host_values, loop_marks, vision, vlm_grid, vlm_loop
from tracer.vlm_grid import grid_geometry, grid_side, is_grid

IMAGE_TOKEN_KEYS = ("image_token_id", "image_token_index")
# Models whose processor returns token_type_ids, which their forward turns into a bidirectional block in the attention
# mask (a materialised mask where SDPA would otherwise run causal without one): Gemma-3's processor marks the image
# tokens 1 (Gemma3Processor, `mm_token_type_ids`; modeling_gemma3 `get_block_sequence_ids_for_mask`), PaliGemma's
# marks the suffix 1 after an image-and-prompt prefix that attends both ways (PaliGemmaProcessor; modeling_paligemma
# builds `block_sequence_ids` from token_type_ids == 0).
TOKEN_TYPES = {"gemma3": "image", "paligemma": "suffix"}


def is_vlm(cfg) -> bool:
    """A config of a vision-language model priced whole with its images (by its model_type)."""
    return getattr(cfg, "model_type", None) in VLM_TYPES


def image_token_id(cfg) -> int:
    for key in IMAGE_TOKEN_KEYS:
        value = getattr(cfg, key, None)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    raise ValueError(f"model_type: {cfg.model_type!r} states no image token id ({' or '.join(IMAGE_TOKEN_KEYS)}); "
                     "its forward finds the images' places by it (a checkpoint's config.json states it)")


def image_geometry(cfg) -> tuple[int, int]:
    """(image side in pixels, channels) of the config's vision tower: square images of its image_size (a grid
    model's: GRID_IMAGE_SIZE, its default)."""
    if is_grid(cfg):
        return GRID_IMAGE_SIZE, grid_geometry(cfg)["num_channels"]
    vc = getattr(cfg, "vision_config", None)
    if cfg.model_type in NAFLEX_VLM_TYPES:   # one tile of its processor (families.NAFLEX_VLM_IMAGE_SIZE)
        return NAFLEX_VLM_IMAGE_SIZE, int(getattr(vc, "num_channels", 3) or 3)
    size = getattr(vc, "image_size", None)
    if isinstance(size, (list, tuple)):
        if len(set(size)) != 1:
            raise ValueError(f"model_type: {cfg.model_type!r} has a non-square image size {list(size)}; willitfit "
                             "prices square images")
        size = size[0]
    if not isinstance(size, int) or size < 1:
        raise ValueError(f"model_type: {cfg.model_type!r} states no image size in its vision_config")
    return size, int(getattr(vc, "num_channels", 3) or 3)


def _pixels(model, lead: tuple, device, geometry: tuple[int, int] | None = None) -> torch.Tensor:
    """Pixel values (*lead, C, H, W) in the weights' dtype, square images of `geometry` (side, channels), or the
    config's vision tower's (`image_geometry`)."""
    size, channels = geometry or image_geometry(model.config)
    dtype = next(model.parameters()).dtype
    return torch.empty(*lead, channels, size, size, dtype=dtype, device=device)


def _ones(t: torch.Tensor) -> torch.Tensor:
    """`t` marked as holding ones (tracer.host_values): nonzero pixels, an all-true mask."""
    with unset_fake_temporarily():
        values = torch.ones(tuple(t.shape), dtype=t.dtype, device="cpu")
    return host_values.known(t, values)


def image_kwargs(model, batch: int, images: int, device, image_size: int = 0) -> dict:
    """The pixel inputs of `images` images per sample: pixel_values (b x images, C, H, W); a model of
    families.STACKED_VLM_TYPES gets them as (b, images, C, H, W) with an all-true pixel_attention_mask (b, images, H,
    W), pixels the host knows are nonzero (real images: none of the all-zero padding ones their processors add, which
    their forward drops by a boolean index of its own). A tiled or Pixtral-towered model's (tracer.vlm_loop) images
    are `image_size` px square (0: its default)."""
    cfg = model.config
    hi = getattr(cfg, "high_res_vision_config", None)
    if hi is not None:   # DeepSeek-VL-Hybrid: each image also at its SAM tower's high resolution, as its processor does
        geometry = (int(hi.image_size), int(getattr(hi, "num_channels", 3) or 3))
        return {"pixel_values": _pixels(model, (batch * images,), device),
                "high_res_pixel_values": _pixels(model, (batch * images,), device, geometry)}
    if vlm_loop.is_loop(cfg):   # tiles per image and each image's size (tracer.vlm_loop)
        return vlm_loop.loop_kwargs(model, batch, images, device, image_size)
    if vlm_loop.is_pixtral(cfg):   # each image at its own size, which the host knows
        return vlm_loop.pixtral_kwargs(model, batch, images, device, image_size)
    if cfg.model_type in NAFLEX_VLM_TYPES:   # LFM2-VL: SigLIP2's NaFlex patches, one tile per image
        size, channels = image_geometry(cfg)
        patch = int(cfg.vision_config.patch_size)
        return vision.naflex_inputs(batch * images, size // patch, size // patch, patch, channels,
                                    next(model.parameters()).dtype, device)
    if cfg.model_type not in STACKED_VLM_TYPES:
        return {"pixel_values": _pixels(model, (batch * images,), device)}
    size = image_geometry(cfg)[0]
    mask = torch.empty(batch, images, size, size, dtype=torch.bool, device=device)
    return {"pixel_values": _ones(_pixels(model, (batch, images), device)), "pixel_attention_mask": _ones(mask)}


@contextlib.contextmanager
def _valued(model):
    """Where a model of HOST_VLM_TYPES runs on the meta device (its image tokens, its unreached parameters): under a
    fake mode of its own with host values, which answer the host reads meta tensors cannot (the meta parameters
    taken as they are); nothing for every other model."""
    if model.config.model_type not in HOST_VLM_TYPES:
        yield
        return
    with unset_fake_temporarily(), FakeTensorMode(allow_non_fake_inputs=True), host_values.host_values():
        yield


_TOKENS: dict[str, int] = {}   # per config (json), within a process: a derivation builds its model once per trace


def image_tokens(model, config: dict | None = None, image_size: int = 0) -> int:
    """The tokens one image becomes in the sequence: the model's own get_image_features on one image of the config's
    size, run on the meta device (its elements over the text model's hidden size); memoised by `config` where given
    (0.2-0.3 s for LLaVA-1.5's CLIP-L tower, paid once per derivation instead of once per trace). A grid model's: its
    merged tokens, (side / (patch x merge))^2 for a square image of `image_size` px (its merger's output rows; checked
    against its own forward by tests/test_vlm_grid.py)."""
    if is_grid(model.config):
        return grid_side(model.config, image_size) ** 2
    if vlm_loop.is_pixtral(model.config):   # (side / (patch x merge))^2, checked against its forward (tests/test_vlm.py)
        size = image_size or int(model.config.vision_config.image_size)
        return pixtral_tokens(model.config.model_type, vlm_loop.pixtral_geometry(model.config), size)
    if not vlm_loop.is_loop(model.config):   # only a tiled model's tokens (read below) follow the image's size
        image_size = 0
    if config is not None:
        key = json.dumps([config, image_size], sort_keys=True, default=str)
        if key not in _TOKENS:
            _TOKENS[key] = image_tokens(model, image_size=image_size)
        return _TOKENS[key]
    device = next(model.parameters()).device
    # the image-text-to-text class's own method, or its inner model's (DeepSeek-VL, Janus keep it there)
    get = getattr(model, "get_image_features", None) or model.model.get_image_features
    with _valued(model), torch.no_grad():
        features = get(**image_kwargs(model, 1, 1, device, image_size))
    if not torch.is_tensor(features) and getattr(features, "pooler_output", None) is None and \
            getattr(features, "last_hidden_state", None) is not None:
        # Llama-4: the tower's output rows (each tile's pixel-shuffled patches) are projected in the forward itself,
        # one token each (vision_flat -> multi_modal_projector -> masked_scatter)
        rows = features.last_hidden_state
        return int(rows.numel() // rows.shape[-1])
    features = getattr(features, "pooler_output", features)
    parts = [features] if torch.is_tensor(features) else list(features)
    hidden = model.get_input_embeddings().embedding_dim
    total = sum(int(t.numel()) for t in parts)
    widths = sorted({int(t.shape[-1]) for t in parts} - {hidden})
    if widths:   # masked_scatter would take them by element count alone (Ovis2's default config: 1536 into 4096)
        raise ValueError(f"model_type: {model.config.model_type!r}'s image features are {widths[0]} wide and its text "
                         f"embeddings {hidden}: a config whose parts disagree (its forward would scatter the features "
                         "by element count); a checkpoint's config.json matches them")
    if total % hidden:
        raise ValueError(f"model_type: {model.config.model_type!r}'s image features ({total} elements) are no whole "
                         f"number of tokens of width {hidden}")
    return total // hidden


def vlm_inputs(model, workload, device: str, per_image: int, clone_labels: bool = True) -> dict:
    """input_ids (b, s) with `images` x `per_image` image token ids after one text token, pixel values for b x images
    images, and labels (a copy of the ids, or the ids themselves) for training. A grid model's: `grid_inputs`."""
    if is_grid(model.config):   # its own layout, never shorter than its images (tracer.vlm_grid)
        return vlm_grid.grid_inputs(model, workload, device, per_image, image_token_id(model.config), clone_labels)
    n = workload.images
    wrap = INDICATOR_TOKENS.get(model.config.model_type, 0)
    tokens = fixed_layout(model.config.model_type, n, per_image, breaks=vlm_loop.is_pixtral(model.config))
    if workload.seq <= tokens and not _FITTING.get():
        raise ValueError(f"seq: {workload.seq} tokens cannot hold {n} image(s) of {per_image + wrap} tokens each; use a "
                         f"seq over {tokens}")
    tok = image_token_id(model.config)
    vocab = model.get_input_embeddings().num_embeddings
    if wrap:   # ids the host knows: its forward asks which indicator ids they hold
        input_ids = _indicated_ids(model.config, workload, device, per_image, min(tok, vocab))
    else:
        input_ids = torch.randint(0, max(1, min(tok, vocab)), (workload.batch, workload.seq), device=device)
        # Pixtral's break tokens after each row are text (fixed_layout counts them); where they sit changes nothing
        input_ids[:, 1:1 + n * per_image if vlm_loop.is_pixtral(model.config) else 1 + tokens] = tok
    out = {"input_ids": input_ids, **image_kwargs(model, workload.batch, n, device, workload.image_size)}
    marks = TOKEN_TYPES.get(model.config.model_type)
    if marks is not None:   # what the model's processor hands over beside the ids: it changes the attention mask
        types = torch.zeros_like(input_ids)
        if marks == "image":
            types[:, 1:1 + tokens] = 1
        else:   # the suffix: the second half of the text, after the image and the prompt
            types[:, (1 + tokens + workload.seq) // 2:] = 1
        out["token_type_ids"] = types
    if workload.mode == "train":
        out["labels"] = input_ids.clone() if clone_labels else input_ids
    return out


def _indicated_ids(cfg, workload, device: str, per_image: int, high: int) -> torch.Tensor:
    """Ovis2's ids, values the host knows: after one text token, per image an indicator, its image tokens and two more
    indicators (Ovis2Processor: <IMG_START>, <IMG_ATOM> x tokens, <IMG_GRID>, <IMG_END> for one tile), the rest text
    below the image token id. Which of config.visual_indicator_token_ids names which indicator transformers does not
    say; each image holds three distinct ones once, and the step's memory is the same for any three. Positions past
    seq are dropped (a derivation's short seqs: `fitting`)."""
    ind, tok = list(cfg.visual_indicator_token_ids), image_token_id(cfg)
    ids = host_values.random_ids(torch.empty(workload.batch, workload.seq, dtype=torch.long, device=device), high)
    layout = [t for _ in range(workload.images) for t in (ind[0], *[tok] * per_image, ind[1], ind[2])]
    layout = layout[:max(0, workload.seq - 1)]
    with unset_fake_temporarily():
        host_values.value_of(ids)[:, 1:1 + len(layout)] = torch.tensor(layout, dtype=torch.long)
    return ids


_FITTING = contextvars.ContextVar("willitfit_vlm_fitting", default=False)


@contextlib.contextmanager
def fitting():
    """Inside (tracer.derive's traces): a sequence shorter than the images' tokens is traced too. On fake tensors the
    step's shapes do not depend on which positions hold image tokens (the features are scattered with
    `masked_scatter`, whose output is the embeddings' shape), so the fit's small sizes follow the same polynomial as
    the sizes a GPU can run; the estimate refuses a seq that cannot hold the images (estimator.vision.check_images),
    and the profile is checked against full-depth traces at sizes that can (tests/test_vlm.py, scripts/vlm_check.py)."""
    token = _FITTING.set(True)
    try:
        yield
    finally:
        _FITTING.reset(token)


def in_fitting() -> bool:
    """Whether this trace is a derivation's (inside `fitting`): its seq may be shorter than the images' (or an
    audio-language model's clips': tracer.audio) tokens."""
    return _FITTING.get()


def seq_floor(cfg, workload) -> int:
    """The shortest seq minus one a grid model's step with images can run (its images' tokens, each followed by a
    text token): a derivation fits above it (tracer.derive.pieces_for), since its 3D positions and Qwen3-VL's
    deepstack read where the image tokens are; 0 for every other model (their fits may run shorter seqs: `fitting`)."""
    if not workload.images or not is_grid(cfg):
        return 0
    return grid_layout(workload.images, grid_side(cfg, workload.image_size) ** 2)


def step_context(model, workload, counter=None):
    """What a traced step of this model runs inside: a grid model's inputs with images carry their values
    (tracer.host_values); a text-only step reads none. A model that loops over its images (tracer.vlm_loop) marks
    the loop's iterations on `counter`, where there is one."""
    inner = getattr(model, "module", model)
    config = getattr(inner, "config", None)
    if getattr(config, "model_type", None) in HOST_VALUE_TYPES:   # a text model that reads its token ids
        return host_values.host_values()
    if vision.is_naflex(config):   # SigLIP2: its grids and mask read on the host
        stack = contextlib.ExitStack()
        stack.enter_context(host_values.host_values())
        if counter is not None:
            stack.enter_context(loop_marks.naflex_step(inner, counter))
        return stack
    if getattr(config, "model_type", None) in AUDIO_TYPES and getattr(workload, "audios", 0):
        return host_values.host_values()   # its mask and ids are read on the host (tracer.audio)
    if config is not None and (vlm_loop.is_loop(config) or vlm_loop.is_pixtral(config)) and workload.images:
        stack = contextlib.ExitStack()
        stack.enter_context(host_values.host_values())
        if counter is not None:
            marks = vlm_loop.loop_step if vlm_loop.is_loop(config) else vlm_loop.pixtral_step
            stack.enter_context(marks(inner, counter))
        return stack
    if config is not None and config.model_type in NAFLEX_VLM_TYPES and workload.images:
        stack = contextlib.ExitStack()   # LFM2-VL: its tower's per-image grids and its per-image projection
        stack.enter_context(host_values.host_values())
        if counter is not None:
            stack.enter_context(loop_marks.naflex_step(inner, counter))
            stack.enter_context(loop_marks.unshuffle_step(inner, counter))
        return stack
    if config is not None and config.model_type in HOST_VLM_TYPES and workload.images:
        return host_values.host_values()
    if config is None or not is_grid(config) or not workload.images:
        return contextlib.nullcontext()
    stack = contextlib.ExitStack()
    stack.enter_context(host_values.host_values())
    stack.enter_context(vlm_grid.grid_step(inner))
    if counter is not None:   # Cosmos-3-Edge's per-image position grids, VideoLLaMA3's un-shuffle (no-ops elsewhere)
        stack.enter_context(vlm_loop.positions_step(inner, counter))
        stack.enter_context(loop_marks.unshuffle_step(inner, counter))
    return stack


@contextlib.contextmanager
def host_checks_skipped():
    """Run transformers' tensor checks on fake tensors without their host read (see the module docstring)."""
    from torch._subclasses.fake_tensor import FakeTensor

    original = torch._check_tensor_all_with

    def check(error_type, cond, message=None):
        if isinstance(cond, FakeTensor) or getattr(cond, "is_meta", False):
            cond._is_all_true()   # what the check allocates on the device; the values it would read do not exist
            return
        original(error_type, cond, message)

    torch._check_tensor_all_with = check
    try:
        yield
    finally:
        torch._check_tensor_all_with = original


def unreached(model) -> list:
    """[[name, shape, count]] of the parameters a training step with one image gives no gradient (so no optimizer
    state): LLaVA's vision tower past its `vision_feature_layer` (-2: CLIP's last layer and post-LayerNorm). Read from
    one forward and backward on the meta device (shapes only, about 2 s for a 7B model), `name` the parameter's own
    (weight, bias) with its module's: what the swapped optimizer's formulas (estimator.inventory.trainable_shapes) and
    LoRA's adapters (by module name) are matched by."""
    tokens = model._willitfit_image_tokens
    with _valued(model):
        ids = torch.zeros(1, tokens + 1, dtype=torch.long, device="meta")
        ids[:, 1:1 + tokens] = image_token_id(model.config)
        with host_checks_skipped():
            model(input_ids=ids, **image_kwargs(model, 1, 1, "meta"), labels=ids).loss.backward()
    out = Counter((".".join(n.split(".")[-2:]), tuple(p.shape)) for n, p in model.named_parameters()
                  if p.requires_grad and p.grad is None)
    model.zero_grad(set_to_none=True)
    return [[name, list(shape), n] for (name, shape), n in sorted(out.items())]


def info(model) -> dict:
    """What the inventory keeps of a vision-language model (estimator.inventory: `vlm`); `unreached` is None where
    the meta step fails (the optimizer formulas then count every parameter: a grid model's step reads its inputs'
    values, which meta tensors do not hold). A grid model's image_size and image_tokens are its default image's, and
    `grid` says how another size maps to tokens (estimator.vision.image_tokens)."""
    size, channels = image_geometry(model.config)
    if vlm_loop.is_loop(model.config):   # the image priced: square, two tiles a side
        size = vlm_loop.default_image_size(model.config)
    try:
        missed = None if is_grid(model.config) else unreached(model)
    except (RuntimeError, ValueError, TypeError, IndexError, NotImplementedError):
        missed = None
    return {"image_size": size, "num_channels": channels, "image_tokens": int(model._willitfit_image_tokens),
            "image_token_id": image_token_id(model.config), "unreached": missed,
            **({"tiles": vlm_loop.geometry(model.config)} if vlm_loop.is_loop(model.config) else {}),
            **({"pixtral": vlm_loop.pixtral_geometry(model.config)} if vlm_loop.is_pixtral(model.config) else {}),
            **({"grid": grid_geometry(model.config)} if is_grid(model.config) else {})}
