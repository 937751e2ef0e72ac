"""Vision-language models whose forward loops over the images: LLaVA-NeXT's any-resolution tiles
(estimator.families.LOOP_VLM_TYPES) and Pixtral's tower (PIXTRAL_VLM_TYPES, and LLaVA with a Pixtral tower: below).

    kwargs = loop_kwargs(model, batch, images, "cpu", image_size=672)   # pixel_values (n, tiles, C, S, S), sizes
    with loop_step(model, counter): ...                                  # the loop's ticks keyed per iteration

LLaVA-NeXT, LLaVA-NeXT-Video and LLaVA-OneVision cut an image into tiles of the vision tower's image size (the
best of the config's `image_grid_pinpoints` for the image's size, plus the whole image at one tile: transformers'
`image_size_to_num_patches`), run the tower on every tile of every image at once, and then pack each image's
features in a Python loop (`pack_image_features`: the tiles' grid put back together, the padding cut off by the
image's own size, one `image_newline` token per row, the base tile's features first). The loop's operations repeat
once per image, so a step with more images runs more of them, which no polynomial in (batch, seq) fits as it stands.
Each image's iteration does the same work on the same sizes (square images of one size), and what an iteration
holds beyond the one before it is that image's output (forward) or its gradient (backward), which the next keeps:
so the counter marks the iterations (`StorageCounter.set_loop`) and the derivation keys the loop's ticks by their
place in their iteration and keeps the last iteration's (tracer.ticks), the largest. That last iteration is
(b x images - 1) images' outputs plus one image's temporaries: a polynomial in b again.

Marks: forward, each iteration starts where `pack_image_features` takes its next image (the list it loops over is a
`_Marked` one) and the loop ends where the list runs out; backward, autograd runs each image's chain as a whole, the
last image's first (their nodes' sequence numbers are in forward order), so a gradient hook on each image's packed
output marks its iteration, and a pre-hook on `torch.split`'s backward node (which joins the images' gradients) ends
the loop. `image_sizes` carries its values (tracer.host_values), as the processor's tensor does on a GPU: the code
reads it on the host (`tolist`) to choose each image's tiles and padding.
"""
from __future__ import annotations

import contextlib

import torch
from torch._subclasses.fake_tensor import FakeTensor, unset_fake_temporarily

from estimator.families import LOOP_VLM_TYPES, PIXTRAL_VLM_TYPES
from tracer import host_values, loop_marks, source_is


def is_loop(cfg) -> bool:
    return getattr(cfg, "model_type", None) in LOOP_VLM_TYPES


def is_pixtral(cfg) -> bool:
    """Pixtral's tower: Mistral-3, LightOnOCR, and LLaVA with a Pixtral vision_config (Pixtral-12B's checkpoints)."""
    if getattr(cfg, "model_type", None) in PIXTRAL_VLM_TYPES:
        return True
    return getattr(cfg, "model_type", None) == "llava" and \
        getattr(getattr(cfg, "vision_config", None), "model_type", None) == "pixtral"


def pixtral_geometry(cfg) -> dict:
    """What the estimator needs to count one image's tokens at any size (estimator.vision.pixtral_tokens)."""
    return {"patch": int(cfg.vision_config.patch_size), "merge": int(getattr(cfg, "spatial_merge_size", 1) or 1)}


def tile_size(cfg) -> int:
    """The vision tower's image size: one tile's side in pixels."""
    return int(cfg.vision_config.image_size)


def default_image_size(cfg) -> int:
    """The square image priced when none is asked for: two tiles a side (a 2 x 2 grid where the pinpoints hold one:
    LLaVA-NeXT's 672 px on its 336-px CLIP tiles)."""
    return 2 * tile_size(cfg)


def geometry(cfg) -> dict:
    """What the estimator needs to count one image's tokens at any size (estimator.vision.tiled_tokens): the tile's
    side and its patches' (px), the pinpoints, and OneVision's cap on the unpadded features (`anyres_max_N`: N tiles'
    worth, None for LLaVA-NeXT)."""
    aspect = getattr(cfg, "vision_aspect_ratio", None)
    cap = int(aspect.strip("anyres_max_")) if isinstance(aspect, str) and aspect.startswith("anyres_max_") else None
    return {"tile": tile_size(cfg), "patch": int(cfg.vision_config.patch_size),
            "pinpoints": [list(map(int, p)) for p in cfg.image_grid_pinpoints], "max_tiles": cap}


def tiles(cfg, image_size: int) -> int:
    """Tiles one square image of `image_size` px is cut into, the base tile included (transformers' own
    `image_size_to_num_patches`)."""
    from transformers.models.llava_next.modeling_llava_next import image_size_to_num_patches

    return int(image_size_to_num_patches((image_size, image_size), cfg.image_grid_pinpoints, tile_size(cfg)))


