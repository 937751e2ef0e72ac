"""tracer.selective: a step under selective activation checkpointing (the attention core) replayed from the traced step
without it, against its own trace, tick by tick, and a profile derived that way against full-depth traces."""
from __future__ import annotations

import os
from dataclasses import replace

import pytest

from estimator.spec import Parallel, Workload

pytest.importorskip("torch")

from estimator import store  # noqa: E402
from estimator.estimate import clear_caches  # noqa: E402
from tracer import derive, recompute, replay, selective  # noqa: E402
from tracer.ticks import trace_ticks  # noqa: E402
from traced import assert_equals_trace, assert_replay_equals_trace, tiny as _config  # noqa: E402

pytestmark = pytest.mark.replays   # their derivations replay, as outside the tests (tests/conftest.py)

SLOW = pytest.mark.skipif(not os.environ.get("WILLITFIT_SLOW"), reason="slow tier: WILLITFIT_SLOW=1")

# what the replay must get right: the attention call's output outliving it (o_proj saves it; the recompute makes a
# copy), LoRA (selective checkpointing changes no embedding), eager attention with a sliding window and soft-capping
CASES = [
    ("llama", dict(method="lora")),
    ("gemma2", dict(attention="eager")),
    ("gpt2", dict(recipe="amp")),
]
SLOW_CASES = [
    ("llama", {}),
    ("llama", dict(loss="fused-linear")),
    ("dsv3", {}),
    ("mixtral", {}),
    ("bert", {}),
    ("qwen3_next", {}),
    ("jamba", {}),
    ("phi3", dict(method="lora", lora_targets=("qkv_proj",))),
    ("llama4", {}),
    ("opt", dict(recipe="amp")),
    ("neox", dict(optimizer="sgd", optimizer_impl="fused")),
]


def _check(family: str, knobs: dict, b: int, s: int, layers=(0, 1, 2), parallel: Parallel = Parallel()) -> None:
    w = Workload(batch=b, seq=s, **knobs)
    assert selective.replayable(w, parallel) == ""
    # (watching the attention calls, and the probe forward after the step, change nothing the fit reads)
    assert_replay_equals_trace(_config(family), w, "selective", parallel, layers)


@pytest.mark.parametrize("family, knobs", CASES, ids=[c[0] for c in CASES])
def test_a_replayed_step_under_selective_checkpointing_has_the_traced_ticks(family, knobs):
    _check(family, knobs, 2, 37)


@SLOW
@pytest.mark.parametrize("family, knobs", SLOW_CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(SLOW_CASES)])
def test_a_replayed_step_under_selective_checkpointing_has_the_traced_ticks_everywhere(family, knobs):
    for b, s in ((1, 64), (3, 29)):
        _check(family, knobs, b, s)


def test_fsdp2_is_replayed():
    """FSDP2's unshard and reshard around each layer run alike with and without a checkpointed attention core; after
    a step its unsharded storages sit at 0 bytes, whose closing the probe must not read as frees."""
    _check("llama", dict(method="lora"), 2, 37, parallel=Parallel(strategy="fsdp", gpus=2))


@SLOW
def test_ddp_and_an_optimizer_in_backward_are_replayed():
    _check("llama", {}, 2, 37, parallel=Parallel(strategy="ddp", gpus=2))
    _check("gpt2", dict(optimizer_in_backward=True), 2, 37)


def test_both_checkpointing_replays_come_from_one_trace():
    """Full and selective checkpointing from the same traced step (two probes after it), each equal to its trace."""
    cfg = _config("phi3")   # a sliding window: the mask the attention call is handed is one of its arguments
    w = Workload(batch=2, seq=37)
    both = trace_ticks(cfg, w, Parallel(), [0, 1, 2], replays=("checkpointing", "selective", "grad_accum"))
    for kind, ckpt in (("checkpointing", "full"), ("selective", "selective")):
        traced = trace_ticks(cfg, replace(w, checkpointing=ckpt), Parallel(), [0, 1, 2])
        assert replay.keyed(both.replayed[kind]) == replay.keyed(traced), kind
    assert replay.keyed(both.replayed["grad_accum"]) == replay.keyed(
        trace_ticks(cfg, replace(w, grad_accum=2), Parallel(), [0, 1, 2]))


