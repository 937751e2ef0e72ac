"""Vision encoders (ViT, DINOv2, SigLIP's and CLIP's vision towers): which class a step builds, and its inputs.

    cls, cfg = vision_class(hf_cfg, "train")     # AutoModelForImageClassification, the config it is built from
    inputs = pixel_inputs(model, workload, "cpu")    # pixel_values (b, 3, H, W) [+ labels (b,)]

A vision step's size is its token count per image, `workload.seq` := p + extra: p = h * w patches (a square image
of `image_size` pixels has p = (image_size // patch_size)^2) and `extra` the tokens the embeddings add (ViT's and
CLIP's CLS token, DINOv2's CLS and register tokens, none for SigLIP), read from the model's own embeddings on the
meta device (`extra_tokens`), not from a table. The profile is then a polynomial in tokens, as a text encoder's is:
tokens rather than p because CUDA's memory-efficient attention pads the token count (estimator.profile.poly's m, l).

Training builds the image-classification model (AutoModelForImageClassification: ViTForImageClassification,
Dinov2ForImageClassification, SiglipForImageClassification, CLIPForImageClassification; labels of shape (b,), cross
entropy on the pooled output); inference the base vision model (AutoModel for ViT/DINOv2, SiglipVisionModel /
CLIPVisionModel on the config's vision_config), one forward under no_grad.

Position embeddings: at the config's image size the models add theirs as they are; at any other grid they
interpolate them (bicubic) when the forward is told to (`interpolate_pos_encoding=True`: ViT, SigLIP, CLIP refuse or
mis-add otherwise) or always (DINOv2), and so do the traces here: `interpolate_pos_encoding` is passed, True, where
the forward takes it and the grid differs from the config's. Pixel values are built in the weights' dtype, as the
transformers docs cast them (`inputs.to(model.dtype)`), so the patch convolution copies nothing.
"""
from __future__ import annotations

import contextlib
import contextvars
import inspect
import math

import torch
from torch._subclasses.fake_tensor import unset_fake_temporarily
from torch.utils._mode_utils import no_dispatch

# The vision encoders modelled (estimator.families.VISION_TYPES); other image-classification types (ConvNeXt, Swin,
# BEiT, ...) are refused in one line. The classification head's width is the config's num_labels (transformers'
# default 2; a config with id2label sets its own).
from estimator.families import (NAFLEX_TYPES, SIDE_GRID_TYPES, SPATIAL_VISION_TYPES, VISION_REFUSED, VISION_TYPES,
                                unpriced_vision_option)
from tracer import host_values

DEFAULT_IMAGE_SIZE = 224   # a spatial model's image size where its config states none (ResNet, RegNet, BiT)


def is_vision(cfg) -> bool:
    """A config of a modelled vision encoder (by its model_type)."""
    return getattr(cfg, "model_type", None) in VISION_TYPES


