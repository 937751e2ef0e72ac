"""Every way to lay one run over N GPUs as torchtitan composes it, ranked by its worst rank.

torchtitan builds a device mesh of data-parallel shards (FSDP2 `fully_shard`), tensor-parallel ranks and pipeline
stages (torchtitan/distributed/parallel_dims.py: dp_shard x tp x pp = world size). For a model, a workload and N
GPUs, `layouts` prices each valid (dp, tp, pp) with `estimate` (FSDP over dp, composed with TP and PP as
estimator.parallel shares them; docs/parallel.md) and says, for each, which rank decides (a pipeline's first or last
stage holds the embedding or the head) and which component fills it most: the question "which of FSDP, TP, PP fits
70B on my 8 GPUs?" answered in one table.
"""
from __future__ import annotations

from dataclasses import dataclass

from estimator.breakdown import COMPONENTS
from estimator.estimate import Options, estimate, profile_where
from estimator.model import Model
from estimator.parallel import check_model
from estimator.spec import MAX_GPUS, Parallel, Workload
from estimator.store import ProfileMissing
from estimator.units import fmt_bytes

RANKS = {"only": "every rank", "first": "the first pipeline stage", "last": "the last pipeline stage",
         "first and last": "the rank holding the first and the last pipeline stage", "middle": "a middle pipeline stage"}


@dataclass(frozen=True)
class Layout:
    """One (dp, tp, pp) layout of N GPUs and its worst rank."""

    dp: int
    tp: int
    pp: int
    parallel: Parallel
    device_bytes: int          # the worst rank's peak, everything included (what nvidia-smi shows)
    fits: bool
    worst_rank: str            # which rank holds the peak, in words
    peak_stage: str            # the step's stage at the peak (forward, backward, optimizer, ...)
    largest: str               # the Breakdown component with the most bytes at the peak
    largest_bytes: int
    per_rank: bool = False     # priced from per-rank traced profiles (on disk), not the analytic rule
    cp: int = 1                # context-parallel degree (dp is then dp_shard: FSDP shards over dp x cp)

    @property
    def priced(self) -> str:
        """How the worst rank is priced: from its traced profile (plain FSDP is the traced FSDP rank at n = dp; TP and
        pipeline layouts where their ranks' profiles are on disk), or by the analytic rule over the FSDP rank."""
        return "traced per rank" if self.per_rank or self.tp == self.pp == 1 else "analytic rule"

    @property
    def label(self) -> str:
        if self.cp > 1:
            return f"FSDP {self.dp} x CP {self.cp} x TP {self.tp}"
        return f"FSDP {self.dp} x TP {self.tp} x PP {self.pp}"

    def why(self, gpu_bytes: int) -> str:
        """One sentence: how it fits, or which rank and component do not."""
        over = self.device_bytes - gpu_bytes
        where = f"{self.worst_rank} peaks in {self.peak_stage}, {self.largest} the largest part " \
                f"({fmt_bytes(self.largest_bytes, 'GiB')})"
        if over <= 0:
            return f"fits with {fmt_bytes(-over, 'GiB')} to spare; {where}"
        lever = {"activations": "; activation checkpointing (checkpointing full) frees most of them",
                 "optimizer_states": "; more data-parallel shards, an 8-bit optimizer or optimizer offload shrink them",
                 "kv_cache": "; an fp8 KV cache halves it"}.get(self.largest, "")
        return f"over by {fmt_bytes(over, 'GiB')}: {where}{lever}"


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def layouts(model: Model, workload: Workload, gpus: int, gpu_bytes: int,
            options: Options = Options(), pp_schedule: str = "1f1b", microbatches: int = 0) -> tuple[Layout, ...]:
    """Every valid (dp, tp, pp) with dp * tp * pp = gpus, the fitting ones first, then by the worst rank's device
    bytes; the layouts with pp > 1 run `pp_schedule` over `microbatches` (0: the workload's grad_accum). A degree the
    model cannot take (TP not dividing the heads, PP past the layers or its stages) is left out. FSDP x CP (x
    TP) layouts (dp * cp * tp = gpus) join where both derived CP ranks' profiles are on disk already: ranking never
    starts a CP derivation (two of a minute or more each; the Multi-GPU page derives one degree on request)."""
    if isinstance(gpus, bool) or not isinstance(gpus, int) or not 1 <= gpus <= MAX_GPUS:
        raise ValueError(f"gpus: must be a whole number in 1..{MAX_GPUS}, got {gpus!r}")
    out = []
    for tp in _divisors(gpus):
        for pp in _divisors(gpus // tp):
            piped = dict(pp_schedule=pp_schedule, microbatches=microbatches) if pp > 1 else {}
            par = Parallel() if gpus == 1 else Parallel(strategy="fsdp", gpus=gpus, tp=tp, pp=pp, **piped)
            lay = _priced(model, workload, par, gpu_bytes, options)
            out += [lay] if lay is not None else []
        for cp in _divisors(gpus // tp)[1:] if workload.training else ():
            par = Parallel(strategy="fsdp", gpus=gpus, tp=tp, cp=cp)
            try:
                on_disk = profile_where(model, workload, par) is not None
            except ValueError:   # a seq the load balancer cannot cut, a model ring attention cannot run
                continue
            lay = _priced(model, workload, par, gpu_bytes, options) if on_disk else None
            out += [lay] if lay is not None else []
    return tuple(sorted(out, key=lambda lay: (not lay.fits, lay.device_bytes, lay.tp, lay.pp, lay.cp)))


def _priced(model: Model, workload: Workload, par: Parallel, gpu_bytes: int, options: Options) -> Layout | None:
    """The layout `par` priced, or None where the model cannot take it."""
    try:
        check_model(model.inventory, par, model.name)
        est = estimate(model, workload, par, options)
    except ProfileMissing:
        raise
    except ValueError:  # a degree this model cannot take: not a layout
        return None
    parts = est.components.as_dict()
    largest = max((c for c in COMPONENTS if c != "overhead"), key=lambda c: parts[c])
    return Layout(par.dp_size, par.tp_size, par.pp_size, par, est.total_bytes, est.total_bytes <= gpu_bytes,
                  RANKS.get(est.pipeline_stage, est.pipeline_stage), est.peak_stage, largest, parts[largest],
                  est.per_rank, par.cp)
