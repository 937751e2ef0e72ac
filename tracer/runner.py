"""Build a Hugging Face model from a config dict and run a workload's stages on it.

This is the one place that knows how a `Workload` becomes a model, an optimizer, inputs and a sequence of
stages. It does not count memory: `run_stages` calls `on_stage(name)` at every stage boundary and the
caller reads whatever counter it uses there (`bench.trace.cases` reads a dispatch-mode counter on fake CPU
tensors, `bench.measure.harness` reads torch.cuda's peak statistics on a real GPU).

What each training recipe keeps in which dtype (what this module implements):
- pure:  weights, gradients and optimizer states in `precision`; compute in `precision`.
- amp:   fp32 weights, gradients and optimizer states; forward under torch.autocast(precision)
         (autocast caches the half-precision weight copies for the forward, as it does on a GPU).
         fp16 amp would add a GradScaler: one scale tensor and in-place unscaling, no extra buffers
         worth counting, so it is not run.
- mixed: half-precision weights and gradients, fp32 master weights and fp32 optimizer states in the
         optimizer (the 2+2+12 bytes/param of ZeRO, arXiv 1910.02054 Section 3.1). `MasterWeightsOptimizer`
         upcasts the gradients to fp32 for the step, as DeepSpeed's bf16 optimizer does.
- fp32:  everything fp32.
"""
from __future__ import annotations

import contextlib
import inspect
import sys
import warnings
from collections.abc import Callable

import torch
from torch._subclasses.fake_tensor import unset_fake_temporarily

from estimator.families import AUDIO_TYPES, HOST_VALUE_TYPES, VLM_TYPES
from estimator.spec import Workload
from tracer import serialized
from estimator import vision as vision_sizes
from tracer import audio, host_values, recipes, seq2seq, vision, vlm, vlm_grid, vlm_loop
from tracer.depth import reduce_depth
from tracer.meta import DTYPES, hf_config, is_masked_lm, is_vision_model, model_class  # noqa: F401  (DTYPES, is_masked_lm: used by callers of the runner)

LEARNING_RATE = 1e-5  # any value; it does not change memory


def weight_dtype(workload: Workload) -> torch.dtype:
    """dtype the model's (base) weights are stored in."""
    if workload.weight_format != "auto":
        if workload.weight_format not in DTYPES:
            raise ValueError(
                f"weight_format: {workload.weight_format!r} needs quantization kernels (bitsandbytes, GPTQ, GGUF) "
                "that the runner does not build; use fp32, bf16 or fp16 (or the analytic estimate)")
        return DTYPES[workload.weight_format]
    if workload.mode == "infer" or workload.recipe in ("pure", "mixed"):
        return DTYPES[workload.precision]
    return torch.float32  # amp and fp32 keep fp32 weights


def attn_implementation(workload: Workload, device: str) -> str:
    """HF attn_implementation for the workload. 'flash' means FlashAttention-2 where it is installed on a
    GPU; elsewhere it falls back to SDPA, whose flash backend saves the same tensors (out + logsumexp)."""
    if workload.attention == "eager":
        return "eager"
    if workload.attention == "flash" and str(device).startswith("cuda"):
        try:
            import flash_attn  # noqa: F401
            return "flash_attention_2"
        except ImportError:
            pass
    return "sdpa"


def _selective_attention(base: str) -> str:
    """Register (once) an attention function that checkpoints the attention core only.

    'selective' checkpointing follows Megatron's selective recompute (arXiv 2205.05198 Section 4.2): the
    QK^T / softmax / attention-over-V core is recomputed in backward, the projections and MLP keep their
    activations. Here the whole HF attention interface call (after RoPE, before o_proj) is wrapped in
    non-reentrant torch.utils.checkpoint, so only q, k, v are saved for it. The name gets the base's mask function
    too (transformers' masking_utils makes no mask at all for an attention name it has no mask function for: eager
    attention then ran unmasked, and a sliding window was not applied, a mask the step holds left out; fixed
    2026-11-28).
    """
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, AttentionInterface

    name = f"willitfit_selective_{base}"
    if name not in ALL_MASK_ATTENTION_FUNCTIONS:
        ALL_MASK_ATTENTION_FUNCTIONS.register(name, ALL_MASK_ATTENTION_FUNCTIONS[base])
    if name in ALL_ATTENTION_FUNCTIONS:
        return name

    def attention(module, *args, **kwargs):
        if base == "eager":  # eager attention is defined per model file, not in the registry
            fn = sys.modules[type(module).__module__].eager_attention_forward
        else:
            fn = ALL_ATTENTION_FUNCTIONS[base]
        return torch.utils.checkpoint.checkpoint(fn, module, *args, use_reentrant=False, **kwargs)

    AttentionInterface.register(name, attention)
    return name


