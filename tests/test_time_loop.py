"""A step that loops over time steps in Python (RecurrentGemma's RG-LRU scan): its ticks keyed per iteration
(tracer.time_loop, tracer.ticks), the guards that check which iterations the profile keeps, and the profile against
full-depth traces (slow tier).

    python -m pytest tests/test_time_loop.py -q          # WILLITFIT_SLOW=1: derivations against full-depth traces
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from estimator.profile.profile import CATEGORIES
from estimator.spec import Parallel, Workload
from tests.traced import assert_equals_trace

pytest.importorskip("torch")

from tracer import time_loop  # noqa: E402
from tracer.counters import Timeline  # noqa: E402
from tracer.ticks import PINNED_INDEX, LOOP_INDEX, _candidates, trace_ticks  # noqa: E402

TINY = Path(__file__).parent / "data" / "tiny"
SLOW = pytest.mark.skipif(not __import__("os").environ.get("WILLITFIT_SLOW"), reason="slow tier: WILLITFIT_SLOW=1")


def _config(**overrides) -> dict:
    return {**json.loads((TINY / "t-recurrent_gemma.json").read_text()), **overrides}


def _timeline(sizes: list[int], loops: tuple, stage: str = "forward") -> Timeline:
    """Allocations of `sizes` bytes, each freed at once (ticks 2k+1, 2k+2), as activations, in one `stage` window."""
    n = 2 * len(sizes)
    kind = np.zeros(n + 1, dtype=np.int8)
    nbytes = np.zeros(n + 1, dtype=np.int64)
    kind[1::2], kind[2::2] = 1, -1
    nbytes[1::2] = nbytes[2::2] = sizes
    cat = np.full(n + 1, CATEGORIES.index("activations"), dtype=np.int8)
    return Timeline(kind, nbytes, cat, np.arange(n + 1), ((n, stage),), (), loops)


def test_the_guards_refuse_an_iteration_the_profile_does_not_keep_holding_more():
    P = time_loop.PINNED
    # backward: the first two iterations to run are kept; a later one (dropped) that holds more is refused
    kept = _timeline([10, 10, 9], ((0, P), (2, P + 1), (4, time_loop.SKIP), (6, None)))
    assert len(_candidates(kept, train=False).keys) == 2
    with pytest.raises(ValueError, match=r"^fit: a later iteration of a loop over time steps in forward holds 50 B, "
                                         r"more than the first iteration to run \(10 B\)"):
        _candidates(_timeline([10, 10, 50], ((0, P), (2, P + 1), (4, time_loop.SKIP), (6, None))), train=False)
    # a loop kept by its last iteration: an earlier one that holds more is refused
    assert len(_candidates(_timeline([10, 20], ((0, 0), (2, 1), (4, None))), train=False).keys) == 1
    with pytest.raises(ValueError, match=r"^fit: an earlier iteration of a loop in forward holds 50 B, more than its "
                                         r"last \(10 B\)"):
        _candidates(_timeline([50, 10], ((0, 0), (2, 1), (4, None))), train=False)


@pytest.mark.parametrize("w", [Workload(), Workload(method="lora", lora_targets=("linear_x", "q_proj")),
                               Workload(checkpointing="full")], ids=["full", "lora", "ckpt"])
def test_a_time_loops_ticks_have_the_same_keys_at_every_size(w):
    # 50 and 72 time steps (both past the 48-token window) run 50 and 72 iterations per recurrent layer: the same keys once they are keyed per iteration
    # (batch 1 and batch >= 2 are fit apart: a batch of one runs other operations anyway)
    from dataclasses import replace

    cfg = _config(num_hidden_layers=3)
    a, b = (trace_ticks(cfg, replace(w, batch=bb, seq=s), Parallel(), None) for bb, s in ((2, 50), (3, 72)))
    assert a.keys == b.keys
    loops = [k for k in a.keys if isinstance(k[-1], int) and k[-1] >= LOOP_INDEX]
    pinned = {(k[-1] // PINNED_INDEX) % (LOOP_INDEX // PINNED_INDEX) for k in loops}
    assert loops and pinned == {0, 1, 2}   # the forward's last iteration (0), backward's first two (1, 2)


def test_the_marks_are_gone_after_the_step():
    import transformers.models.recurrent_gemma.modeling_recurrent_gemma as rg

    assert "range" not in rg.__dict__ and rg.RecurrentGemmaRglru._rnn_scan.__name__ == "_rnn_scan"


@SLOW
@pytest.mark.parametrize("w, sizes", [
    (Workload(), ((2, 300), (1, 40))),
    (Workload(method="lora", lora_rank=4, lora_targets=("linear_x", "q_proj")), ((3, 100),)),
    (Workload(checkpointing="full"), ((2, 130),)),
    (Workload(mode="infer", gen_tokens=3), ((2, 200),)),
], ids=["full", "lora", "ckpt-full", "infer"])
def test_recurrent_gemma_equals_a_full_depth_trace(w, sizes):
    # 7 layers (recurrent, recurrent, attention, ...), traced at 4-5; a 48-token window: past it at these sizes
    assert_equals_trace(_config(num_hidden_layers=7), "t-recurrent_gemma", w, sizes)


def test_a_reduced_recurrent_gemma_keeps_each_layers_own_type():
    # its layer types are block_types cycled over the layers: a reduced model's must be the kept layers' own, or its
    # inference cache gives a recurrent layer an attention layer's cache ('LinearAttentionLayer' has no 'update')
    from tracer.depth import reduce_depth
    from tracer.runner import build_model

    model = build_model(_config(num_hidden_layers=7), Workload(), meta_then_empty=True)
    reduce_depth(model, [0, 1, 1, 2, 6])
    kinds = [type(layer.temporal_block).__name__ for layer in model.model.layers]
    assert [k == "RecurrentGemmaRecurrentBlock" for k in kinds] == [True, True, True, False, True]
    assert model.config.layer_types == ["linear_attention"] * 3 + ["sliding_attention", "linear_attention"]


# MiniMax's lightning attention: a Python loop over blocks of block_size positions (tests/data/tiny/t-minimax.json:
# 3 layers, linear, full, linear, 2 experts; blocks of 64), keyed per iteration (tracer.time_loop._lightning_forward)
def _minimax() -> dict:
    return json.loads((TINY / "t-minimax.json").read_text())


def test_a_lightning_loops_ticks_have_the_same_keys_at_every_block_count():
    # 5 and 7 blocks (the last one partial at both): the same keys, the last two iterations of the forward
    # and the first two backward runs kept, the rest dropped (and checked to hold less)
    from dataclasses import replace

    a, b = (trace_ticks(_minimax(), replace(Workload(), batch=bb, seq=s), Parallel(), None)
            for bb, s in ((2, 270), (3, 400)))
    assert a.keys == b.keys
    loops = [k for k in a.keys if isinstance(k[-1], int) and k[-1] >= LOOP_INDEX]
    assert {(k[-1] // PINNED_INDEX) % (LOOP_INDEX // PINNED_INDEX) for k in loops} == {1, 2}


def test_the_lightning_forward_is_transformers_own_and_unmarked_after_the_step():
    # the copy is used only while transformers' forward is the one it was copied from (its source's hash)
    import transformers.models.minimax.modeling_minimax as mm

    assert time_loop._lightning_source_ok(mm.MiniMaxLightningAttention)
    assert "range" not in mm.__dict__ and mm.MiniMaxLightningAttention.forward.__qualname__ == \
        "MiniMaxLightningAttention.forward"


def test_minimax_training_equals_a_full_depth_trace_in_each_piece_and_at_its_ends():
    # four pieces of s (tracer.seqs._block_values): one block (no loop marks), two (the second to last iteration is
    # the first, whose carried state is zeros), three (it begins beside the first's locals), more; at both ends of
    # each, and seven blocks
    assert_equals_trace(_minimax(), "t-minimax", Workload(),
                        ((2, 403), (1, 64), (3, 65), (2, 128), (1, 129), (2, 192), (3, 193)))


@SLOW
@pytest.mark.parametrize("w, sizes", [
    (Workload(method="lora"), ((3, 150),)),
    (Workload(checkpointing="full"), ((2, 90),)),
    (Workload(mode="infer", gen_tokens=5), ((2, 100), (3, 20), (1, 300))),
], ids=["lora", "ckpt-full", "infer"])
def test_minimax_equals_a_full_depth_trace(w, sizes):
    # inference: MiniMax's own cache (MiniMaxCache, made by its prefill) keeps each linear layer's K^T V state
    assert_equals_trace(_minimax(), "t-minimax", w, sizes)


def test_a_blocks_cut_is_never_merged_away():
    # the step runs other operations on the two sides of a block's cut: a piece too narrow to fit is refused, not
    # merged into the next (whose seqs would all lie past the cut, nothing checking the seqs before it)
    from tracer.meta import hf_config
    from tracer.seqs import pieces_for

    cfg = hf_config({**_minimax(), "block_size": 32})
    assert [p[1] for p in pieces_for(cfg, 4096, infer=False)] == [32, 64, 96, None]
    with pytest.raises(ValueError, match=r"^seq: the piece of s from 1 to 32 \(a loop over blocks of 32 positions\) is "
                                         r"too short to derive a profile in; a block_size of 35 or more is$"):
        pieces_for(cfg, 4096, infer=True)
