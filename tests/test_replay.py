"""tracer.replay: a step of grad_accum 2 replayed from the traced step of grad_accum 1, against its own trace."""
from __future__ import annotations

import os
from dataclasses import replace

import pytest

from estimator.spec import Parallel, Workload

pytest.importorskip("torch")

from estimator import store  # noqa: E402
from estimator.estimate import clear_caches  # noqa: E402
from tracer import replay  # noqa: E402
from tracer.ticks import trace_ticks  # noqa: E402
from traced import assert_equals_trace, assert_replay_equals_trace, tiny as _config  # noqa: E402

pytestmark = pytest.mark.replays   # their derivations replay, as outside the tests (tests/conftest.py)

SLOW = pytest.mark.skipif(not os.environ.get("WILLITFIT_SLOW"), reason="slow tier: WILLITFIT_SLOW=1")


# what the replay must get right: a frozen embedding (the second micro-batch's embedding runs in layer 0's block),
# tied weights, amp's fp32 gradients, recompute in backward, a chunked loss, routed experts, the output kept into the
# next forward; in the slow tier an encoder, fused SGD, sliding windows, an image, hybrids
CASES = [
    ("llama", dict(method="lora", lora_targets=("q_proj", "v_proj"))),
    ("gpt2", dict(recipe="amp", checkpointing="selective", loop="keep-output")),
    ("mixtral", dict(loss="chunked", loss_chunks=4, checkpointing="full")),
]
SLOW_CASES = [
    ("bert", dict(recipe="amp")),
    ("llama", {}),
    ("llama", dict(checkpointing="op-sac", loss="fused-linear")),
    ("llama", dict(recipe="mixed", optimizer_impl="forloop")),
    ("neox", dict(optimizer="sgd", optimizer_impl="fused")),
    ("gemma2", dict(attention="eager", method="lora", lora_targets=("q_proj", "v_proj"))),
    ("phi3", dict(method="lora", lora_targets=("qkv_proj",), loop="keep-output")),
    ("opt", dict(checkpointing="full", recipe="amp")),
    ("llava", dict(images=1)),
    ("jamba", {}),
    ("qwen3_next", dict(method="lora", lora_targets=("q_proj", "v_proj"))),
]


def _check(family: str, knobs: dict, b: int, s: int) -> None:
    w = Workload(batch=b, seq=s, **knobs)
    assert replay.replayable(w, Parallel()) == ""
    # (watching the gradients changes nothing the fit reads)
    assert_replay_equals_trace(_config(family), w, "grad_accum")


@pytest.mark.parametrize("family, knobs", CASES, ids=[c[0] for c in CASES])
def test_a_replayed_step_of_grad_accum_2_has_the_traced_ticks(family, knobs):
    _check(family, knobs, 2, 37)


@SLOW
@pytest.mark.parametrize("family, knobs", SLOW_CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(SLOW_CASES)])
def test_a_replayed_step_of_grad_accum_2_has_the_traced_ticks_everywhere(family, knobs):
    for b, s in ((1, 64), (3, 29)):
        _check(family, knobs, b, s)


def test_what_is_not_replayed_says_why():
    assert "fsdp" in replay.replayable(Workload(), Parallel(strategy="fsdp", gpus=2))
    assert "optimizer_in_backward" in replay.replayable(Workload(optimizer_in_backward=True), Parallel())
    assert "activation_offload" in replay.replayable(Workload(activation_offload=True), Parallel())
    assert "compile" in replay.replayable(Workload(compile=True), Parallel())
    assert "inference" in replay.replayable(Workload(mode="infer"), Parallel())


