"""An audio-language model's audio, as the estimate sees it (no torch): how many clips a step takes, the tokens they
become in each sample's seq, and the one-line refusals (tracer.audio builds and traces them;
estimator.families.AUDIO_TYPES lists the types)."""
from __future__ import annotations

from estimator.families import AUDIO_TYPES
from estimator.model import Model
from estimator.spec import Workload


def audio_of(model: Model) -> dict | None:
    """An audio-language model's audio (seconds, mels, frames, audio_tokens per clip, audio_token_id), or None: the
    inventory's `audio` part (tracer.audio.info)."""
    return model.inventory.extra.get("audio")


def _seconds(a: dict) -> str:
    """A clip's length as its feature extractor's window says it: "30" (seconds)."""
    return f"{float(a['seconds']):g}"


def audio_tokens(model: Model, w: Workload) -> int:
    """The tokens a step's audio clips take of each sample's seq (0 without audio): the shortest seq is one more."""
    a = audio_of(model)
    return w.audios * int(a["audio_tokens"]) if w.audios and a is not None else 0


def audio_words(model: Model, w: Workload) -> str:
    """"2 audio clips of 30 s (1,500 audio tokens) per sample", or "" for a step without audio."""
    a = audio_of(model)
    if not w.audios or a is None:
        return ""
    n = w.audios
    tokens = audio_tokens(model, w)
    return f"{n} audio clip{'s' if n > 1 else ''} of {_seconds(a)} s ({tokens:,} audio tokens) per sample"


def check_audio(model: Model, w: Workload) -> None:
    """One line before any slow work: audio for a model that takes none here, or a seq too short for its tokens."""
    if not w.audios:
        return
    a = audio_of(model)
    refused = model.inventory.extra.get("audio_refused")
    if a is None and refused:
        raise ValueError(f"audios: {model.name}'s audio path fails on its own config ({refused}); only a text-only "
                         "step (0 audio clips) is priced")
    if a is None:
        raise ValueError(f"audios: {model.name} ({model.model_type}) takes no audio here; the audio-language models "
                         f"priced with audio: {', '.join(AUDIO_TYPES)} (0 prices a text-only step)")
    tokens = audio_tokens(model, w)
    if w.seq <= tokens:
        raise ValueError(f"seq: {w.seq:,} tokens cannot hold {w.audios} audio clip(s) of {a['audio_tokens']:,} tokens "
                         f"each ({_seconds(a)} s); use a seq over {tokens:,}")


def scope_notes(model: Model, w: Workload) -> tuple[str, ...] | None:
    """What an audio-language model's estimate covers (None for any other model): a text-only step says so and how to
    price the audio."""
    inv = model.inventory
    if inv.model_type not in AUDIO_TYPES:
        return None
    if audio_of(model) is not None:
        return () if w.audios else (
            f"scope: {inv.model_type} is built whole ({inv.built_as}) and the step is text-only; --audios N prices N "
            f"{_seconds(audio_of(model))}-s audio clips per sample (audio encoder, projector and audio tokens)",)
    return (f"scope: {inv.model_type} is built whole ({inv.built_as}: its audio encoder's weights are held) but the "
            f"step is text-only: its audio path fails on this config ({inv.extra.get('audio_refused', '')})",)