def refuse_unmodelled_vision(model_type: str) -> None:
    """One line for an image model willitfit does not model (before any slow work)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES

    if model_type in VISION_REFUSED:
        raise ValueError(f"model_type: {model_type!r} is not priced: {VISION_REFUSED[model_type]}")
    if model_type in MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES and model_type not in VISION_TYPES:
        raise ValueError(f"model_type: {model_type!r} is an image model willitfit does not model yet; the vision "
                         f"encoders it models are {', '.join(VISION_TYPES)} (docs/architectures.md)")


def vision_config(cfg):
    """The config that sizes the encoder: SigLIP's and CLIP's vision_config, else the config itself."""
    inner = getattr(cfg, "vision_config", None)
    return inner if inner is not None else cfg


def vision_class(cfg, mode: str):
    """(class with `from_config`, config to build it from) for a training step ("train": the image-classification
    model) or inference (the base vision model)."""
    from transformers import AutoModel, AutoModelForImageClassification
    from transformers.models.auto.modeling_auto import (MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES,
                                                        MODEL_MAPPING_NAMES)

    unpriced = unpriced_vision_option(cfg.model_type, lambda key: getattr(cfg, key, None))
    if unpriced:
        raise ValueError(unpriced)
    if mode == "train":
        names = MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES.get(cfg.model_type)
        if isinstance(names, tuple):  # DeiT, LeViT: with and without a distillation teacher, told apart by
            return _Concrete(_trainable(cfg, names)), cfg    # config.architectures (None: transformers fails)
        return AutoModelForImageClassification, cfg
    vc = vision_config(cfg)
    if vc is not cfg and vc.model_type not in MODEL_MAPPING_NAMES:
        # a tower AutoModel does not list (MetaCLIP-2's): the class its config names, in the same module
        return _Concrete(_sibling_class(vc, "Config", "Model")), vc
    return AutoModel, vc


class _Concrete:
    """A transformers model class behind the Auto interface the builders call (`from_config`, `__name__`)."""

    def __init__(self, cls):
        self.cls, self.__name__ = cls, cls.__name__

    def from_config(self, config, **kwargs):
        return self.cls._from_config(config, **kwargs)


def _trainable(cfg, names: tuple):
    """The class of `names` a fine-tuning run builds: the one config.architectures names if its forward takes labels
    (DeiT's and LeViT's WithTeacher classes are for inference only and take none), else the first."""
    import transformers

    stated = [n for n in (getattr(cfg, "architectures", None) or ()) if n in names]
    for name in stated + list(names):
        cls = getattr(transformers, name)
        if "labels" in inspect.signature(cls.forward).parameters:
            return cls
    raise ValueError(f"model_type: {cfg.model_type!r} has no image-classification class that takes labels")


def _sibling_class(cfg, suffix: str, replacement: str):
    """The model class in the config class's own transformers module whose name is the config class's with
    `suffix` replaced (MetaClip2VisionConfig -> MetaClip2VisionModel)."""
    import importlib

    name = type(cfg).__name__.removesuffix(suffix) + replacement
    module = importlib.import_module(type(cfg).__module__.replace(".configuration_", ".modeling_"))
    cls = getattr(module, name, None)
    if cls is None:
        raise ValueError(f"model_type: {cfg.model_type!r} has no {name} in transformers to build its vision tower from")
    return cls


def geometry(model) -> tuple[int, int, int]:
    """(image_size, unit, num_channels) of a built model: square images; the unit is the patch a token covers, or a
    spatial model's grid unit (`grid_unit`, computed once by `tracer.runner.build_model` and kept on the model as
    `_willitfit_unit`). A spatial model whose config states no image size (ResNet, RegNet, BiT) gets the 224 pixels
    its checkpoints are trained and evaluated at (DEFAULT_IMAGE_SIZE)."""
    vc = vision_config(model.config)
    spatial = is_spatial(model.config)
    out = []
    for key in ("image_size", "patch_size", "num_channels"):
        if key == "patch_size" and spatial:
            out.append(getattr(model, "_willitfit_unit", None) or grid_unit(model))
            continue
        v = getattr(vc, key, None)
        if key == "image_size" and is_naflex(model.config):   # its default max_num_patches as a square image
            side = math.isqrt(int(getattr(vc, "num_patches", 0) or 0))
            v = side * int(vc.patch_size) if side * side == int(vc.num_patches) else None
        if v is None and key == "image_size" and spatial:
            v = DEFAULT_IMAGE_SIZE
        if key == "num_channels" and spatial:
            v = _channels(vc)
        if isinstance(v, (list, tuple)) and len(v) == 2 and v[0] == v[1]:
            v = v[0]
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{key}: must be a positive integer (square images and patches), got {v!r}")
        out.append(v)
    return tuple(out)


def _channels(vc) -> int | None:
    """A spatial model's input channels: num_channels, or TextNet's stem_num_channels."""
    v = getattr(vc, "num_channels", None)
    return v if v is not None else getattr(vc, "stem_num_channels", None)


def is_naflex(cfg) -> bool:
    """SigLIP2's NaFlex encoders (families.NAFLEX_TYPES; inference builds the tower alone, on its vision config):
    patches in, with a pixel mask and each sample's grid."""
    return str(getattr(cfg, "model_type", None)).removesuffix("_vision_model") in NAFLEX_TYPES


def is_spatial(cfg) -> bool:
    """A vision model without patch tokens (families.SPATIAL_VISION_TYPES): conv nets and hierarchical encoders."""
    return getattr(cfg, "model_type", None) in SPATIAL_VISION_TYPES


@torch.no_grad()
def grid_unit(model) -> int:
    """A spatial model's grid unit in pixels: its total stride (the base model's output side on two square images
    on the meta device, 512 and 1024 pixels: 1024 - 512 pixels over the difference of the sides), times its
    attention window where its config has one (Swin's every stage must be a whole number of windows, or it pads). On
    images of h x w units every feature map holds a whole multiple of h * w positions."""
    base = getattr(model, "base_model", model)
    p = next(base.parameters())   # on meta where tracer.runner.build_model calls it: the forward costs nothing
    channels = int(_channels(vision_config(model.config)) or 3)
    sides = []
    for size in (512, 1024):
        out = base(torch.empty(1, channels, size, size, device=p.device, dtype=p.dtype), output_hidden_states=True)
        h = out.last_hidden_state if getattr(out, "last_hidden_state", None) is not None else out[0]
        maps = [t for t in getattr(out, "hidden_states", None) or () if t.dim() == 4]
        if h.dim() < 3 and maps:   # the last feature map: HGNet-V2's classifier hands back its logits
            h = maps[-1]
        sides.append(h.shape[-2] if h.dim() == 4 else math.isqrt(h.shape[1]))
    if sides[1] <= sides[0] or 512 % (sides[1] - sides[0]):
        raise ValueError(f"model_type: {model.config.model_type!r}: willitfit cannot read a whole total stride from "
                         f"its output sides {sides} at 512 and 1024 pixels")
    stride = 512 // (sides[1] - sides[0])
    window = getattr(model.config, "window_size", None)
    return stride * (window if isinstance(window, int) and not isinstance(window, bool) and window > 1 else 1)