def _hf_config(config: dict):
    """transformers' config for a config.json dict (tracer.meta.hf_config: one rule, one place)."""

    return hf_config(config)


def _model_class(hf_config, mode: str = "train"):
    """(Auto class, config to build it from): tracer.meta.model_class."""

    return model_class(hf_config, mode)


@serialized
def build_model(config: dict, workload: Workload, device: str = "cpu", *, meta_then_empty: bool = False,
                seed: int = 0, layers: list[int] | None = None) -> torch.nn.Module:
    """A randomly initialised HF model for `config`; no weights are downloaded, no remote code runs.

    With meta_then_empty the model is built on the meta device and then given uninitialised storage on
    `device` (fast for big models). Values, RoPE inv_freq included, are then uninitialised, which changes
    no tensor's size. Tied tensors (input/output embeddings) stay tied. `layers` keeps only those decoder
    layers (reduced depth, tracer.depth.reduce_depth), before any adapter is added.
    """
    if workload.method == "qlora":
        raise ValueError("method: qlora needs bitsandbytes 4-bit layers, which the runner does not build; "
                         "use lora (or the analytic estimate)")
    top = _hf_config(config)
    cls, hf_config = _model_class(top, workload.mode)
    masked = cls.__name__ == "AutoModelForMaskedLM"
    is_vision = vision.is_vision(top)  # inference builds SigLIP's / CLIP's tower from its vision_config alone
    attn = attn_implementation(workload, device)
    if workload.checkpointing == "selective":
        attn = _selective_attention(attn if attn in ("sdpa", "eager") else "sdpa")
    dtype = weight_dtype(workload)
    torch.manual_seed(seed)
    old_dtype = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # module.to(dtype) fails in swap_tensors under fake mode
    try:
        with torch.device("meta" if meta_then_empty else device):
            # built on meta outside any fake mode: a constructor's own CPU arithmetic (Data2Vec-Vision reads its
            # drop-path rates with .item()) runs for real; _materialize gives the tensors fake storage after
            with (unset_fake_temporarily() if meta_then_empty else contextlib.nullcontext()):
                model = _from_config(cls, hf_config, dtype, attn)
            if layers is not None:
                reduce_depth(model, layers)
            model._willitfit_masked_lm = masked
            if getattr(model.config, "languages", None) and getattr(model.config, "default_language", "") is None:
                # X-MOD runs no step until a language is chosen (set_default_language); every language's adapter
                # is the same size and one runs on every token, so the first one's step is any one's
                model.config.default_language = model.config.languages[0]
            model._willitfit_vision = is_vision
            if vlm.is_vlm(top) and workload.images:  # the tokens one image becomes, read once per config
                model._willitfit_image_tokens = vlm.image_tokens(model, config, workload.image_size)
                if vlm_grid.is_grid(top):   # its vision tower's one varlen call per layer (tracer.vlm_grid)
                    vlm_grid.check_attention(top, workload)
                    vlm_grid.use_packed_attention(model)
                elif vlm_loop.is_pixtral(top):   # Pixtral's: the same varlen call over every image's patches
                    refused = vision_sizes.grid_refusal(top.model_type, workload, masked=True)
                    if refused:
                        raise ValueError(refused)
                    vlm_grid.use_packed_attention(model)
            if audio.is_audio(top) and workload.audios:  # the tokens one clip becomes, read once per config
                model._willitfit_audio_tokens = audio.audio_tokens(model, config)
            if is_vision:  # tokens per image beyond the patches, read on the model as built (tracer.vision)
                if vision.is_spatial(model.config):    # its grid unit: the total stride (x a window), read once
                    model._willitfit_unit = vision.grid_unit(model)
                model._willitfit_extra_tokens = vision.extra_tokens(model)
            if workload.method == "lora":
                model = _add_lora(model, workload, masked or is_vision)
    finally:
        torch.set_default_dtype(old_dtype)
    if meta_then_empty:
        _materialize(model, device)
    if workload.mode == "infer":
        model.eval()
        model.requires_grad_(False)
    else:
        model.train()
        if workload.checkpointing == "full":
            enable = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
            enable()
        recipes.prepare(model, workload)  # float8, op-sac (tracer.recipes)
    return model


