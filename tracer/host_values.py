"""Values the host knows, carried beside fake tensors: what a processor hands a model (token ids, token types, image
grids) and the index arithmetic the model's own code does on them.

    with host_values():
        ids = known(torch.empty(b, s, dtype=torch.long), real_ids)   # a fake tensor that carries its values
        model(input_ids=ids, image_grid_thw=known(..., grid), ...)   # .tolist(), .item(), nonzero() now answer

Fake tensors hold shapes, not values, so code that reads a value on the host (`grid_thw.tolist()`, `lengths.tolist()`
to split a packed sequence, `itertools.groupby` over token types, `x[x != -100]`) cannot run on them. Qwen2-VL's
family does all of these between its inputs and its first matmul: transformers.vision_utils builds the vision
tower's rotary positions, its `cu_seqlens` and Qwen2.5-VL's window index from `image_grid_thw` with loops and
`.tolist()`; the SDPA path splits q/k/v per image with `torch.split(t, lengths.tolist())`; `get_rope_index` walks
each sample's token types to lay out the 3D (t, h, w) positions. On a GPU those are small integer tensors, computed on
the device (or on the host and copied there) from values the processor set.

`HostValues` is a TorchDispatchMode that keeps a real CPU copy (`VALUE`) beside each fake tensor whose values the host
would know, and nothing else changes: every op still runs on the fake tensors below it (so aliasing, storages and
the allocation counters see exactly what they saw), and where all of an op's tensor arguments carry values the op
also runs on those values, its outputs then carrying theirs. The seeds are the inputs marked with `known` and integer
or boolean factories (`arange`, `zeros`, `ones`, `full`: positions and index ranges), at every size, so the same
ops carry values at the small sizes a profile is fit on and at the large ones it is checked at. A host read of a
tensor with a value returns it; an op whose output shape depends on values (`nonzero`, a boolean mask index,
`unique_consecutive`, `repeat_interleave` by a tensor) gets a fake output of the shape its values give, allocated as
the device allocates it. In-place writes into a tensor with a value from one without drop its value (it is no longer
known). Floating-point tensors carry values only where an op computes them from ones that do, or where a zeros,
ones or full factory makes at most SMALL elements (X-MOD's language ids: `default_lang_id * torch.ones(batch)`).

This is torch's FakeTensor constant propagation (`FakeTensor.constant`) without its limit of one element and
without its side effect: its constant outputs get storages of their own, which a storage counter would read as an
allocation per view. `torch.tensor([...])` of tensors with values (`get_rope_index`'s per-sample deltas) reads
their data directly rather than through dispatch: `TensorsOfValues`, a TorchFunctionMode, hands it the values.
"""
from __future__ import annotations

import contextlib

import torch
from torch._subclasses.fake_tensor import (DataDependentOutputException, DynamicOutputShapeException, FakeTensor,
                                           unset_fake_temporarily)
from torch.overrides import TorchFunctionMode
from torch.utils._mode_utils import no_dispatch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map, tree_map_only

VALUE = "_willitfit_value"
aten = torch.ops.aten
_SCALAR_READS = {aten._local_scalar_dense.default, aten.item.default}
_FACTORIES = {aten.arange.default, aten.arange.start, aten.arange.start_step, aten.zeros.default, aten.ones.default,
              aten.full.default, aten.scalar_tensor.default}
_LIFTS = {aten.lift_fresh.default, aten.lift_fresh_copy.default}
_MASK_INDEXED = {aten.index.Tensor, aten.index_put.default, aten.index_put_.default}
_INTEGRAL = (torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64)
# Float factories of at most this many elements carry values too (X-MOD's per-sample language ids are
# `default_lang_id * torch.ones(batch)`, floats); larger ones (masks, buffers) never: their values would cost host memory
SMALL = 1 << 16


def value_of(t) -> torch.Tensor | None:
    """The real CPU values a fake tensor carries, or None (also for a view whose base has lost its values)."""
    if not isinstance(t, FakeTensor):
        return None
    value = getattr(t, VALUE, None)
    if value is not None and t._base is not None and getattr(t._base, VALUE, None) is None:
        return None
    return value


