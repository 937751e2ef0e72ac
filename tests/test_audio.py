"""Audio-language models priced whole with their audio (tracer/audio.py, `--audios N`).

Tiny Qwen2-Audio, Audio Flamingo 3 and GLM-ASR configs (tests/data/tiny: a 5-layer Qwen2 or Llama of hidden 128 with a
3-layer audio encoder of hidden 64 on 16 mel bins; Qwen2-Audio's and AF3's Whisper-style encoders take a 128-frame
window, 2 x max_source_positions, GLM-ASR's the 3000 frames of Whisper's 30-s window) are built whole; the tokens a
clip becomes are what the model's own forward scatters (checked by running the forward with that many audio ids, its
own count check on, and with one fewer); the estimate with audio, at sizes the fit never used, equals a full-depth
trace stage by stage, to the byte; audio for a model that takes none, and a sequence too short for the clips' tokens,
are refused in one line.

    python -m pytest tests/test_audio.py -q                 # WILLITFIT_SLOW=1 adds LoRA, inference, checkpointing
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from estimator.spec import Parallel, Workload
from traced import assert_equals_trace

TINY = Path(__file__).parent / "data" / "tiny"
ROOT = Path(__file__).resolve().parents[1]
SLOW = pytest.mark.skipif(not os.environ.get("WILLITFIT_SLOW"), reason="slow tier: WILLITFIT_SLOW=1")
# tokens per clip: Qwen2-Audio's and AF3's Whisper encoder halves 128 frames by its stride-2 conv and again by its
# pooling (32); GLM-ASR's halves 3000 by its conv (1500) and merges 4 frames into a token (375)
TOKENS = {"qwen2_audio": 32, "audioflamingo3": 32, "glmasr": 375}


def _config(name: str) -> dict:
    return json.loads((TINY / f"t-{name}.json").read_text())


def _model(name: str):
    from estimator.model import from_hf_config

    return from_hf_config(_config(name), f"t-{name}")


@pytest.mark.parametrize("name", sorted(TOKENS))
def test_built_whole_with_its_clips_tokens(name):
    import torch
    import transformers
    from transformers import AutoConfig

    from tracer.audio import audio_class

    m = _model(name)
    cfg = dict(_config(name))
    hf = AutoConfig.for_model(cfg.pop("model_type"), **cfg)
    with torch.device("meta"):
        whole = audio_class(name).from_config(hf)
    assert m.params == sum(p.numel() for p in whole.parameters())
    assert m.inventory.built_as == type(whole).__name__ and hasattr(transformers, type(whole).__name__)
    a = m.inventory.extra["audio"]
    assert (a["audio_tokens"], a["audio_token_id"], a["mels"], a["unreached"]) == (TOKENS[name], 511, 16, [])
    assert m.layers == 5   # the language model's layers; the audio encoder is traced whole


@pytest.mark.parametrize("name", ["qwen2_audio", "glmasr"])
def test_the_tokens_are_what_the_models_own_forward_counts(name):
    # the model's own check (the ids hold one audio token per feature row) runs on the host with the ids' values: it
    # passes with the counted tokens and fails with one fewer
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    from estimator.spec import Workload as W
    from tracer import host_values
    from tracer.audio import audio_inputs, audio_tokens
    from tracer.runner import build_model

    cfg = _config(name)
    with FakeTensorMode(allow_non_fake_inputs=True):
        model = build_model(cfg, W(audios=1), "cpu", meta_then_empty=True)
        tokens = audio_tokens(model)
        assert tokens == TOKENS[name]
        with host_values.host_values(), torch.no_grad():
            inputs = audio_inputs(model, W(audios=1, batch=2, seq=tokens + 9), "cpu", tokens)
            model(**inputs)
            short = audio_inputs(model, W(audios=1, batch=2, seq=tokens + 9), "cpu", tokens - 1)
            with pytest.raises((ValueError, RuntimeError), match="(?i)audio"):
                model(**short)


def test_glmasr_estimate_with_audio_equals_a_full_depth_trace(capsys):
    # one 30-s clip (375 tokens) at sizes the fit never used
    assert_equals_trace(_config("glmasr"), "t-glmasr", Workload(audios=1), [(3, 787)])
    # the longest seq that fits starts past the clip's tokens (a shorter one cannot hold them)
    from estimator import search
    from estimator.estimate import estimate

    m, w = _model("glmasr"), Workload(audios=1, batch=3)
    at = {s: estimate(m, Workload(audios=1, batch=3, seq=s), Parallel()).total_bytes for s in (376, 400)}
    assert search.max_seq(m, w, Parallel(), at[400], limit=2048) >= 400
    assert search.max_seq(m, w, Parallel(), at[376] - 1, limit=2048) == 0
    # the CLI's text view names the clips (the profile derived above, in this process's cache)
    from estimator.cli import main

    assert main(["--model", str(TINY / "t-glmasr.json"), "--audios", "1", "--batch", "3", "--seq", "787"]) == 0
    assert "batch 3 x seq 787 with 1 audio clip of 30 s (375 audio tokens) per sample" in capsys.readouterr().out


@SLOW
@pytest.mark.parametrize("name, workload, sizes", [
    ("qwen2_audio", Workload(audios=1), [(3, 101)]),
    ("qwen2_audio", Workload(audios=2), [(2, 300), (5, 1000)]),
    ("qwen2_audio", Workload(audios=1, method="lora", lora_rank=8), [(4, 700)]),
    ("qwen2_audio", Workload(audios=1, mode="infer", gen_tokens=16), [(3, 500)]),
    ("audioflamingo3", Workload(audios=1), [(3, 101)]),
    ("audioflamingo3", Workload(audios=1, checkpointing="full"), [(4, 900)]),
    ("glmasr", Workload(audios=1, method="lora", lora_rank=4), [(2, 1200)]),
    ("glmasr", Workload(audios=0), [(2, 1200)]),
    ("voxtral", Workload(audios=2), [(3, 300)]),   # its projector merges frames by intermediate / hidden size (2 here)
])
def test_estimate_with_audio_equals_a_full_depth_trace(name, workload, sizes):
    assert_equals_trace(_config(name), f"t-{name}", workload, sizes)


def test_audio_is_refused_in_one_line_where_it_cannot_run():
    from estimator.estimate import estimate
    from estimator.model import from_hf_config

    m = _model("glmasr")
    with pytest.raises(ValueError, match=r"^seq: 300 tokens cannot hold 1 audio clip\(s\) of 375 tokens each \(30 s\); "
                                         r"use a seq over 375$"):
        estimate(m, Workload(audios=1, seq=300), Parallel())
    text = from_hf_config(json.loads((TINY / "t-llama.json").read_text()), "t-llama")
    with pytest.raises(ValueError, match=r"^audios: t-llama \(llama\) takes no audio here; the audio-language models"):
        estimate(text, Workload(audios=1), Parallel())
    # a text-only step of an audio-language model says how to price its audio
    from estimator.vision import scope_notes

    assert "--audios N prices N 30-s audio clips" in scope_notes(m, Workload())[0]
    assert scope_notes(m, Workload(audios=1)) == ()


def test_a_config_whose_audio_path_fails_is_priced_text_only():
    # a config that states no audio token id (transformers' own default Voxtral config): its forward cannot find the
    # clips' places, so it is refused with audio and priced without it
    from estimator.estimate import estimate
    from estimator.model import from_hf_config

    m = from_hf_config({"model_type": "voxtral"}, "voxtral-default")
    assert "audio" not in m.inventory.extra and m.inventory.extra["audio_refused"].startswith(
        "model_type: 'voxtral' states no audio token id")
    with pytest.raises(ValueError, match=r"^audios: voxtral-default's audio path fails on its own config"):
        estimate(m, Workload(audios=1, seq=500))


def test_a_cached_inventory_of_another_audio_route_is_read_again(monkeypatch, tmp_path):
    # a refusal cached by an older version of the audio path must not outlive its fix: the inventory says which
    # version read it (families.AUDIO_ROUTE), and another one is read again from a meta-device build
    from estimator import store

    monkeypatch.setenv("WILLITFIT_CACHE", str(tmp_path))
    store.clear_memo()
    cfg = _config("glmasr")
    assert store.inventory(cfg, "t-glmasr").extra["audio_route"]
    path = tmp_path / store.config_hash(cfg)[:16] / "inventory.json"
    data = json.loads(path.read_text())
    data.pop("audio")
    data.update(audio_refused="an older version's refusal", audio_route="0")
    path.write_text(json.dumps(data))
    store.clear_memo()
    again = store.inventory(cfg, "t-glmasr")
    assert again.extra["audio"]["audio_tokens"] == 375 and "audio_refused" not in again.extra
    store.clear_memo()


def test_cli_names_the_audio_and_refuses_a_short_seq():
    cfg = str(TINY / "t-qwen2_audio.json")
    _model("qwen2_audio")   # its inventory in this session's cache (the CLI inherits WILLITFIT_CACHE)
    out = subprocess.run([sys.executable, "-m", "estimator", "--model", cfg, "--audios", "4", "--seq", "60",
                          "--no-derive"], capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert out.returncode == 2
    assert out.stderr.strip().splitlines()[-1] == ("python -m estimator: error: seq: 60 tokens cannot hold 4 audio "
                                                   "clip(s) of 32 tokens each (1.28 s); use a seq over 128")
    assert "--audios N" in subprocess.run([sys.executable, "-m", "estimator", "--help"], capture_output=True, text=True,
                                          cwd=ROOT, timeout=600).stdout