def loop_kwargs(model, batch: int, images: int, device, image_size: int = 0) -> dict:
    """pixel_values (b x images, tiles, C, S, S) in the weights' dtype and image_sizes (b x images, 2), each image
    `image_size` px square (0: `default_image_size`), whose values the host knows."""
    cfg = model.config
    px = image_size or default_image_size(cfg)
    side, n = tile_size(cfg), batch * images
    channels = int(getattr(cfg.vision_config, "num_channels", 3) or 3)
    dtype = next(model.parameters()).dtype
    pixels = torch.empty(n, tiles(cfg, px), channels, side, side, dtype=dtype, device=device)
    sizes = torch.full((n, 2), px, dtype=torch.long, device=device)
    if isinstance(sizes, FakeTensor):   # a fake tensor holds no values: the host's copy (a real one has them)
        with unset_fake_temporarily():
            values = torch.full((n, 2), px, dtype=torch.long, device="cpu")
        host_values.known(sizes, values)
    return {"pixel_values": pixels, "image_sizes": sizes}


class _Marked(list):
    """The per-image features `pack_image_features` loops over: each item taken marks its iteration, the end of
    the list the loop's end."""

    counter = None

    def __iter__(self):
        for i, x in enumerate(list.__iter__(self)):
            self.counter.set_loop(i)
            yield x
        self.counter.set_loop(None)


def _marking(pack, counter):
    def wrapped(self, image_features, *args, **kwargs):
        marked = _Marked(image_features)
        marked.counter = counter
        out, lens = pack(self, marked, *args, **kwargs)
        grads = [t for t in out if t.requires_grad]
        if grads:
            n = len(out)
            for i, t in enumerate(out):   # backward: the last image's chain runs first
                if t.requires_grad:
                    t.register_hook(lambda g, i=i: counter.set_loop(n - 1 - i))
            split = image_features[0].grad_fn
            if split is not None:
                split.register_prehook(lambda grads: counter.set_loop(None))
        return out, lens
    return wrapped


@contextlib.contextmanager
def loop_step(model, counter):
    """Inside: the model's `pack_image_features` marks its iterations on `counter` (forward and backward)."""
    # the inner model's, which its get_image_features calls (the ForConditionalGeneration class's only delegates to it)
    owners = {type(m) for m in model.modules() if "pack_image_features" in type(m).__dict__
              and not type(m).__name__.endswith("ForConditionalGeneration")}
    saved = []
    try:
        for cls in owners:
            fn = cls.__dict__["pack_image_features"]
            saved.append((cls, fn))
            setattr(cls, "pack_image_features", _marking(fn, counter))
        yield
    finally:
        for cls, fn in saved:
            setattr(cls, "pack_image_features", fn)


# Pixtral's tower (Mistral-3, LightOnOCR): images of any size, each its own grid of patches, concatenated into one
# sequence whose attention keeps the images apart (families.PIXTRAL_VLM_TYPES). Two loops run per image: the 2D
# positions (`torch.meshgrid` per image in PixtralVisionModel.forward) and the patch merger's `unfold` per image
# (Mistral3PatchMerger / LightOnOcrPatchMerger); `pixtral_step` marks their iterations the same way, at the call
# that starts each (meshgrid, unfold) and, in backward, at the gradient of each image's unfolded grid.

def pixtral_kwargs(model, batch: int, images: int, device, image_size: int = 0) -> dict:
    """pixel_values (b x images, C, px, px) in the weights' dtype and image_sizes, [(px, px)] per image; px the vision
    tower's image_size where `image_size` is 0.

    image_sizes goes in as a list, not the processor's (b x images, 2) tensor: the tower and the merger each read
    every image's size with a floor division of a 0-d tensor per side (`size[0] // patch_size`), two 8-byte
    allocations per image freed at once, a loop before the tower's first layer whose ticks would change with the
    batch; on a list the same arithmetic runs on the host. What that leaves out of the step is those transient
    0-d tensors; what it adds is the (images, 2) int64 tensor Mistral-3's `torch.as_tensor(image_sizes)` makes from
    the list (of the processor's device tensor it makes none), freed after its `tolist()`: all of it transient, after
    the vision tower and before the language model, where no stage peaks."""
    vc = model.config.vision_config
    px, n = image_size or int(vc.image_size), batch * images
    dtype = next(model.parameters()).dtype
    pixels = torch.empty(n, int(getattr(vc, "num_channels", 3) or 3), px, px, dtype=dtype, device=device)
    return {"pixel_values": pixels, "image_sizes": [(px, px)] * n}


def _split_node(t: torch.Tensor):
    """The split backward node a per-image chunk's gradient flows into (a few views up from `t`), or None."""
    node = t.grad_fn
    for _ in range(8):
        if node is None:
            return None
        if type(node).__name__.startswith("SplitWithSizesBackward"):
            return node
        node = node.next_functions[0][0] if node.next_functions else None
    return None