def grid(patches: int) -> tuple[int, int]:
    """(h, w) patches with h * w = patches, as square as it factors (h <= w): a square image where p is a square,
    else the nearest rectangle of the same patch count (what the fit traces at a token count between squares)."""
    if patches < 1:
        raise ValueError(f"seq: a vision step needs at least one patch per image, got {patches}")
    h = math.isqrt(patches)
    while patches % h:
        h -= 1
    return h, patches // h


_INTERPOLATING = contextvars.ContextVar("willitfit_vision_interpolating", default=False)


@contextlib.contextmanager
def interpolating():
    """Inside (tracer.derive's fits): a token count whose patches make the config's own square grid is traced as a
    rectangle of the same patches, so the position embeddings are interpolated at every fitted size. At the config's
    own grid the models add their embeddings as they are (ViT, SigLIP, CLIP: `num_patches == num_positions and
    height == width`), a shorter list of operations that no fit across sizes can join; the profile is the
    interpolating step's, and at the config's size it is checked against the real, non-interpolating trace
    (tests/test_vision.py: equal stage peaks; the skipped interpolation's temporaries come and go before the first
    layer, under every stage's peak)."""
    token = _INTERPOLATING.set(True)
    try:
        yield
    finally:
        _INTERPOLATING.reset(token)


def _rectangle(patches: int) -> tuple[int, int]:
    """(h, w), h < w, h * w = patches: the most square factorization that is not square (1 x p at worst)."""
    h = math.isqrt(patches)
    h -= h * h == patches
    while h > 1 and patches % h:
        h -= 1
    return max(h, 1), patches // max(h, 1)


def _embeddings(model):
    """The model's embeddings module (ViTEmbeddings, Dinov2Embeddings, SiglipVisionEmbeddings, CLIPVisionEmbeddings):
    the first module, in definition order, whose class is named *Embeddings (a PEFT wrapper included)."""
    for m in model.modules():
        if type(m).__name__.endswith("Embeddings"):
            return m
    raise ValueError(f"model_type: {model.config.model_type!r} has no patch embeddings willitfit can find")


