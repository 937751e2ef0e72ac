"""torchtune's activation offloading, as it moves memory on the GPU, for fake CPU tensors.

Follows ``OffloadActivations`` (torchtune/training/_activation_offloading.py) with its defaults, as
``get_act_offloading_ctx_manager`` builds it for the recipes (``use_streams=True``, ``min_offload_size=1024`` bytes,
``max_fwd_stash_size=5``), a ``saved_tensors_hooks`` pair:

- pack (forward): a saved tensor of at least 1024 bytes (``element_size() * nelement()``, the view's bytes) that is
  not an ``nn.Parameter`` or ``nn.Buffer`` object is copied to pinned CPU memory and replaced by an id. The check
  is on the object's type, so a parameter's view (the ``weight.t()`` that ``mm`` saves for a Linear) is offloaded too.
  With streams the GPU tensor is kept in ``fwd_stash`` until a tensor ``max_fwd_stash_size`` ids later is packed
  (the copy must finish first), so the last few offloaded activations are still on the GPU when forward ends.
- unpack (backward): an offloaded tensor is copied back to a new GPU tensor (``.to(device)`` of the CPU copy: its
  layout is the CPU copy's, ``empty_like``'s), kept in ``bwd_tensor_stash`` until the next autograd node that
  brings one back has run (the previous node's tensors are dropped in that node's post hook), and the rest when
  backward ends (a callback queued on the engine). A tensor still in ``fwd_stash`` is handed back as it is.
- the output head is excluded: a ``NoOpManager`` (identity hooks) is entered in the output Linear's pre-hook.
  The recipes compute the loss outside the offloading context (``_loss_step``), so the head and the loss are not
  offloaded; here the NoOp context opens when the base model returns (HF runs head and loss in the same forward).

On fake CPU tensors the "CPU copy" is only the tensor's size, strides and dtype (pinned host memory is not GPU
memory and is not counted); dropping the GPU reference in pack and allocating a same-sized tensor in unpack is what
the GPU allocator sees. Events and streams themselves change no lifetime beyond what is modelled here.
"""
from __future__ import annotations

import contextlib

import torch
from torch.autograd.graph import saved_tensors_hooks

MIN_OFFLOAD_BYTES = 1024   # OffloadActivations(min_offload_size=1024)
MAX_FWD_STASH = 5          # OffloadActivations(max_fwd_stash_size=5)
# Reduced-depth copies of each middle layer type a derivation traces under offloading (tracer.extend.plan_layers):
# the stash keeps the last MAX_FWD_STASH offloaded tensors on the GPU, so a tick sees up to MAX_FWD_STASH - 1 of the
# layers before it through the stash (one each where a layer offloads one tensor, as under full checkpointing).
# With fewer layers before it than that, one more layer adds its tensor to the stash *and* its own bytes, and the
# extension would read both for every further layer (a 7-layer GPT-2 with LoRA, full checkpointing and a kept
# output read two hidden-state tensors high at 3 + 4 reduced layers).
DEPTH_COPIES = MAX_FWD_STASH


class _HostCopy:
    """The pinned CPU copy torchtune makes (``torch.empty_like(activation, device="cpu")``): its layout only."""

    def __init__(self, t: torch.Tensor):
        from torch._prims_common import (
            is_non_overlapping_and_dense_or_false as is_non_overlapping_and_dense,
        )

        self.size, self.dtype, self.device = t.size(), t.dtype, t.device
        # empty_like(preserve_format) keeps the strides of a dense, non-overlapping tensor, else it is contiguous
        self.stride = t.stride() if is_non_overlapping_and_dense(t) else None

    def to_gpu(self) -> torch.Tensor:
        if self.stride is None:
            return torch.empty(self.size, dtype=self.dtype, device=self.device)
        return torch.empty_strided(self.size, self.stride, dtype=self.dtype, device=self.device)


def _offloadable(t: torch.Tensor, min_bytes: int) -> bool:
    is_buffer = hasattr(torch.nn, "Buffer") and isinstance(t, torch.nn.Buffer)
    return t.element_size() * t.nelement() >= min_bytes and not isinstance(t, torch.nn.Parameter) and not is_buffer


