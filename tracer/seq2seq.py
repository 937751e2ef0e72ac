"""Encoder-decoder models whole: T5, BART, Marian, Pegasus... (text to text) and Whisper (speech to text).

    cls = model_class(cfg)                        # AutoModelForSeq2SeqLM / AutoModelForSpeechSeq2Seq
    inputs = seq2seq_inputs(model, workload, "cpu")

What a step is, as transformers and its Trainer (Seq2SeqTrainer) run it:
- **Text to text**: `input_ids` (b, seq) into the encoder, `labels` (b, t) whose shifted copy the model feeds its
  decoder (`shift_tokens_right`: the model's own code, so the decoder's inputs are allocated where the model allocates
  them). t is `workload.target_seq`, or seq where that is 0 (`target_len`): a class field, so memory stays a
  polynomial in (b, seq) per target length (with t = seq, one in (b, seq) for every seq).
- **Speech to text** (Whisper): `input_features` (b, mel bins, frames) of the config's fixed window (Whisper's encoder
  refuses any other length: max_source_positions x its two convolutions' strides, 3000 frames = 30 s), in the
  weights' dtype as its processor's output is cast, and `labels` (b, seq): seq is the transcript's tokens, at most the
  decoder's `max_target_positions` (448).
- **Inference** (generate): the encoder runs once on the prompt (text: seq tokens; speech: the window), then the
  decoder runs from its start token (text; speech: seq prompt tokens, Whisper's forced language/task tokens) and
  decodes `gen_tokens` more, with an `EncoderDecoderCache`: a self-attention cache that grows by one position per
  token and a cross-attention cache of the encoder's keys and values, written once.

Both layer stacks are cut at reduced depth (tracer.depth.layer_stacks: the encoder's layers, then the decoder's, one
list of layer types), so the derivation extends each stack's count on its own.
"""
from __future__ import annotations

import torch

from estimator.families import HOST_VALUE_TYPES
from estimator.seq2seq import target_len
from tracer import host_values

# Speech encoders: mel features of a fixed window in, one decoder over text tokens out. Whisper's window is its
# encoder's (2 x max_source_positions frames); Speech2Text, Canary and Cohere-ASR (Parakeet's encoder) take any length,
# (frames, bins) with a mask as their feature extractors hand them over (a 10 ms hop; the mask int32, all valid), priced
# on a 30-s window (FRAMES_FIRST: 3000 frames) like Whisper's
SPEECH_TYPES = ("whisper", "speech_to_text", "moonshine", "moonshine_streaming", "canary", "cohere_asr")
FRAMES_FIRST = {"speech_to_text": 3000, "canary": 3000, "cohere_asr": 3000}
# Moonshine reads the raw waveform, input_values (b, samples) at 16 kHz: priced on 30 s (480,000 samples) without the
# mask its feature extractor may add (transformers' own examples hand generate() the values alone)
RAW_SAMPLES = {"moonshine": 16000 * 30, "moonshine_streaming": 16000 * 30}
# Encoder-decoder types whose steps are not one polynomial per class or do not run on fake tensors, with why
REFUSED = {
    "bigbird_pegasus": "its encoder's block-sparse attention loops over blocks of the sequence (its ops change "
                       "with seq)",
    "led": "its encoder's sliding-window attention (Longformer's) pads and chunks the sequence by value",
    "longt5": "its local and transient-global attention block the sequence by its length",
    "pegasus_x": "its block-local encoder attention pads the sequence to its block size",
    "prophetnet": "its n-stream decoder builds its relative positions on the host",
    "switch_transformers": "its experts pick their tokens by value (`nonzero` on the router's choice), which a trace "
                           "on fake tensors cannot run",
    "nllb-moe": "its experts pick their tokens by value (`nonzero` on the router's choice), which a trace on fake "
                "tensors cannot run",
    "encoder-decoder": "a composite of two configs (EncoderDecoderModel): price its decoder's and encoder's own "
                       "model types",
}


def is_encoder_decoder(cfg) -> bool:
    return bool(getattr(cfg, "is_encoder_decoder", False))


def is_speech(cfg) -> bool:
    return getattr(cfg, "model_type", None) in SPEECH_TYPES


def is_seq2seq_model(model) -> bool:
    return is_encoder_decoder(getattr(model, "config", None))