def _from_config(cls, hf_config, dtype: torch.dtype, attn: str):
    try:
        return cls.from_config(hf_config, dtype=dtype, attn_implementation=attn)
    except ValueError as e:  # HF refuses e.g. SDPA for Gemma-2; name the field the user can change
        first = str(e).split(". ")[0]
        field = "attention" if "attention implementation" in str(e) else "config"
        raise ValueError(f"{field}: {first} (attn_implementation={attn!r})") from None
    except KeyError as e:
        if attn.startswith("willitfit_selective_") and attn in str(e):
            # the model picks its attention from a table of its own (Falcon's FALCON_ATTENTION_CLASSES), not from
            # transformers' AttentionInterface, where selective checkpointing registers its wrapped attention
            raise ValueError(f"checkpointing: selective checkpointing wraps transformers' attention interface, which "
                             f"{getattr(hf_config, 'model_type', 'this model')}'s attention does not call (it picks "
                             "its attention from a table of its own); use none, full or op-sac") from None
        raise


def _materialize(model: torch.nn.Module, device: str) -> None:
    """Give every meta parameter and buffer uninitialised storage on `device`, keeping ties.

    Like nn.Module.to_empty, but without its tensor swap: _apply swaps fake parameters
    (torch.utils.swap_tensors), which refuses tensors FakeTensorMode holds weak references to, and
    to_empty would also untie shared parameters. Each tensor is replaced once and reused where shared.
    """
    new: dict[int, torch.Tensor] = {}
    for module in model.modules():
        for name, p in module._parameters.items():
            if p is not None:
                if id(p) not in new:
                    new[id(p)] = torch.nn.Parameter(torch.empty_like(p, device=device), requires_grad=p.requires_grad)
                module._parameters[name] = new[id(p)]
        for name, b in module._buffers.items():
            if b is not None:
                if id(b) not in new:
                    new[id(b)] = torch.empty_like(b, device=device)
                module._buffers[name] = new[id(b)]


def _add_lora(model, workload: Workload, encoder: bool = False):
    from peft import LoraConfig, get_peft_model

    # an encoder-decoder model takes the plain PeftModel (as HF's Whisper LoRA guide builds it): PEFT's seq2seq and
    # causal wrappers pass input_ids by name, which Whisper's forward (input_features) does not take
    task = None if encoder or seq2seq.is_seq2seq_model(model) else "CAUSAL_LM"
    # PEFT freezes the base model and, by default (autocast_adapter_dtype=True), keeps adapters in fp32.
    lora = LoraConfig(r=workload.lora_rank, target_modules=list(workload.lora_targets), lora_dropout=0.0,
                      task_type=task)
    try:
        with warnings.catch_warnings():  # PEFT still calls transformers' deprecated is_gradient_checkpointing
            warnings.simplefilter("ignore", FutureWarning)
            return get_peft_model(model, lora)
    except ValueError as e:
        raise ValueError(f"lora_targets: {', '.join(workload.lora_targets)} do not match this model ({e})") from None


class MasterWeightsOptimizer:
    """'mixed' recipe: the model keeps half-precision weights and grads; `inner` steps fp32 master copies.

    step(): upcast every grad into its master's .grad, step the inner optimizer, copy masters back into the
    half-precision weights, drop the fp32 grads. Master weights count as optimizer state (ZeRO's K=12).
    """

    def __init__(self, params: list[torch.Tensor], make_inner: Callable[[list], torch.optim.Optimizer]):
        self.params = params
        self.master_params = [p.detach().to(torch.float32, copy=True) for p in params]
        self.inner = make_inner(self.master_params)
        self.state: dict = {}

    @torch.no_grad()
    def step(self) -> None:
        for p, m in zip(self.params, self.master_params):
            m.grad = None if p.grad is None else p.grad.to(torch.float32)
        self.inner.step()
        for p, m in zip(self.params, self.master_params):
            p.copy_(m)
            m.grad = None

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params:
            p.grad = None


