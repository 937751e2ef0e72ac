"""tracer.recompute: a step under full activation checkpointing replayed from the traced step without it, against its
own trace, tick by tick, and a profile derived that way against full-depth traces."""
from __future__ import annotations

import os
from dataclasses import replace

import pytest

from estimator.spec import Parallel, Workload

pytest.importorskip("torch")

from estimator import store  # noqa: E402
from estimator.estimate import clear_caches  # noqa: E402
from tracer import derive, recompute, replay  # noqa: E402
from tracer.ticks import trace_ticks  # noqa: E402
from traced import assert_equals_trace, assert_replay_equals_trace, tiny as _config  # noqa: E402

pytestmark = pytest.mark.replays   # their derivations replay, as outside the tests (tests/conftest.py)

SLOW = pytest.mark.skipif(not os.environ.get("WILLITFIT_SLOW"), reason="slow tier: WILLITFIT_SLOW=1")


# what the replay must get right: a fused loss that makes gradients in forward and hands them on in backward, tied
# weights under amp (autocast's cast cache), routed experts whose router saves tensors no node reads (a topk freed in
# forward); in the slow tier more families, an encoder, hybrids with state-space and linear-attention layers
CASES = [
    ("llama", dict(loss="fused-linear")),
    ("gpt2", dict(recipe="amp")),
    ("dsv3", {}),
]
SLOW_CASES = [
    ("llama", {}),
    ("llama", dict(loss="chunked", loss_chunks=4)),
    ("llama", dict(recipe="mixed", optimizer_impl="forloop")),
    ("mixtral", {}),
    ("bert", {}),
    ("neox", dict(optimizer="sgd", optimizer_impl="fused")),
    ("gemma2", dict(attention="eager")),
    ("opt", dict(recipe="amp")),
    ("falcon", {}),
    ("qwenmoe", {}),
    ("llama4", {}),
    ("jamba", {}),
    ("qwen3_next", {}),
    ("qwen3_5_text", {}),
    ("kimi_linear", {}),
    ("bamba", {}),
    ("nemotron_h", {}),
    ("falcon_h1", {}),
    ("vit", {}),
]


def _check(family: str, knobs: dict, b: int, s: int, layers=(0, 1, 2), parallel: Parallel = Parallel()) -> None:
    w = Workload(batch=b, seq=s, **knobs)
    assert recompute.replayable(w, parallel) == ""
    # (watching what autograd saves, and the probe forward after the step, change nothing the fit reads)
    assert_replay_equals_trace(_config(family), w, "checkpointing", parallel, layers)


@pytest.mark.parametrize("family, knobs", CASES, ids=[c[0] for c in CASES])
def test_a_replayed_step_under_full_checkpointing_has_the_traced_ticks(family, knobs):
    _check(family, knobs, 2, 37)


@SLOW
@pytest.mark.parametrize("family, knobs", SLOW_CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(SLOW_CASES)])
def test_a_replayed_step_under_full_checkpointing_has_the_traced_ticks_everywhere(family, knobs):
    for b, s in ((1, 64), (3, 29)):
        _check(family, knobs, b, s)


def test_ddp_and_an_optimizer_in_backward_are_replayed():
    """DDP's gradient hooks and an optimizer stepped in backward run alike with and without checkpoints."""
    _check("llama", {}, 2, 37, parallel=Parallel(strategy="ddp", gpus=2))
    _check("gpt2", dict(optimizer_in_backward=True), 2, 37)


@SLOW
def test_ddp_and_an_optimizer_in_backward_are_replayed_on_routed_experts_and_hybrids():
    for family in ("mixtral", "dsv3", "qwen3_next"):
        _check(family, {}, 3, 29, parallel=Parallel(strategy="ddp", gpus=2))
        _check(family, dict(optimizer_in_backward=True), 3, 29)


@SLOW
def test_an_encoder_decoder_step_is_replayed_across_both_stacks():
    _check("whisper", {}, 2, 37, layers=(0, 1, 4, 5))