def model_class(cfg):
    """The Auto class of this encoder-decoder config: speech-to-text (Whisper) or text-to-text; refused in one line
    where neither lists the type or the step is not priced (`REFUSED`)."""
    from transformers import AutoModelForSeq2SeqLM, AutoModelForSpeechSeq2Seq
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES,
        MODEL_FOR_SPEECH_SEQ_2_SEQ_MAPPING_NAMES,
    )

    mt = cfg.model_type
    if mt in REFUSED:
        raise ValueError(f"model_type: {mt!r} is an encoder-decoder model willitfit does not price: {REFUSED[mt]}")
    if mt in SPEECH_TYPES and mt in MODEL_FOR_SPEECH_SEQ_2_SEQ_MAPPING_NAMES:
        return AutoModelForSpeechSeq2Seq
    if mt in MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES and mt not in MODEL_FOR_SPEECH_SEQ_2_SEQ_MAPPING_NAMES:
        return AutoModelForSeq2SeqLM
    raise ValueError(f"model_type: {mt!r} is an encoder-decoder model whose inputs willitfit does not build (priced: "
                     f"text-to-text models of transformers' seq2seq LM class, and {', '.join(SPEECH_TYPES)} for "
                     "speech)")


def takes_any_length(cfg) -> bool:
    """A speech model whose encoder takes audio of any length (its input padded to the batch's longest), priced at
    `--audio-seconds` (workload.audio_seconds); Whisper's reads its fixed window only."""
    return cfg.model_type in FRAMES_FIRST or cfg.model_type in RAW_SAMPLES


