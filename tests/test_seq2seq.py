"""Encoder-decoder models priced whole (tracer/seq2seq.py, estimator/seq2seq.py, `--target-seq N`).

Tiny T5, BART and Whisper configs (tests/data/tiny/t-t5.json, t-bart.json, t-whisper.json: 4 encoder and 4 decoder
layers of width 64) are built whole; both layer stacks are cut at reduced depth and extended on their own; the
estimate at sizes the fit never used equals a full-depth trace of the same step, stage by stage, to the byte.

    python -m pytest tests/test_seq2seq.py -q        # WILLITFIT_SLOW=1 adds training of all three, LoRA, checkpointing
"""
from __future__ import annotations

import json
import os
from dataclasses import replace
from pathlib import Path

import pytest

from estimator.spec import Parallel, Workload
from traced import assert_equals_trace

TINY = Path(__file__).parent / "data" / "tiny"
SLOW = pytest.mark.skipif(not os.environ.get("WILLITFIT_SLOW"), reason="slow tier: WILLITFIT_SLOW=1")


def _config(name: str) -> dict:
    return json.loads((TINY / f"t-{name}.json").read_text())


def _model(name: str):
    from estimator.model import from_hf_config

    return from_hf_config(_config(name), f"t-{name}")


@pytest.mark.parametrize("name, cls", [("t5", "T5ForConditionalGeneration"), ("bart", "BartForConditionalGeneration"),
                                       ("whisper", "WhisperForConditionalGeneration")])
def test_the_whole_encoder_decoder_model_is_counted(name, cls):
    import torch
    import transformers

    m = _model(name)
    assert m.inventory.built_as == cls
    auto = transformers.AutoModelForSpeechSeq2Seq if name == "whisper" else transformers.AutoModelForSeq2SeqLM
    with torch.device("meta"):
        built = auto.from_config(transformers.AutoConfig.for_model(**_config(name)))
    assert m.params == sum(p.numel() for p in built.parameters())
    info = m.inventory.extra["seq2seq"]
    assert (info["encoder_layers"], info["decoder_layers"]) == (4, 4) and m.layers == 8
    assert info["kind"] == ("speech" if name == "whisper" else "text")


def test_reduced_depth_cuts_each_stack_on_its_own():
    from tracer import runner
    from tracer.depth import layer_infos, layer_stacks

    model = runner.build_model(_config("bart"), Workload(), device="meta", layers=[0, 1, 3, 4, 5, 5, 7])
    enc, dec = (layers for _, _, layers in layer_stacks(model))
    assert (len(enc), len(dec)) == (3, 4)
    assert (model.config.encoder_layers, model.config.decoder_layers) == (3, 4)
    assert [layer.self_attn.layer_idx for layer in dec] == [0, 1, 2, 3]   # the cache indexes the decoder's own
    sigs = [li.signature for li in layer_infos(model)]
    assert sigs[0] == sigs[2] != sigs[3]   # an encoder layer is never a decoder layer's type
    with pytest.raises(ValueError, match="interleaves"):
        runner.build_model(_config("bart"), Workload(), device="meta", layers=[4, 0, 7])


def test_the_target_length_is_part_of_the_class_and_zero_keeps_every_old_key():
    from estimator import store

    base = Workload(batch=2, seq=512)
    assert "target_seq" not in store.workload_class(base)
    assert store.profile_key(base, Parallel()) != store.profile_key(replace(base, target_seq=128), Parallel())
    assert store.workload_class(replace(base, target_seq=128))["target_seq"] == 128
    with pytest.raises(ValueError, match="^target_seq: .*mode='train'"):
        Workload(mode="infer", target_seq=16)