def test_what_is_not_replayed_says_why():
    assert "lora" in recompute.replayable(Workload(method="lora"), Parallel())
    assert "fsdp" in recompute.replayable(Workload(), Parallel(strategy="fsdp", gpus=2))
    assert recompute.replayable(Workload(), Parallel(strategy="ddp", gpus=2)) == ""
    assert "checkpointing" in recompute.replayable(Workload(checkpointing="selective"), Parallel())
    assert "loop" in recompute.replayable(Workload(loop="keep-output"), Parallel())
    assert "compile" in recompute.replayable(Workload(compile=True), Parallel())
    assert "inference" in recompute.replayable(Workload(mode="infer"), Parallel())
    assert recompute.replayable(Workload(), Parallel()) == ""


def test_nested_checkpointed_blocks_are_refused_not_guessed():
    """Zamba2's hybrid layers each hold a checkpointed shared transformer block: checkpoints would nest, which the
    replay does not read; the traced ticks are the ones a run without the probe has."""
    cfg = _config("zamba2")
    w = Workload(batch=2, seq=37)
    both = trace_ticks(cfg, w, Parallel(), None, replays=("checkpointing",))
    assert both.replayed["checkpointing"].refused.startswith("recompute: a layer holds a checkpointed block")
    assert replay.keyed(both) == replay.keyed(trace_ticks(cfg, w, Parallel(), None))


def test_one_derivation_prices_full_checkpointing_exactly(tmp_path, monkeypatch):
    """A derivation without checkpointing leaves the class of full checkpointing beside it: a later estimate under
    full checkpointing derives nothing (derive=False would raise) and equals a full-depth trace, at a size no fit used;
    one asked for full checkpointing is replayed the same way."""
    monkeypatch.setenv("WILLITFIT_CACHE", str(tmp_path))
    monkeypatch.setattr(store, "SHIPPED_DIR", tmp_path / "none")
    clear_caches(tables=False)   # the estimator's class memo too (estimate._CLASSES)
    cfg = _config("llama")
    none, = assert_equals_trace(cfg, "tiny", Workload(), [(3, 45)])
    assert "replay_refused" not in none.profile, none.profile["replay_refused"]   # each replay met its traced check
    clear_caches(tables=False)
    full, = assert_equals_trace(cfg, "tiny", Workload(checkpointing="full"), [(5, 91)], derive=False)
    assert "tracer.recompute" in full.profile.get("replayed", "") and "replayed" not in none.profile


@SLOW
@pytest.mark.parametrize("w, parallel", [(Workload(batch=3, seq=45), Parallel(strategy="ddp", gpus=4)),
                                         (Workload(batch=2, seq=30, optimizer_in_backward=True), Parallel())],
                         ids=["ddp", "optimizer-in-backward"])
def test_a_replayed_derivation_under_ddp_or_an_optimizer_in_backward_is_exact(w, parallel, tmp_path, monkeypatch):
    monkeypatch.setenv("WILLITFIT_CACHE", str(tmp_path))
    monkeypatch.setattr(store, "SHIPPED_DIR", tmp_path / "none")
    clear_caches(tables=False)
    cfg = _config("llama")
    assert_equals_trace(cfg, "tiny", w, [(w.batch, w.seq)], parallel)
    est, = assert_equals_trace(cfg, "tiny", replace(w, checkpointing="full"), [(5, 91)], parallel, derive=False)
    assert "tracer.recompute" in est.profile.get("replayed", "")


def test_a_replay_that_misses_its_traced_check_is_not_given(monkeypatch):
    """Each derivation checks the replay against one traced step under full checkpointing, key by key: a wrong replay
    (here: the step without checkpointing as it was traced) gives no profile of that class, and one asked for full
    checkpointing is then traced after all."""
    real = recompute.checkpointed
    monkeypatch.setattr(recompute, "checkpointed", lambda tl, saves, unit="layers": recompute.traced_part(tl)
                        if unit == "layers" else real(tl, saves, unit))
    asked, kept, *others = derive.derive_profiles(_config("llama"), Workload(checkpointing="full"))
    assert asked.workload_class["checkpointing"] == "full" and "replayed" not in asked.provenance
    assert kept.workload_class["checkpointing"] == "none"
    assert kept.provenance["replay_refused"]["checkpointing"].startswith("replay: at (b, s, n, r) = (4, ")
    assert sorted((p.workload_class["grad_accum"], p.workload_class["checkpointing"]) for p in others) == \
        [(1, "selective"), (2, "none")]