class OffloadActivations(saved_tensors_hooks):
    """torchtune's OffloadActivations with streams (its default), on what it keeps on the GPU; see the module doc."""

    def __init__(self, min_offload_size: int = MIN_OFFLOAD_BYTES, max_fwd_stash_size: int = MAX_FWD_STASH):
        self.min_tensor_size_bytes = min_offload_size
        self.max_fwd_stash_size = max_fwd_stash_size
        self.tracker: dict[int, tuple[object, bool]] = {}   # id -> (host copy or the tensor itself, offloaded?)
        self.tensor_id = 0
        self.is_first_forward_call = True
        self.is_first_backward_call = True
        self.fwd_stash: dict[int, torch.Tensor] = {}      # id -> GPU activation kept until its copy is done
        self.bwd_tensor_stash: dict[int, torch.Tensor] = {}  # id -> GPU tensor brought back
        self.curr_graph_id = None
        self.curr_autograd_node = None
        super().__init__(self._pack, self._unpack)

    def _pack(self, activation: torch.Tensor) -> int:
        if self.is_first_forward_call:
            assert not self.tracker, "backward pass should have cleared tracker of all tensors"
            self.is_first_forward_call = False
            self.is_first_backward_call = True
        self.tensor_id += 1
        tensor_id = self.tensor_id
        if _offloadable(activation, self.min_tensor_size_bytes):
            for old in list(self.fwd_stash):   # ids ascend: drop the ones offloaded long enough ago
                if old <= tensor_id - self.max_fwd_stash_size:
                    del self.fwd_stash[old]
                else:
                    break
            self.tracker[tensor_id] = (_HostCopy(activation), True)
            self.fwd_stash[tensor_id] = activation
        else:
            self.tracker[tensor_id] = (activation, False)
        return tensor_id

    def _unpack(self, unpack_tensor_id: int) -> torch.Tensor:
        if self.is_first_backward_call:
            self.curr_graph_id = torch._C._current_graph_task_id()
            torch.autograd.variable.Variable._execution_engine.queue_callback(self.bwd_tensor_stash.clear)
            self.is_first_backward_call = False
            self.is_first_forward_call = True
        held, modified = self.tracker.pop(unpack_tensor_id)
        if not modified:
            return held
        graph_id = torch._C._current_graph_task_id()
        node = torch._C._current_autograd_node()
        prev_node_ids: list[int] = []
        if graph_id == self.curr_graph_id and self.curr_autograd_node != node:
            self.curr_autograd_node = node
            prev_node_ids = list(self.bwd_tensor_stash)
        brought_back = unpack_tensor_id not in self.fwd_stash
        if brought_back:
            gpu_tensor = held.to_gpu()
            self.bwd_tensor_stash[unpack_tensor_id] = gpu_tensor
            storage_refcount = torch._C._storage_Use_Count(gpu_tensor.untyped_storage()._cdata)
        else:
            gpu_tensor = self.fwd_stash[unpack_tensor_id]

        def hook(outputs, inputs):
            if brought_back:
                unpacked = self.bwd_tensor_stash[unpack_tensor_id]
                if torch._C._storage_Use_Count(unpacked.untyped_storage()._cdata) > storage_refcount:
                    del self.bwd_tensor_stash[unpack_tensor_id]  # record_stream: freed when its last user lets go
            self.fwd_stash.clear()                                # in backward now: the forward stash goes
            for old in prev_node_ids:
                self.bwd_tensor_stash.pop(old, None)
            return outputs

        node.register_hook(hook)
        return gpu_tensor


class NoOpManager(saved_tensors_hooks):
    """torchtune's NoOpManager: identity hooks that shadow the offloading hooks inside a region."""

    def __init__(self) -> None:
        super().__init__(lambda t: t, lambda t: t)


@contextlib.contextmanager
def offloading(model: torch.nn.Module, body: torch.nn.Module):
    """The offloading context around one forward of `model`, with the head and loss (everything after `body`, the
    base model, returns) under a NoOpManager, as torchtune's get_act_offloading_ctx_manager keeps its output head."""
    manager = getattr(model, "_willitfit_offload", None)
    if manager is None:  # the recipe builds one per model and reuses it every step
        manager = model._willitfit_offload = OffloadActivations()
    noop = NoOpManager()
    entered = []

    def after_body(module, args, output):
        noop.__enter__()
        entered.append(True)

    handle = body.register_forward_hook(after_body)
    try:
        with manager:
            try:
                yield
            finally:
                if entered:
                    noop.__exit__(None, None, None)
    finally:
        handle.remove()
