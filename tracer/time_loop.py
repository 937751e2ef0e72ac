"""Models whose step runs a Python loop over time steps, on a GPU as here: RecurrentGemma's RG-LRU scan.

    with marks(model, counter): ...   # the scan's iterations marked on the counter (forward and backward)

transformers' `RecurrentGemmaRglru._rnn_scan` (models/recurrent_gemma/modeling_recurrent_gemma.py) runs the linear
recurrence one position at a time (`for t in range(hidden_states.shape[1])`: an fp32 state times the gate, plus the
input, written into `contextualized_states[:, t]`); transformers has no kernel for it, so a CUDA run loops the same
way. A step of seq s runs s iterations, so a step at another seq runs other operations and no polynomial in (batch,
seq) fits its ticks as they are. Each iteration does the same work on (batch, width) tensors; what differs between
iterations is what autograd has saved so far, and the counter's loop marks (`StorageCounter.set_loop`, the mechanism
tracer.vlm_loop uses for a loop over images) key the loop's ticks by their place in their iteration:

- **forward**: each iteration saves the gate (an fp32 copy) and the state before it for the product's backward, so
  the live bytes only grow; the last iteration's ticks are kept (the largest): they hold s - 1 iterations' saved
  tensors, a polynomial in (b, s). Marked by the loop's own `range`, replaced in the modeling module's globals for the
  step (its only other `range` runs at construction), so transformers' code runs unchanged;
- **backward**: autograd runs the iterations last first (their nodes' sequence numbers are in forward order) and each
  frees what its forward saved. The first iteration to run stores the gradients of the scan's inputs (a (b, s, width)
  tensor per `hidden_states[:, t]` and `recurrent_gate[:, t]` select) in autograd's input buffers; every later one
  adds its own to them, holding one more such tensor while it does: so the first iteration or the second holds the
  most (found on a tiny RecurrentGemma: the later ones held 16,256 B more than the first, which the second holds
  too). Those two are kept, each keyed as itself (`PINNED` + 0, + 1), and the later iterations' ticks are dropped
  (`SKIP`); the derivation checks on every trace that none of them holds more than the largest kept tick of its loop
  (tracer.ticks: it refuses itself otherwise). Marked by pre-hooks on the `CopySlices` nodes of the writes into
  `contextualized_states` (each iteration's last node, so the first of its backward), and the loop's end by a
  pre-hook on the scan's first node (`recurrent_gate * ~reset`), the next node autograd runs.

Under activation checkpointing the scan runs again inside backward (its recompute): its forward marks make it a loop
of its own, keyed like the forward. Inference's prefill runs the loop without autograd (every iteration alike) and
decoding one token takes the branch without it.
"""
from __future__ import annotations

import contextlib
import sys

import torch

from tracer import source_is

SKIP = -2   # a loop iteration whose ticks are dropped (tracer.ticks): backward's iterations after the second to run
PINNED = 1 << 20   # PINNED + j: the j-th iteration to run, keyed as itself (tracer.ticks), not as the loop's last
_SCAN_CLASS = "RecurrentGemmaRglru"


def _scan_modules(model) -> list:
    return [m for m in model.modules() if type(m).__name__ == _SCAN_CLASS]


def _marked_range(counter):
    def marked(*args):
        r = range(*args)

        def walk():
            for i in r:
                counter.set_loop(i)
                yield i
            counter.set_loop(None)
        return walk() if len(r) > 1 else r
    return marked


def _backward_marks(out: torch.Tensor, inputs: tuple, counter) -> None:
    """Pre-hooks on the scan's graph: the first two iterations backward runs marked PINNED + 0 and + 1, the rest
    SKIP, the loop's end (the scan's first node, the oldest that is newer than its inputs') None."""
    node = out.grad_fn
    if node is None:
        return
    chain = []   # the writes into contextualized_states, last first
    while node is not None and node.name().endswith("CopySlices"):
        chain.append(node)
        node = next((f for f, _ in node.next_functions if f is not None and f.name().endswith("CopySlices")), None)
    if len(chain) < 2:
        return
    floor = max((t.grad_fn._sequence_nr() for t in inputs if t.grad_fn is not None), default=None)
    if floor is None:   # no input has a history: no bound on the walk (unreached here: the step's inputs have one)
        return
    seen, todo, first = set(), [out.grad_fn], None   # the scan's own nodes: newer than its inputs'
    while todo:
        n = todo.pop()
        if n is None or n in seen or n._sequence_nr() <= floor:
            continue
        seen.add(n)
        if first is None or n._sequence_nr() < first._sequence_nr():
            first = n
        todo.extend(f for f, _ in n.next_functions)
    chain[0].register_prehook(lambda grads: counter.set_loop(PINNED))
    chain[1].register_prehook(lambda grads: counter.set_loop(PINNED + 1))
    if len(chain) > 2:
        chain[2].register_prehook(lambda grads: counter.set_loop(SKIP))
    if first is not None and first not in chain:
        first.register_prehook(lambda grads: counter.set_loop(None))


