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
    """Inside: every RG-LRU scan of `model` marks its iterations on `counter` (a no-op for other models)."""
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
