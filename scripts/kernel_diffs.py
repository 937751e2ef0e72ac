"""What each CUDA override of the tracer changes, in bytes, on the preset it matters most for.

    python scripts/kernel_diffs.py            # writes the table into docs/activations.md ("## CPU and CUDA kernels")
    python scripts/kernel_diffs.py --no-doc

For every override of tracer.kernels.emulate("cuda") (OVERRIDES) and a preset where it matters, the case
is traced twice with CUDA's kernels, once with that one override left out (the CPU's own kernel in its place):
the difference of the forward-stage peak and of the overall peak is what the CPU kernel keeps more (positive) or
less (negative) than CUDA's. Batch 4, seq 2048 (a preset's learned positions if fewer), full fine-tuning, pure bf16
unless the row says amp, AdamW foreach, two steps. The labels row is not a kernel: `--kernels cpu` passes the
input ids tensor itself as labels (the plain loop), `cuda` a clone (a data collator): 8 * b * s bytes.
"""
from __future__ import annotations

import argparse
import sys
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from scripts.perf_doc import replace_section  # noqa: E402

DOC = Path(__file__).resolve().parent.parent / "docs" / "activations.md"
HEADING = "## CPU and CUDA kernels, measured"
MiB = 2**20
# (override, preset, workload changes, what the CPU keeps, what CUDA keeps, CUDA source)
CASES = (
    ("sdpa", "gpt2", {}, "math SDPA (dropout_p > 0): fp32 q, k, v, the fp32 s x s softmax and its dropout mask",
     "flash: q, k, v, output, fp32 logsumexp, RNG state; dropout in-kernel",
     "transformers/cuda/sdp_utils.cpp can_use_flash_attention; attention.cpp"),
    ("sdpa", "bert-large-uncased", {}, "as GPT-2 (attention_probs_dropout_prob 0.1)", "as GPT-2", "as GPT-2"),
    ("sdpa", "deepseek-v2-lite", {}, "math SDPA (q/k and v head sizes differ: 192, 128)",
     "memory-efficient: q, k, v, output, fp32 logsumexp padded to 32 rows",
     "sdp_utils.cpp check_head_dim_size_flash / _mem_efficient"),
    ("dropout", "opt-1.3b", {}, "dropout noise in the input dtype (2 B per element in bf16)",
     "native_dropout's bool mask (1 B per element)", "native/Dropout.cpp dropout(); native/cuda/Dropout.cu"),
    ("autocast", "gpt2", {"recipe": "amp"}, "CPU lists: pow, softmax, layer_norm in bf16",
     "CUDA lists: gelu_new's pow (so its whole chain), softmax, layer_norm in fp32",
     "autocast_mode.h AT_FORALL_FP32 / _SET_OPT_DTYPE; autocast_mode.cpp:181"),
    ("autocast", "bert-large-uncased", {"recipe": "amp"}, "CPU lists: cross_entropy_loss in fp32 (an fp32 copy "
     "and fp32 log-probs); layer_norm in bf16", "bf16 log-probs and nll_loss's fp32 copy; fp32 layer_norm",
     "autocast_mode.h; native/LossNLL.cpp cross_entropy_loss"),
    ("layer_norm", "pythia-1.4b", {}, "LayerNorm mean/rstd in bf16", "fp32 mean/rstd",
     "native/cuda/layer_norm_kernel.cu layer_norm_cuda (acc_type)"),
    ("layer_norm", "falcon-7b", {}, "as Pythia", "as Pythia", "as Pythia"),
    ("packed_sequences", "llama-3.2-1b", {}, "transformers' packed-sequence check under fake tensors: a (b, 1, s, s) "
     "mask, made additive per layer and saved by SDPA, and K/V repeated to every query head",
     "no mask: is_causal SDPA with enable_gqa (K/V kv-head wide)", "transformers masking_utils (not a kernel)"),
    ("packed_sequences", "mistral-7b", {}, "as Llama", "as Llama", "as Llama"),
    ("packed_sequences", "falcon-7b", {}, "nothing more: Falcon always builds its (b, 1, s, s) causal mask "
     "(`create_causal_mask(..., allow_is_causal_skip=False)`, no position_ids, so no packed check)",
     "the same mask, kept by the math SDPA (multi-query)", "transformers models/falcon/modeling_falcon.py"),
)