def test_one_derivation_prices_both_grad_accum_classes_exactly(tmp_path, monkeypatch):
    """A derivation of grad_accum 1 leaves the class of grad_accum >= 2 beside it: a later estimate at grad_accum 4
    derives nothing (derive=False would raise) and equals a full-depth trace at grad_accum 4."""
    monkeypatch.setenv("WILLITFIT_CACHE", str(tmp_path))
    monkeypatch.setattr(store, "SHIPPED_DIR", tmp_path / "none")
    clear_caches(tables=False)   # the estimator's class memo too (estimate._CLASSES)
    cfg = _config("llama")
    w = Workload(method="lora", lora_targets=("q_proj", "v_proj"), lora_rank=5)
    one, = assert_equals_trace(cfg, "tiny", w, [(3, 45)])
    clear_caches(tables=False)
    four, = assert_equals_trace(cfg, "tiny", replace(w, grad_accum=4), [(3, 45)], derive=False)
    assert "replayed" in four.profile and "replayed" not in one.profile


def test_a_replay_that_misses_its_traced_check_is_not_given(monkeypatch):
    """Each derivation checks the replay against one traced step of grad_accum 2, key by key: a wrong replay (here:
    none at all, the step of grad_accum 1 as it was traced) gives no profile of that class, and one asked for
    grad_accum 2 is then traced after all."""
    from tracer import derive

    monkeypatch.setattr(replay, "accumulating", lambda tl, accumulations: tl)
    asked, kept, *replayed = derive.derive_profiles(_config("llama"), Workload(grad_accum=3))
    assert asked.workload_class["grad_accum"] == 2 and "replayed" not in asked.provenance
    assert kept.workload_class["grad_accum"] == 1 and kept.provenance["replay_refused"]["grad_accum"].startswith("replay: at (b, s, n, r) = (4, ")


def test_a_replayed_step_the_guards_refuse_leaves_the_traced_class_alone():
    """LLaVA-NeXT's per-image loop under grad_accum 2: an earlier image's backward iteration holds more than the last
    (the gradients it hands AccumulateGrad die there), which the loop's guard refuses (tracer.ticks): the replayed
    ticks say so, and the traced step's ticks are the ones a run without the replay has."""
    cfg = _config("llava_next")
    w = Workload(images=1, batch=2, seq=300)
    both = trace_ticks(cfg, w, Parallel(), None, replays=("grad_accum",))
    assert both.replayed["grad_accum"].refused.startswith("fit: an earlier iteration of a loop in backward holds")
    assert replay.keyed(both) == replay.keyed(trace_ticks(cfg, w, Parallel(), None))


def test_the_replays_switch_takes_0_or_1_and_says_so_in_one_line(monkeypatch):
    from tracer import derive

    for raw, on in (("", True), ("1", True), ("0", False), (" 0 ", False)):
        monkeypatch.setenv("WILLITFIT_REPLAYS", raw)
        assert derive.replays_on() is on
    monkeypatch.setenv("WILLITFIT_REPLAYS", "yes")
    with pytest.raises(ValueError, match=r"^WILLITFIT_REPLAYS: 1 \(replay .* or 0 \(trace the class asked for alone\); "
                       r"got 'yes'$"):
        derive.replays_on()


def test_a_replayed_step_under_ddp_has_the_traced_ticks():
    # DDP's one memory effect on a rank is its gradient buckets, allocated at construction (tracer.session): the
    # micro-batches run as on one GPU beside them
    w = Workload(batch=2, seq=37, method="lora", lora_targets=("q_proj", "v_proj"))
    assert replay.replayable(w, Parallel(strategy="ddp", gpus=4)) == ""
    assert_replay_equals_trace(_config("llama"), w, "grad_accum", Parallel(strategy="ddp", gpus=4))


@SLOW
def test_one_ddp_derivation_prices_grad_accum_exactly(tmp_path, monkeypatch):
    monkeypatch.setenv("WILLITFIT_CACHE", str(tmp_path))
    monkeypatch.setattr(store, "SHIPPED_DIR", tmp_path / "none")
    clear_caches(tables=False)
    cfg, ddp = _config("llama"), Parallel(strategy="ddp", gpus=8)
    assert_equals_trace(cfg, "tiny", Workload(recipe="amp"), [(3, 45)], ddp)
    clear_caches(tables=False)
    four, = assert_equals_trace(cfg, "tiny", Workload(recipe="amp", grad_accum=4), [(5, 91)], ddp, derive=False)
    assert "tracer.replay" in four.profile.get("replayed", "")
