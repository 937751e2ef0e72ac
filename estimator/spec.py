"""Workload and parallelism specs: the one vocabulary shared by the estimator, bench and the app.

Every field name and allowed value here is also a CLI flag value (`python -m estimator`), a column of
the `runs` table (`bench/store/schema.sql`) and a widget in the app. Validation lives in `__post_init__` and
raises `ValueError` naming the field and the allowed values.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass, field, fields

MODES = ("train", "infer")
METHODS = ("full", "lora", "qlora")
# pure: everything in --precision; amp: fp32 weights/grads/states + autocast; mixed: half weights and grads +
# fp32 master and states (DeepSpeed, Megatron); fp32; fsdp-mp: FSDP2 MixedPrecisionPolicy(param_dtype=half,
# reduce_dtype=fp32): fp32 sharded weights, grads and states, half gathered weights for compute.
RECIPES = ("pure", "amp", "mixed", "fp32", "fsdp-mp")
PRECISIONS = ("bf16", "fp16", "fp32")
# Weight storage formats. "auto" = the recipe's weight dtype (training) or --precision (inference).
WEIGHT_FORMATS = (
    "auto", "fp32", "bf16", "fp16", "fp8", "int8",
    "nf4", "fp4",                      # bitsandbytes 4-bit
    "gptq-4bit", "gptq-8bit", "awq-4bit",  # group-wise integer
    "gguf-q8_0", "gguf-q6_k", "gguf-q5_k_m", "gguf-q4_k_m", "gguf-q4_0", "gguf-q3_k_m", "gguf-q2_k",
)
OPTIMIZERS = ("adamw", "adam", "sgd", "sgd-momentum", "adamw-8bit", "adafactor", "lion",
              "paged-adamw", "paged-adamw-8bit")  # paged: bitsandbytes PagedAdamW(8bit), states in CUDA unified memory
PAGED_OPTIMIZERS = ("paged-adamw", "paged-adamw-8bit")
OPTIMIZER_IMPLS = ("foreach", "fused", "forloop")
# full: every decoder layer (HF gradient_checkpointing_enable); selective: the attention core (Megatron,
# arXiv 2205.05198 sec. 4.2); op-sac: torchtitan's per-op policy (save matmul outputs every other mm, SDPA and
# collective outputs; torchtitan/distributed/activation_checkpoint.py `SelectiveAC`, formerly `_save_list`)
CHECKPOINTING = ("none", "full", "selective", "op-sac")
ATTENTION = ("sdpa", "flash", "eager")
KV_DTYPES = ("auto", "fp32", "bf16", "fp16", "fp8", "int8")
CP_STRATEGIES = ("fsdp", "zero3", "fsdp-grad-op", "hsdp")   # FSDP2 on torchtitan's dp_shard x cp mesh
STRATEGIES = ("single", "ddp", "zero1", "zero2", "zero3", "fsdp", "fsdp-grad-op", "hsdp", "tp", "pp", "ep")
OFFLOADS = ("none", "optimizer", "optimizer+params")
# How FSDP2 groups parameters into units (each unit all-gathered and resharded as one): "layers", each decoder layer
# then the root (HF Accelerate's TRANSFORMER_BASED_WRAP: the embedding, final norm and head are the root's, gathered
# for the whole step); "torchtitan", its apply_fsdp: the embedding a unit, each block, the final norm with the head a
# unit kept gathered after forward, then the root (torchtitan/models/llama3/infra/parallelize.py)
FSDP_WRAPS = ("layers", "torchtitan")
# Pipeline schedules (torch.distributed.pipelining, torchtitan's pipeline_parallel_schedule): in 1F1B stage i keeps
# min(pp - i, microbatches) micro-batches of activations (the first stage the most); GPipe runs every forward first,
# so each stage keeps all of them; interleaved 1F1B (ScheduleInterleaved1F1B, torchtitan's "Interleaved1F1B") gives
# each rank PP_STAGES_PER_RANK stages (rank r: stages r, r + pp, ...) and runs chunk forwards depth first; the zero-
# bubble schedules split each backward into its input and weight gradients and run the latter later: interleaved-zb
# (ScheduleInterleavedZeroBubble, "InterleavedZeroBubble": stages r, r + pp), zbv (ScheduleZBVZeroBubble,
# "ZBVZeroBubble": stages r and 2 pp - 1 - r, a V) and dualpipev (ScheduleDualPipeV, "DualPipeV": the V, a forward
# and a backward of two micro-batches overlapped). The zero-bubble ones are priced from traced ranks only.
PP_SCHEDULES = ("1f1b", "gpipe", "interleaved-1f1b", "interleaved-zb", "zbv", "dualpipev")
# Stages per rank: torchtitan's default for a multi-stage schedule without pipeline_parallel_layers_per_stage
# (torchtitan/distributed/pipeline_parallel.py `_get_pipeline_metadata`: 1 for single-stage schedules, else 2).
PP_STAGES_PER_RANK = {"1f1b": 1, "gpipe": 1, "interleaved-1f1b": 2, "interleaved-zb": 2, "zbv": 2, "dualpipev": 2}
PP_TRACED_ONLY = ("interleaved-zb", "zbv", "dualpipev")   # no analytic rule: weight gradients that wait
PP_V_SCHEDULES = ("zbv", "dualpipev")   # rank r runs stages r and 2 pp - 1 - r (torchtitan's style "v")
# What the training loop keeps alive: HF Trainer and torchtune keep only the loss; seed 000's harness and
# litgpt's loops keep the model output (logits) through backward and the optimizer step.
LOOPS = ("loss-only", "keep-output")
# The loss: full cross-entropy on materialised logits (HF ForCausalLMLoss); chunked (torchtune
# CEWithChunkedOutputLoss, litgpt chunked_cross_entropy: the lm_head output and its fp32 upcast per chunk);
# fused-linear (Liger LigerFusedLinearCrossEntropyLoss: logits never materialised beyond one chunk).
LOSSES = ("full", "chunked", "fused-linear")
# Which Linears QLoRA stores in 4-bit: every Linear of the decoder blocks (bitsandbytes replace_with_bnb_linear,
# as litgpt and PEFT load them) or only the Linears that carry LoRA adapters (torchtune lora_*_qlora builders).
QUANTIZE_SCOPES = ("all", "adapted")
MAX_LOSS_CHUNKS = 4096


def fused_chunk_count(vocab: int, hidden: int) -> int:
    """k of the fused-linear loss's bounding chunks (tracer.losses.bounding_chunk_rows): the largest power of two at
    most half of Liger's inc_factor = cdiv(V, H)."""
    inc_factor = -(-vocab // hidden)
    return 1 << max(0, (max(1, inc_factor // 2)).bit_length() - 1)


def loss_seq_step(w: "Workload", vocab: int | None, hidden: int | None) -> int:
    """What seqs a profile is derived and verified on multiples of (tracer.derive), and the searches step by where it
    is 16 or more (estimator.search.max_seq): a chunked loss splits the sequence into loss_chunks slices, the
    fused-linear bound into k chunks of B*T rows (`fused_chunk_count`); where they do not divide, one chunk is
    ceil(s / chunks) long, a step no polynomial follows (under by less than one row of one chunk's logits; past a
    window with a mask, only multiples of 16 are priced: docs/recipes.md). Otherwise 8."""
    if w.mode != "train":
        return 8
    if w.loss == "chunked":
        return max(8, w.loss_chunks)
    if w.loss == "fused-linear" and isinstance(vocab, int) and isinstance(hidden, int) and hidden > 0:
        return max(8, fused_chunk_count(vocab, hidden))
    return 8

# Bounds keep sweeps and contributed rows sane; they are far above any real run.
MAX_BATCH = 1 << 20
MAX_SEQ = 1 << 24
MAX_GPUS = 1 << 16
MAX_LORA_RANK = 1 << 16
MAX_IMAGE_SIZE = 1 << 16
MAX_IMAGES = 1 << 10
MAX_AUDIO_SECONDS = 3600
# The workload's sizes: what a profile is evaluated at (a polynomial in batch, seq and gen_tokens; a vision
# encoder's image_size resolves to its seq, estimator.vision); every other field is the profile's class.
SIZE_FIELDS = ("batch", "seq", "gen_tokens", "image_size")


def _check_choice(name: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ValueError(f"{name}: {value!r} is not allowed; choose one of {', '.join(allowed)}")


def _check_int(name: str, value: int, lo: int, hi: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name}: must be an integer, got {value!r}")
    if not lo <= value <= hi:
        raise ValueError(f"{name}: {value} is out of range; allowed {lo}..{hi}")


@dataclass(frozen=True)
class Knob:
    """The one declaration of a workload field: everything the CLI flag, the run row's column, the grid axis, the
    published mapping and the app's widget are generated from (estimator.knobs, bench.store.rows, pages.inputs)."""

    label: str                     # the app's label
    help: str                      # the CLI's --help and the app's tooltip
    choices: tuple[str, ...] = ()  # allowed values of a text field
    lo: int = 0                    # bounds of an integer field
    hi: int = 0
    applies: str = "all"           # when it means something: all | train | infer | adapter (lora/qlora training)
    #                                | frozen | text | vision | vlm | seq2seq (encoder-decoder training)
                                   # | frozen (weights that do not train: inference or adapters)
                                   # | text (a text model's size) | vision (a vision encoder's size)
    advanced: bool = False         # the app folds it under "More settings"
    row_required: bool = False     # a run row must state it (bench.store.rows)


def knob(default, label: str, help: str, **kw):
    """A dataclass field carrying its Knob (dataclasses.field metadata)."""
    return field(default=default, metadata={"knob": Knob(label, help, **kw)})


def knob_of(f) -> Knob:
    return f.metadata["knob"]


@dataclass(frozen=True)
class Workload:
    """What the user runs on the model. Defaults are a common single-GPU bf16 fine-tune."""

    mode: str = knob("train", "Mode", "train: forward + backward + optimizer step; infer: prefill the prompt, then "
                     "decode with a KV cache (Hugging Face generate)", choices=MODES, row_required=True)
    method: str = knob("full", "Method", "full: every weight trains; lora: frozen base + low-rank adapters; qlora: "
                       "LoRA on a 4-bit (NF4/FP4) frozen base (arXiv 2305.14314)", choices=METHODS, applies="train",
                       row_required=True)
    lora_rank: int = knob(8, "LoRA rank r", "rank r of every adapter (PEFT `r`, default 8): A is r x in, B is "
                          "out x r", lo=1, hi=MAX_LORA_RANK, applies="adapter")
    lora_targets: tuple[str, ...] = knob(("q_proj", "v_proj"), "LoRA target modules", "comma-separated Linear "
                                         "modules that get adapters (PEFT `target_modules`; q_proj,v_proj is its "
                                         "default for Llama-family models)", applies="adapter")
    recipe: str = knob("pure", "Precision recipe", "which tensors hold which dtype in training: pure (all in "
                       "--precision), amp (fp32 weights, autocast), mixed (half weights + fp32 master and states), "
                       "fp32, fsdp-mp (FSDP2 MixedPrecisionPolicy: fp32 shards, half gathered weights)",
                       choices=RECIPES, applies="train", row_required=True)
    precision: str = knob("bf16", "Precision", "compute and activation dtype (and weight dtype unless the recipe "
                          "says otherwise)", choices=PRECISIONS, row_required=True)
    weight_format: str = knob("auto", "Weight format", "storage of the frozen or inference weights: auto follows "
                              "the recipe/precision; int8/nf4/fp4 bitsandbytes; gptq/awq group-wise ints; gguf "
                              "llama.cpp blocks", choices=WEIGHT_FORMATS, applies="frozen")
    optimizer: str = knob("adamw", "Optimizer", "optimizer whose states are held (PyTorch, bitsandbytes, "
                          "transformers); paged-*: states in CUDA unified memory", choices=OPTIMIZERS, applies="train")
    optimizer_impl: str = knob("foreach", "Optimizer implementation", "torch optimizer implementation: foreach "
                               "(PyTorch's CUDA default; temporaries as large as a state group), fused, forloop",
                               choices=OPTIMIZER_IMPLS, applies="train")
    batch: int = knob(1, "Micro-batch size (per GPU)", "micro-batch per GPU (sequences)", lo=1, hi=MAX_BATCH,
                      row_required=True)
    seq: int = knob(2048, "Sequence length (tokens)", "training sequence length, or the prompt length for "
                    "inference (a vision encoder's is its tokens per image, from --image-size)", lo=1, hi=MAX_SEQ,
                    applies="text", row_required=True)
    image_size: int = knob(0, "Image size (pixels, square)", "vision models (ViT, DINOv2, SigLIP, CLIP, DeiT, BEiT, "
                           "ConvNeXt, ResNet, Swin...): the side of the square input image in pixels, a multiple of "
                           "the patch size (a conv net's or Swin's grid unit: its total stride, x its window); the "
                           "step runs (image_size // patch_size)^2 patches plus the CLS/register tokens; 0: the "
                           "config's image_size (224 where a conv net's config has none). Qwen2-VL's family (with "
                           "--images): each image's side, a multiple of patch x merge (28 or 32 px), (side / (patch x "
                           "merge))^2 tokens each; 0: 448. LLaVA-NeXT's family (with --images): each image's side, "
                           "cut into tiles of its vision tower's size as its processor does; 0: two tiles a side. "
                           "Mistral-3 and LightOnOCR (Pixtral's tower): a multiple of 28 px; 0: the config's",
                           lo=0, hi=MAX_IMAGE_SIZE, applies="image")
    images: int = knob(0, "Images per sample", "vision-language models (LLaVA, PaliGemma, InternVL, Gemma-3, "
                       "Llama-4 (its 336-px tiles); Qwen2-VL/2.5-VL/3-VL, LLaVA-NeXT/OneVision and Mistral-3 at "
                       "--image-size): images per sample at the config's image size, each "
                       "one its image tokens inside --seq (the vision tower, the projector and the language model "
                       "run whole); 0: a text-only step",
                       lo=0, hi=MAX_IMAGES, applies="vlm")
    audios: int = knob(0, "Audio clips per sample", "audio-language models (Qwen2-Audio, Voxtral, Audio Flamingo "
                       "3, Music Flamingo, GLM-ASR, Nemotron-3.5-Transcribe, Fun-ASR-Nano): 30-second "
                       "windows of audio per sample (a longer recording is cut into such windows, as their "
                       "processors do), each one its audio tokens inside --seq (the audio encoder, the projector "
                       "and the language model run whole); 0: a text-only step",
                       lo=0, hi=MAX_IMAGES, applies="audio")
    audio_seconds: int = knob(0, "Audio length (seconds)", "speech encoder-decoders whose encoder takes any length "
                              "(Speech2Text, Canary, Cohere-ASR, Moonshine, Moonshine-Streaming): each sample's audio "
                              "in seconds, the batch padded to it as their feature extractors pad it; 0: 30 s "
                              "(Whisper's encoder always reads its fixed 30-s window)", lo=0, hi=MAX_AUDIO_SECONDS,
                              applies="speech")
    target_seq: int = knob(0, "Target length (tokens)", "encoder-decoder models (T5, BART, Marian...): the decoder's "
                           "tokens per sample in training (the labels), while --seq is the encoder's; 0: as many as "
                           "--seq. Whisper's --seq is its transcript's tokens (its audio is the config's 30 s window)",
                           lo=0, hi=MAX_SEQ, applies="seq2seq")
    gen_tokens: int = knob(0, "Generated tokens", "tokens generated after the prompt (inference); the KV cache "
                           "grows to prompt + generated", lo=0, hi=MAX_SEQ, applies="infer")
    grad_accum: int = knob(1, "Gradient accumulation steps", "micro-batches accumulated per optimizer step "
                           "(gradients then live through the forward pass too)", lo=1, hi=MAX_BATCH, applies="train")
    checkpointing: str = knob("none", "Activation checkpointing", "none; full (each layer's input kept, the layer "
                              "recomputed in backward); selective (the attention core, arXiv 2205.05198 sec. 4.2); "
                              "op-sac (torchtitan's per-op policy)", choices=CHECKPOINTING, applies="train")
    attention: str = knob("sdpa", "Attention implementation", "attention kernel: sdpa/flash never store the "
                          "seq x seq scores; eager does", choices=ATTENTION)
    kv_dtype: str = knob("auto", "KV-cache dtype", "KV-cache dtype; auto = the precision (fp8/int8 halve a bf16 "
                         "cache)", choices=KV_DTYPES, applies="infer")
    loop: str = knob("loss-only", "Training loop keeps", "what the training loop keeps alive: the loss only (HF "
                     "Trainer, torchtune) or the whole model output through backward and the optimizer step "
                     "(litgpt, `out = model(...)` loops)", choices=LOOPS, applies="train", advanced=True)
    loss: str = knob("full", "Loss", "full cross-entropy on the logits; chunked (torchtune "
                     "CEWithChunkedOutputLoss, litgpt chunked_cross_entropy); fused-linear (Liger: logits never "
                     "materialised)", choices=LOSSES, applies="train", advanced=True)
    loss_chunks: int = knob(8, "Loss chunks", "chunks of the sequence for loss chunked (torchtune "
                            "num_output_chunks, default 8)", lo=1, hi=MAX_LOSS_CHUNKS, applies="train",
                            advanced=True)
    optimizer_in_backward: bool = knob(False, "Optimizer in backward", "step each parameter as its gradient is "
                                       "ready and free it (torchtune optimizer_in_bwd)", applies="train",
                                       advanced=True)
    activation_offload: bool = knob(False, "Activation offloading", "move saved activations to CPU memory "
                                    "(torchtune enable_activation_offloading)", applies="train", advanced=True)
    quantize_scope: str = knob("all", "QLoRA quantizes", "QLoRA: 4-bit on every block Linear (all: bitsandbytes, "
                               "litgpt, PEFT) or only the adapted ones (adapted: torchtune)", choices=QUANTIZE_SCOPES,
                               applies="adapter", advanced=True)
    double_quant: bool = knob(True, "QLoRA double quantization", "QLoRA: quantize the 4-bit absmax scales again "
                              "(arXiv 2305.14314 sec. 3); off keeps them in fp32 (HF BitsAndBytesConfig's default)",
                              applies="adapter", advanced=True)
    float8: bool = knob(False, "float8 training", "torchao float8 training of the block Linears (torchtitan)",
                        applies="train", advanced=True)
    compile: bool = knob(False, "torch.compile", "the model is torch.compile'd: what AOTAutograd's partitioner "
                         "saves (no inductor fusion; tracer.compiled), with the full loss: on one GPU or DDP the "
                         "whole step as one graph, under FSDP2 each block and the loss apart (torchtitan)",
                         advanced=True)

    def __post_init__(self) -> None:
        check_declared(self)
        if self.mode == "infer":
            if self.method != "full":
                raise ValueError(f"method: {self.method!r} needs mode='train'; inference uses method='full'")
            if self.grad_accum != 1:
                raise ValueError("grad_accum: gradient accumulation needs mode='train'")
            if self.checkpointing != "none":
                raise ValueError("checkpointing: activation checkpointing needs mode='train'")
            for name in ("optimizer_in_backward", "activation_offload", "float8"):
                if getattr(self, name):
                    raise ValueError(f"{name}: needs mode='train'")
            if self.target_seq:
                raise ValueError("target_seq: the decoder's training tokens need mode='train'; inference decodes "
                                 "--gen-tokens")
            if self.loop != "loss-only" or self.loss != "full":
                raise ValueError("loop: the training loop and loss settings need mode='train'; inference uses "
                                 "loop='loss-only', loss='full'")
        else:
            if self.gen_tokens != 0:
                raise ValueError("gen_tokens: generated tokens need mode='infer'")
        if self.method == "qlora":
            if self.weight_format not in ("auto", "nf4", "fp4"):
                raise ValueError(f"weight_format: qlora stores the base in 4-bit; use nf4 or fp4, not {self.weight_format!r}")
            if self.recipe == "fp32" or self.precision == "fp32":
                raise ValueError("recipe: qlora computes in bf16/fp16; fp32 weights contradict a 4-bit base")
        if self.mode == "train" and self.method == "full" and self.weight_format not in ("auto", "fp32", "bf16", "fp16"):
            raise ValueError(
                f"weight_format: {self.weight_format!r} weights cannot be fully fine-tuned; "
                "use method='lora'/'qlora' or a float format (fp32, bf16, fp16)")
        if self.recipe == "fp32" and self.precision != "fp32":
            raise ValueError("precision: recipe 'fp32' needs precision='fp32'")
        if self.recipe in ("amp", "mixed", "fsdp-mp") and self.precision == "fp32":
            raise ValueError(f"precision: recipe {self.recipe!r} needs a half precision (bf16 or fp16)")
        if self.optimizer in ("adamw-8bit", *PAGED_OPTIMIZERS) and self.optimizer_impl == "fused":
            raise ValueError(f"optimizer_impl: bitsandbytes {self.optimizer} has no 'fused' variant; use foreach or forloop")
        if self.loss_chunks != 8 and self.loss != "chunked":
            raise ValueError("loss_chunks: sets the chunks of loss='chunked'; leave it at 8 for other losses")
        if self.optimizer_in_backward and self.grad_accum != 1:
            raise ValueError("optimizer_in_backward: steps in backward, so it cannot accumulate gradients; "
                             "use grad_accum=1 (torchtune refuses the combination too)")
        if self.quantize_scope != "all" and self.method != "qlora":
            raise ValueError("quantize_scope: chooses which Linears QLoRA quantizes; needs method='qlora'")
        if self.float8 and self.method != "full":
            raise ValueError("float8: torchao float8 training converts trainable Linears; needs method='full'")
        if self.float8 and self.precision != "bf16":
            raise ValueError("float8: torchao float8 training computes in bf16; needs precision='bf16'")

    @property
    def training(self) -> bool:
        return self.mode == "train"


@dataclass(frozen=True)
class Parallel:
    """How the run is split over GPUs. `gpus` is the world size; tp*pp*ep must divide it."""

    strategy: str = "single"  # single GPU, or one of STRATEGIES
    gpus: int = 1             # world size
    tp: int = 1               # tensor-parallel degree (strategy 'tp' sets it to gpus if left at 1)
    pp: int = 1               # pipeline stages (strategy 'pp' sets it to gpus if left at 1)
    ep: int = 1               # expert-parallel degree for MoE (strategy 'ep')
    sequence_parallel: bool = False  # Megatron sequence parallelism (shards LayerNorm/dropout activations over tp)
    offload: str = "none"     # ZeRO-Offload / FSDP CPU offload of optimizer states (and params)
    hsdp_shard: int = 0       # HSDP shard-group size (0 = gpus // 2, i.e. 2 replicas); only for strategy 'hsdp'
    pp_schedule: str = "1f1b"  # pipeline schedule (PP_SCHEDULES); only with pipeline parallelism
    microbatches: int = 0     # micro-batches per step through the pipeline (0: the workload's grad_accum)
    cp: int = 1               # context-parallel degree (torchtitan's context_parallel_degree): each sequence split
    #                           over cp ranks, ring attention; FSDP shards over dp_shard x cp (CP_STRATEGIES only)
    fsdp_wrap: str = "layers"  # FSDP2's units (FSDP_WRAPS); only with an FSDP strategy

    def __post_init__(self) -> None:
        _check_choice("strategy", self.strategy, STRATEGIES)
        _check_choice("offload", self.offload, OFFLOADS)
        _check_int("gpus", self.gpus, 1, MAX_GPUS)
        _check_int("tp", self.tp, 1, MAX_GPUS)
        _check_int("pp", self.pp, 1, MAX_GPUS)
        _check_int("ep", self.ep, 1, MAX_GPUS)
        _check_int("hsdp_shard", self.hsdp_shard, 0, MAX_GPUS)
        _check_choice("pp_schedule", self.pp_schedule, PP_SCHEDULES)
        _check_int("microbatches", self.microbatches, 0, MAX_BATCH)
        _check_int("cp", self.cp, 1, MAX_GPUS)
        _check_choice("fsdp_wrap", self.fsdp_wrap, FSDP_WRAPS)
        if self.fsdp_wrap != "layers" and self.strategy not in CP_STRATEGIES:
            raise ValueError(f"fsdp_wrap: groups FSDP2's units; needs strategy {', '.join(CP_STRATEGIES)}, not "
                             f"{self.strategy!r}")
        if self.fsdp_wrap != "layers" and self.pp > 1:
            raise ValueError("fsdp_wrap: torchtitan's units are traced without pipeline parallelism (each stage wraps "
                             "its own modules); use fsdp_wrap 'layers' with pp")
        if self.cp > 1 and self.strategy not in CP_STRATEGIES:
            raise ValueError(f"cp: context parallelism is priced under FSDP2 (strategy {', '.join(CP_STRATEGIES)}: "
                             f"torchtitan shards over dp_shard x cp), not {self.strategy!r}")
        if self.cp > 1 and (self.pp, self.ep) != (1, 1):
            raise ValueError("cp: context parallelism composed with pp or ep is not priced yet; use cp with FSDP, or "
                             "FSDP x TP (docs/parallel.md, \"Context parallelism\")")
        if self.strategy == "single" and self.gpus != 1:
            raise ValueError(f"strategy: 'single' runs on one GPU, got gpus={self.gpus}; pick ddp, zero1..3, fsdp, tp or pp")
        mesh = self.tp * self.pp * self.ep * self.cp
        if mesh > self.gpus or self.gpus % mesh:
            raise ValueError(f"gpus: tp*pp*ep{'*cp' if self.cp > 1 else ''} = {mesh} must divide gpus={self.gpus}")
        if self.sequence_parallel and self.tp_size == 1:
            raise ValueError("sequence_parallel: needs tensor parallelism (tp > 1 or strategy 'tp')")
        if self.offload != "none" and self.strategy not in ("zero1", "zero2", "zero3", "fsdp", "single"):
            raise ValueError(f"offload: CPU offload needs strategy zero1/zero2/zero3/fsdp, not {self.strategy!r}")
        if (self.pp_schedule != "1f1b" or self.microbatches) and self.pp_size == 1:
            raise ValueError("pp_schedule: the schedule and micro-batches of a pipeline need pipeline parallelism "
                             "(pp > 1 or strategy 'pp')")
        if self.strategy == "hsdp" and self.hsdp_shard and self.gpus % self.hsdp_shard:
            raise ValueError(f"hsdp_shard: {self.hsdp_shard} must divide gpus={self.gpus}")
        if self.strategy == "hsdp" and self.hsdp_shard and self.dp_size % self.hsdp_shard:
            raise ValueError(f"hsdp_shard: {self.hsdp_shard} must divide the data-parallel size "
                             f"gpus / (tp*pp*ep{'*cp' if self.cp > 1 else ''}) = {self.dp_size}")

    @property
    def tp_size(self) -> int:
        return self.gpus if (self.strategy == "tp" and self.tp == 1) else self.tp

    @property
    def pp_size(self) -> int:
        return self.gpus if (self.strategy == "pp" and self.pp == 1) else self.pp

    @property
    def ep_size(self) -> int:
        return self.gpus if (self.strategy == "ep" and self.ep == 1) else self.ep

    @property
    def dp_size(self) -> int:
        """Data-parallel replicas: the ranks that take different batches (the ZeRO/FSDP shard group spans these, and
        with context parallelism the cp ranks that split each of their sequences: estimator.parallel.shard_group)."""
        return max(1, self.gpus // (self.tp_size * self.pp_size * (self.ep_size if self.strategy != "ep" else 1)
                                    * self.cp))


def check_declared(obj) -> None:
    """Each declared field alone: its type, its choices, its bounds (the cross-field rules follow in the class)."""
    for f in fields(obj):
        k, v = knob_of(f), getattr(obj, f.name)
        if isinstance(f.default, bool):
            if not isinstance(v, bool):
                raise ValueError(f"{f.name}: must be true or false, got {v!r}")
        elif isinstance(f.default, int):
            _check_int(f.name, v, k.lo, k.hi)
        elif k.choices:
            _check_choice(f.name, v, k.choices)
        elif isinstance(f.default, tuple):
            if not isinstance(v, tuple) or not v:
                raise ValueError(f"{f.name}: must be a non-empty tuple of module names, e.g. {f.default!r}")
            for t in v:
                if not isinstance(t, str) or not t.replace("_", "").replace(".", "").isalnum() or len(t) > 64:
                    raise ValueError(f"{f.name}: {t!r} is not a module name (letters, digits, '_', '.')")


def spec_dict(obj) -> dict:
    """A dataclass as a flat JSON-friendly dict (tuples become comma-joined strings for lora_targets)."""
    out = {}
    for f in fields(obj):
        v = getattr(obj, f.name)
        out[f.name] = ",".join(v) if isinstance(v, tuple) else v
    return out


# A workload's fields other than its sizes (its class: what a profile is keyed by), read as one tuple (C's attrgetter:
# the memo keys of estimator.estimate.resolve and estimator.evaluate.stage_plans, built on every estimate)
CLASS_FIELDS = tuple(f.name for f in fields(Workload) if f.name not in SIZE_FIELDS)
class_key = operator.attrgetter(*CLASS_FIELDS)
