"""Audio-language models whole: the model, its audio clips and their tokens (estimator.families.AUDIO_TYPES).

    tokens = audio_tokens(model)                  # audio tokens one clip becomes (read on the model as built)
    inputs = audio_inputs(model, workload, "cpu", tokens)   # input_ids with clips x tokens audio ids, input_features

A step of `workload.audios` clips per sample, each one 30-second window of log-mel features as the model's feature
extractor hands it over (`geometry`: (mels, 3000) per clip for Whisper's extractor, the others' in families
.AUDIO_FEATURES), in the weights' dtype, with its mask all valid (int32, as the extractors return it: a full window),
and input_ids whose first positions after one text token are the audio token id, clips x tokens of them per sample
(every model here scatters its projected audio features there: `masked_scatter` on `input_ids == audio_token_id`).
The rest of the sequence is text. The audio encoder's and projector's activations are the same for every sequence
length, so memory stays a polynomial in (batch, seq) for a fixed clip count, and the derivation needs nothing beyond
its (b, s) fit: `audios` is part of the profile's class.

Their forwards read the mask and the ids on the host (each clip's valid frames, `mask.sum(-1)`, pick the valid
features by a boolean index; Qwen2-Audio asks whether the ids hold consecutive audio tokens; Music Flamingo finds each
clip's span with `torch.where`): the steps run with host values (tracer.host_values), the mask and the ids carrying
theirs, as a processor's tensors do on a GPU.
"""
from __future__ import annotations

import contextlib
import inspect
import json
from collections import Counter

import torch

from torch._subclasses.fake_tensor import FakeTensorMode, unset_fake_temporarily

from estimator.families import AUDIO_FEATURES, AUDIO_TYPES
from tracer import host_values
from tracer.vlm import host_checks_skipped, in_fitting

TOKEN_KEYS = ("audio_token_id", "audio_token_index")
MASK_KEYS = ("input_features_mask", "feature_attention_mask")
FRAMES = 3000   # 30 s at Whisper's 10 ms hop


def is_audio(cfg) -> bool:
    """A config of an audio-language model priced whole with its audio (by its model_type)."""
    return getattr(cfg, "model_type", None) in AUDIO_TYPES


def audio_token_id(cfg) -> int:
    for key in TOKEN_KEYS:
        value = getattr(cfg, key, None)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    raise ValueError(f"model_type: {cfg.model_type!r} states no audio token id ({' or '.join(TOKEN_KEYS)}); its "
                     "forward finds the audio's places by it (a checkpoint's config.json states it)")


def _audio_config(cfg):
    return getattr(cfg, "audio_config", None) or getattr(cfg, "encoder_config", None)


def _mel_bins(cfg) -> int:
    """num_mel_bins of the audio encoder's config, wherever the config nests it (Nemotron-3.5-Transcribe: its ASR
    encoder's), times the frames it stacks (Fun-ASR-Nano's num_stacked_frames)."""
    todo = [_audio_config(cfg)]
    while todo:
        c = todo.pop(0)
        if c is None:
            continue
        bins = getattr(c, "num_mel_bins", None)
        if isinstance(bins, int) and bins > 0:
            return bins * int(getattr(c, "num_stacked_frames", 1) or 1)
        todo += [v for v in vars(c).values() if hasattr(v, "to_dict")]
    raise ValueError(f"model_type: {cfg.model_type!r} states no num_mel_bins for its audio encoder")


def geometry(cfg) -> tuple[int, int, bool, float]:
    """(features per frame, frames per clip, frames first, seconds per clip) of one clip as the model's feature
    extractor hands it over: a Whisper-style encoder's window (2 x max_source_positions frames of num_mel_bins, 10 ms
    each: 30 s by default), Whisper's 30-s window (3000 frames) where the encoder states no window, the others' from
    families.AUDIO_FEATURES (30 s)."""
    if cfg.model_type in AUDIO_FEATURES:
        frames, first = AUDIO_FEATURES[cfg.model_type]
        return _mel_bins(cfg), frames, first, 30.0
    window = getattr(_audio_config(cfg), "max_source_positions", None)
    frames = 2 * int(window) if isinstance(window, int) and window > 0 else FRAMES
    return _mel_bins(cfg), frames, False, frames / 100