def peaks(config: dict, name: str, workload, skip: tuple[str, ...]) -> tuple[int, int]:
    """(forward-stage peak, overall peak) with CUDA's kernels less `skip`."""
    from estimator.spec import Parallel
    from tracer import kernels, session

    session.check_learned_positions(config, name, workload)
    with kernels.emulate("cuda", skip=skip), session._prepared(config, workload, Parallel()) as case:
        counter = session._run(case, 2)
    log = counter.log()
    return next(s.peak_bytes for s in log.stages if s.stage == "forward"), log.peak.peak_bytes


def measure(batch: int, seq: int) -> list[dict]:
    from dataclasses import replace

    from estimator.model import from_hf_config
    from estimator.presets import load_config
    from estimator.spec import Workload

    rows = []
    for override, preset, changes, cpu, cuda, source in CASES:
        start = time.perf_counter()
        name, config = load_config(preset)
        s = min(seq, from_hf_config(config, name, derive=False).max_positions)
        w = replace(Workload(batch=batch, seq=s), **changes)
        f_all, p_all = peaks(config, name, w, ())
        f_cpu, p_cpu = peaks(config, name, w, (override,))
        rows.append({"override": override, "preset": preset, "seq": s, "amp": bool(changes), "cpu": cpu,
                     "cuda": cuda, "source": source, "forward": f_cpu - f_all, "overall": p_cpu - p_all})
        print(f"{override:17s} {preset:20s} seq {s:5d}  forward {f_cpu - f_all:+,} B  overall {p_cpu - p_all:+,} B "
              f"({time.perf_counter() - start:.0f} s)", flush=True)
    return rows


def table(rows: list[dict], batch: int) -> str:
    lines = ["| override | preset (b, s) | the CPU keeps | CUDA keeps | CPU - CUDA, forward peak | "
             "CPU - CUDA, overall peak | CUDA source |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['override']} | {r['preset']}{' amp' if r['amp'] else ''} ({batch}, {r['seq']}) | "
                     f"{r['cpu']} | {r['cuda']} | {r['forward']:+,} B ({r['forward'] / MiB:+,.1f} MiB) | "
                     f"{r['overall']:+,} B ({r['overall'] / MiB:+,.1f} MiB) | {r['source']} |")
    lines.append(f"| labels (not a kernel) | any ({batch}, s) | the input ids as labels | a clone (data collator) | "
                 f"-8 * b * s B ({-8 * batch * 2048:+,} B at s 2048) | the same | "
                 "transformers DataCollatorForLanguageModeling |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, default=4, help="sequences per step (default 4)")
    p.add_argument("--seq", type=int, default=2048, help="tokens per sequence (default 2048)")
    p.add_argument("--no-doc", action="store_true", help="print only; do not write docs/activations.md")
    args = p.parse_args(argv)
    warnings.filterwarnings("ignore")
    text = table(measure(args.batch, args.seq), args.batch)
    print(text)
    if not args.no_doc:
        cmd = "python scripts/kernel_diffs.py" + (f" --batch {args.batch}" if args.batch != 4 else "") + \
            (f" --seq {args.seq}" if args.seq != 2048 else "")
        replace_section(HEADING, f"{HEADING}\n\nMade with `{cmd}`: each row traces the preset with CUDA's kernels "
                        "twice, once with that override left out; MiB = 2^20 B.\n\n" + text + "\n", DOC)
    return 0


if __name__ == "__main__":
    sys.exit(main())