@pytest.mark.parametrize("name, workload, parallel, match", [
    ("llama", Workload(target_seq=64, seq=128), Parallel(), "^target_seq: .* no encoder-decoder model"),
    ("whisper", Workload(target_seq=64, seq=128), Parallel(), "^target_seq: .*audio window"),
    ("whisper", Workload(seq=449), Parallel(), "^seq: .*448 positions"),
    ("whisper", Workload(mode="infer", seq=440, gen_tokens=9), Parallel(), "^seq: .*448 positions"),
    ("bart", Workload(seq=64, target_seq=1025), Parallel(), "^target_seq: .*1,024 positions"),
    ("bart", Workload(seq=64, loss="chunked"), Parallel(), "^loss: not priced for encoder-decoder"),
    ("t5", Workload(seq=64), Parallel(strategy="tp", gpus=2), "^strategy: tp is not priced"),
    ("t5", Workload(seq=64), Parallel(strategy="fsdp", gpus=4, tp=2), "^strategy: tensor, pipeline and context"),
])
def test_what_is_not_priced_is_refused_in_one_line_before_any_trace(name, workload, parallel, match):
    from estimator.estimate import estimate

    with pytest.raises(ValueError, match=match) as e:
        estimate(_model(name), workload, parallel)
    assert "\n" not in str(e.value)


def _check(name: str, workload: Workload, sizes, parallel: Parallel = Parallel()) -> None:
    assert_equals_trace(_config(name), f"t-{name}", workload, sizes, parallel)


def test_speech2text_equals_full_depth_traces():
    """Speech2Text: (frames, bins) features of a 30-s window with their mask, its conv subsampler, eager attention (its
    only one), at a size no fit used."""
    m = _model("speech_to_text")
    info = m.inventory.extra["seq2seq"]
    assert (info["kind"], info["mel_bins"], info["frames"], m.layers) == ("speech", 16, 3000, 8)
    assert m.inventory.built_as == "Speech2TextForConditionalGeneration"
    _check("speech_to_text", Workload(attention="eager"), [(5, 77)])   # LoRA and inference: the slow tier, below


def test_moonshine_equals_full_depth_traces():
    """Moonshine: the raw 16 kHz waveform of a 30-s clip (480,000 samples) through its conv stack; its config sets no
    pad token, which its training step's label shift reads (its start token stands in): training (full and LoRA) and
    inference at sizes no fit used."""
    m = _model("moonshine")
    info = m.inventory.extra["seq2seq"]
    assert (info["kind"], info["frames"], info["seconds"], info["samples"]) == ("speech", 480_000, 30, True)
    _check("moonshine", Workload(), [(5, 77)])   # LoRA and inference: the slow tier, below
    from estimator.seq2seq import words

    assert words(m, Workload(seq=77)) == "encoder 480,000 audio samples (30 s of audio), decoder 77 transcript tokens"


def test_canary_runs_every_layer_and_reads_its_decoders_positions():
    """Canary: a Parakeet (FastConformer) encoder whose LayerDrop (0.1, nested in encoder_config) is priced with every
    layer run (the draw would be a host read of a fake tensor); the decoder's positions read from its decoder_config.
    Its step against a full-depth trace: the slow tier below."""
    from tracer.meta import hf_config

    assert _config("canary")["encoder_config"].get("layerdrop") is None   # ParakeetEncoderConfig's default: 0.1
    assert hf_config(_config("canary")).encoder_config.layerdrop == 0.0
    assert _model("canary").inventory.extra["seq2seq"]["max_target"] == 256