def audio_frames(cfg, seconds: int = 0) -> tuple[int, int]:
    """(mel bins, frames) of a speech model's input: Whisper's fixed window (80 or 128 bins x 3000 frames); a model
    that takes any length (`takes_any_length`) at `seconds` of audio (0: 30), 100 frames a second (FRAMES_FIRST:
    Speech2Text's input_feat_per_channel x input_channels bins, Canary's and Cohere-ASR's encoder's mels) or 16,000
    samples (RAW_SAMPLES, one channel)."""
    if cfg.model_type in RAW_SAMPLES:   # one channel of samples
        return 1, RAW_SAMPLES[cfg.model_type] * seconds // 30 if seconds else RAW_SAMPLES[cfg.model_type]
    if cfg.model_type in FRAMES_FIRST:   # Speech2Text's bins, or a Parakeet-style encoder's (Canary, Cohere-ASR)
        enc = getattr(cfg, "encoder_config", None)
        bins = int(getattr(cfg, "input_feat_per_channel", 0) or getattr(enc, "num_mel_bins", 0) or 0) * \
            int(getattr(cfg, "input_channels", 1) or 1)
        frames = FRAMES_FIRST[cfg.model_type] * seconds // 30 if seconds else FRAMES_FIRST[cfg.model_type]
        # Speech2Text's conv subsampler halves the frames per layer; its encoder's positions must hold what is left
        positions = getattr(cfg, "max_source_positions", None)
        if bins < 1 or (positions and -(-frames // 2 ** int(getattr(cfg, "num_conv_layers", 2))) > positions):
            raise ValueError(f"audio_seconds: {cfg.model_type!r}'s encoder takes fewer positions than "
                             f"{seconds or 30} s of audio make, or states no feature bins")
        return bins, frames
    bins = getattr(cfg, "num_mel_bins", None)
    positions = getattr(cfg, "max_source_positions", None)
    if not (isinstance(bins, int) and isinstance(positions, int) and bins > 0 and positions > 0):
        raise ValueError(f"model_type: {cfg.model_type!r} states no num_mel_bins and max_source_positions")
    return bins, 2 * positions   # WhisperEncoder: conv1 stride 1, conv2 stride 2


def max_target(cfg) -> int:
    """The most decoder positions the model has (0: no limit of its own, as T5's relative positions); Canary's
    decoder states them in its decoder_config."""
    for c in (cfg, getattr(cfg, "decoder_config", None)):
        for key in ("max_target_positions", "max_position_embeddings"):
            v = getattr(c, key, None)
            if isinstance(v, int) and not isinstance(v, bool) and v > 0:
                return v
    return 0


def start_token_stated(cfg) -> None:
    """T5's config class states no decoder_start_token_id (its released checkpoints' config.json do: 0, the pad
    token), and its training step reads it (`_shift_right`): a config without one gets its pad token, as those
    checkpoints state; Moonshine's gets a pad token (its start token) likewise. A token id changes no tensor's size."""
    if is_encoder_decoder(cfg) and getattr(cfg, "decoder_start_token_id", None) is None:
        cfg.decoder_start_token_id = getattr(cfg, "pad_token_id", None) or 0
    if is_encoder_decoder(cfg) and getattr(cfg, "pad_token_id", None) is None and cfg.model_type in RAW_SAMPLES:
        # Moonshine's training step shifts the labels right with its pad token in place of -100
        # (`shift_tokens_right`), which its config class leaves unset: its start token, as for T5's above
        cfg.pad_token_id = cfg.decoder_start_token_id


def decoder_start(cfg) -> int:
    v = getattr(cfg, "decoder_start_token_id", None)
    if not isinstance(v, int) or isinstance(v, bool):
        v = getattr(cfg, "pad_token_id", None)
    return v if isinstance(v, int) and not isinstance(v, bool) and v >= 0 else 0


def seq2seq_inputs(model, workload, device: str) -> dict:
    """The encoder's inputs and, in training, the labels (see the module docstring)."""
    cfg = model.config
    vocab = int(model.get_output_embeddings().weight.shape[0]) if model.get_output_embeddings() is not None else \
        int(getattr(cfg, "vocab_size", 0) or 0)
    if vocab < 1:
        raise ValueError("config: vocab_size must be a positive integer")
    b, s = workload.batch, workload.seq
    if is_speech(cfg):
        bins, frames = audio_frames(cfg, workload.audio_seconds)
        dtype = next(model.parameters()).dtype
        if cfg.model_type in RAW_SAMPLES:   # the waveform itself
            out = {"input_values": torch.randn(b, frames, device=device, dtype=dtype)}
        elif cfg.model_type in FRAMES_FIRST:   # (b, frames, bins) and the mask its extractor returns (all valid)
            mask = torch.ones(b, frames, dtype=torch.int32, device=device)
            out = {"input_features": torch.randn(b, frames, bins, device=device, dtype=dtype), "attention_mask": mask}
        else:
            out = {"input_features": torch.randn(b, bins, frames, device=device, dtype=dtype)}
        if workload.mode == "train":
            out["labels"] = torch.randint(0, vocab, (b, s), device=device)
        else:   # the decoder's prompt: seq tokens (Whisper's start, language and task tokens)
            out["decoder_input_ids"] = torch.randint(0, vocab, (b, s), device=device)
        return out
    input_ids = torch.randint(0, vocab, (b, s), device=device)
    out = {"input_ids": input_ids}
    if workload.mode == "train":
        out["labels"] = torch.randint(0, vocab, (b, target_len(workload)), device=device)
    else:
        out["decoder_input_ids"] = torch.full((b, 1), decoder_start(cfg), dtype=torch.long, device=device)
    if getattr(cfg, "model_type", None) in HOST_VALUE_TYPES:   # FSMT reads its padding mask on the host
        out = {k: host_values.random_ids(v, vocab, seed=i) if k != "decoder_input_ids" else v
               for i, (k, v) in enumerate(out.items())}
    return out


def encoder_inputs(inputs: dict) -> dict:
    """What generate() hands the encoder: every input but the decoder's."""
    return {k: v for k, v in inputs.items() if k != "decoder_input_ids"}


def new_cache():
    """generate()'s cache for an encoder-decoder model: self-attention and cross-attention caches."""
    from transformers import DynamicCache, EncoderDecoderCache

    return EncoderDecoderCache(DynamicCache(), DynamicCache())


def cache_parts(cache) -> list:
    """The caches an EncoderDecoderCache holds (self-attention, cross-attention), or [cache] for any other."""
    parts = [getattr(cache, a, None) for a in ("self_attention_cache", "cross_attention_cache")]
    parts = [p for p in parts if p is not None]
    return parts or [cache]


def kv_cache_tensors(cache) -> list[torch.Tensor]:
    """The tensors an HF Cache holds: keys/values of attention layers, and the conv and recurrent (SSM) states of
    state-space layers, which transformers' cache_utils `LinearAttentionLayer` keeps in dicts by state index."""
    out = []
    for part in cache_parts(cache):   # an encoder-decoder model's: self- and cross-attention caches
        out.extend(_cache_tensors(part))
    return out


def _cache_tensors(cache) -> list[torch.Tensor]:
    if isinstance(cache, (list, tuple)):   # RWKV's state: the tensors themselves
        return [t for t in cache if isinstance(t, torch.Tensor)]
    # a cache's own lists of states beside its layers (MiniMaxCache.linear_cache: each linear layer's K^T V)
    out = [x for v in vars(cache).values() if isinstance(v, list) for x in v if isinstance(x, torch.Tensor)]
    for layer in getattr(cache, "layers", ()):
        for v in vars(layer).values():
            if isinstance(v, torch.Tensor):
                out.append(v)
            elif isinstance(v, dict):
                out.extend(x for x in v.values() if isinstance(x, torch.Tensor))
    return out


def info(model) -> dict:
    """The inventory's `seq2seq` entry: the kind, the decoder's position limit and a speech model's input window."""
    cfg = model.config
    out = {"kind": "speech" if is_speech(cfg) else "text", "max_target": max_target(cfg),
           "encoder_layers": 0, "decoder_layers": 0}
    if is_speech(cfg):
        out["mel_bins"], out["frames"] = audio_frames(cfg)
        out["seconds"] = RAW_SAMPLES[cfg.model_type] // 16000 if cfg.model_type in RAW_SAMPLES else out["frames"] // 100
        if cfg.model_type in RAW_SAMPLES:
            out["samples"] = True
        if takes_any_length(cfg):   # priced at --audio-seconds (the window above: 0)
            out["any_length"] = True
        out["encoder_positions"] = int(getattr(cfg, "max_source_positions", 0) or 0)
    return out
