"""FSDP2's units as torchtitan groups them (`--fsdp-wrap torchtitan`, estimator.spec.FSDP_WRAPS; docs/parallel.md):
the embedding a unit, each block, the final norm with the head a unit kept gathered after forward, then the root,
against HF Accelerate's transformer wrap ("layers": each decoder layer, then the root, which holds the embedding, the
final norm and the head for the whole step).

    python -m pytest tests/test_fsdp_wrap.py -q
    WILLITFIT_SLOW=1 python -m pytest tests/test_fsdp_wrap.py -q     # derivations against full-depth traces
"""
from __future__ import annotations

import pytest

from estimator.spec import Parallel, Workload
from traced import assert_equals_trace, tiny

SLOW = pytest.mark.slow


def _units(cfg: dict, wrap: str) -> set[frozenset[str]]:
    """The parameter names of each FSDP2 unit the tracer builds (a unit over several modules, as torchtitan's norm
    and head, is registered on each of them: counted once)."""
    from torch.distributed.fsdp import FSDPModule

    from tracer import fsdp

    with fsdp.fsdp_model(cfg, Workload(), Parallel(strategy="fsdp", gpus=2, fsdp_wrap=wrap)) as (model, _):
        names = {id(p): n for n, p in model.named_parameters()}
        groups = {id(g): g for m in model.modules() if isinstance(m, FSDPModule)
                  for g in [m._get_fsdp_state()._fsdp_param_group] if g is not None}
        return {frozenset(names[id(fp.sharded_param)] for fp in g.fsdp_params) for g in groups.values()}


def test_torchtitan_wraps_the_embedding_and_the_head_apart():
    cfg = dict(tiny("llama"), num_hidden_layers=2)
    emb, head, norm = "model.embed_tokens.weight", "lm_head.weight", "model.norm.weight"
    layers, titan = _units(cfg, "layers"), _units(cfg, "torchtitan")
    assert len(layers) == 3 and frozenset({emb, head, norm}) in layers     # 2 layers; the root holds the rest
    assert len(titan) == 4 and {frozenset({emb}), frozenset({head, norm})} < titan   # the root holds nothing
    tied = _units(dict(cfg, tie_word_embeddings=True), "torchtitan")    # one weight, one unit (named once)
    assert len(tied) == 3 and frozenset({emb, norm}) in tied


def test_a_wrap_needs_an_fsdp_strategy_and_no_pipeline():
    with pytest.raises(ValueError, match="^fsdp_wrap: groups FSDP2's units; needs strategy"):
        Parallel(strategy="ddp", gpus=4, fsdp_wrap="torchtitan")
    with pytest.raises(ValueError, match="^fsdp_wrap: torchtitan's units are traced without pipeline"):
        Parallel(strategy="fsdp", gpus=8, pp=2, fsdp_wrap="torchtitan")
    with pytest.raises(ValueError, match="^fsdp_wrap: .auto. is not allowed; choose one of layers, torchtitan"):
        Parallel(strategy="fsdp", gpus=8, fsdp_wrap="auto")


def test_the_wrap_is_part_of_the_profile_key():
    from estimator import store

    w = Workload()
    assert store.parallel_class(Parallel(strategy="fsdp", gpus=8)) == {"strategy": "fsdp"}   # shipped keys hold
    assert store.parallel_class(Parallel(strategy="fsdp", gpus=8, fsdp_wrap="torchtitan")) == \
        {"strategy": "fsdp", "wrap": "torchtitan"}
    assert store.profile_key(w, Parallel(strategy="fsdp", gpus=2)) != \
        store.profile_key(w, Parallel(strategy="fsdp", gpus=2, fsdp_wrap="torchtitan"))


@SLOW
@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
def test_a_torchtitan_wrapped_rank_equals_full_depth_traces(tie, tmp_path, monkeypatch):
    """Derived on the reduced models (2 ranks, n fit in 1/n), evaluated at 4 ranks and sizes no fit used, against
    traces of the whole 5-layer model: every stage to the byte, training and with LoRA."""
    from estimator import store
    from estimator.estimate import clear_caches

    monkeypatch.setenv("WILLITFIT_CACHE", str(tmp_path))
    monkeypatch.setattr(store, "SHIPPED_DIR", tmp_path / "none")
    clear_caches(tables=False)
    cfg = dict(tiny("llama"), num_hidden_layers=5, tie_word_embeddings=tie)
    par = Parallel(strategy="fsdp", gpus=4, fsdp_wrap="torchtitan")
    assert_equals_trace(cfg, "tiny", Workload(recipe="pure"), [(3, 45), (5, 91)], par)
    if not tie:
        assert_equals_trace(cfg, "tiny", Workload(recipe="pure", method="lora"), [(2, 77)], par)


def test_torchtitan_units_are_for_text_models():
    from estimator.estimate import Options, estimate
    from strategies import model

    for name, w in (("dinov2-giant", Workload(image_size=224)), ("whisper-large-v3", Workload(seq=448)),
                    ("llava-1.5-7b", Workload(images=1))):
        with pytest.raises(ValueError, match="^fsdp_wrap: torchtitan's units .* are traced for text models"):
            estimate(model(name), w, Parallel(strategy="fsdp", gpus=2, fsdp_wrap="torchtitan"), Options(derive=False))


@SLOW
@pytest.mark.parametrize("ckpt, wrap", [("none", "layers"), ("full", "layers"), ("full", "torchtitan")])
def test_a_compiled_fsdp_rank_equals_full_depth_traces(ckpt, wrap, tmp_path, monkeypatch):
    """torch.compile under FSDP2 as torchtitan applies it (each block and the loss apart, the checkpoint around the
    compiled block: tracer.compiled.compile_units): derived on the reduced models, evaluated at 4 ranks and sizes no
    fit used, against traces of the whole 5-layer model, every stage to the byte."""
    from estimator import store
    from estimator.estimate import clear_caches

    monkeypatch.setenv("WILLITFIT_CACHE", str(tmp_path))
    monkeypatch.setattr(store, "SHIPPED_DIR", tmp_path / "none")
    clear_caches(tables=False)
    cfg = dict(tiny("llama"), num_hidden_layers=5)
    ests = assert_equals_trace(cfg, "tiny", Workload(recipe="pure", compile=True, checkpointing=ckpt),
                               [(2, 100), (8, 1000)], Parallel(strategy="fsdp", gpus=4, fsdp_wrap=wrap))
    assert [n for n in ests[0].notes if n.startswith("compile")][0].startswith("compile: traced as")   # not eager