def test_audio_seconds_prices_a_shorter_clip_where_the_encoder_takes_any_length():
    """--audio-seconds: Speech2Text's encoder takes any length (its feature extractor pads the batch to its longest),
    so 7 s of audio is 700 frames, its own class, equal to a full-depth trace and below the 30-s window; Whisper's
    encoder reads its fixed window only, and a text model takes no audio: both refused in one line."""
    from estimator.estimate import estimate
    from estimator.seq2seq import words

    m = _model("speech_to_text")
    w = Workload(attention="eager", audio_seconds=7)
    assert words(m, replace(w, seq=41)) == "encoder 700 mel frames (7 s of audio), decoder 41 transcript tokens"
    _check("speech_to_text", w, [(3, 41)])
    short = estimate(m, replace(w, batch=3, seq=41), Parallel()).total_bytes
    assert short < estimate(m, Workload(attention="eager", batch=3, seq=41), Parallel()).total_bytes
    with pytest.raises(ValueError, match=r"^audio_seconds: t-whisper \(whisper\) reads a fixed audio window"):
        estimate(_model("whisper"), Workload(audio_seconds=7, seq=41), Parallel())
    with pytest.raises(ValueError, match=r"^audio_seconds: t-t5 \(t5\) takes no audio of a length to choose"):
        estimate(_model("t5"), Workload(audio_seconds=7, seq=41), Parallel())


def test_whisper_inference_equals_a_full_depth_trace():
    """The encoder once on the 30 s window, the decoder's prompt, then 5 tokens with an EncoderDecoderCache."""
    _check("whisper", Workload(mode="infer", gen_tokens=5), [(3, 301), (1, 77)])


@SLOW
@pytest.mark.parametrize("name, workload, sizes", [
    ("bart", Workload(), [(3, 333), (1, 77)]),
    ("bart", Workload(target_seq=24), [(3, 333)]),
    ("t5", Workload(target_seq=24), [(3, 333), (1, 77)]),     # SDPA: the cross-attention's t x m mask copy
    ("bart", Workload(method="lora", lora_rank=5), [(3, 333)]),
    ("bart", Workload(mode="infer", gen_tokens=5), [(3, 333)]),
    ("t5", Workload(), [(3, 333), (1, 77)]),
    ("whisper", Workload(), [(3, 301)]),
    ("whisper", Workload(checkpointing="full"), [(2, 301)]),
    ("whisper", Workload(method="lora"), [(2, 301)]),        # the plain PeftModel: Whisper takes no input_ids
    ("speech_to_text", Workload(attention="eager", method="lora", lora_targets=("q_proj", "v_proj")), [(2, 120)]),
    ("speech_to_text", Workload(attention="eager", mode="infer", gen_tokens=20), [(3, 4)]),
    ("moonshine", Workload(method="lora", lora_targets=("q_proj", "v_proj")), [(2, 120)]),
    ("moonshine", Workload(mode="infer", gen_tokens=20), [(3, 4)]),
    ("moonshine_streaming", Workload(), [(5, 77)]),          # its waveform in 5-ms frames, sliding-window encoder
    ("moonshine_streaming", Workload(method="lora", lora_targets=("q_proj", "v_proj")), [(2, 120)]),
    ("moonshine_streaming", Workload(mode="infer", gen_tokens=20), [(3, 4)]),
    ("canary", Workload(), [(5, 77)]),                      # dropout 0.1 (CUDA's masks), every layer run
    ("canary", Workload(method="lora", lora_targets=("q_proj", "v_proj")), [(2, 120)]),
    ("canary", Workload(mode="infer", gen_tokens=20), [(3, 4)]),
    ("cohere_asr", Workload(), [(5, 77)]),
    ("cohere_asr", Workload(method="lora", lora_targets=("q_proj", "v_proj")), [(2, 120)]),
    ("cohere_asr", Workload(mode="infer", gen_tokens=20), [(3, 4)]),
])
def test_training_and_inference_equal_full_depth_traces(name, workload, sizes):
    _check(name, workload, sizes)


@SLOW
@pytest.mark.parametrize("workload, parallel", [
    (Workload(), Parallel(strategy="fsdp", gpus=4)),
    (Workload(method="lora", lora_targets=("q", "v")), Parallel(strategy="fsdp", gpus=8)),
])
def test_fsdp_over_both_stacks_equals_a_traced_rank(workload, parallel):
    """FSDP2 on every layer of the encoder and the decoder, then the root: rank 0 of a fake process group."""
    _check("t5", workload, [(3, 301)], parallel)
