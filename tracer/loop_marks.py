"""Op-for-op copies of transformers' Python loops over the images or samples of a step, with their iterations marked.

    with unshuffle_step(model, counter), naflex_step(model, counter): ...   # around a traced step (tracer.vlm)

A loop whose length is the batch (or the images in it) runs more operations in a larger step, which no profile in
the batch fits as it stands. Where each iteration does the same work on the same sizes, the counter marks the
iterations (`StorageCounter.set_loop`) and tracer.ticks keys their ticks by their place in their iteration, keeping
the one that holds the most: the last where each iteration keeps what the ones before it made (forward), the first
two to run where each frees what its forward saved (backward: `mark_backward`, pinned, with tracer.time_loop's
marks). Each copy runs only while transformers' source hashes to the one copied (tracer.source_is); another
transformers runs unmarked, and its derivation refuses itself in one line. LLaVA-NeXT's, Pixtral's and
Cosmos-3-Edge's loops are marked in tracer.vlm_loop.
"""
from __future__ import annotations

import contextlib

import torch

from tracer import source_is
from tracer.time_loop import PINNED, SKIP


# VideoLLaMA3's vision model (VideoLlama3VisionModel.pixel_unshuffle, transformers 5.23) puts each image's patches back
# on its grid and interpolates them to the merged grid, one image per iteration of a Python loop over grid_thw, each
# output waiting in a list for the concatenation: the iterations do the same work on the same sizes, the last holds
# the most (forward: every earlier image's output; backward, which runs the images last first, every later image's
# gradient, waiting for the split's node that joins them). `unshuffle_step` runs that method op for op (a copy, used
# only while transformers' source hashes to the one copied) with its iterations marked.
_UNSHUFFLE_CLASS = "VideoLlama3VisionModel"
_UNSHUFFLE_SOURCE = "2f9b8bc36c2ff0f5"   # sha256 of the method copied below, first 16 digits


def _unshuffle_source_ok(cls) -> bool:
    return source_is(cls.pixel_unshuffle, _UNSHUFFLE_SOURCE)