@contextlib.contextmanager
def marks(model, counter):
    """Inside: every RG-LRU scan of `model` marks its iterations on `counter`, and so does every MiniMax lightning
    attention (`_lightning_marks`); a no-op for other models."""
    lightning = [m for m in model.modules() if type(m).__name__ == _LIGHTNING_CLASS]
    if lightning and counter is not None:
        with _lightning_marks(type(lightning[0]), counter):
            yield
        return
    scans = _scan_modules(model)
    if not scans or counter is None:
        yield
        return
    cls = type(scans[0])
    module = sys.modules[cls.__module__]
    scan = cls.__dict__["_rnn_scan"]

    def wrapped(self, hidden_states, recurrent_gate, reset, recurrent_states, *args, **kwargs):
        out = scan(self, hidden_states, recurrent_gate, reset, recurrent_states, *args, **kwargs)
        if torch.is_grad_enabled() and out[0].requires_grad:
            _backward_marks(out[0], (hidden_states, recurrent_gate), counter)
        return out

    before = module.__dict__.get("range")   # transformers' module defines none: the builtin is what it calls
    module.range = _marked_range(counter)
    cls._rnn_scan = wrapped
    try:
        yield
    finally:
        cls._rnn_scan = scan
        if before is None:
            del module.range
        else:
            module.range = before


# MiniMax's lightning attention (transformers models/minimax/modeling_minimax.py, MiniMaxLightningAttention.forward):
# a Python loop over blocks of `block_size` positions, as on a GPU (transformers has no kernel for it). Iteration i
# keeps its output in a list (concatenated after the loop) and carries the (b, heads, d, d) state K^T V into the next;
# autograd saves each block's products. `_lightning_forward` is that forward op for op (the source it copies is
# checked by its hash before it is used: another transformers runs its own forward unmarked, and the derivation
# refuses the model as before), with the iterations marked: forward, the last two iterations keyed as themselves
# (PINNED + 0 the second to last, a full block; + 1 the last, s mod block_size wide where s is no multiple) and the
# earlier ones dropped (SKIP: they hold fewer blocks' outputs and saved products than the second to last, checked by
# tracer.ticks); backward, which runs the blocks last first, the last block PINNED + 0, the one before it + 1, the
# rest SKIP, and the loop's end where the values' transpose (the newest node before the loop) runs.
_LIGHTNING_CLASS = "MiniMaxLightningAttention"
_LIGHTNING_SOURCE = "69bc3f622840097c"   # sha256 of the forward copied below (transformers 5.23.0), first 16 digits


def _lightning_source_ok(cls) -> bool:
    return source_is(cls.forward, _LIGHTNING_SOURCE)


@contextlib.contextmanager
def _lightning_marks(cls, counter):
    if not _lightning_source_ok(cls):
        yield
        return
    original = cls.__dict__["forward"]
    helpers = sys.modules[cls.__module__]

    def forward(self, hidden_states, position_embeddings, attention_mask, past_key_values=None, **kwargs):
        return _lightning_forward(self, helpers, counter, hidden_states, attention_mask, past_key_values)

    cls.forward = forward
    try:
        yield
    finally:
        cls.forward = original


