"""The fixed grid of scripts/bench_cold.py: (model, knob combination) pairs whose profile is not shipped.

Each pair is a `python -m estimator` command line (its model, its workload and parallel flags, a GPU for the
verdict) and the categories it covers. Models are presets (data/models) or config.json files of model types that
are not presets, written from transformers' own config classes (`AutoConfig.for_model(t).to_dict()`, no network)
into scripts/bench_cold_configs/ by `python scripts/bench_cold.py --write-configs`.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CONFIG_DIR = ROOT / "scripts" / "bench_cold_configs"
# model types transformers 5 has and data/models has not; their default configs are 2.6-35 B decoders
NON_PRESET_TYPES = ("olmo2", "granite", "starcoder2", "stablelm", "glm", "cohere", "exaone4", "helium")
# what the grid must cover (tests/test_bench_cold.py checks each is present)
CATEGORIES = ("lora-rank", "lora-qkvo", "lora-all-linear", "qlora", "ckpt-full", "ckpt-selective", "ckpt-op-sac",
              "fsdp", "ddp", "zero", "tp", "pp", "loss-chunked", "loss-fused", "opt-in-backward", "act-offload",
              "compile", "long-infer-fp8-kv", "preset", "non-preset")

QKVO = "q_proj,k_proj,v_proj,o_proj"
ALL_LINEAR = "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj"


@dataclass(frozen=True)
class Pair:
    name: str                 # unique; what --only matches
    model: str                # a preset name, or a model type of NON_PRESET_TYPES (its config under CONFIG_DIR)
    flags: tuple[str, ...]    # python -m estimator flags besides --model and --json
    tags: tuple[str, ...]     # CATEGORIES it covers ('preset' / 'non-preset' are added from the model)

    @property
    def model_arg(self) -> str:
        """What --model gets: the preset name, or the path of the written config.json."""
        return str(CONFIG_DIR / f"{self.model}.json") if self.model in NON_PRESET_TYPES else self.model

    @property
    def categories(self) -> tuple[str, ...]:
        return self.tags + (("non-preset",) if self.model in NON_PRESET_TYPES else ("preset",))

    def argv(self) -> list[str]:
        return ["--model", self.model_arg, *self.flags, "--json"]


def _lora(rank: int, targets: str) -> tuple[str, ...]:
    return ("--method", "lora", "--lora-rank", str(rank), "--lora-targets", targets)


def _qlora(rank: int, targets: str) -> tuple[str, ...]:
    return ("--method", "qlora", "--lora-rank", str(rank), "--lora-targets", targets)


def _par(strategy: str, gpus: int, *more: str) -> tuple[str, ...]:
    return ("--strategy", strategy, "--gpus", str(gpus), *more)


def _p(name, model, flags, *tags, gpu="h100-sxm-80gb") -> Pair:
    size = () if "--seq" in flags else ("--batch", "2", "--seq", "2048")  # long-context pairs give their own
    return Pair(name, model, (*flags, *size, "--gpu", gpu), tags)


def _grid() -> tuple[Pair, ...]:
    g = [
        # LoRA: ranks 8..128, q/k/v/o and every Linear of the blocks
        _p("llama8b-lora-r16-qkvo", "llama-3.1-8b", _lora(16, QKVO), "lora-rank", "lora-qkvo", gpu="l4"),
        _p("qwen7b-lora-r64-all", "qwen2.5-7b", _lora(64, ALL_LINEAR), "lora-rank", "lora-all-linear", gpu="a10g"),
        _p("mistral7b-lora-r128-qkvo", "mistral-7b", _lora(128, QKVO), "lora-rank", "lora-qkvo", gpu="rtx-4090"),
        _p("gemma2-9b-lora-r8-qkvo", "gemma-2-9b", _lora(8, QKVO), "lora-rank", "lora-qkvo"),
        _p("olmo2-lora-r32-all", "olmo2", _lora(32, ALL_LINEAR), "lora-rank", "lora-all-linear", gpu="l4"),
        _p("phi3-lora-r16-fused", "phi-3-mini", _lora(16, "qkv_proj,o_proj"), "lora-rank", gpu="t4"),
        _p("granite-lora-r128-all", "granite", _lora(128, ALL_LINEAR) + ("--checkpointing", "full"), "lora-rank",
           "lora-all-linear", "ckpt-full", gpu="l4"),
        # QLoRA
        _p("llama70b-qlora-r64-all-ckpt", "llama-3.1-70b", _qlora(64, ALL_LINEAR) + ("--checkpointing", "full"),
           "qlora", "lora-rank", "lora-all-linear", "ckpt-full", gpu="a100-sxm-40gb"),
        _p("mixtral-qlora-r16-qkvo", "mixtral-8x7b", _qlora(16, QKVO), "qlora", "lora-qkvo"),
        _p("helium-qlora-r8", "helium", _qlora(8, "q_proj,v_proj"), "qlora", gpu="t4"),
        _p("qwen3-14b-qlora-adapted", "qwen3-14b", _qlora(32, QKVO) + ("--quantize-scope", "adapted"), "qlora",
           "lora-qkvo", gpu="rtx-4090"),
        # activation checkpointing
        # (llama-3.2-3b and llama-3.1-70b ship their selective class since 2026-11-26: qwen3-4b and qwen2.5-72b here)
        # qwen3-4b's selective class ships since 2026-11-27: the selective pair moved to a preset that does not
        # (and pythia-1.4b's since later that day: falcon-7b here)
        # (falcon-7b's selective checkpointing is refused since 2026-11-28: Falcon's attention never calls transformers'
        # AttentionInterface, which the 2026-11-28 run found as a KeyError; a hybrid preset here instead)
        # (nemotron-h-8b's pure bf16 selective class ships since 2026-11-29, replayed: amp here)
        _p("nemotronh8b-amp-ckpt-selective", "nemotron-h-8b", ("--recipe", "amp", "--checkpointing", "selective"),
           "ckpt-selective", gpu="l4"),
        _p("qwen3-8b-ckpt-op-sac", "qwen3-8b", ("--checkpointing", "op-sac"), "ckpt-op-sac"),
        _p("starcoder2-ckpt-full", "starcoder2", ("--checkpointing", "full"), "ckpt-full"),
        _p("gemma3-4b-lora-ckpt-full", "gemma-3-4b", _lora(16, QKVO) + ("--checkpointing", "full"), "ckpt-full",
           "lora-qkvo", "lora-rank", gpu="l4"),
        _p("stablelm-ckpt-op-sac-amp", "stablelm", ("--checkpointing", "op-sac", "--recipe", "amp"), "ckpt-op-sac"),
        # parallelism: FSDP, DDP, ZeRO, TP, PP at 2..64 GPUs
        _p("llama70b-fsdp8-selective", "llama-3.1-70b", _par("fsdp", 8) + ("--checkpointing", "selective"), "fsdp",
           "ckpt-selective"),
        _p("llama405b-fsdp64-tp8-ckpt", "llama-3.1-405b", _par("fsdp", 64, "--tp", "8") +
           ("--checkpointing", "full", "--recipe", "fsdp-mp"), "fsdp", "tp", "ckpt-full"),
        _p("qwen72b-zero3-32-selective", "qwen2.5-72b", _par("zero3", 32) + ("--checkpointing", "selective"),
           "zero", "ckpt-selective"),
        _p("llama8b-ddp4-amp-op-sac", "llama-3.1-8b", _par("ddp", 4) + ("--recipe", "amp", "--checkpointing",
                                                                          "op-sac"), "ddp", "ckpt-op-sac"),
        _p("mistral7b-zero1-8-mixed-selective", "mistral-7b", _par("zero1", 8) +
           ("--recipe", "mixed", "--checkpointing", "selective"), "zero", "ckpt-selective"),
        _p("qwen3-14b-zero2-16-lora-r32", "qwen3-14b", _par("zero2", 16) + _lora(32, ALL_LINEAR) +
           ("--checkpointing", "op-sac"), "zero", "lora-rank", "lora-all-linear", "ckpt-op-sac"),
        # qwen2.5-72b's selective class ships since 2026-11-27 (its TP rank is priced from it): moved likewise, and
        # again from codellama-34b, whose selective class shipped later that day
        # (and gemma-2-9b's pure bf16 one since 2026-11-29: amp here)
        _p("gemma2-9b-tp8-sp-amp-selective", "gemma-2-9b", _par("tp", 8, "--sequence-parallel") +
           ("--recipe", "amp", "--checkpointing", "selective"), "tp", "ckpt-selective"),
        _p("llama2-70b-pp4-ga8-ckpt", "llama-2-70b", _par("pp", 4) + ("--grad-accum", "8", "--checkpointing",
                                                                         "selective"), "pp", "ckpt-selective"),
        _p("qwen3-32b-hsdp16-ckpt", "qwen3-32b", ("--dp-shard", "8", "--dp-replicate", "2", "--checkpointing",
                                                  "selective"), "fsdp", "ckpt-selective"),
        _p("cohere-fsdp2-grad-op", "cohere", _par("fsdp-grad-op", 2), "fsdp"),
        _p("glm-tp2-ckpt-full", "glm", _par("tp", 2) + ("--checkpointing", "full"), "tp", "ckpt-full"),
        _p("qwen3-30b-a3b-pp2-gpipe", "qwen3-30b-a3b", _par("pp", 2, "--pp-schedule", "gpipe") +
           ("--grad-accum", "4", "--checkpointing", "full"), "pp", "ckpt-full"),
        _p("exaone4-ddp2-op-sac", "exaone4", _par("ddp", 2) + ("--checkpointing", "op-sac"), "ddp", "ckpt-op-sac"),
        # the loss: chunked (torchtune) and fused-linear (Liger)
        _p("llama8b-chunked-selective", "llama-3.1-8b", ("--loss", "chunked", "--checkpointing", "selective"),
           "loss-chunked", "ckpt-selective"),
        _p("qwen7b-fused-linear", "qwen2.5-7b", ("--loss", "fused-linear"), "loss-fused"),
        _p("gemma3-12b-lora-chunked16", "gemma-3-12b", _lora(8, QKVO) + ("--loss", "chunked", "--loss-chunks",
                                                                         "16"), "loss-chunked", "lora-qkvo"),
        _p("olmo2-fused-linear-ckpt", "olmo2", ("--loss", "fused-linear", "--checkpointing", "full"), "loss-fused",
           "ckpt-full"),
        # optimizer in backward (torchtune optimizer_in_bwd)
        _p("llama1b-opt-in-bwd-op-sac", "llama-3.2-1b", ("--optimizer-in-backward", "--checkpointing", "op-sac"),
           "opt-in-backward", "ckpt-op-sac", gpu="t4"),
        _p("phi4-opt-in-bwd-paged", "phi-4", ("--optimizer-in-backward", "--optimizer", "paged-adamw",
                                              "--checkpointing", "full", "--loss", "chunked"),
           "opt-in-backward", "ckpt-full", "loss-chunked"),
        _p("stablelm-opt-in-bwd", "stablelm", ("--optimizer-in-backward",), "opt-in-backward", gpu="a10g"),
        # activation offloading (torchtune enable_activation_offloading)
        _p("llama8b-lora-r32-offload-ckpt", "llama-3.1-8b", _lora(32, QKVO) + ("--activation-offload",
                                                                               "--checkpointing", "full"),
           "act-offload", "lora-rank", "lora-qkvo", "ckpt-full", gpu="l4"),
        _p("qwen3-4b-offload-op-sac", "qwen3-4b", ("--activation-offload", "--checkpointing", "op-sac"),
           "act-offload", "ckpt-op-sac"),
        _p("exaone4-offload-ckpt", "exaone4", ("--activation-offload", "--checkpointing", "full"), "act-offload",
           "ckpt-full"),
        # torch.compile (AOTAutograd's saved tensors)
        _p("qwen3-1.7b-compile", "qwen3-1.7b", ("--compile",), "compile", gpu="l4"),
        _p("qwen0.5b-compile-lora", "qwen2.5-0.5b", ("--compile",) + _lora(16, ALL_LINEAR), "compile", "lora-rank",
           "lora-all-linear", gpu="t4"),
        _p("helium-compile-ddp2", "helium", ("--compile",) + _par("ddp", 2), "compile", "ddp"),
        # long-context inference with an fp8 KV cache
        # (FlashAttention-2 on a text model is SDPA's class since 2026-11-28, estimator.estimate.traced_class: the
        # bf16 flash pairs on llama-3.1-8b, qwen2.5-72b x tp4 and llama-4-scout became shipped and moved to fp16 and
        # mistral-7b in fp16)
        _p("llama8b-infer-124k-fp8kv-fp16", "llama-3.1-8b", ("--mode", "infer", "--attention", "flash",
                                                           "--precision", "fp16", "--kv-dtype", "fp8", "--batch",
                                                           "1", "--seq", "126976", "--gen-tokens", "4096"),
           "long-infer-fp8-kv"),
        _p("qwen72b-infer-32k-fp8kv-tp4-fp16", "qwen2.5-72b", ("--mode", "infer", "--attention", "flash",
                                                              "--precision", "fp16", "--kv-dtype", "fp8", "--batch",
                                                              "4", "--seq", "30720", "--gen-tokens", "2048")
           + _par("tp", 4), "long-infer-fp8-kv", "tp"),
        _p("glm-infer-128k-fp8kv", "glm", ("--mode", "infer", "--kv-dtype", "fp8", "--batch", "1", "--seq",
                                           "126976", "--gen-tokens", "4096"), "long-infer-fp8-kv"),
        _p("mistral7b-infer-28k-fp8kv-fp16", "mistral-7b", ("--mode", "infer", "--attention", "flash",
                                                            "--precision", "fp16", "--kv-dtype", "fp8", "--batch",
                                                            "2", "--seq", "28672", "--gen-tokens", "4096"),
           "long-infer-fp8-kv"),
        _p("cohere-infer-8k-fp8kv-fp16", "cohere", ("--mode", "infer", "--precision", "fp16", "--kv-dtype", "fp8",
                                                    "--batch", "8", "--seq", "7168", "--gen-tokens", "1024"),
           "long-infer-fp8-kv"),
    ]
    return tuple(g)


GRID = _grid()
