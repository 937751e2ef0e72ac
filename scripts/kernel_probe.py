"""Which implementation transformers resolved for each kernel function of the hybrid models a session measures.

    python scripts/kernel_probe.py [--out probe.json]

transformers (5.23, `integrations.hub_kernels.use_kernel_func_from_hub_with_fallback`) binds each of these
functions once, at import: the package's kernel when `fla`, `mamba_ssm` or `causal_conv1d` imports, else its own
torch reference, silently. A row measured on the reference would be filed as the CUDA kernels' truth, so
scripts/measure_kernels.sh measures the hybrid phases only when this exits 0: every function of every module below
resolved to a package (per model: `--ok` names the measuring plan's configs whose module did). Prints one JSON
object {module: {function: implementation}}.
"""
from __future__ import annotations

import argparse
import importlib
import inspect
import json
import sys

MODULES = {  # module: the config of scripts/measure_plan.py's hybrid phases it runs
    "transformers.models.qwen3_5.modeling_qwen3_5": "qwen3.5-text-8l",
    "transformers.models.nemotron_h.modeling_nemotron_h": "nemotron-h-8l",
}


def resolved(module_name: str) -> dict[str, str]:
    """{function: "package.module.name" of what it calls, or "torch reference"} for the module's kernel functions."""
    module = importlib.import_module(module_name)
    out = {}
    for name, fn in sorted(vars(module).items()):
        if not inspect.isfunction(fn) or fn.__closure__ is None:
            continue
        free = dict(zip(fn.__code__.co_freevars, (c.cell_contents for c in fn.__closure__)))
        if "implementation" not in free or "torch_function" not in free:
            continue
        impl = free["implementation"]
        out[name] = ("torch reference" if impl is free["torch_function"]
                     else f"{getattr(impl, '__module__', '?')}.{getattr(impl, '__qualname__', repr(impl))}")
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=None, help="also write the JSON here")
    p.add_argument("--ok", default=None, help="write the configs whose kernels all resolved here, as a regex a|b")
    args = p.parse_args(argv)
    found = {m: resolved(m) for m in MODULES}
    text = json.dumps(found, indent=1)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    ok = [MODULES[m] for m, fns in found.items() if fns and "torch reference" not in fns.values()]
    if args.ok:
        with open(args.ok, "w") as f:
            f.write("|".join(ok) + "\n")
    missing = [f"{m.rsplit('.', 1)[-1]}.{fn}" for m, fns in found.items() for fn, impl in fns.items()
               if impl == "torch reference"]
    if missing or not all(found.values()):
        print("error: on the torch reference: " + (", ".join(missing) or "no kernel function found"), file=sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
