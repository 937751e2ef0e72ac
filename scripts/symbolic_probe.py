"""Would symbolic shapes make a derivation cheaper? One reduced-depth forward + backward, concrete vs symbolic sizes.

    python scripts/symbolic_probe.py [--model llama-3.1-8b] [--repeat 3]

A derivation traces each reduced model at 11 concrete sizes per batch region (tracer.derive); with symbolic batch and
sequence (FakeTensorMode(shape_env=ShapeEnv()), inputs with DimDynamic.DYNAMIC sizes) one trace would give every
allocation as an expression in (b, s) instead. This measures what that trace costs against a concrete one, and which
guards the model's code puts on the sizes (a guard `Eq(s, 512)` specialises the size: the trace is then of that size
only). transformers' loss pads the labels with torch.nn.functional.pad, whose C++ path (and aten.constant_pad_nd's
fake kernel) reads the sizes as ints and so specialises both; the probe routes constant pads through the Python
reference torch._refs.constant_pad_nd, after which a Llama forward, loss and backward put no guard on the sizes.
Prints; writes nothing.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llama-3.1-8b", help="preset or config.json (default llama-3.1-8b)")
    ap.add_argument("--repeat", type=int, default=3, help="timed runs of each kind (default 3; the best is shown)")
    args = ap.parse_args(argv)

    import torch
    import torch.nn.functional as F
    from torch._dynamo.source import ConstantSource
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv, StatelessSymbolicContext

    from estimator.presets import load_config
    from estimator.spec import Workload
    from tracer import runner
    from tracer.depth import decoder_layer_list

    name, cfg = load_config(args.model)
    w = Workload(batch=2, seq=512)
    n = len(decoder_layer_list(runner.build_model(cfg, w, "meta"))[2])
    layers = [0, 1, n - 1]
    pad = F.pad

    def sym_pad(input, pad_, mode="constant", value=None):
        if mode == "constant":
            return torch._refs.constant_pad_nd(input, list(pad_), 0 if value is None else value)
        return pad(input, pad_, mode, value)

    def run(symbolic: bool) -> tuple[float, list[str]]:
        model = runner.build_model(cfg, w, "meta", layers=layers)
        env = ShapeEnv()
        fm = FakeTensorMode(shape_env=env if symbolic else None, allow_non_fake_inputs=True)
        ids = torch.randint(0, 1000, (2, 512))
        x = fm.from_tensor(ids, symbolic_context=StatelessSymbolicContext([DimDynamic.DYNAMIC] * 2),
                           source=ConstantSource("x")) if symbolic else fm.from_tensor(ids)
        t = time.process_time()
        with fm:
            runner._materialize(model, "cpu")
            out = model(input_ids=x, labels=x)
            out.loss.backward()
        return time.process_time() - t, [str(g.expr) for g in env.guards]

    F.pad = sym_pad
    try:
        run(False)
        run(True)   # warm both paths (imports, caches)
        concrete = min(run(False)[0] for _ in range(args.repeat))
        results = [run(True) for _ in range(args.repeat)]
    finally:
        F.pad = pad
    symbolic = min(t for t, _ in results)
    print(f"{name}, {len(layers)} of {n} layers, batch 2 x seq 512, forward + backward with the loss, CPU seconds "
          f"(best of {args.repeat}):")
    print(f"  concrete sizes: {concrete:.3f} s")
    print(f"  symbolic sizes: {symbolic:.3f} s ({symbolic / concrete:.1f}x)")
    print(f"  guards on the sizes: {', '.join(results[-1][1]) or 'none'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