def _impl_kwargs(workload: Workload, name: str, fused_ok: bool) -> dict:
    if workload.optimizer_impl == "fused":
        if not fused_ok:
            raise ValueError(f"optimizer_impl: torch has no fused {name}; use foreach or forloop")
        return {"fused": True}
    return {"foreach": workload.optimizer_impl == "foreach"}


def _optimizer_factory(workload: Workload) -> Callable[[list], torch.optim.Optimizer]:
    opt = workload.optimizer
    if opt == "lion":
        raise ValueError("optimizer: lion is not available in torch; use adamw, adam, sgd, sgd-momentum "
                         "or adafactor (or the analytic estimate)")
    if opt == "adamw-8bit":
        try:
            import bitsandbytes as bnb
        except ImportError:
            raise ValueError("optimizer: adamw-8bit needs bitsandbytes, which is not installed") from None
        # bitsandbytes has one 8-bit AdamW kernel: foreach and forloop build the same optimizer
        return lambda ps: bnb.optim.AdamW8bit(ps, lr=LEARNING_RATE)
    if opt in ("adamw", "adam"):
        cls = torch.optim.AdamW if opt == "adamw" else torch.optim.Adam
        kw = _impl_kwargs(workload, opt, fused_ok=True)
        return lambda ps: cls(ps, lr=LEARNING_RATE, **kw)
    if opt in ("sgd", "sgd-momentum"):
        kw = _impl_kwargs(workload, opt, fused_ok=True)
        momentum = 0.9 if opt == "sgd-momentum" else 0.0
        return lambda ps: torch.optim.SGD(ps, lr=LEARNING_RATE, momentum=momentum, **kw)
    if opt == "adafactor":
        kw = _impl_kwargs(workload, opt, fused_ok=False)
        return lambda ps: torch.optim.Adafactor(ps, lr=LEARNING_RATE, **kw)
    raise ValueError(f"optimizer: {opt!r} is not handled by the runner")


def make_optimizer(model: torch.nn.Module, workload: Workload):
    """The workload's optimizer over the trainable parameters, or None for inference.

    foreach -> foreach=True (forced, also on CPU where torch would default to the loop), forloop ->
    foreach=False, fused -> fused=True (torch has fused Adam/AdamW/SGD kernels for CPU and CUDA).
    """
    if workload.mode != "train":
        return None
    make = _optimizer_factory(workload)
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        raise ValueError("method: the model has no trainable parameters")
    in_backward = recipes.optimizer(params, make, workload)  # torchtune's optimizer_in_bwd
    if in_backward is not None:
        return in_backward
    if workload.recipe == "mixed":
        return MasterWeightsOptimizer(params, make)
    return make(params)


