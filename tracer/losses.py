"""The training losses people swap in for HF's full cross-entropy, run on an HF causal LM as the frameworks run them.

- ``chunked``: torchtune's ``CEWithChunkedOutputLoss`` (torchtune/modules/loss/ce_chunked_output_loss.py) fed by
  ``TransformerDecoder.chunked_output`` (torchtune/modules/transformer.py): the decoder's output projection is applied
  to each of ``num_output_chunks`` slices of the last hidden state (``tensor_split`` on the sequence), the list of
  half-precision chunk logits is returned, and the loss upcasts one chunk at a time to fp32 inside
  ``compute_cross_entropy`` (``F.cross_entropy(logits.float(), labels, reduction="sum")``), summing and dividing by
  the number of non-ignored labels. Labels are shifted as the recipe does (recipes/full_finetune_single_device.py
  ``_loss_step`` / ``train``: ``hstack((labels[..., 1:], ignore_labels_cache))``).
- ``fused-linear``: Liger's ``LigerFusedLinearCrossEntropyFunction`` (src/liger_kernel/ops/fused_linear_cross_entropy.py,
  ``fused_linear_cross_entropy_forward``) as Liger's HF patch calls it (src/liger_kernel/transformers/model/llama.py
  ``lce_forward`` -> model/loss_utils.py ``LigerForCausalLMLoss``): the forward computes, per chunk of tokens, the
  chunk's logits, their softmax gradient (written over the logits in place by the Triton kernel), and accumulates the
  gradients of the hidden state and of the lm_head weight; backward only hands those back. Logits never exist
  beyond one chunk. The Triton kernel does not run on fake CPU tensors, so ``_cross_entropy_in_place`` does its
  work with in-place torch ops that allocate only per-row scalars, as the kernel allocates nothing.

Both run inside the model's own forward (``lm_forward`` replaces the causal LM's ``forward`` for one call), so hooks
on the root module (FSDP2's all-gather of the embedding and lm_head) fire as in a real run.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from estimator.spec import fused_chunk_count

IGNORE_INDEX = -100


@dataclass
class LossOutput:
    """What a recipe's forward hands the training loop: the loss, and the logits it materialised (a list of chunks
    for 'chunked', None for 'fused-linear', whose logits never exist beyond one chunk)."""

    loss: torch.Tensor
    logits: object = None


def causal_lm(model: torch.nn.Module) -> torch.nn.Module:
    """The *ForCausalLM module inside PEFT's wrapper (PeftModel.get_base_model), or the model itself."""
    get = getattr(model, "get_base_model", None)
    return get() if get is not None else model


def head_and_body(lm: torch.nn.Module) -> tuple[torch.nn.Module, torch.nn.Module]:
    """(the lm_head, the base model that returns the normed last hidden state) of an HF causal LM."""
    head = lm.get_output_embeddings()
    body = getattr(lm, getattr(lm, "base_model_prefix", "model"), None)
    if head is None or body is None or body is lm:
        raise ValueError(f"loss: {type(lm).__name__} has no separate output head to chunk; use loss='full'")
    return head, body


@contextlib.contextmanager
def lm_forward(model: torch.nn.Module, forward):
    """Run `forward(lm, input_ids, labels)` as the causal LM's forward for the calls inside the block.

    The instance attribute shadows the class's forward, so ``model(...)`` still goes through every module hook of the
    root (and PEFT's wrapper, which calls the inner model's ``forward``)."""
    lm = causal_lm(model)

    def patched(input_ids=None, labels=None, **_ignored):
        return forward(lm, input_ids, labels)

    lm.forward = patched
    try:
        yield
    finally:
        del lm.forward


def _hidden(lm, input_ids) -> torch.Tensor:
    _, body = head_and_body(lm)
    return body(input_ids=input_ids, use_cache=False)[0]  # (B, T, H), after the final norm


def _softcap(lm, logits: torch.Tensor) -> torch.Tensor:
    """Gemma-2's final logit soft-capping, as its HF forward applies it to the logits."""
    cap = getattr(lm.config, "final_logit_softcapping", None)
    if cap is None:
        return logits
    return torch.tanh(logits / cap) * cap


def shift_labels(labels: torch.Tensor) -> torch.Tensor:
    """torchtune's shift: labels[..., 1:] with one ignore column appended, so the logits are not sliced."""
    ignore = torch.full((labels.shape[0], 1), IGNORE_INDEX, dtype=labels.dtype, device=labels.device)
    return torch.hstack((labels[..., 1:], ignore))  # (B, T)