def mask_key(model) -> str:
    """The forward's name for the features' mask (Qwen2-Audio and Qwen2.5-Omni: feature_attention_mask), read on the
    model itself under PEFT's wrapper (whose forward hands every keyword through)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    params = inspect.signature(type(base).forward).parameters
    return next((k for k in MASK_KEYS if k in params), MASK_KEYS[0])


def audio_kwargs(model, clips: int, device) -> dict:
    """input_features of `clips` clips (clips, mels, frames) (frames first where the extractor hands them so) in the
    weights' dtype, and their mask (clips, frames), all valid, its values known to the host."""
    mels, frames, first, _ = geometry(model.config)
    dtype = next(model.parameters()).dtype
    shape = (clips, frames, mels) if first else (clips, mels, frames)
    features = torch.empty(*shape, dtype=dtype, device=device)
    mask = torch.empty(clips, frames, dtype=torch.int32, device=device)
    with unset_fake_temporarily():
        ones = torch.ones(clips, frames, dtype=torch.int32, device="cpu")
    return {"input_features": features, mask_key(model): host_values.known(mask, ones)}


@contextlib.contextmanager
def _valued():
    """Where the model runs on the meta device (its audio tokens, its unreached parameters): a fake mode of its own
    with host values, which answers the host reads meta tensors cannot (the meta parameters taken as they are), under
    torch's own default dtype, float32, as on a GPU (the runner builds under the weights' dtype: Qwen2.5-Omni's
    `feature_lens / (n_window * 2)` in bf16 reads 3000 frames as 3008 and cuts one chunk too many)."""
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float32)
    try:
        with unset_fake_temporarily(), FakeTensorMode(allow_non_fake_inputs=True), host_values.host_values():
            yield
    finally:
        torch.set_default_dtype(old)


_TOKENS: dict[str, int] = {}   # per config (json), within a process: a derivation builds its model once per trace


def _from_tower(model) -> int:
    """The tokens one full clip becomes by the audio tower's own length rule (`_get_feat_extract_output_lengths`: its
    convolutions' and pooling's), for a model whose get_audio_features needs the ids themselves (Music Flamingo) or
    that has none (Qwen2-Audio, whose forward applies the same rule)."""
    tower = model.audio_tower if hasattr(model, "audio_tower") else model.model.audio_tower
    with unset_fake_temporarily(), torch.device("cpu"):   # integer arithmetic on the host, as the forward's is
        lengths = tower._get_feat_extract_output_lengths(torch.tensor([geometry(model.config)[1]]))
        return int((lengths[-1] if isinstance(lengths, tuple) else lengths).reshape(-1)[0])