def test_what_is_not_replayed_says_why():
    assert selective.replayable(Workload(method="lora"), Parallel()) == ""
    assert selective.replayable(Workload(attention="eager"), Parallel(strategy="ddp", gpus=2)) == ""
    assert selective.replayable(Workload(), Parallel(strategy="fsdp", gpus=2)) == ""
    assert "tp" in selective.replayable(Workload(), Parallel(strategy="fsdp", gpus=4, tp=2))
    assert "strategy pp" in selective.replayable(Workload(), Parallel(strategy="pp", gpus=2, pp=2))
    assert "checkpointing" in selective.replayable(Workload(checkpointing="full"), Parallel())
    assert "flash" in selective.replayable(Workload(attention="flash"), Parallel())
    assert "qlora" in selective.replayable(Workload(method="qlora"), Parallel())
    assert "loop" in selective.replayable(Workload(loop="keep-output"), Parallel())
    assert "inference" in selective.replayable(Workload(mode="infer"), Parallel())
    assert "grad_accum" in selective.replayable(Workload(grad_accum=4), Parallel())


def test_a_model_without_the_attention_interface_is_refused_not_guessed():
    """A state-space model calls no attention, Falcon's picks its attention from a table of its own: the replay says
    so and the traced ticks are untouched."""
    for family, attention in (("mamba", "eager"), ("falcon", "sdpa")):
        cfg = _config(family)
        w = Workload(batch=2, seq=37, attention=attention)
        both = trace_ticks(cfg, w, Parallel(), [0, 1], replays=("selective",))
        assert both.replayed["selective"].refused.startswith("selective: the forward calls no attention")
        assert replay.keyed(both) == replay.keyed(trace_ticks(cfg, w, Parallel(), [0, 1]))


def test_one_lora_derivation_prices_selective_checkpointing_exactly(tmp_path, monkeypatch):
    """A LoRA derivation without checkpointing leaves the class of selective checkpointing beside it (not full: LoRA
    under full checkpointing is a different backward): a later estimate under selective checkpointing derives nothing
    (derive=False would raise) and equals a full-depth trace at a size no fit used; one asked for selective
    checkpointing is replayed the same way."""
    monkeypatch.setenv("WILLITFIT_CACHE", str(tmp_path))
    monkeypatch.setattr(store, "SHIPPED_DIR", tmp_path / "none")
    clear_caches(tables=False)   # the estimator's class memo too (estimate._CLASSES)
    cfg = _config("llama")
    w = Workload(method="lora", lora_rank=8)
    none, = assert_equals_trace(cfg, "tiny", w, [(3, 45)])
    clear_caches(tables=False)
    sel, = assert_equals_trace(cfg, "tiny", replace(w, checkpointing="selective"), [(5, 91)], derive=False)
    assert "tracer.selective" in sel.profile.get("replayed", "") and "replayed" not in none.profile
    assert derive.replay_plan(replace(w, checkpointing="selective"), Parallel())[2] == "selective"


@SLOW
@pytest.mark.parametrize("parallel", [Parallel(strategy="fsdp", gpus=4), Parallel(strategy="zero3", gpus=8)],
                         ids=["fsdp", "zero3"])
def test_a_replayed_derivation_under_fsdp_is_exact_per_rank(parallel, tmp_path, monkeypatch):
    monkeypatch.setenv("WILLITFIT_CACHE", str(tmp_path))
    monkeypatch.setattr(store, "SHIPPED_DIR", tmp_path / "none")
    clear_caches(tables=False)
    cfg = _config("llama")
    ests = assert_equals_trace(cfg, "tiny", Workload(checkpointing="selective"), [(3, 45), (5, 91)], parallel)
    assert all("tracer.selective" in est.profile.get("replayed", "") for est in ests)


def test_a_replay_that_misses_its_traced_check_is_not_given(monkeypatch):
    """A wrong replay (here: the step without checkpointing as it was traced) gives no profile of that class, and one
    asked for selective checkpointing is then traced after all."""
    real = recompute.checkpointed
    monkeypatch.setattr(recompute, "checkpointed", lambda tl, saves, unit="layers": recompute.traced_part(tl)
                        if unit == "attention" else real(tl, saves, unit))
    asked, kept, *others = derive.derive_profiles(_config("llama"), Workload(checkpointing="selective"))
    assert asked.workload_class["checkpointing"] == "selective" and "replayed" not in asked.provenance
    assert kept.workload_class["checkpointing"] == "none"
    assert kept.provenance["replay_refused"]["selective"].startswith("replay: at (b, s, n, r) = (4, ")
    assert sorted((p.workload_class["grad_accum"], p.workload_class["checkpointing"]) for p in others) == \
        [(1, "full"), (2, "none")]