@torch.no_grad()
def extra_tokens(model) -> int:
    """Tokens the embeddings add to the patches (CLS, registers): their output length on an image of the config's
    own size, less its patches (run by `tracer.runner.build_model` on the meta model, where it costs nothing, and
    kept on the model as `_willitfit_extra_tokens`); 0 for a spatial model (its size is counted in grid units)."""
    if is_spatial(model.config) or is_naflex(model.config):   # NaFlex: patches only (SigLIP2 has no CLS token)
        return 0
    image, patch, channels = geometry(model)
    emb = _embeddings(model)
    p = next(emb.parameters())
    pixels = torch.empty(1, channels, image, image, device=p.device, dtype=p.dtype)
    out = emb(pixels)
    out = out[0] if isinstance(out, tuple) else out
    return int(out.shape[1]) - (image // patch) ** 2


def _takes_interpolate(model) -> bool:
    """The embeddings interpolate only when told to (ViT, SigLIP, CLIP; DINOv2 always does): the flag is passed to the
    model's forward, which hands it down (CLIPForImageClassification through its **kwargs)."""
    if is_spatial(model.config) and not any(type(m).__name__.endswith("Embeddings") for m in model.modules()):
        return False
    return "interpolate_pos_encoding" in inspect.signature(_embeddings(model).forward).parameters


def pixel_inputs(model, workload, device: str) -> dict:
    """pixel_values (b, channels, h * patch, w * patch) for `workload.seq` tokens per image, in the weights' dtype;
    labels (b,) int64 for training; `interpolate_pos_encoding` where the forward takes it and the grid is not the
    config's."""
    inner = getattr(model, "module", model)
    image, patch, channels = geometry(inner)
    if inner.config.model_type in SIDE_GRID_TYPES:   # seq is the units per side of a square image
        h = w = workload.seq
    else:
        h, w = grid(workload.seq - inner._willitfit_extra_tokens)
        if _INTERPOLATING.get() and (h, w) == (image // patch,) * 2 and h > 1:
            h, w = _rectangle(h * w)
    dtype = next(inner.parameters()).dtype
    if is_naflex(inner.config):
        out = naflex_inputs(workload.batch, h, w, patch, channels, dtype, device)
    else:
        out = {"pixel_values": torch.randn(workload.batch, channels, h * patch, w * patch, device=device,
                                           dtype=dtype)}  # (B, C, H, W)
    if _takes_interpolate(inner) and (h, w) != (image // patch,) * 2:
        out["interpolate_pos_encoding"] = True
    if workload.mode == "train":
        labels = int(getattr(inner.config, "num_labels", 0) or 0)
        if labels < 1:
            raise ValueError("num_labels: an image-classification step needs at least one label")
        out["labels"] = torch.randint(0, labels, (workload.batch,), device=device)  # (B,)
    return out


def naflex_inputs(batch: int, h: int, w: int, patch: int, channels: int, dtype, device) -> dict:
    """What Siglip2ImageProcessor hands the model for `batch` images of h x w patches with max_num_patches = h * w:
    pixel_values (b, h * w, C x P x P) in the weights' dtype, pixel_attention_mask (b, h * w) int32, all ones, and
    spatial_shapes (b, 2) int64; the mask and the shapes carry their values (the model reads both on the host:
    `spatial_shapes[i].tolist()`, and the mask's `all()` where transformers drops a mask of ones)."""
    with unset_fake_temporarily(), no_dispatch():
        mask = torch.ones(batch, h * w, dtype=torch.int32, device="cpu")   # (host values: never the meta device)
        shapes = torch.tensor([[h, w]] * batch, dtype=torch.long, device="cpu")

    return {"pixel_values": torch.empty(batch, h * w, channels * patch * patch, device=device, dtype=dtype),
            "pixel_attention_mask": host_values.on_device(mask, device),
            "spatial_shapes": host_values.on_device(shapes, device)}


def unreached_params(model, image: int, channels: int) -> tuple[list[list[int]], str]:
    """Shapes of the parameters an image-classification step leaves without a gradient, so without an optimizer
    state (torch creates states lazily, for parameters with a .grad): read from one step on the meta device (no data,
    no compute: a 1-image batch at the config's size, backward from the loss). DINOv2's mask_token (read only with
    bool_masked_pos, which the step never passes), SigLIP's attention-pooling head and CLIP's post_layernorm (their
    classifiers mean-pool the last hidden state, or read it before that norm): hypothesis found the fused AdamW step's
    temporaries negative for SigLIP where only mask_token was named. NaFlex models (their grid is read on the host)
    and a step the meta device cannot run keep that rule: parameters named mask_token. With how they were read
    ("step" or "named"; an inventory without it is read again, estimator.store)."""
    named = [list(p.shape) for n, p in model.named_parameters() if n.split(".")[-1] == "mask_token"]
    params = [p for p in model.parameters() if p.requires_grad]
    if is_naflex(model.config) or not params or params[0].device.type != "meta":
        return named, "named"
    labels = max(1, int(getattr(model.config, "num_labels", 0) or 0))
    try:
        with torch.enable_grad():
            out = model(pixel_values=torch.empty(1, channels, image, image, device="meta", dtype=params[0].dtype),
                        labels=torch.zeros(1, dtype=torch.long, device="meta").clamp(max=labels - 1))
            out.loss.backward()
        return [list(p.shape) for p in params if p.grad is None], "step"
    except (RuntimeError, NotImplementedError, TypeError, ValueError, AttributeError):
        return named, "named"
    finally:
        for p in params:   # the probe leaves no gradient on the inventory's model
            p.grad = None


def info(model) -> dict:
    """The vision part of an inventory: what the estimator needs to turn an image size into tokens."""
    image, patch, channels = geometry(model)
    unreached, read = unreached_params(model, image, channels)
    window = getattr(model.config, "window_size", None)   # Swin's: part of its grid unit (grid_unit)
    return {"image_size": image, "patch_size": patch, "num_channels": channels,
            "extra_tokens": extra_tokens(model), "num_labels": int(getattr(model.config, "num_labels", 0) or 0),
            "unreached": unreached, "unreached_read": read,
            **({"grid": "side" if model.config.model_type in SIDE_GRID_TYPES else "spatial"}
               if is_spatial(model.config) else {}),
            **({"window": window} if is_spatial(model.config) and isinstance(window, int) and window > 1 else {})}