@contextlib.contextmanager
def pixtral_step(model, counter):
    """Inside: Pixtral's per-image position loop and its patch merger's per-image loop mark their iterations on
    `counter` (forward, and the merger's in backward too)."""
    import torch.nn.functional as F

    towers = [m for m in model.modules() if type(m).__name__ == "PixtralVisionModel"]
    mergers = [m for m in model.modules() if type(m).__name__.endswith("PatchMerger")]
    real_meshgrid, real_unfold = torch.meshgrid, F.unfold
    state = {"pos": 0, "k": 0, "grids": [], "split": False}

    def meshgrid(*args, **kwargs):
        counter.set_loop(state["pos"])
        state["pos"] += 1
        return real_meshgrid(*args, **kwargs)

    def unfold(x, *args, **kwargs):
        counter.set_loop(state["k"])
        state["k"] += 1
        out = real_unfold(x, *args, **kwargs)
        if out.requires_grad:
            i = len(state["grids"])
            state["grids"].append(out)
            out.register_hook(lambda g, i=i: counter.set_loop(state["n"] - 1 - i))
            split = _split_node(x) if not state["split"] else None
            if split is not None:
                state["split"] = True
                split.register_prehook(lambda grads: counter.set_loop(None))
        return out

    def tower_pre(module, args, kwargs):
        state["pos"] = 0
        torch.meshgrid = meshgrid

    def positions_pre(module, args):
        torch.meshgrid = real_meshgrid
        counter.set_loop(None)

    def merger_pre(module, args):
        state.update(k=0, grids=[], split=False)
        F.unfold = unfold

    def merger_post(module, args, out):
        F.unfold = real_unfold
        state["n"] = len(state["grids"])
        state["grids"] = []
        counter.set_loop(None)

    handles = []
    try:
        for t in towers:
            handles.append(t.register_forward_pre_hook(tower_pre, with_kwargs=True))
            handles.append(t.patch_positional_embedding.register_forward_pre_hook(positions_pre))
        for m in mergers:
            handles.append(m.register_forward_pre_hook(merger_pre))
            handles.append(m.register_forward_hook(merger_post))
        yield
    finally:
        for h in handles:
            h.remove()
        torch.meshgrid, F.unfold = real_meshgrid, real_unfold


# Cosmos-3-Edge's vision embeddings (Cosmos3EdgeVisionEmbeddings.resize_positional_embeddings, transformers 5.23)
# interpolate the learned square grid of positions once per image, in a loop over `grid_thw`, and concatenate the
# images' grids: its iterations do the same work on the same sizes (square images of one size), each output waiting
# in a list for the concatenation, so the last iteration holds the most, forward and backward (there each later
# image's gradient of the shared grid is added to the first's). `positions_step` runs that function op for op (a
# copy, used only while transformers' source hashes to the one copied) with its iterations marked, on a GPU's branch:
# transformers copies the grid to fp32 on a CPU (antialiased interpolation has no half-precision CPU kernel), not on
# a GPU, where the interpolation runs in the weights' dtype.
_POSITIONS_CLASS = "Cosmos3EdgeVisionEmbeddings"
_POSITIONS_SOURCE = "15272bc717efbbe6"   # sha256 of the function copied below, first 16 digits


def _positions_source_ok(cls) -> bool:
    return source_is(cls.resize_positional_embeddings, _POSITIONS_SOURCE)


def _resize_marked(counter):
    import torch.nn.functional as F

    def resize_positional_embeddings(positional_embeddings, grid_thw, spatial_merge_size):
        positional_embeddings = positional_embeddings.permute(2, 0, 1).unsqueeze(0)
        source_dtype = positional_embeddings.dtype
        position_chunks = []
        for i, (temporal, height, width) in enumerate(grid_thw.tolist()):
            counter.set_loop(i)
            resized_embeddings = F.interpolate(positional_embeddings, size=(height, width), mode="bilinear",
                                               align_corners=False, antialias=True)
            resized_embeddings = resized_embeddings.squeeze(0).permute(1, 2, 0).to(source_dtype)
            resized_embeddings = resized_embeddings.reshape(height // spatial_merge_size, spatial_merge_size,
                                                            width // spatial_merge_size, spatial_merge_size, -1)
            resized_embeddings = resized_embeddings.transpose(1, 2).reshape(height * width, -1)
            position_chunks.append(resized_embeddings.repeat(temporal, 1))
        counter.set_loop(None)
        # backward runs the images last first, each from its repeat's node; the grid's unsqueeze runs next
        loop_marks.mark_backward(counter, position_chunks, positional_embeddings)
        return torch.cat(position_chunks, dim=0)
    return resize_positional_embeddings


def positions_step(model, counter):
    """Inside: Cosmos-3-Edge's per-image interpolation of its position grid marks its iterations on `counter` (a
    no-op for other models, and where transformers' function is not the one copied)."""
    return loop_marks.patched(model, counter, {_POSITIONS_CLASS: ("resize_positional_embeddings", _positions_source_ok,
                                                                  _resize_marked, True)})
