"""One derivation with and without the store of meta-device models (tracer.runner._META_MODELS), in this process.

    WILLITFIT_TRACE_WORKERS=1 python scripts/bench_meta_store.py --model llama-3.2-1b --rounds 2

Each round derives the same classes twice, the store on then off (off: runner.META_MODELS_KEPT = 0, every build
from transformers' from_config and PEFT), and prints wall and CPU seconds per derivation and a hash of each profile
less its provenance (timings): the two must be equal. A derivation of another class first warms the imports.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from estimator.presets import load_config  # noqa: E402
from estimator.spec import Workload  # noqa: E402
from tracer import runner  # noqa: E402
from tracer.derive import derive_profile  # noqa: E402

CLASSES = {
    "lora r16 q,k,v,o": Workload(method="lora", lora_rank=16, lora_targets=("q_proj", "k_proj", "v_proj", "o_proj")),
    "full, full checkpointing": Workload(checkpointing="full"),
}


def _digest(profile) -> str:
    data = json.loads(profile.to_json())
    data.pop("provenance", None)
    return hashlib.sha1(json.dumps(data, sort_keys=True).encode()).hexdigest()[:12]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="llama-3.2-1b", help="a preset (default llama-3.2-1b)")
    p.add_argument("--rounds", type=int, default=1, help="rounds of (store on, store off) (default 1)")
    args = p.parse_args(argv)
    _, config = load_config(args.model)
    derive_profile(config, Workload(batch=1, seq=64))  # imports, the model's code, FakeTensor's dispatch cache
    kept = runner.META_MODELS_KEPT
    print("| round | store | class | traces | wall s | CPU s | profile |\n|---:|---|---|---:|---:|---:|---|")
    for i in range(args.rounds):
        for on in (True, False):
            runner.META_MODELS_KEPT = kept if on else 0
            runner._META_MODELS.clear()
            for name, workload in CLASSES.items():
                wall, cpu = time.perf_counter(), time.process_time()
                profile = derive_profile(config, workload)
                print(f"| {i + 1} | {'on' if on else 'off'} | {name} | {profile.provenance.get('traces', '')} | "
                      f"{time.perf_counter() - wall:.1f} | {time.process_time() - cpu:.1f} | {_digest(profile)} |",
                      flush=True)
    runner.META_MODELS_KEPT = kept
    return 0


if __name__ == "__main__":
    sys.exit(main())
