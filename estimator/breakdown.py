"""`Breakdown`: the bytes of each memory component at one moment on one GPU (what every estimate is made of)."""
from __future__ import annotations

from dataclasses import dataclass, fields

COMPONENTS = ("weights", "gradients", "optimizer_states", "master_weights", "activations", "kv_cache",
              "temporaries", "buffers", "allocator_cache", "overhead")
@dataclass(frozen=True)
class Breakdown:
    """Bytes per component at one moment on one GPU."""

    weights: int = 0           # model weights (quantized where the format says so), this GPU's share (+ gathered)
    gradients: int = 0         # .grad of trainable params (+ DDP buckets)
    optimizer_states: int = 0  # Adam moments etc.
    master_weights: int = 0    # fp32 master copy (recipe 'mixed')
    activations: int = 0       # everything else the step holds: saved tensors, temporaries of the ops, logits
    kv_cache: int = 0          # inference K/V cache
    temporaries: int = 0       # the optimizer step's temporaries; dequantized weights of a 4/8-bit matmul
    buffers: int = 0           # model inputs, labels and non-parameter buffers (RoPE tables)
    allocator_cache: int = 0   # reserved - allocated: cached free blocks and split tails (estimator.reserved)
    overhead: int = 0          # CUDA context, cuBLAS workspace, NCCL buffers

    @property
    def total(self) -> int:
        return (self.weights + self.gradients + self.optimizer_states + self.master_weights + self.activations
                + self.kv_cache + self.temporaries + self.buffers + self.allocator_cache
                + self.overhead)  # every field (a test checks)

    @property
    def tensor_bytes(self) -> int:
        """The tensors alone: total less the allocator's cache and the overhead (context, cuBLAS, NCCL)."""
        return self.total - self.allocator_cache - self.overhead

    def as_dict(self) -> dict[str, int]:
        return {f.name: getattr(self, f.name) for f in fields(self)}