def chunked_forward(num_chunks: int):
    """torchtune's chunked output + CEWithChunkedOutputLoss as the causal LM's forward (see the module docstring)."""

    def forward(lm, input_ids, labels):
        head, _ = head_and_body(lm)
        h = _hidden(lm, input_ids)
        # TransformerDecoder.chunked_output: [b, s/n, v] per chunk, in the model's dtype
        logits = [_softcap(lm, head(chunk)) for chunk in h.tensor_split(num_chunks, dim=1)]
        del h
        loss = chunked_cross_entropy(logits, shift_labels(labels), num_chunks)
        return LossOutput(loss, logits)

    return forward


def chunked_cross_entropy(logits: list[torch.Tensor], labels: torch.Tensor, num_chunks: int) -> torch.Tensor:
    """CEWithChunkedOutputLoss.forward: one chunk at a time upcast to fp32, summed, over the non-ignored labels."""
    total_elements = (labels != IGNORE_INDEX).sum()
    label_chunks = [c.reshape(-1) for c in labels.tensor_split(num_chunks, dim=1)]
    logit_chunks = [c.reshape(-1, c.size(-1)) for c in logits]
    total_loss = 0.0
    for logits_chunk, labels_chunk in zip(logit_chunks, label_chunks):
        # compute_cross_entropy
        total_loss += torch.nn.functional.cross_entropy(logits_chunk.float(), labels_chunk,
                                                        ignore_index=IGNORE_INDEX, reduction="sum")
    return total_loss / total_elements


# ------------------------------------------------------------------------------------------------- fused linear

