"""Context parallelism on fake tensors: one training step of each CP rank, as torch's `context_parallel` runs it.

    python scripts/cp_probe.py --cp 4 --batch 2 --seq 4096          # a 4-layer Llama of 1024 hidden, every rank
    python scripts/cp_probe.py --cp 2 --seq 2048 --layers 2

The probe that came before pricing CP (the estimator prices it since 2026-11-27: `--cp`, tracer.cp, with FSDP2 over
dp_shard x cp as torchtitan runs it); kept as the smallest view of the mechanism, without FSDP. It builds a small Llama (random weights, meta then fake storage), opens a fake
process group of `cp` ranks and, for each rank, runs forward and backward inside
`torch.distributed.tensor.experimental.context_parallel` (torchtitan's CP: input ids, labels and position ids
sharded along the sequence with the head-tail load balancer; SDPA becomes ring attention, K and V all-gathered once
per call, the default rotate method) under CUDA's kernels (tracer.kernels.emulate). It counts live storage bytes
(tracer.counters.StorageCounter) and prints each rank's forward and backward peaks beside the same step without CP
at seq / cp and at seq: what "divide the activations by cp" would say, and what one GPU would hold.
"""
from __future__ import annotations

import argparse
import sys
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.distributed.tensor.experimental._context_parallel._attention as cp_attention  # noqa: E402
from torch._subclasses.fake_tensor import FakeTensorMode  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.distributed.tensor.experimental import context_parallel  # noqa: E402
from torch.testing._internal.distributed.fake_pg import FakeStore  # noqa: E402

from estimator.spec import Workload  # noqa: E402
from estimator.units import GiB  # noqa: E402
from tracer import kernels  # noqa: E402
from tracer.counters import StorageCounter  # noqa: E402
from tracer.runner import build_model  # noqa: E402


def config(layers: int, hidden: int) -> dict:
    return {"model_type": "llama", "hidden_size": hidden, "intermediate_size": 4 * hidden, "num_hidden_layers": layers,
            "num_attention_heads": hidden // 64, "num_key_value_heads": max(1, hidden // 256), "vocab_size": 32000,
            "max_position_embeddings": 1 << 17}


def step(cfg: dict, batch: int, seq: int, mesh=None) -> tuple[dict[str, int], Counter]:
    """(peak live bytes per stage, ring calls and all-gather sizes) of one bf16 forward and backward."""
    calls: Counter = Counter()
    gather = cp_attention.ft_c.all_gather_single

    def counted(t, *a, **k):
        calls[f"K+V all-gather of {t.numel()} elements"] += 1
        return gather(t, *a, **k)

    cp_attention.ft_c.all_gather_single = counted
    try:
        with kernels.emulate("cuda"), FakeTensorMode(allow_non_fake_inputs=True):
            model = build_model(cfg, Workload(batch=batch, seq=seq), "cpu", meta_then_empty=True)
            ids = torch.randint(0, cfg["vocab_size"], (batch, seq))
            labels = ids.clone()
            pos = torch.arange(seq).unsqueeze(0).expand(batch, -1).contiguous()
            with StorageCounter() as counter:
                counter.track(list(model.parameters()), "weights")
                counter.track([ids, labels, pos], "other")
                ctx = (context_parallel(mesh, buffers=[ids, labels, pos], buffer_seq_dims=[1, 1, 1],
                                        no_restore_buffers={ids, labels, pos}) if mesh is not None else None)
                if ctx is not None:
                    ctx.__enter__()
                try:
                    counter.mark_stage("load")
                    loss = model(input_ids=ids, position_ids=pos, labels=labels).loss
                    counter.mark_stage("forward")
                    loss.backward()
                    counter.mark_stage("backward")
                finally:
                    if ctx is not None:
                        ctx.__exit__(None, None, None)
            return {s: b for s, (b, _) in counter._stage_ticks.items()}, calls
    finally:
        cp_attention.ft_c.all_gather_single = gather


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cp", type=int, default=4, help="context-parallel degree (default 4)")
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq", type=int, default=4096, help="global sequence length, a multiple of 2 * cp")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=1024, help="hidden size, a multiple of 256 (default 1024)")
    args = p.parse_args(argv)
    if args.cp < 2 or args.seq % (2 * args.cp):
        print(f"error: seq: {args.seq} must be a multiple of 2 * cp = {2 * args.cp} (the head-tail load balancer "
              "cuts it into 2 * cp chunks), and cp >= 2", file=sys.stderr)
        return 2
    if args.hidden % 256 or args.layers < 1:
        print("error: hidden: a multiple of 256; layers: at least 1", file=sys.stderr)
        return 2
    cfg = config(args.layers, args.hidden)
    print(f"Llama, {args.layers} layers, hidden {args.hidden}, bf16; batch {args.batch}, seq {args.seq}; peaks in "
          "live bytes (GiB = 2^30 B)\n")
    print("| run | forward peak | backward peak | ring calls |\n|---|---:|---:|---|")
    for rank in range(args.cp):
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=args.cp)
        try:
            mesh = init_device_mesh("cpu", (args.cp,), mesh_dim_names=("cp",))
            peaks, calls = step(cfg, args.batch, args.seq, mesh)
        finally:
            dist.destroy_process_group()
        ring = ", ".join(f"{n} x {c}" for c, n in sorted(calls.items()))
        print(f"| CP rank {rank} of {args.cp} | {peaks['forward']:,} B ({peaks['forward'] / GiB:.3f} GiB) | "
              f"{peaks['backward']:,} B ({peaks['backward'] / GiB:.3f} GiB) | {ring} |")
    for seq in (args.seq // args.cp, args.seq):
        peaks, _ = step(cfg, args.batch, seq)
        print(f"| no CP, seq {seq} | {peaks['forward']:,} B ({peaks['forward'] / GiB:.3f} GiB) | "
              f"{peaks['backward']:,} B ({peaks['backward'] / GiB:.3f} GiB) | |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
