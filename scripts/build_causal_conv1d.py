"""Build causal-conv1d's CUDA extension (`causal_conv1d_cuda`) for one GPU architecture, for a measuring session.

    python scripts/build_causal_conv1d.py CSRC BUILD_DIR [--arch 90]

CSRC is the `csrc` folder of Dao-AILab/causal-conv1d at the commit docs/activations.md cites (0d2252d1); BUILD_DIR
then holds `causal_conv1d_cuda.so`, importable with BUILD_DIR on sys.path (the package's `cpp_functions` imports
it by that name). The nvcc flags are the package's own setup.py's, with one `-gencode` for `--arch` instead of
its eight: a build for the card in hand takes a minute or two on 16 cores instead of many. Needs nvcc and ninja
(torch.utils.cpp_extension); scripts/measure_kernels.sh runs it in the background on the GPU machine.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

SOURCES = ("causal_conv1d.cpp", "causal_conv1d_fwd.cu", "causal_conv1d_bwd.cu", "causal_conv1d_update.cu")
NVCC_FLAGS = [  # causal-conv1d setup.py (commit 0d2252d1), CUDA branch, without the -gencode list
    "-O3", "-U__CUDA_NO_HALF_OPERATORS__", "-U__CUDA_NO_HALF_CONVERSIONS__", "-U__CUDA_NO_BFLOAT16_OPERATORS__",
    "-U__CUDA_NO_BFLOAT16_CONVERSIONS__", "-U__CUDA_NO_BFLOAT162_OPERATORS__", "-U__CUDA_NO_BFLOAT162_CONVERSIONS__",
    "--expt-relaxed-constexpr", "--expt-extended-lambda", "--use_fast_math", "-lineinfo", "--threads", "4",
]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("csrc", type=Path)
    p.add_argument("build", type=Path)
    p.add_argument("--arch", default="90", help="compute capability without the dot (default 90: H100, H200)")
    args = p.parse_args(argv)
    missing = [s for s in SOURCES if not (args.csrc / s).is_file()]
    if missing:
        print(f"error: csrc: {args.csrc} lacks {', '.join(missing)}", file=sys.stderr)
        return 2
    from torch.utils.cpp_extension import load

    args.build.mkdir(parents=True, exist_ok=True)
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