def known(fake: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """Mark `fake` (an input the caller allocated) as carrying `values` (a real tensor of its shape and dtype)."""
    if isinstance(values, FakeTensor) or tuple(fake.shape) != tuple(values.shape) or fake.dtype != values.dtype:
        raise ValueError(f"values: a real tensor of shape {tuple(fake.shape)} {fake.dtype}, got "
                         f"{type(values).__name__} {tuple(values.shape)} {values.dtype}")
    with unset_fake_temporarily():
        setattr(fake, VALUE, values.detach().clone().cpu())
    return fake


def on_device(values: torch.Tensor, device) -> torch.Tensor:
    """An input on `device` carrying `values` (a real CPU tensor): allocated empty in the current mode (a fake tensor
    under the tracer), filled with them where it is a real one (a test's forward on CPU tensors), and `known`."""
    t = torch.empty(values.shape, dtype=values.dtype, device=device)
    if not isinstance(t, FakeTensor) and t.device.type != "meta":
        t.copy_(values)
    return known(t, values)


def random_ids(fake: torch.Tensor, high: int, seed: int = 0) -> torch.Tensor:
    """`fake` (integer token ids the caller allocated) marked as carrying random ids in [0, high), drawn on the host
    from `seed`: what a tokenizer's ids are to a GPU run, values the host knows."""
    with unset_fake_temporarily():
        values = torch.randint(0, max(1, high), tuple(fake.shape), generator=torch.Generator().manual_seed(seed))
    return known(fake, values.to(fake.dtype))


def _small(func, args) -> bool:
    """A zeros / ones / full factory of at most SMALL elements (its size is its first argument)."""
    if func not in (aten.zeros.default, aten.ones.default, aten.full.default) or not args:
        return False
    size = args[0]
    try:
        n = 1
        for d in size:
            n *= int(d)
    except (TypeError, ValueError):
        return False
    return n <= SMALL


def _real(x):
    """An argument as the real op takes it: a fake tensor's values, anything else as it is."""
    return value_of(x) if isinstance(x, FakeTensor) else x


def _mutated(func, args, kwargs) -> list:
    """The tensors an op writes into (its schema's mutable arguments)."""
    out = []
    for i, arg in enumerate(func._schema.arguments):
        if arg.alias_info is not None and arg.alias_info.is_write:
            value = args[i] if i < len(args) else kwargs.get(arg.name)
            out.extend(t for t in tree_flatten(value)[0] if isinstance(t, torch.Tensor))
    return out


class HostValues(TorchDispatchMode):
    """See the module docstring. Enter it inside the fake mode, around the step."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        fakes = [t for t in tensors if isinstance(t, FakeTensor)]
        # every tensor argument a fake one with values or a plain real one, and at least one with values (or the
        # real tensor `torch.tensor(...)` lifts); never a subclass (DTensor, FSDP's parameters), never only real ones
        plain = all(isinstance(t, FakeTensor) or type(t) is torch.Tensor for t in tensors)
        carried = plain and all(value_of(t) is not None for t in fakes) and (
            bool(fakes) or (func in _LIFTS and bool(tensors)))
        if func in _SCALAR_READS and carried:
            with unset_fake_temporarily(), no_dispatch():
                return value_of(fakes[0]).item()
        if func in _MASK_INDEXED and not carried:
            args = self._masks_to_indices(args)
        real = self._compute(func, args, kwargs) if carried or (func in _FACTORIES and not tensors) else None
        if real is None:
            for t in _mutated(func, args, kwargs):   # written from unknown values: no longer known, nor its base's
                for u in (t, t._base):
                    if isinstance(u, FakeTensor) and hasattr(u, VALUE):
                        with unset_fake_temporarily():
                            delattr(u, VALUE)
        try:
            out = func(*args, **kwargs)
        except (DynamicOutputShapeException, DataDependentOutputException):
            if real is None:
                raise
            # the output's shape is what the values make it: allocated as the device allocates it
            out = tree_map_only(torch.Tensor, lambda r: torch.empty(r.shape, dtype=r.dtype, device=fakes[0].device),
                                real)
        if real is not None:
            self._attach(out, real, func)
        return out

    @staticmethod
    def _masks_to_indices(args):
        """`x[mask]` / `x[mask] = y` with a boolean mask of known values: the mask as the long indices its nonzero()
        gives, allocated once as (k, dims) like CUDA's index kernel does (at::native::expandTensors), so the op's
        output shape is known."""
        indices = list(args[1])
        changed = False
        for i, index in enumerate(indices):
            mask = value_of(index)
            if mask is None or index.dtype not in (torch.bool, torch.uint8):
                continue
            with unset_fake_temporarily(), no_dispatch():
                where = mask.bool().nonzero()
            found = torch.empty(where.shape, dtype=torch.long, device=index.device)
            setattr(found, VALUE, where)
            indices[i:i + 1] = list(found.unbind(1))
            changed = True
        return (args[0], indices, *args[2:]) if changed else args

    @staticmethod
    def _compute(func, args, kwargs):
        factory = not any(isinstance(t, torch.Tensor) for t in tree_flatten((args, kwargs))[0])
        if factory:
            arange = func in (aten.arange.default, aten.arange.start, aten.arange.start_step)
            if kwargs.get("dtype", torch.int64 if arange else torch.float32) not in _INTEGRAL and not _small(func, args):
                return None   # a float factory past SMALL elements: its values are never needed on the host
        if factory or "device" in kwargs:
            # values live on the host, whatever device the op names (a factory, `.to(meta_tensor.device)`)
            kwargs = {**kwargs, "device": "cpu"}
        with unset_fake_temporarily(), no_dispatch():
            try:
                real = func(*tree_map(_real, args), **tree_map(_real, kwargs))
            except (RuntimeError, TypeError, ValueError, IndexError):
                return None
        if func in _FACTORIES and isinstance(real, torch.Tensor) and real.dtype not in _INTEGRAL and \
                real.numel() > SMALL:
            return None
        return real

    @staticmethod
    def _attach(out, real, func) -> None:
        fake_leaves = tree_flatten(out)[0]
        real_leaves = tree_flatten(real)[0]
        if len(fake_leaves) != len(real_leaves):
            return
        with unset_fake_temporarily():
            for f, r in zip(fake_leaves, real_leaves):
                if isinstance(f, FakeTensor) and isinstance(r, torch.Tensor) and tuple(f.shape) == tuple(r.shape):
                    setattr(f, VALUE, r)


class TensorsOfValues(TorchFunctionMode):
    """`torch.tensor(data)` where data holds tensors with values: built from their values, as on a GPU (where it copies
    each to the host). The fake `torch.tensor` would read the fake tensors' (absent) data directly. A tensor made
    from plain numbers (`torch.tensor` or `torch.as_tensor` of a list) carries them."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.tensor and args:
            data = tree_map_only(FakeTensor, lambda t: value_of(t).tolist() if value_of(t) is not None else t, args[0])
            args = (data, *args[1:])
        out = func(*args, **kwargs)
        if func in (torch.tensor, torch.as_tensor) and args and isinstance(out, FakeTensor) and value_of(out) is None \
                and isinstance(args[0], (list, tuple)) and out.numel() <= SMALL:
            # plain numbers (Mistral-3's image sizes, `torch.as_tensor(image_sizes)`): the host has them
            with unset_fake_temporarily():
                real = torch.tensor(args[0], dtype=out.dtype, device="cpu")
            if tuple(real.shape) == tuple(out.shape):
                known(out, real)
        return out


@contextlib.contextmanager
def host_values():
    """Both modes, for one step (inside the fake mode and the allocation counter)."""
    with TensorsOfValues(), HostValues():
        yield