def _lightning_forward(self, helpers, counter, hidden_states, attention_mask, past_key_values):
    """transformers 5.23's MiniMaxLightningAttention.forward, op for op, its block loop marked on `counter`."""
    batch_size, seq_len, hidden_size = hidden_states.shape
    num_blocks = (seq_len + self.block_size - 1) // self.block_size

    qkv_states = self.act_fn(self.qkv_proj(hidden_states))
    qkv_states = helpers.apply_mask_to_padding_states(qkv_states, attention_mask)
    qkv_states = qkv_states.reshape(batch_size, seq_len, self.num_attention_heads, 3 * self.head_dim)

    query_states, key_states, value_states = torch.split(qkv_states, self.head_dim, dim=3)

    query_states = query_states.transpose(1, 2)
    key_states = key_states.transpose(1, 2)
    value_states = value_states.transpose(1, 2)

    attn_weights_inter = None
    if past_key_values is not None:
        attn_weights_inter = past_key_values.get_linear_cache(self.layer_idx)

    if attn_weights_inter is None:
        attn_weights_inter = torch.zeros(batch_size, self.num_attention_heads, self.head_dim, self.head_dim,
                                         device=value_states.device, dtype=value_states.dtype)
        # the node of the state each iteration but the last hands the next (its tensor is not held: under
        # checkpointing, or without grad, it dies where the original's does)
        attn_output, carried = [], []
        marked = num_blocks > 1
        for i in range(num_blocks):
            if marked:
                counter.set_loop(SKIP if i < num_blocks - 2 else PINNED + i - (num_blocks - 2))
            start_idx = i * self.block_size
            end_idx = min(start_idx + self.block_size, seq_len)
            current_block_size = end_idx - start_idx

            current_query_states = query_states[:, :, start_idx:end_idx]
            current_key_states = key_states[:, :, start_idx:end_idx]
            current_value_states = value_states[:, :, start_idx:end_idx]

            current_query_decay = self.query_decay[:, :current_block_size]
            current_key_decay = self.key_decay[:, -current_block_size:]
            current_diagonal_decay = self.diagonal_decay[:, :, :current_block_size, :current_block_size]
            block_decay = torch.exp(-self.slope_rate * current_block_size)

            attn_weights_intra = torch.matmul(current_query_states, current_key_states.transpose(-1, -2))
            attn_output_intra = torch.matmul(attn_weights_intra * current_diagonal_decay, current_value_states)

            attn_output_inter = torch.matmul(current_query_states * current_query_decay, attn_weights_inter)

            current_attn_output = attn_output_inter + attn_output_intra
            attn_output.append(current_attn_output)

            next_attn_weights_inter = torch.matmul(
                (current_key_states * current_key_decay).transpose(-1, -2), current_value_states
            )
            attn_weights_inter = attn_weights_inter * block_decay + next_attn_weights_inter
            if i < num_blocks - 1:
                carried.append(attn_weights_inter.grad_fn)
        if marked:
            counter.set_loop(None)
            if torch.is_grad_enabled() and attn_output[-1].requires_grad:
                _lightning_backward_marks(attn_output[-1], carried, value_states, counter)
        del carried
    else:
        ratio = torch.exp(-self.slope_rate)
        attn_output = []
        for i in range(seq_len):
            current_query_states = query_states[:, :, i : i + 1]
            current_key_states = key_states[:, :, i : i + 1]
            current_value_states = value_states[:, :, i : i + 1]

            current_attn_weights_inter = torch.matmul(current_key_states.transpose(-1, -2), current_value_states)
            attn_weights_inter = ratio * attn_weights_inter + current_attn_weights_inter
            current_attn_output = torch.matmul(current_query_states, attn_weights_inter)

            attn_output.append(current_attn_output)

    attn_output = torch.cat(attn_output, dim=-2)

    attn_output = attn_output.transpose(1, 2)
    attn_output = attn_output.reshape(batch_size, seq_len, self.num_attention_heads * self.head_dim)
    attn_output = self.norm(attn_output)
    attn_output = torch.nn.functional.sigmoid(self.output_gate(hidden_states)) * attn_output
    attn_output = self.out_proj(attn_output)

    if past_key_values is not None:
        past_key_values.set_linear_cache(self.layer_idx, attn_weights_inter)

    return attn_output, attn_weights_inter


def _lightning_backward_marks(last_output, carried, value_states, counter) -> None:
    """Pre-hooks on the first node backward runs of each block: the last block's output (its carried state feeds
    nothing the loss reads), then each earlier block's carried state (`carried`: their nodes, the newest of each
    block, run before its output's); the loop ends at the values' transpose."""
    firsts = [last_output.grad_fn, *reversed(carried)]
    if any(f is None for f in firsts):
        return
    firsts[0].register_prehook(lambda grads: counter.set_loop(PINNED))
    firsts[1].register_prehook(lambda grads: counter.set_loop(PINNED + 1))
    if len(firsts) > 2:
        firsts[2].register_prehook(lambda grads: counter.set_loop(SKIP))
    if value_states.grad_fn is not None:
        value_states.grad_fn.register_prehook(lambda grads: counter.set_loop(None))