def _unshuffle_marked(counter):
    def pixel_unshuffle(self, hidden_states, grid_thw, merge_sizes):
        hidden_states_chunks = hidden_states.split(grid_thw.prod(dim=1).tolist(), dim=0)
        outputs = []

        for i, (hidden_states, (t, h, w), merge_size) in enumerate(zip(hidden_states_chunks, grid_thw, merge_sizes)):
            counter.set_loop(i)
            c = hidden_states.shape[-1]
            hidden_states = hidden_states.view(t, h // merge_size, w // merge_size, merge_size, merge_size, c).permute(
                0, 1, 3, 2, 4, 5
            )
            hidden_states = hidden_states.reshape(t, h, w, c).permute(0, 3, 1, 2)
            hidden_states = torch.nn.functional.interpolate(
                hidden_states, size=(h // merge_size, w // merge_size), mode="bilinear"
            )
            hidden_states = hidden_states.permute(0, 2, 3, 1).view(-1, c)
            outputs.append(hidden_states)
        counter.set_loop(None)
        mark_backward(counter, outputs, hidden_states_chunks[0] if hidden_states_chunks else None)
        return torch.cat(outputs, dim=0)
    return pixel_unshuffle


def mark_backward(counter, outputs: list, source, pinned: bool = False) -> None:
    """Backward runs each iteration's chain whole, the last iteration's first (their nodes' sequence numbers are in
    forward order): a pre-hook on each output's node marks its iteration, one on `source`'s node (the node that
    joins the iterations' gradients) ends the loop. `pinned`: where each chain frees what its iteration saved, so
    the first chains to run hold the most (the second one more: the gradient the first accumulated into a
    parameter, and its own), the first two to run are kept as themselves (tracer.time_loop.PINNED + 0, + 1) and the
    rest dropped (SKIP; tracer.ticks checks that none of them holds more)."""
    nodes = [o.grad_fn for o in outputs]
    if nodes and all(n is not None for n in nodes) and source is not None and source.grad_fn is not None:
        for k, node in enumerate(reversed(nodes)):
            if not pinned:
                node.register_prehook(lambda grads, k=k: counter.set_loop(k))
            elif k <= 2:
                node.register_prehook(lambda grads, k=k: counter.set_loop(SKIP if k == 2 else PINNED + k))
        source.grad_fn.register_prehook(lambda grads: counter.set_loop(None))


@contextlib.contextmanager
def patched(model, counter, patches: dict):
    """Inside: each class of `model` named in `patches` ({class name: (attribute, source_ok, marked, static)}) has
    that attribute replaced by `marked(counter)` (a staticmethod where `static`) while `source_ok(cls)` says
    transformers' code is the one copied; put back on the way out."""
    owners = {type(m) for m in model.modules() if type(m).__name__ in patches}
    saved = []
    try:
        for cls in owners:
            name, source_ok, marked, static = patches[cls.__name__]
            if source_ok(cls):
                saved.append((cls, name, cls.__dict__[name]))
                setattr(cls, name, staticmethod(marked(counter)) if static else marked(counter))
        yield
    finally:
        for cls, name, fn in saved:
            setattr(cls, name, fn)


def unshuffle_step(model, counter):
    """Inside: VideoLLaMA3's per-image un-shuffle, LFM3-VL's per-image short convolutions and LFM2-VL's and
    PaddleOCR-VL's per-image projections mark their iterations on `counter` (a no-op for other models, and where
    transformers' method is not the one copied)."""
    return patched(model, counter, {
        _UNSHUFFLE_CLASS: ("pixel_unshuffle", _unshuffle_source_ok, _unshuffle_marked, False),
        _SHORTCONV_CLASS: ("forward", _shortconv_source_ok, _shortconv_marked, False),
        _PROJECT_CLASS: ("get_image_features", _project_source_ok, _project_marked, False),
        _PADDLE_CLASS: ("forward", _paddle_source_ok, _paddle_marked, False)})


# LFM3-VL's vision tower (Lfm3VlVisionShortConv.forward, transformers 5.23): in each of its convolution layers the
# patches of every image are put back on their grid and convolved, one image per iteration of a Python loop over
# torch.split, each output waiting in a list for the concatenation, each grid's copy saved for the convolution's
# backward: forward, the last iteration holds the most, as in VideoLLaMA3's un-shuffle; backward, each image's chain
# frees its saved copy as it adds its gradient, so the first to run holds the most: pinned (`mark_backward`).
_SHORTCONV_CLASS = "Lfm3VlVisionShortConv"
_SHORTCONV_SOURCE = "51290ae839305f86"   # sha256 of the forward copied below, first 16 digits


def _shortconv_source_ok(cls) -> bool:
    return source_is(cls.forward, _SHORTCONV_SOURCE)


def _shortconv_marked(counter):
    def forward(self, hidden_states, grid_thw, **kwargs):
        input_gate, output_gate, conv_input = self.in_proj(hidden_states).chunk(3, dim=-1)
        gated = input_gate * conv_input
        merge = self.spatial_merge_size
        conv_outputs = []
        channels = gated.shape[-1]
        lengths = [temporal * height * width for temporal, height, width in grid_thw]
        chunks = torch.split(gated, lengths, dim=0)
        for i, (frames, (temporal, height, width)) in enumerate(zip(chunks, grid_thw)):
            counter.set_loop(i)
            frames = frames.view(temporal, height // merge, width // merge, merge, merge, channels)
            frames = frames.permute(0, 5, 1, 3, 2, 4).reshape(temporal, channels, height, width)
            frames = self.spatial_conv(frames)
            frames = frames.view(temporal, channels, height // merge, merge, width // merge, merge)
            conv_outputs.append(frames.permute(0, 2, 4, 3, 5, 1).reshape(temporal * height * width, channels))
        counter.set_loop(None)
        mark_backward(counter, conv_outputs, chunks[0] if chunks else None, pinned=True)
        hidden_states = torch.cat(conv_outputs, dim=0)
        hidden_states = output_gate * hidden_states
        return self.out_proj(hidden_states)
    return forward


# SigLIP2's NaFlex embeddings (Siglip2VisionEmbeddings.resize_positional_embeddings, transformers 5.23) interpolate the
# learned position grid to each sample's own grid (its spatial_shapes, read on the host) in a Python loop over the
# batch, writing each into one (b, patches, dim) tensor: the iterations do the same work on the same sizes (images of
# one size), each interpolation dead before the next. Run op for op with the iterations marked, on a GPU's branch
# (transformers copies the grid to fp32 on a CPU, where antialiased interpolation has no half-precision kernel; a GPU
# interpolates in the weights' dtype, the cast back a no-op). Backward runs each sample's writes and interpolation
# last first, each write's node cloning the whole (b, patches, dim) gradient, the first to run beside the gradient it
# came with: the first two kept (pinned), the learned grid's permute, where their gradients join, ends the loop.
_NAFLEX_CLASS = "Siglip2VisionEmbeddings"
_NAFLEX_SOURCE = "68f911bfd61655d9"   # sha256 of the function copied below, first 16 digits


def _naflex_source_ok(cls) -> bool:
    return source_is(cls.resize_positional_embeddings, _NAFLEX_SOURCE)


class _Node:
    """A stand-in whose grad_fn is one iteration's last autograd node (`mark_backward` takes outputs)."""

    def __init__(self, grad_fn):
        self.grad_fn = grad_fn


def _naflex_marked(counter):
    import torch.nn.functional as F

    def resize_positional_embeddings(positional_embeddings, spatial_shapes, max_length):
        batch_size = spatial_shapes.shape[0]
        embed_dim = positional_embeddings.shape[-1]
        source_dtype = positional_embeddings.dtype
        resulted_positional_embeddings = torch.empty((batch_size, max_length, embed_dim),
                                                     device=positional_embeddings.device, dtype=source_dtype)
        positional_embeddings = positional_embeddings.permute(2, 0, 1).unsqueeze(0)
        ends = []
        for i in range(batch_size):
            counter.set_loop(i)
            height, width = spatial_shapes[i].tolist()
            resized_embeddings = F.interpolate(positional_embeddings, size=(height, width), mode="bilinear",
                                               align_corners=False, antialias=True)
            resized_embeddings = resized_embeddings.reshape(embed_dim, height * width).transpose(0, 1)
            resized_embeddings = resized_embeddings.to(source_dtype)
            resulted_positional_embeddings[i, : height * width] = resized_embeddings
            resulted_positional_embeddings[i, height * width :] = resized_embeddings[0]
            ends.append(_Node(resulted_positional_embeddings.grad_fn))
        counter.set_loop(None)
        mark_backward(counter, ends, positional_embeddings, pinned=True)
        return resulted_positional_embeddings
    return resize_positional_embeddings


def naflex_step(model, counter):
    """Inside: SigLIP2's per-sample position grids are interpolated on a GPU's branch with their iterations marked on
    `counter` (a no-op for other models, and where transformers' function is not the one copied)."""
    return patched(model, counter, {_NAFLEX_CLASS: ("resize_positional_embeddings", _naflex_source_ok,
                                                    _naflex_marked, True)})


# LFM2-VL (Lfm2VlModel.get_image_features, transformers 5.23) runs SigLIP2's NaFlex tower on every image at once, then
# projects each image in a Python loop (its patches unpadded, put back on their grid, pixel-unshuffled 2 x 2, layer
# norm and MLP), each image's output waiting in a list: forward keeps the last iteration, backward (each image's chain
# freeing what its projector saved) the first two to run, batch 2 apart with one image per sample
# (families.batch_two_apart). Run op for op with the iterations marked, used only while transformers' source hashes
# to the one copied.
_PROJECT_CLASS = "Lfm2VlModel"
_PROJECT_SOURCE = "15c21d34032acf15"   # sha256 of the method copied below (its decorators' source included)


def _project_source_ok(cls) -> bool:
    return source_is(cls.get_image_features, _PROJECT_SOURCE)


def _project_marked(counter):
    from transformers.utils.generic import can_return_tuple

    @can_return_tuple
    def get_image_features(self, pixel_values, spatial_shapes, pixel_attention_mask, **kwargs):
        image_outputs = self.vision_tower(pixel_values=pixel_values, spatial_shapes=spatial_shapes,
                                          pixel_attention_mask=pixel_attention_mask, return_dict=True, **kwargs)
        last_hidden_state = image_outputs.last_hidden_state
        img_feature_lengths = pixel_attention_mask.sum(dim=1)
        image_features = []
        for img_idx in range(last_hidden_state.size(0)):
            counter.set_loop(img_idx)
            feature = last_hidden_state[img_idx]
            feature = feature[: img_feature_lengths[img_idx], :].unsqueeze(0)
            feature_org_h, feature_org_w = spatial_shapes[img_idx]
            feature = feature.reshape(1, feature_org_h, feature_org_w, -1)
            img_embedding = self.multi_modal_projector(feature)
            img_embedding = img_embedding.reshape(-1, img_embedding.size(-1))
            image_features.append(img_embedding)
        counter.set_loop(None)
        mark_backward(counter, image_features, last_hidden_state, pinned=True)
        image_outputs.pooler_output = image_features
        return image_outputs
    return get_image_features


# PaddleOCR-VL's projector (PaddleOCRProjector.forward, transformers 5.23) merges and projects each image's patches in a
# Python loop over image_grid_thw (layer norm, 2 x 2 merge, MLP), each output waiting in a list for the concatenation:
# forward keeps the last iteration; backward, each image's chain freeing what its layer norm and MLP saved, the first
# two to run (pinned), batch 2 apart with one image per sample (families.PINNED_IMAGE_LOOP_TYPES), as LFM2-VL's.
_PADDLE_CLASS = "PaddleOCRProjector"
_PADDLE_SOURCE = "d9a5ab425c9cb1a4"   # sha256 of the forward copied below, first 16 digits


def _paddle_source_ok(cls) -> bool:
    return source_is(cls.forward, _PADDLE_SOURCE)


def _paddle_marked(counter):
    def forward(self, image_features, image_grid_thw):
        image_features_chunks = image_features.split(image_grid_thw.prod(dim=1).tolist(), dim=0)
        m1, m2 = self.merge_kernel_size
        processed_features = []
        for i, (image_feature, image_grid) in enumerate(zip(image_features_chunks, image_grid_thw)):
            counter.set_loop(i)
            image_feature = self.pre_norm(image_feature)
            t, h, w = image_grid
            d = image_feature.shape[-1]
            h_block = h // m1
            w_block = w // m2
            image_feature = image_feature.reshape(t, h_block, m1, w_block, m2, d)
            image_feature = image_feature.transpose(2, 3)
            image_feature = image_feature.reshape(t * h_block * w_block, m1 * m2 * d)
            hidden_states = self.linear_1(image_feature)
            hidden_states = self.act(hidden_states)
            hidden_states = self.linear_2(hidden_states)
            processed_features.append(hidden_states)
        counter.set_loop(None)
        mark_backward(counter, processed_features, image_features_chunks[0] if image_features_chunks else None,
                      pinned=True)
        return torch.cat(processed_features, dim=0)
    return forward