def audio_tokens(model, config: dict | None = None) -> int:
    """The tokens one clip becomes in the sequence: the rows of the model's own get_audio_features on one clip, run on
    the meta device (its elements over the text model's hidden size); memoised by `config` where given. Where it needs
    the ids or does not exist, the audio tower's length rule (`_from_tower`; both checked against the model's forward by
    tests/test_audio.py)."""
    if config is not None:
        key = json.dumps(config, sort_keys=True, default=str)
        if key not in _TOKENS:
            _TOKENS[key] = audio_tokens(model)
        return _TOKENS[key]
    get = getattr(model, "get_audio_features", None)
    if get is None or "input_ids" in inspect.signature(get).parameters:
        return _from_tower(model)
    device = next(model.parameters()).device
    # the method's own parameters (the top model's may hand *args through to its inner model's): Granite-Speech's
    # takes the features alone
    own = getattr(getattr(model, "model", None), "get_audio_features", None) or get
    masked = any(k in inspect.signature(own).parameters for k in MASK_KEYS)
    with _valued(), torch.no_grad():   # inputs made inside: fake tensors, which carry the mask's values
        kwargs = audio_kwargs(model, 1, device)
        features = get(kwargs["input_features"], *([kwargs[mask_key(model)]] if masked else []))
    features = getattr(features, "pooler_output", features)
    hidden = model.get_input_embeddings().embedding_dim
    if features.shape[-1] != hidden:
        raise ValueError(f"model_type: {model.config.model_type!r}'s audio features are {features.shape[-1]} wide and "
                         f"its text embeddings {hidden}: a config whose parts disagree (its forward would scatter the "
                         "features by element count); a checkpoint's config.json matches them")
    return int(features.numel() // hidden)


def audio_inputs(model, workload, device: str, per_clip: int, clone_labels: bool = True) -> dict:
    """input_ids (b, s) with `audios` x `per_clip` audio token ids after one text token (values the host knows), the
    features of b x audios clips with their mask, and labels (a copy of the ids, or the ids themselves) for
    training."""
    n = workload.audios
    tokens = n * per_clip
    if workload.seq <= tokens and not in_fitting():   # a derivation's small seqs may be shorter (tracer.vlm.fitting)
        raise ValueError(f"seq: {workload.seq} tokens cannot hold {n} audio clip(s) of {per_clip} tokens each; use a "
                         f"seq over {tokens}")
    tok = audio_token_id(model.config)
    vocab = model.get_input_embeddings().num_embeddings
    ids = host_values.random_ids(torch.empty(workload.batch, workload.seq, dtype=torch.long, device=device),
                                 max(1, min(tok, vocab)))
    with unset_fake_temporarily():
        host_values.value_of(ids)[:, 1:1 + tokens] = tok
    out = {"input_ids": ids, **audio_kwargs(model, workload.batch * n, device)}
    if workload.mode == "train":
        out["labels"] = ids.clone() if clone_labels else ids
    return out


def audio_class(model_type: str):
    """The Auto class transformers lists an audio-language type under (seq2seq LM, speech seq2seq or
    image-text-to-text): each builds the whole model (Qwen2AudioForConditionalGeneration...)."""
    import transformers
    from transformers.models.auto import modeling_auto

    for cls, mapping in (("AutoModelForSeq2SeqLM", "MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES"),
                         ("AutoModelForSpeechSeq2Seq", "MODEL_FOR_SPEECH_SEQ_2_SEQ_MAPPING_NAMES"),
                         ("AutoModelForImageTextToText", "MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES")):
        if model_type in getattr(modeling_auto, mapping):
            return getattr(transformers, cls)
    raise ValueError(f"model_type: {model_type!r} is listed by no auto class that builds its audio encoder")


def seq_floor(config: dict, cfg, workload) -> int:
    """The shortest seq minus one a step with audio can run (its clips' tokens): a derivation fits above it
    (tracer.derive.pieces_for), since these models check on the host that the ids hold one audio token per feature
    (`inputs_embeds[mask].numel() == features.numel()`, with the ids' values known); 0 without audio. The tokens are
    memoised under the key the runner's builds read (`audio_tokens(model, config)`), so a derivation counts them once."""
    if not workload.audios or not is_audio(cfg):
        return 0
    key = json.dumps(config, sort_keys=True, default=str)
    if key not in _TOKENS:
        old = torch.get_default_dtype()
        torch.set_default_dtype(torch.bfloat16)
        try:
            with unset_fake_temporarily(), torch.device("meta"):
                model = audio_class(cfg.model_type).from_config(cfg)
        finally:
            torch.set_default_dtype(old)
        _TOKENS[key] = audio_tokens(model)
    return workload.audios * _TOKENS[key]


def unreached(model) -> list:
    """[[name, shape, count]] of the parameters a training step with one clip gives no gradient (no optimizer state),
    read from one forward and backward on the meta device (shapes only); named as tracer.vlm.unreached names them."""
    tokens = model._willitfit_audio_tokens
    with unset_fake_temporarily():
        values = torch.tensor([[0] + [audio_token_id(model.config)] * tokens], device="cpu")
    with _valued():
        ids = host_values.known(torch.empty(1, tokens + 1, dtype=torch.long, device="meta"), values)
        with host_checks_skipped():
            model(input_ids=ids, **audio_kwargs(model, 1, "meta"), labels=ids).loss.backward()
    out = Counter((".".join(n.split(".")[-2:]), tuple(p.shape)) for n, p in model.named_parameters()
                  if p.requires_grad and p.grad is None)
    model.zero_grad(set_to_none=True)
    return [[name, list(shape), n] for (name, shape), n in sorted(out.items())]


def info(model) -> dict:
    """What the inventory keeps of an audio-language model (estimator.inventory: `audio`); `unreached` is None where
    the meta step fails (the optimizer formulas then count every parameter)."""
    mels, frames, first, seconds = geometry(model.config)
    try:
        missed = unreached(model)
    except (RuntimeError, ValueError, TypeError, IndexError, NotImplementedError):
        missed = None
    return {"seconds": seconds, "mels": mels, "frames": frames, "frames_first": first,
            "audio_tokens": int(model._willitfit_audio_tokens), "audio_token_id": audio_token_id(model.config),
            "unreached": missed}
