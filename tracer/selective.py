"""Selective activation checkpointing replayed from a step traced without it (issue "Exact and instant").

The runner's 'selective' checkpointing (runner._selective_attention: Megatron's selective recompute, arXiv
2205.05198 Section 4.2) wraps each call of transformers' attention interface (after RoPE, before o_proj) in torch's
non-reentrant checkpoint. What that changes in a step is what full checkpointing changes (tracer.recompute), with the
attention call as the checkpointed unit instead of the decoder layer: the call's ops save holders, so what it makes
dies with its last Python reference, its arguments (q, k, v, the mask, keyword tensors) live with the frame, and the
first unpack of one of its holders in backward recomputes the call up to its last pack. So the same records serve
(tracer.recompute.Saves): during the traced step every attention call is watched (`watch`: where it starts and ends,
which layer runs it, and which call each pack happens in), and after it a second probe forward (`probe`) runs with
each call's ops saving nothing and its tensor arguments held. `units` turns that into the view
`tracer.recompute.checkpointed` reads (units are the calls, each emitted under its layer's block).

What it covers (`replayable`): one GPU, DDP or FSDP2 alone (the attention core holds no parameter, so FSDP's hooks
around each layer run alike with and without it; an unsharded parameter's storage that a step left at 0 bytes is
read as no free: tracer.recompute.checkpointed), full fine-tuning or LoRA (selective checkpointing touches no
embedding, so transformers' `enable_input_require_grads` does not enter), SDPA or eager attention, the loss-only loop,
no offload, compile, images or audio, grad_accum 1. A derivation checks it against one traced step of selective
checkpointing (tracer.derive), so a model whose attention does not run through the interface, or whose checkpointed
attention differs from this reading, is traced, not replayed.
"""
from __future__ import annotations

import contextlib
import sys

import numpy as np
import torch
from torch.utils._pytree import tree_leaves

from estimator.parallel import TRACED_SHARDING
from estimator.spec import Parallel, Workload
from tracer import replay, runner
from tracer.counters import StorageCounter, Timeline

PROBE = "probe-attention"   # the stage name of the attention probe (dropped from the traced timeline)


def replayable(workload: Workload, parallel: Parallel) -> str:
    """Why this class's selective-checkpointing step cannot be replayed from its step without checkpointing ("" where
    it can)."""
    why = replay.probed_step_refusal(workload)
    if why:
        return why
    if parallel.strategy not in ("single", "ddp", *TRACED_SHARDING):
        return f"strategy {parallel.strategy}: its hooks around each layer are not replayed"
    if max(parallel.tp, parallel.pp, parallel.cp) > 1:   # DTensor activations; a pipeline's schedule; ring attention
        return "tp, pp, cp: only data parallelism (DDP, FSDP2 alone) is replayed"
    if workload.method not in ("full", "lora"):
        return f"method {workload.method}: the runner builds full fine-tuning and LoRA"
    if workload.attention not in ("sdpa", "eager"):
        return f"attention {workload.attention}: selective checkpointing wraps SDPA or eager attention"
    return ""


@contextlib.contextmanager
def attention_calls(model, around):
    """Every call of `model`'s attention through transformers' attention interface (the implementation the config
    names) or a model file's `eager_attention_forward` goes through `around(fn, module, args, kwargs)` inside."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    def wrapped(fn):
        def call(module, *args, **kwargs):
            return around(fn, module, args, kwargs)
        return call

    name = getattr(model.config, "_attn_implementation", None) or "sdpa"
    files = {type(m).__module__ for m in model.modules()}
    files = [sys.modules[f] for f in files if hasattr(sys.modules.get(f), "eager_attention_forward")]
    eager = [(f, f.eager_attention_forward) for f in files]
    local = ALL_ATTENTION_FUNCTIONS._local_mapping
    had = local.get(name)
    try:
        for f, fn in eager:
            f.eager_attention_forward = wrapped(fn)
        if name != "eager" and name in ALL_ATTENTION_FUNCTIONS:
            ALL_ATTENTION_FUNCTIONS[name] = wrapped(ALL_ATTENTION_FUNCTIONS[name])
        yield
    finally:
        for f, fn in eager:
            f.eager_attention_forward = fn
        if had is not None:
            local[name] = had
        else:
            local.pop(name, None)


@contextlib.contextmanager
def watch(model, counter: StorageCounter, saves):
    """Record every attention call of the traced step: (first tick, last tick, layer) in `saves.regions`, and the
    call's number in `saves.region` while it runs (each pack notes it: tracer.recompute.watching)."""

    def around(fn, module, args, kwargs):
        saves.region = len(saves.regions)
        saves.regions.append([counter.now, None, counter.block()])
        try:
            return fn(module, *args, **kwargs)
        finally:
            saves.regions[saves.region][1] = counter.now
            saves.region = None

    with attention_calls(model, around):
        yield


def _drop(x):
    return None


def _never(held):
    raise RuntimeError("selective: the probe forward has no backward")


def probe(case, counter: StorageCounter, saves) -> None:
    """The attention probe: one more forward after the traced step (and the layer probe), each attention call's ops
    saving nothing (as under a checkpoint's holders) and its tensor arguments held to the end (the frame's)."""
    held = []

    def around(fn, module, args, kwargs):
        tensors = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        pos = len(held)
        held.append(tensors)
        saves.held_attention.extend((pos, counter.record_of(t)) for t in tensors)
        with torch.autograd.graph.saved_tensors_hooks(_drop, _never):
            return fn(module, *args, **kwargs)

    first = counter.now
    with attention_calls(case.model, around):
        loss = runner.forward_loss(case.model, case.workload, case.inputs)
    counter.mark_stage(PROBE)
    saves.probe_attention = (first, counter.now)
    del loss
    held.clear()


def units(tl: Timeline, saves, start: int, fwd: int, block: np.ndarray):
    """The attention calls of the traced forward (ticks start..fwd) as tracer.recompute's units: (packs as (tick,
    record, call or None), per-tick call (-1 outside), each call's layer, where each call starts, the probe's held
    (call, record), the probe's ticks). Raises ValueError where the forward made no call the probe matches."""
    calls = [(i, s, e, layer) for i, (s, e, layer) in enumerate(saves.regions)
             if start <= s and e is not None and e <= fwd]
    if not calls:
        raise ValueError("selective: the forward calls no attention through transformers' attention interface")
    if saves.probe_attention is None or max((p for p, _ in saves.held_attention), default=-1) + 1 != len(calls):
        raise ValueError("selective: the probe forward calls attention another number of times than the traced one")
    number = {i: k for k, (i, _, _, _) in enumerate(calls)}
    unit = np.full(len(block), -1, dtype=np.int64)
    for k, (_, s, e, _) in enumerate(calls):
        unit[s + 1:e + 1] = k
    packs = [(tick, rec, number.get(region)) for tick, rec, _, region in saves.packs]
    layer_of = {k: -1 if layer is None else int(layer) for k, (_, _, _, layer) in enumerate(calls)}
    starts = {k: s for k, (_, s, _, _) in enumerate(calls)}
    return packs, unit, layer_of, starts, list(saves.held_attention), saves.probe_attention
