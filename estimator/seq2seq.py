"""Encoder-decoder models in the estimate (tracer.seq2seq builds and traces them): what --seq and --target-seq mean
for one, and the one-line refusals said before any derivation.

Text to text (T5, BART, Marian, Pegasus...): --seq is the encoder's tokens per sample and --target-seq the decoder's
in training (0: as many as --seq); a profile is of one target length (its class), a polynomial in (batch, seq).
Speech to text (Whisper): the encoder reads the config's fixed window (Whisper: 30 s, 3000 mel frames) and --seq is
the decoder's tokens (training: the transcript; inference: the prompt before --gen-tokens), at most the decoder's
max_target_positions.
"""
from __future__ import annotations

from estimator.model import Model
from estimator.spec import Parallel, Workload

# What is priced: one GPU, a data-parallel copy of it (DDP's buckets, ZeRO-1/2's shards of states and gradients over
# the one-GPU trace), and FSDP2 traced per rank (`fully_shard` on every layer of both stacks, then the root, as HF
# Accelerate's FSDP2 wraps a T5Block or a WhisperEncoderLayer; HSDP as FSDP over its shard group). TP, PP and CP split a
# decoder-only stack as torchtitan does, which has no encoder-decoder model: not priced.
STRATEGIES = ("single", "ddp", "zero1", "zero2", "fsdp", "zero3", "fsdp-grad-op", "hsdp")
# The loss variants patch a causal LM's head (tracer.losses); activation offloading hooks its body; compile and
# float8 were never checked on these models
TRAIN_ONLY_DEFAULTS = {"loss": "full", "activation_offload": False, "compile": False, "float8": False}


def seq2seq_of(model: Model) -> dict | None:
    """The inventory's `seq2seq` part (tracer.seq2seq.info: kind "text" or "speech", max_target, the two stacks'
    layer counts, a speech model's window), or None for a decoder-only or encoder-only model."""
    v = model.inventory.extra.get("seq2seq")
    return v if isinstance(v, dict) else None


def seq_limit(model: Model) -> int:
    """The most --seq a speech model's decoder takes (Whisper: 448), else 0 (no limit of this module's)."""
    v = seq2seq_of(model)
    return int(v.get("max_target") or 0) if v is not None and v["kind"] == "speech" else 0


def target_len(w: Workload) -> int:
    """The decoder's tokens per sample in training: target_seq, or seq where it is 0 (tracer.seq2seq builds them)."""
    return w.target_seq or w.seq


