"""Build causal-conv1d's CUDA extension (`causal_conv1d_cuda`) for one GPU architecture, for a measuring session.

    python scripts/build_causal_conv1d.py CSRC BUILD_DIR [--arch 90] [--bf16-only]

CSRC is the `csrc` folder of Dao-AILab/causal-conv1d at the commit docs/activations.md cites (0d2252d1); BUILD_DIR
then holds `causal_conv1d_cuda.so`, importable with BUILD_DIR on sys.path (the package's `cpp_functions` imports
it by that name). The nvcc flags are the package's own setup.py's, with one `-gencode` for `--arch` instead of
its eight. Even so, on an H200's machine (16 cores) the build had not finished after 300 s (2026-11-28): each
kernel is instantiated for 9 (input, weight) dtype pairs. `--bf16-only` builds a copy of the sources with only the
bf16 x bf16 pair (the dispatch macros of causal_conv1d.cpp narrowed to BFloat16, the other explicit instantiations
of the .cu files dropped): what a pure-bf16 step calls, with the same kernels and allocations; any other dtype
then fails with the package's own "not implemented" error. Needs nvcc and ninja (torch.utils.cpp_extension);
scripts/measure_kernels.sh runs it on the GPU machine.
"""
from __future__ import annotations

import argparse
import os
import re
import shutil
import sys
import time
from pathlib import Path

SOURCES = ("causal_conv1d.cpp", "causal_conv1d_fwd.cu", "causal_conv1d_bwd.cu", "causal_conv1d_update.cu")
NVCC_FLAGS = [  # causal-conv1d setup.py (commit 0d2252d1), CUDA branch, without the -gencode list
    "-O3", "-U__CUDA_NO_HALF_OPERATORS__", "-U__CUDA_NO_HALF_CONVERSIONS__", "-U__CUDA_NO_BFLOAT16_OPERATORS__",
    "-U__CUDA_NO_BFLOAT16_CONVERSIONS__", "-U__CUDA_NO_BFLOAT162_OPERATORS__", "-U__CUDA_NO_BFLOAT162_CONVERSIONS__",
    "--expt-relaxed-constexpr", "--expt-extended-lambda", "--use_fast_math", "-lineinfo", "--threads", "4",
]


BF16 = "at::BFloat16"
_DISPATCH = re.compile(r"#define DISPATCH_([IW])TYPE_FLOAT_AND_HALF_AND_BF16\((\w+), NAME, \.\.\.\).*?\n\n", re.S)
_INSTANCE = re.compile(r"^template void \w+<([\w:]+), ([\w:]+)>\(.*\);\n", re.M)


def bf16_only(csrc: Path, dest: Path) -> Path:
    """A copy of `csrc` whose kernels exist for bf16 inputs and weights only (see the module docstring)."""
    shutil.rmtree(dest, ignore_errors=True)
    shutil.copytree(csrc, dest)
    cpp = dest / "causal_conv1d.cpp"

    def narrowed(m: re.Match) -> str:
        kind, var = m.group(1), m.group(2)
        name = "input_t" if kind == "I" else "weight_t"
        what = "input" if kind == "I" else "weight"
        return (f"#define DISPATCH_{kind}TYPE_FLOAT_AND_HALF_AND_BF16({var}, NAME, ...) \\\n"
                f"    if ({var} == at::ScalarType::BFloat16) {{ using {name} = at::BFloat16; __VA_ARGS__(); }} \\\n"
                f"    else {{ AT_ERROR(#NAME, \" not implemented for {what} type '\", toString({var}), \"'\"); }}\n\n")

    text, n = _DISPATCH.subn(narrowed, cpp.read_text())
    if n != 2:
        raise ValueError(f"csrc: causal_conv1d.cpp has {n} dispatch macros where 2 were expected")
    cpp.write_text(text)
    for cu in SOURCES[1:]:
        path = dest / cu
        text = _INSTANCE.sub(lambda m: m.group(0) if (m.group(1), m.group(2)) == (BF16, BF16) else "",
                             path.read_text())
        if f"<{BF16}, {BF16}>" not in text:
            raise ValueError(f"csrc: {cu} has no bf16 x bf16 instantiation")
        path.write_text(text)
    return dest


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("csrc", type=Path)
    p.add_argument("build", type=Path)
    p.add_argument("--arch", default="90", help="compute capability without the dot (default 90: H100, H200)")
    p.add_argument("--bf16-only", action="store_true", help="kernels for bf16 inputs and weights only (fast)")
    args = p.parse_args(argv)
    missing = [s for s in SOURCES if not (args.csrc / s).is_file()]
    if missing:
        print(f"error: csrc: {args.csrc} lacks {', '.join(missing)}", file=sys.stderr)
        return 2
    from torch.utils.cpp_extension import load

    args.build.mkdir(parents=True, exist_ok=True)
    if args.bf16_only:
        args.csrc = bf16_only(args.csrc, args.build / "csrc-bf16")
    os.environ.setdefault("MAX_JOBS", str(os.cpu_count() or 4))
    start = time.time()
    module = load(name="causal_conv1d_cuda", sources=[str(args.csrc / s) for s in SOURCES],
                  extra_cflags=["-O3"], extra_include_paths=[str(args.csrc)], build_directory=str(args.build),
                  extra_cuda_cflags=NVCC_FLAGS + ["-gencode", f"arch=compute_{args.arch},code=sm_{args.arch}"],
                  verbose=True)
    print(f"built {module.__file__} in {time.time() - start:.1f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