def make_inputs(config: dict, workload: Workload, device: str, model=None, clone_labels: bool = True) -> dict:
    """Token ids of shape (batch, seq), plus labels (the same ids; HF shifts them) for training: a copy, as a
    data collator makes (clone_labels), or the input_ids tensor itself. The vocabulary is the model's input
    embedding's (a config may leave vocab_size to its class's default, or nest it in text_config). A vision
    encoder gets pixel values for `workload.seq` tokens per image instead (tracer.vision.pixel_inputs)."""
    inner = getattr(model, "module", model)  # DDP wraps the model
    if inner is not None and is_vision_model(inner):
        return vision.pixel_inputs(inner, workload, device)
    if inner is not None and seq2seq.is_seq2seq_model(inner):
        return seq2seq.seq2seq_inputs(inner, workload, device)
    if workload.target_seq:
        raise ValueError(f"target_seq: {config.get('model_type')!r} is no encoder-decoder model; its --seq is every "
                         "token of a step")
    if workload.audios:
        tokens = getattr(inner, "_willitfit_audio_tokens", None)   # PEFT's wrapper hands the attribute through
        if tokens is None:
            raise ValueError(f"audios: {config.get('model_type')!r} takes no audio in willitfit; the audio-language "
                             "models priced with audio are " + ", ".join(AUDIO_TYPES))
        return audio.audio_inputs(inner, workload, device, tokens, clone_labels=clone_labels)
    if workload.images:
        tokens = getattr(inner, "_willitfit_image_tokens", None)   # PEFT's wrapper hands the attribute through
        if tokens is None:
            raise ValueError(f"images: {config.get('model_type')!r} takes no images in willitfit; the vision-language "
                             "models priced with images are " + ", ".join(VLM_TYPES))
        return vlm.vlm_inputs(inner, workload, device, tokens, clone_labels=clone_labels)
    emb = inner.get_input_embeddings() if inner is not None else None
    vocab = int(emb.num_embeddings if emb is not None else (config.get("vocab_size") or 0))
    if vocab < 1:
        raise ValueError("config: vocab_size must be a positive integer")
    input_ids = torch.randint(0, vocab, (workload.batch, workload.seq), device=device)  # (B, T)
    if config.get("model_type") in HOST_VALUE_TYPES:   # its forward reads them on the host (tracer.host_values)
        input_ids = host_values.random_ids(input_ids, vocab)
        if workload.mode == "train":
            return {"input_ids": input_ids, "labels": host_values.random_ids(input_ids.clone(), vocab) if
                    clone_labels else input_ids}
    if workload.mode == "train":
        return {"input_ids": input_ids, "labels": input_ids.clone() if clone_labels else input_ids}
    return {"input_ids": input_ids}


def step_autocast(workload: Workload, model: torch.nn.Module):
    if workload.mode == "train" and workload.recipe == "amp":
        device_type = next(model.parameters()).device.type
        return torch.autocast(device_type=device_type, dtype=DTYPES[workload.precision])
    return contextlib.nullcontext()


def run_stages(model, optimizer, workload: Workload, inputs: dict, on_stage: Callable[[str], None],
               steps: int = 2, live: dict | None = None) -> None:
    """Run the workload, calling on_stage(stage) at the end of every stage.

    A stage name repeats (forward of every micro-batch and step, decode of every token); callers keep
    the max. Training runs `steps` optimizer steps (default 2: Adam creates its states in step 1, so
    step 2 is the steady state). The caller calls on_stage("load") itself after building and inputs.
    `live`, if given, receives the objects the stages create that a counter may want to classify at
    on_stage (inference: the KV cache under "kv_cache"); with loop "keep-output" it holds the last model output
    under "output", so a caller that runs the steps over several calls (bench.measure.worker) keeps the previous
    step's output alive into the next forward, as one Python loop does.
    """
    if steps < 1:
        raise ValueError(f"steps: must be at least 1, got {steps}")
    if workload.mode == "train":
        _train(model, optimizer, workload, inputs, on_stage, steps, {} if live is None else live)
    else:
        _infer(model, workload, inputs, on_stage, {} if live is None else live)


def _train(model, optimizer, workload, inputs, on_stage, steps, live: dict) -> None:
    for _ in range(steps):
        for _ in range(workload.grad_accum):
            with step_autocast(workload, model):
                # recipes.forward: the workload's loss and activation offloading, use_cache=False (otherwise HF
                # builds a DynamicCache that training never reads). HF upcasts the logits to fp32 in the loss.
                if workload.loop == "keep-output":
                    # `out = model(...)`: the previous output (its logits) dies only when this call returns
                    live["output"] = recipes.forward(model, workload, inputs)
                    loss = live["output"].loss
                else:  # loss-only (HF Trainer, torchtune): the logits die here, not after backward
                    loss = recipes.forward(model, workload, inputs).loss
            on_stage("forward")
            # each micro-batch's loss counts 1/grad_accum: scaled through backward's seed gradient (a scalar as
            # large as the ones_like that backward() makes itself), so a micro-batch makes the same tensors at any
            # grad_accum, and one step of grad_accum 2 is a replay of one of grad_accum 1 (tracer.replay)
            loss.backward(torch.full_like(loss, 1 / workload.grad_accum) if workload.grad_accum > 1 else None)
            del loss
            on_stage("backward")
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        on_stage("optimizer")