def liger_chunk_rows(bt: int, vocab: int, hidden: int) -> int:
    """Rows per chunk in Liger's fused linear cross-entropy: chunks sized so that a chunk's logits are about as large
    as the hidden state, rounded up to a power of two (fused_linear_cross_entropy_forward:
    ``inc_factor = cdiv(V, H); chunk_size = next_power_of_2(cdiv(BT, inc_factor))``)."""
    inc_factor = -(-vocab // hidden)
    rows = -(-bt // inc_factor)
    return 1 << max(0, (rows - 1).bit_length())


def bounding_chunk_rows(bt: int, vocab: int, hidden: int) -> int:
    """Rows per chunk for deriving a profile: Liger's power-of-two rounding makes the chunk (and the number of
    chunks) jump with B*T, which no polynomial fits. A fixed number of chunks k, the largest power of two at most
    half of Liger's inc_factor, keeps the step's shape and gives chunks of B*T/k rows: at least Liger's
    next_power_of_2(cdiv(B*T, inc_factor)) less one row, at most four times it. The profile is conservative by at
    most three of Liger's chunks of logits (docs/recipes.md)."""
    return -(-bt // bounding_chunk_count(vocab, hidden))


def bounding_chunk_count(vocab: int, hidden: int) -> int:
    """k of `bounding_chunk_rows` (estimator.spec.fused_chunk_count). Where k does not divide B*T the chunks are
    ceil(B*T / k) rows, a step no polynomial follows: the derivation fits and verifies on seqs that k divides
    (tracer.derive `chunk_step`)."""
    return fused_chunk_count(vocab, hidden)


_CHUNK_RULE = [liger_chunk_rows]


@contextlib.contextmanager
def bounding_chunks():
    """Inside the block, fused-linear chunks follow `bounding_chunk_rows` (tracer.derive uses it)."""
    _CHUNK_RULE.append(bounding_chunk_rows)
    try:
        yield
    finally:
        _CHUNK_RULE.pop()


def fused_linear_forward(chunk_rows=None):
    """Liger's lce_forward + LigerForCausalLMLoss as the causal LM's forward (reduction 'mean', no logits)."""
    chunk_rows = chunk_rows or _CHUNK_RULE[-1]

    def forward(lm, input_ids, labels):
        head, _ = head_and_body(lm)
        h = _hidden(lm, input_ids)
        # LigerForCausalLMLoss: labels padded with one ignore index and shifted; hidden states flattened (a view)
        shifted = torch.nn.functional.pad(labels, (0, 1), value=IGNORE_INDEX)[..., 1:].contiguous()
        x = h.view(-1, h.shape[-1])  # (B*T, H)
        del h
        loss = FusedLinearCrossEntropy.apply(x, head.weight, shifted.view(-1), getattr(head, "bias", None),
                                             chunk_rows)
        return LossOutput(loss, None)

    return forward


def _cross_entropy_in_place(logits: torch.Tensor, target: torch.Tensor, loss_out: torch.Tensor,
                            n_non_ignore: torch.Tensor) -> None:
    """What ``liger_cross_entropy_kernel`` does to one chunk (reduction 'mean'): write each row's loss into
    `loss_out` and overwrite the row's logits with d loss / d logits = (softmax - one_hot) / n_non_ignore, zero for
    ignored rows. The kernel keeps every intermediate in registers; here only (rows, 1) temporaries are allocated and
    the (rows, V) logits are changed in place, so the bytes counted are the kernel's."""
    valid = (target != IGNORE_INDEX).unsqueeze(1)                      # (c, 1)
    idx = target.clamp(min=0).unsqueeze(1)                             # (c, 1)
    m = logits.amax(dim=-1, keepdim=True)                              # (c, 1)
    x_y = logits.gather(1, idx).float()                                # (c, 1)
    logits.sub_(m).exp_()
    d = logits.sum(dim=-1, keepdim=True, dtype=torch.float32)          # (c, 1)
    row_loss = (d.log() + m.float() - x_y) * valid / n_non_ignore      # (c, 1)
    loss_out.copy_(row_loss.squeeze(1))
    logits.div_(d)
    logits.scatter_add_(1, idx, torch.full_like(m, -1.0))
    logits.mul_(valid / n_non_ignore)


class FusedLinearCrossEntropy(torch.autograd.Function):
    """LigerFusedLinearCrossEntropyFunction with reduction 'mean' (the mean/sum path: gradients computed in forward),
    no ce_weight, label smoothing, z-loss or token scaling. Tensor by tensor what fused_linear_cross_entropy_forward
    allocates: grad_input (BT, H) and grad_weight (V, H) zeros in the weight's dtype (accum_dtype None), loss_1d (BT,)
    fp32, then per chunk its logits (rows, V), the grad_input rows' matmul result, and mm(grad_logits.t(), x).float()
    for grad_weight (the path taken unless grad_weight is fp32 on sm80+, where an addmm with out_dtype adds in place)."""

    @staticmethod
    def forward(ctx, x, weight, target, bias, chunk_rows):
        bt, hidden = x.shape
        vocab = weight.shape[0]
        rows = chunk_rows(bt, vocab, hidden)
        input_requires_grad = x.requires_grad
        grad_input = torch.zeros_like(x)
        grad_weight = grad_bias = None
        if input_requires_grad:
            grad_weight = torch.zeros_like(weight) if weight.requires_grad else None
            grad_bias = torch.zeros_like(bias) if bias is not None else None
        loss_1d = torch.zeros(bt, dtype=torch.float32, device=x.device)
        n_non_ignore = (target != IGNORE_INDEX).sum()  # Liger takes .item(); a fake tensor has no value to read
        for start in range(0, bt, rows):
            x_chunk = x[start:start + rows]
            logits_chunk = x_chunk @ weight.t()                        # (rows, V), the one materialised chunk
            if bias is not None:
                logits_chunk = logits_chunk + bias
            logits_chunk = logits_chunk.contiguous()
            _cross_entropy_in_place(logits_chunk, target[start:start + rows].contiguous(),
                                    loss_1d[start:start + rows], n_non_ignore)
            if input_requires_grad:
                grad_input[start:start + rows] = logits_chunk @ weight
            if grad_weight is not None and input_requires_grad:
                if grad_weight.dtype == torch.float32 and logits_chunk.dtype in (torch.float16, torch.bfloat16):
                    # the CUDA sm80+ path (the traced device stands for one): accumulate in place in fp32
                    torch.addmm(grad_weight, logits_chunk.t(), x_chunk.to(logits_chunk.dtype),
                                out_dtype=torch.float32, out=grad_weight)
                else:
                    grad_weight += torch.mm(logits_chunk.t(), x_chunk).float()
            if grad_bias is not None and input_requires_grad:
                torch.add(input=grad_bias, other=logits_chunk.sum(dim=0), out=grad_bias, alpha=1.0)
            del logits_chunk
        loss = torch.sum(loss_1d)
        grad_weight = grad_weight.to(weight.dtype) if grad_weight is not None else None
        grad_bias = grad_bias.to(bias.dtype) if grad_bias is not None else None
        ctx.save_for_backward(grad_input.detach(), grad_weight.detach() if grad_weight is not None else None,
                              grad_bias.detach() if grad_bias is not None else None)
        return loss

    @staticmethod
    def backward(ctx, grad_output):
        grad_input, grad_weight, grad_bias = ctx.saved_tensors
        # fused_linear_cross_entropy_backward: element_mul_kernel scales each in place (skipped when grad_output is
        # 1.0, which a fake tensor cannot be asked; in place, the bytes are the same either way)
        grad_input.mul_(grad_output)
        if grad_weight is not None:
            grad_weight.mul_(grad_output)
        if grad_bias is not None:
            grad_bias.mul_(grad_output)
        return grad_input, grad_weight, None, grad_bias, None