def words(model: Model, w: Workload) -> str:
    """How the step's lengths read: "encoder 512 tokens, decoder 128 tokens" or Whisper's window; "" otherwise."""
    v = seq2seq_of(model)
    if v is None:
        return ""
    if v["kind"] == "speech":
        secs = v.get("seconds", v["frames"] // 100)   # Whisper's feature extractor: 10 ms hop, 100 frames a second
        frames = v["frames"]
        if w.audio_seconds and v.get("any_length"):   # --audio-seconds: its frames (samples) scale with the seconds
            frames, secs = frames * w.audio_seconds // secs, w.audio_seconds
        what = "transcript" if w.mode == "train" else "prompt"
        unit = "audio samples" if v.get("samples") else "mel frames"   # Moonshine reads the waveform at 16 kHz
        return f"encoder {frames:,} {unit} ({secs} s of audio), decoder {w.seq:,} {what} tokens"
    if w.mode == "infer":
        return f"encoder {w.seq:,} tokens, decoder from its start token"
    return f"encoder {w.seq:,} tokens, decoder {target_len(w):,} tokens"


def layerdrop_notes(model: Model, w: Workload) -> tuple[str, ...]:
    """A training step of a config with LayerDrop (M2M-100's, NLLB-MoE's 0.05) skips layers at random; it is priced
    with every layer run (tracer.meta), the most a step holds: said in a note."""
    if w.mode != "train":
        return ()
    drops = {k: v for k, v in model.config.items() if k.endswith("layerdrop") and isinstance(v, (int, float))
             and not isinstance(v, bool) and v > 0}
    if not drops:
        return ()
    said = ", ".join(f"{k} {v}" for k, v in sorted(drops.items()))
    return (f"layerdrop: {model.name} skips layers at random in training ({said}); priced with every layer run, the "
            "most a step holds",)


def decodes_eager_only(config: dict) -> bool:
    """T5's family: its relative position bias is an SDPA mask, which CUDA's memory-efficient kernel pads to 16 keys
    (in decoding, the cache's length: no polynomial), so its inference is priced under eager attention (`check`)."""
    return config.get("relative_attention_num_buckets") is not None


def check(model: Model, w: Workload, parallel: Parallel | None = None) -> None:
    """One line before any slow work: a target length for a model with no decoder of its own, a speech model's
    transcript past its decoder's positions, a knob or parallel layout the traced step does not run."""
    v = seq2seq_of(model)
    if w.audio_seconds and (v is None or not v.get("any_length")):
        raise ValueError(f"audio_seconds: {model.name} ({model.model_type}) " + (
            "reads a fixed audio window (Whisper's encoder: 30 s, its feature extractor pads shorter audio to it)"
            if v is not None and v["kind"] == "speech" else "takes no audio of a length to choose") +
            "; use 0 (the speech encoder-decoders that take any length: Speech2Text, Canary, Cohere-ASR, Moonshine)")
    if v is None:
        if w.target_seq:
            raise ValueError(f"target_seq: {model.name} ({model.model_type}) is no encoder-decoder model; its --seq "
                             "is every token of a step (0 here)")
        return
    if v["kind"] == "speech" and w.target_seq:
        raise ValueError(f"target_seq: {model.name} reads a fixed {v['frames']:,}-frame audio window; its --seq is "
                         "the decoder's tokens (use 0 here)")
    limit = int(v.get("max_target") or 0)
    decoder = w.seq if v["kind"] == "speech" else (target_len(w) if w.mode == "train" else 1 + w.gen_tokens)
    if v["kind"] == "speech" and w.mode == "infer":
        decoder = w.seq + w.gen_tokens
    if limit and decoder > limit:
        what = "--seq" if v["kind"] == "speech" and w.mode == "train" else \
            "--seq + --gen-tokens" if v["kind"] == "speech" else \
            "--target-seq (or --seq where it is 0)" if w.mode == "train" else "1 + --gen-tokens"
        raise ValueError(f"{'seq' if v['kind'] == 'speech' else 'target_seq'}: {model.name}'s decoder has "
                         f"{limit:,} positions; {what} is {decoder:,}")
    if w.mode == "train":
        for name, default in TRAIN_ONLY_DEFAULTS.items():
            if getattr(w, name) != default:
                raise ValueError(f"{name}: not priced for encoder-decoder models ({model.name}: {model.model_type}); "
                                 f"use {str(default).lower()}")
    if decodes_eager_only(model.config) and w.attention != "eager" and w.mode == "infer":
        # T5's position bias is the SDPA mask: CUDA's memory-efficient kernel copies it to a multiple of 16 keys,
        # which in decoding is the cache's length: no polynomial in the generated tokens; eager attention holds the
        # scores themselves
        raise ValueError(f"attention: {model.name}'s position bias runs as an SDPA mask padded to 16 keys, which in "
                         "decoding (the cache's length) no polynomial prices exactly; use --attention eager")
    if parallel is not None and parallel.strategy not in STRATEGIES:
        raise ValueError(f"strategy: {parallel.strategy} is not priced for encoder-decoder models ({model.name}); "
                         f"these are: {', '.join(STRATEGIES)}")
    if parallel is not None and (parallel.tp_size > 1 or parallel.pp_size > 1 or parallel.cp > 1):
        raise ValueError(f"strategy: tensor, pipeline and context parallelism are not priced for encoder-decoder "
                         f"models ({model.name})")