def forward_loss(model, workload: Workload, inputs: dict):
    """One training forward of the loss-only loop (its autocast, the workload's loss): the loss."""
    with step_autocast(workload, model):
        return recipes.forward(model, workload, inputs).loss


def params_with_grads(model, workload, inputs) -> set[str]:
    """Names of the parameters a training step gives a gradient: one forward and backward, then every gradient
    dropped. Parameters the step never reaches (a cross-attention without encoder states, a vision tower in a
    text-only step) get none, and torch's optimizers (`_init_group`) create no state for them."""
    with step_autocast(workload, model):
        loss = recipes.forward(model, workload, inputs).loss
    loss.backward()
    del loss
    names = {n for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return names


def _infer(model, workload, inputs, on_stage, live: dict) -> None:
    if is_vision_model(model):
        if workload.gen_tokens:
            raise ValueError(f"gen_tokens: {model.config.model_type} is a vision encoder and cannot generate; use 0")
        with torch.no_grad():
            model(**inputs)
        on_stage("prefill")
        return
    if seq2seq.is_seq2seq_model(model):   # the encoder once, then the decoder from its start (or prompt) tokens
        with torch.no_grad():
            encoded = model.get_encoder()(**seq2seq.encoder_inputs(inputs))
            cache = live["kv_cache"] = seq2seq.new_cache()
            _generate(lambda ids: model(encoder_outputs=encoded, decoder_input_ids=ids, past_key_values=cache,
                                        use_cache=True), inputs["decoder_input_ids"], workload.gen_tokens, on_stage)
        return
    input_ids = inputs["input_ids"]
    if is_masked_lm(model):
        if workload.gen_tokens:
            raise ValueError(f"gen_tokens: {model.config.model_type} is an encoder and cannot generate; use 0")
        with torch.no_grad():
            model(input_ids=input_ids)
        on_stage("prefill")
        return
    from transformers import DynamicCache

    # generate() computes only the last position's logits during decoding (logits_to_keep=1).
    params = inspect.signature(model.forward).parameters
    keep = {"logits_to_keep": 1} if "logits_to_keep" in params else {}
    # Mamba-2 (and Mamba, FalconMamba) name their cache cache_params: generate() passes it under that name, and a
    # past_key_values they would only forward as an unused keyword (every step a fresh prefill)
    # RWKV names its (a list of 5 (b, hidden, layers) tensors) state
    cache_arg = "past_key_values" if "past_key_values" in params else \
        next((a for a in ("cache_params", "state") if a in params), "past_key_values")
    # a model with a cache class of its own (MiniMax's MiniMaxCache: generate() passes none, the prefill makes it)
    if getattr(model, "_supports_default_dynamic_cache", lambda: True)():
        live["kv_cache"] = DynamicCache(config=model.config)

    def step(ids):
        out = model(input_ids=ids, use_cache=True, **{cache_arg: live.get("kv_cache")}, **keep)
        if "kv_cache" not in live:
            live["kv_cache"] = getattr(out, "state" if cache_arg == "state" else "past_key_values")
        return out
    with torch.no_grad():
        _generate(step, input_ids, workload.gen_tokens, on_stage)


def _generate(step, ids: torch.Tensor, gen_tokens: int, on_stage: Callable[[str], None]) -> None:
    """generate()'s loop: `step(ids)` on the prompt (stage "prefill"), then once per generated token ("decode"),
    each fed the previous call's next token; a call's output dies before the stage ends."""
    for stage in ("prefill",) + ("decode",) * gen_tokens:
        out = step(ids)
        ids = _next_token(out.logits)
        del out
        on_stage(stage)


def _next_token(logits: torch.Tensor) -> torch.Tensor:
    # generate() copies the last logits to fp32 before the logits processors (generation/utils.py)
    last = logits[:, -1, :].to(copy=True, dtype=torch.float32)  # (B, V)
    return last.argmax(dim=-1, keepdim=True)  # (B, 1)


kv_cache_tensors = seq2seq.kv_cache_tensors   # the tensors an HF cache holds (the KV cache, states)
