"""Evaluate a profile at the workload's sizes and swap in what is priced analytically (estimator.estimate).

One vectorised path serves a single estimate and a sweep of thousands of (batch, seq) points: every moment of a
stage is a polynomial per category (estimator.profile), so the moments' values at N points are one tensor
product; the analytic swaps are affine per category; the stage's bytes are the largest total over its moments.
A single estimate then recomputes the winning moment's breakdown in exact integers.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from estimator import components as comp
from estimator.breakdown import Breakdown
from estimator.parallel import (FSDP_FAMILY, Share, composed, pp_in_flight, pp_microbatches, pp_rank_stages,
                                pp_untraced, shard_group, tp_activation_scale)
from estimator.profile.poly import (exponents, lse_rows, mask_width, rank_degree, s_factor_array, scan_chunk,
                                    scan_padded, seq_degree)
from estimator.profile.profile import CATEGORIES, Piece, Profile
from estimator.spec import PP_STAGES_PER_RANK, Parallel, Workload, class_key
from estimator.units import dtype_bytes

C = {c: i for i, c in enumerate(CATEGORIES)}
FWD_BWD = ("forward", "backward", "prefill", "decode", "decode1")
STATE_CATEGORIES = ("weights", "gradients", "optimizer_states", "optimizer_step", "comm_buffers")


def world(p: Parallel) -> int:
    """The n in a traced FSDP profile's 1/n terms: the shard group of this run (1 for everything else)."""
    if p.strategy in FSDP_FAMILY:
        return shard_group(p) if p.gpus > 1 else 1
    return 1


def fsdp_notes(w: Workload, p: Parallel) -> tuple[str, ...]:
    """The notes an estimate gets for FSDP2's units, CPU offload and a stored base on an FSDP rank (Swap._fsdp_rank)."""
    notes = []
    if p.fsdp_wrap == "torchtitan":
        notes.append("fsdp: torchtitan's units (the embedding, each block, the final norm with the head kept "
                     "gathered after forward, the root)")
    if p.offload == "optimizer+params" and p.strategy in FSDP_FAMILY:
        notes.append("offload: optimizer+params moved off the GPU (FSDP2's CPUOffloadPolicy: the shards of "
                     "parameters and gradients in host memory; what FSDP gathers, and one unit's shard in transit, "
                     "stay)")
    elif p.offload != "none":
        notes.append(f"offload: {p.offload} moved off the GPU")
    if p.strategy in FSDP_FAMILY and comp.weight_format(w) not in comp.FLOAT_FORMATS:
        notes.append("fsdp: the stored base sharded and all-gathered as stored (torchtune's NF4Tensor under FSDP2, "
                     "bitsandbytes with bnb_4bit_quant_storage); the root unit (embedding, head) as traced")
    return tuple(notes)


class Swap:
    """What replaces each traced category on one GPU: affine per category (see estimator.estimate)."""

    def __init__(self, model, w: Workload, p: Parallel, tw: Workload, sh: Share, activation_k, overhead,
                 tp_rank: bool = False):
        """`tp_rank`: the profile is of one traced rank (a TP rank, tracer.tp, or a pipeline rank, tracer.pp), which
        already holds this rank's weights, gradients, states, activations and KV cache: nothing is split again; what
        the inventory swaps in (another optimizer's states, the master copy) takes this rank's share of the
        parameters (Share.params_local)."""
        inv = model.inventory
        rd, trd = comp.recipe_dtypes(w), comp.recipe_dtypes(tw)
        traced = p.strategy in FSDP_FAMILY or tp_rank
        # composed (FSDP x TP/PP/EP): StagePlan scales the traced rank's model-state categories per monomial
        # (states_scale); the master copy and the step's swapped temporaries are this rank's 1/n slice
        self.composed = composed(p) and not tp_rank
        self.sharded_frac = sh.fsdp_frac if self.composed else 1.0
        self.gathered_frac = sh.gathered_frac if self.composed else 1.0
        per_rank = self.sharded_frac / world(p)
        self.local = 1.0 if traced else sh.params_local / inv.params
        self.grad = self.local * (1.0 if traced else sh.grad_frac)
        state = self.local * (1.0 if traced else sh.state_frac)
        offload = p.offload != "none"
        trainable = inv.trainable_params(w)
        base = comp.base_weight_bytes(inv, w)
        self.weights_shift = 0 if traced else int((base - inv.params * dtype_bytes(comp.float_dtype(tw))) * self.local)
        if p.offload == "optimizer+params" and not traced:
            self.weights_shift -= int(base * self.local * (1 - sh.weight_frac))
        self.master = 0 if offload else int(comp.master_weight_bytes(trainable, w.recipe) * state)
        self.master_traced = comp.master_weight_bytes(trainable, tw.recipe)
        if tp_rank:  # the same share of both, so that equal recipes cancel to the byte
            # FSDP over a traced TP or pipeline rank holds 1/n of its slice's master copy, as of every state
            per_rank = sh.params_local / inv.params / world(p)
            self.master = int(comp.master_weight_bytes(trainable, w.recipe) * per_rank)
            self.master_traced = int(self.master_traced * per_rank)
        if self.composed or (traced and not tp_rank):
            # an FSDP-family rank (traced per rank) holds 1/n of the master copy, as of every state: the traced
            # optimizer-state category carries that slice, and the swapped-in copy is the same slice (before, the
            # whole model's copy was swapped in and subtracted, which left the total right and the breakdown with a
            # negative optimizer_states: -18.7 GiB beside 29.9 GiB of master weights, llama-3.1-8b mixed, FSDP x 8)
            self.master = 0 if offload else int(comp.master_weight_bytes(trainable, w.recipe) * per_rank)
            self.master_traced = int(self.master_traced * per_rank)
        self.state_ratio, self.step_add = 1.0, 0
        if (w.optimizer, w.optimizer_impl) != (tw.optimizer, tw.optimizer_impl):
            # states scale by the analytic ratio; the step's temporaries trade the traced optimizer's formula
            # for this one's (what the formula does not hold, e.g. mixed's fp32 gradient copies, stays)
            shapes = inv.trainable_shapes(w)
            # the traced category holds the states and torch's step counters (comp.traced_step_counter_bytes); on an
            # FSDP rank the states are its 1/n shards and the counters whole (plain scalars beside the DTensor
            # parameters), so the ratio is this rank's (the whole model's ratio read about 1 byte per parameter tensor
            # high at 2 ranks swapping AdamW for SGD: tests/test_exact_random.py, tests/test_parallel.py)
            shard = world(p) if traced and not tp_rank and not self.composed else 1
            new = comp.optimizer_state_bytes(shapes, w.optimizer, rd.state) / shard + \
                comp.traced_step_counter_bytes(shapes, w.optimizer)
            old = comp.optimizer_state_bytes(shapes, tw.optimizer, trd.state) / shard + \
                comp.traced_step_counter_bytes(shapes, tw.optimizer)
            self.state_ratio = new / old if old else 0.0
            loop = inv.forloop_elems(w) if "forloop" in (w.optimizer_impl, tw.optimizer_impl) else None
            self.step_add = (comp.optimizer_step_temp_bytes(shapes, w.optimizer, w.optimizer_impl, rd.state, loop)
                             - comp.optimizer_step_temp_bytes(shapes, tw.optimizer, tw.optimizer_impl, trd.state,
                                                              loop))
        if comp.paged(w.optimizer):
            self.state_ratio = 0.0  # in CUDA unified memory, outside the allocator: Estimate.paged_bytes
        self.state = 0.0 if offload else state
        # the step runs on this rank's shards: 1/n of the swapped formulas under FSDP (traced per rank, composed or
        # not), the ZeRO share of the states elsewhere (the whole model's before 2026-11-29: fused AdamW on
        # llama-3.1-70b over FSDP 8 read -115 GiB of temporaries in its optimizer stage)
        self.step_add = 0 if offload else int(self.step_add * (per_rank if traced else state))
        self.dequant = comp.dequant_temp_bytes(inv, w)
        self._fsdp_rank(inv, w, p, tw, sh, base, tp_rank)
        self.kv = dtype_bytes(comp.kv_dtype(w)) / dtype_bytes(w.precision) * \
            (1.0 if tp_rank else sh.layers_local / max(1, inv.layers) / p.tp_size)
        # micro-batches whose activations a stage holds at once: the schedule decides (estimator.spec.PP_SCHEDULES)
        micro = pp_microbatches(w, p)
        ruled = p.pp_size > 1 and not tp_rank   # a traced rank holds what its schedule keeps already
        in_flight = pp_in_flight(p.pp_schedule, p.pp_size, sh.pp_rank, micro, pp_untraced(w, p)) if ruled else 1
        self.act_layers = sh.layers_local / max(1, inv.layers) * in_flight if ruled else 1.0
        self.tp_lin, self.tp_sq = (1.0, 1.0) if tp_rank else tp_activation_scale(p.tp_size, p.sequence_parallel)
        self.k_form = None  # the seeds' form: k * b*s*h*L*bytes, i.e. a b*s monomial with this coefficient
        if activation_k is not None and w.mode == "train":
            self.k_form = activation_k * inv.hidden * sh.layers_local * dtype_bytes(w.precision)
        self.mode, self.gpus, self.overhead_cfg = w.mode, p.gpus, overhead
        self.buckets = inv.trainable_params(w) * dtype_bytes(rd.grad) if p.strategy == "ddp" and w.mode == "train" \
            else 0
        # a pipeline priced by the rule (a traced rank holds all this already, tracer.pp): the stage's receive
        # buffers, one (b, s, h) per micro-batch for its input after the first stage and for its output's gradient
        # before the last (torch PipelineStage); under FSDP the stage's parameters stay gathered beside their shards
        # (torchtitan's reshard_after_forward=False with PP) and its gradients whole until the step's end
        # (PipelineStage.backward_maybe_with_nosync): docs/parallel.md, "Traced pipeline parallelism"
        self.pp_buffers, self.pp_weights, self.pp_grads, self.pp_fwd_grads = 0.0, 0, 0, False
        if p.pp_size > 1 and not tp_rank and w.mode == "train":
            # each stage the rank runs: a buffer for its input (after the first stage), one for its output's gradient
            last = p.pp_size * PP_STAGES_PER_RANK[p.pp_schedule] - 1
            n_buf = sum((i > 0) + (i < last) for i in pp_rank_stages(p.pp_size, sh.pp_rank, p.pp_schedule))
            # the hidden states between stages are whole on every TP rank, split over it only with sequence parallelism
            self.pp_buffers = micro * n_buf * inv.hidden * dtype_bytes(comp.float_dtype(w)) / \
                (p.tp_size if p.sequence_parallel else 1)
            if self.composed:
                whole = sh.fsdp_frac * inv.params
                self.pp_weights = int(whole * dtype_bytes(comp.float_dtype(w)))
                self.pp_grads = int(whole * trainable / inv.params * dtype_bytes(rd.grad))
                # 1F1B runs a backward before rank r's last forwards where there are more than pp - r micro-batches
                self.pp_fwd_grads = p.pp_schedule != "gpipe" and in_flight < micro
        self.exact = not self.composed and not self.pp_buffers and not self.sharded_off and \
            (self.local, self.grad, self.state_ratio, self.kv, self.act_layers, self.tp_lin,
             self.gathered_weights) == (1,) * 7

    def _fsdp_rank(self, inv, w: Workload, p: Parallel, tw: Workload, sh: Share, base: int,
                   tp_rank: bool) -> None:
        """What an FSDP-family rank's traced model states become (the profile's 1/n terms are the rank's shards, its
        n-free terms what is all-gathered or not yet reduce-scattered: a layer, the root unit):
        - CPU offload of parameters (FSDP2 `CPUOffloadPolicy`): the sharded parameters and, after each
          reduce-scatter, the sharded gradients live in host memory (torch/distributed/fsdp/_fully_shard:
          `FSDPParam.all_gather_inputs` copies a shard to the GPU for its all-gather, `foreach_reduce` copies the
          reduced shard to the CPU and drops the GPU one), so their 1/n terms leave the GPU (`sharded_off`); one
          unit's shard stays, counted once per stage (the all-gather's copy in forward and backward, the reduce-
          scatter's output in backward: an upper bound, they are transient);
        - a stored base other than the traced float one (QLoRA's NF4, an int8 LoRA base): the shards are the stored
          bytes / n (`weights_shift`, unless offloaded), and a gathered layer its stored bytes
          (`components.gathered_layer_ratio` on the n-free terms), the root unit (embedding, norm, head: never
          quantized) as traced, in forward and backward where FSDP keeps it gathered (`gathered_shift`). Composed
          layouts and torchtitan's units keep their gathered layers at the traced bytes (an upper bound)."""
        self.sharded_off, self.gathered_weights, self.gathered_shift = (), 1.0, 0
        self.offload_weights = self.offload_grads = 0
        if p.strategy not in FSDP_FAMILY:
            return
        fb = dtype_bytes(comp.float_dtype(tw))
        n = world(p)
        if p.offload == "optimizer+params":
            self.sharded_off = ("weights", "gradients")
            unit = sh.largest_layer_params
            self.offload_weights = int(unit * fb / n)
            if w.mode == "train":
                self.offload_grads = int(unit * inv.trainable_params(w) / max(1, inv.params) *
                                         dtype_bytes(comp.recipe_dtypes(w).grad) / n)
        delta = base - inv.params * fb
        if not delta:
            return
        if not self.sharded_off:
            self.weights_shift += int(delta * (sh.params_local / inv.params if tp_rank else self.sharded_frac) / n)
        ratio = comp.gathered_layer_ratio(inv, w, tw)
        if ratio is None or self.composed or tp_rank or p.fsdp_wrap != "layers":
            return   # (torchtitan's units gather the embedding and head apart, not for the whole step)
        self.gathered_weights = ratio
        root = (inv.params - sum(inv.layer_params)) * fb
        self.gathered_shift = int(round((1 - ratio) * root))

    def activation_scale(self, monos) -> np.ndarray:
        """Per monomial: TP's split of the s-linear and s^2 terms, PP's share of the layers."""
        return np.array([(self.tp_sq if seq_degree(m) >= 2 else self.tp_lin if (seq_degree(m) == 1 or m[2]) else 1.0)
                         * self.act_layers for m in monos])

    def states_scale(self, monos) -> np.ndarray:
        """Per monomial of a model-state category (STATE_CATEGORIES) under a composed layout: the sharded terms
        (1/n, n = the dp group) hold this rank's TP/PP slice of the model over ep (Share.fsdp_frac); the n-free
        terms (FSDP's all-gathered unit: a layer, the embedding) its TP/EP share of a layer."""
        return np.array([self.sharded_frac if m[3] else self.gathered_frac for m in monos])

    def pp_gathered(self, stage: str) -> tuple[float, float] | None:
        """(scale of the traced weights' n-free terms, of every traced gradient term) in a forward or backward stage
        of FSDP under a pipeline, whose gathered stage and whole gradients replace them (`pp_weights`, `pp_grads`);
        None elsewhere."""
        if not self.pp_weights or stage not in ("forward", "backward"):
            return None
        return 0.0, (0.0 if stage == "backward" or self.pp_fwd_grads else 1.0)

    def rules(self, stage: str) -> tuple[Rule, ...]:
        """`_rules` per stage, memoised on this Swap (which nothing changes after construction): the breakdown of
        every estimate reads them, so they are built once per stage."""
        memo = self.__dict__.setdefault("_rules_by_stage", {})
        hit = memo.get(stage)
        if hit is None:
            hit = memo[stage] = self._rules(stage)
        return hit

    def _rules(self, stage: str) -> tuple[Rule, ...]:
        """The one declaration of this GPU's affine map, per Breakdown field: which traced categories it takes, by
        what factor, plus what constant. `StagePlan` sums it into totals over many points; `breakdown` evaluates
        it per field in whole bytes. Nothing else prices a moment."""
        k_form = self.k_form is not None and stage in ("forward", "backward")
        opt, fwd_bwd = stage == "optimizer", stage in FWD_BWD
        return (
            Rule("weights", (("weights", (self.local,), 0),),
                 self.weights_shift + (self.pp_weights + self.gathered_shift + self.offload_weights
                                       if stage in ("forward", "backward") else 0)),
            Rule("gradients", (("gradients", (self.grad,), 0), ("comm_buffers", (1.0,), 0)),
                 self.buckets + (self.pp_grads if stage == "backward" or (stage == "forward" and self.pp_fwd_grads)
                                 else 0) + (self.offload_grads if stage == "backward" else 0)),
            # states exist only after the first step: the traced ones less the traced master copy, rescaled
            Rule("optimizer_states", (("optimizer_states", (self.state_ratio, self.state), -self.master_traced),),
                 0, guard=True),
            Rule("master_weights", (), self.master, guard=True),
            # the seeds' k form replaces the traced activations with k * b*s*h*L*bytes (a b*s monomial)
            Rule("activations", () if k_form else (("activations", (1.0,), 0),), 0,
                 (self.k_form if k_form else 0.0) + (self.pp_buffers if stage != "load" else 0.0)),
            Rule("kv_cache", (("kv_cache", (self.kv,), 0),), 0),
            Rule("temporaries", (("optimizer_step", (self.state,), 0),),
                 (self.step_add if opt else 0) + (self.dequant if fwd_bwd else 0)),
            Rule("buffers", (("other", (1.0,), 0),), 0),
            Rule("overhead", (), comp.overhead_bytes(self.gpus, self.overhead_cfg,
                                                     comp.cublas_workspaces(self.mode, stage))),
        )

    def breakdown(self, stage: str, cat, b: int, s: int) -> dict[str, int]:
        """One moment's bytes per profile category -> the Breakdown's fields in whole bytes, at sizes (b, s)."""
        has_states = cat[C["optimizer_states"]] > 0
        out = {}
        for r in self.rules(stage):
            if r.guard and not has_states:
                out[r.field] = 0
                continue
            v = r.const
            for c, fs, off in r.terms:
                v += int(_scaled(cat[C[c]] + off, fs))
            out[r.field] = v + (int(r.bs_coef * b * s) if r.bs_coef else 0)
        return out


def _scaled(x: float, factors: tuple[float, ...]) -> float:
    for f in factors:
        x = x * f
    return x


@dataclass(frozen=True)
class Rule:
    """One Breakdown field as an affine map of a moment's traced categories: sum of int((cat + offset) * factors...)
    over `terms` (category, factors multiplied left to right, offset), plus `const`, plus `bs_coef` * b * s;
    `guard`: only once optimizer states exist."""

    field: str
    terms: tuple[tuple[str, tuple[float, ...], int], ...]
    const: int
    bs_coef: float = 0.0
    guard: bool = False


def monomial_matrix(monos, b, s, g, n) -> np.ndarray:
    """(monomials, points) float values of each monomial at arrays of b, s, g (n scalar)."""
    e = np.asarray([exponents(m) for m in monos], dtype=float)          # (m, 7): r is folded in (Profile.at_rank)
    padded = np.stack([s_factor_array(m, s) for m in monos]) if len(monos) else np.zeros((0, np.size(s)))
    b, s, g = (np.asarray(x, dtype=float) for x in (b, s, g))
    return (b[None, :] ** e[:, :1] * s[None, :] ** e[:, 1:2] * g[None, :] ** e[:, 2:3] * padded) * \
        (1.0 / n) ** e[:, 3:4]


class StagePlan:
    """One stage of one piece, with the swap folded in: totals at points = coef @ monomials + const."""

    def __init__(self, piece: Piece, stage: str, swap: Swap):
        idx, monos, arr = piece._arrays[stage]
        coef = arr.copy()
        coef[:, C["activations"], :] *= swap.activation_scale(monos)
        if swap.composed:
            sc = swap.states_scale(monos)
            for c in STATE_CATEGORIES:
                coef[:, C[c], :] *= sc
            gathered = swap.pp_gathered(stage)
            if gathered is not None:  # FSDP under a pipeline: the stage gathered and its gradients whole instead
                coef[:, C["weights"], :] *= np.array([1.0 if m[3] else gathered[0] for m in monos])
                coef[:, C["gradients"], :] *= gathered[1]
        for c in swap.sharded_off:   # FSDP2's CPU offload: the shards in host memory
            coef[:, C[c], :] *= np.array([0.0 if m[3] else 1.0 for m in monos])
        if swap.gathered_weights != 1.0:   # a quantized base gathered as stored
            coef[:, C["weights"], :] *= np.array([1.0 if m[3] else swap.gathered_weights for m in monos])
        self.idx, self.monos, self.coef, self.stage, self.swap = idx, monos, coef, stage, swap  # coef: (k, C, m)
        alpha, guarded_alpha = np.zeros(len(CATEGORIES)), np.zeros(len(CATEGORIES))
        const = guarded_const = 0.0
        bs_coef = 0.0
        for r in swap.rules(stage):
            for c, fs, off in r.terms:
                (guarded_alpha if r.guard else alpha)[C[c]] += _scaled(1.0, fs)
                if r.guard:
                    guarded_const += _scaled(off, fs)
                else:
                    const += _scaled(off, fs)
            if r.guard:
                guarded_const += r.const
            else:
                const += r.const
            bs_coef += r.bs_coef
        # a guarded rule's terms are categories that are zero where the guard is off (no states yet): the factor
        # applies everywhere, the constant only where the moment holds states
        self.total_coef = np.einsum("kcm,c->km", coef, alpha + guarded_alpha)  # (k, m)
        if bs_coef:
            full = [exponents(m) for m in monos]  # every monomial as its 7 exponents (poly.exponents)
            bs = exponents((1, 1, 0, 0)) if exponents((1, 1, 0, 0)) in full else exponents((0, 1, 0, 0))  # b = 1: no b
            self.total_coef[:, full.index(bs)] += bs_coef
        has_states = np.any(coef[:, C["optimizer_states"], :] != 0, axis=1)
        self.const = const + np.where(has_states, guarded_const, 0.0)
        self.exps = np.asarray([exponents(m) for m in monos], dtype=float)
        if any(rank_degree(m) for m in monos):  # r is a constant of the workload: folded in before a plan is built
            raise ValueError("profile: a rank-variable LoRA profile is evaluated at a rank (Profile.at_rank)")
        self.padded = bool(self.exps[:, 4:].any())  # m, l or q (poly: kernels' padding of s) in a monomial
        self._terms = tuple((exponents(m), scan_chunk(m)) for m in monos)

    def point(self, b: int, s: int, g: int, n: int) -> np.ndarray:
        """(m,) monomial values at one point (the single-estimate path: no matrix building)."""
        if self.padded:   # poly.s_factor's integers, with s's functions read once per point
            mw, lr = mask_width(s), lse_rows(s)
            return np.array([b ** e[0] * s ** e[1] * g ** e[2] * (mw ** e[4] * lr ** e[5] *
                                                                  (scan_padded(s, c) ** e[6] if e[6] else 1))
                             / n ** e[3] for e, c in self._terms], dtype=float)
        return np.array([b ** m[0] * s ** m[1] * g ** m[2] / n ** m[3] for m in self.monos], dtype=float)

    def totals_at(self, b: int, s: int, g: int, n: int, v: np.ndarray | None = None) -> np.ndarray:
        """(k,) totals at one point."""
        return self.total_coef @ (self.point(b, s, g, n) if v is None else v) + self.const

    def totals(self, b, s, g, n) -> np.ndarray:
        """(k, P) totals of every moment at the points."""
        return self.total_coef @ monomial_matrix(self.monos, b, s, g, n) + self.const[:, None]

    def values(self, b, s, g, n) -> np.ndarray:
        """(k, P, C) per-category values (before the swap) at the points."""
        return np.einsum("kcm,mp->kpc", self.coef, monomial_matrix(self.monos, b, s, g, n))


def stage_breakdowns(model, prof: Profile, w: Workload, p: Parallel, tw: Workload, sh: Share, options,
                     cache=None, points: dict | None = None) -> dict:
    """{stage: (moment label, Breakdown)} at this workload's sizes on one pipeline stage's GPU. `cache` (a
    ReservedFit) fills each breakdown's allocator_cache from the bytes torch allocates: everything but the CUDA
    context and NCCL's buffers (its tensors and the stage's cuBLAS workspaces, components.cublas_workspaces)."""

    n = world(p)
    piece = prof.piece_for(w.batch, w.seq)
    swap, plans = stage_plans(model, prof, w, p, tw, sh, options, piece)
    out = {}
    for stage, plan in plans.items():
        if not applies(stage, w.gen_tokens):
            continue
        v = _point(plan, w, n, points)
        totals = plan.totals_at(w.batch, w.seq, w.gen_tokens, n, v)
        k = int(np.argmax(totals))
        name = "decode" if stage == "decode1" else stage
        if name in out and out[name][2] >= totals[k]:
            continue
        moment = piece.moment(stage, plan.idx[k])
        if swap.exact:
            cat = moment.exact(w.batch, w.seq, w.gen_tokens, n)
        else:
            cat = [float(x) for x in plan.coef[k] @ v]  # plan.values at one point, for the chosen moment only
        fields = swap.breakdown(stage, cat, w.batch, w.seq)
        if cache is not None:
            fields["allocator_cache"] = cache.cache_bytes(
                sum(fields.values()) - comp.overhead_bytes(p.gpus, options.overhead, workspaces=0))
        out[name] = (moment.label, Breakdown(**fields), totals[k])
    return {k: v[:2] for k, v in out.items()}


# Float totals and a breakdown's whole bytes differ by the truncation of each rule's terms (under a byte each, a few
# dozen terms): a pipeline stage whose float peak is this far below the largest cannot hold the peak
PEAK_MARGIN_BYTES = 4096


def _point(plan: StagePlan, w: Workload, n: int, points: dict | None) -> np.ndarray:
    """The plan's monomials at the workload's sizes; `points` (one estimate's) keeps them per monomial tuple, which
    every pipeline stage's plan of one piece shares."""
    if points is None:
        return plan.point(w.batch, w.seq, w.gen_tokens, n)
    v = points.get(id(plan.monos))
    if v is None:
        v = points[id(plan.monos)] = plan.point(w.batch, w.seq, w.gen_tokens, n)
    return v


def peak_shares(model, stage_shares: list, w: Workload, p: Parallel, tw: Workload, options,
                points: dict | None = None) -> list:
    """The (Share, Profile) pairs of a pipeline's stages whose largest total can be the peak (all of one): the others'
    breakdowns are never built. A stage's totals are what `stage_breakdowns` ranks its moments by (the rules' bytes
    before the allocator's cache, whose fit is monotone in them); deepseek-v3 over PP 16 breaks down 1 of 3."""
    if len(stage_shares) < 2:
        return stage_shares
    n, peaks = world(p), []
    for sh, prof in stage_shares:
        _, plans = stage_plans(model, prof, w, p, tw, sh, options, prof.piece_for(w.batch, w.seq))
        peaks.append(max(float(plan.totals_at(w.batch, w.seq, w.gen_tokens, n, _point(plan, w, n, points)).max())
                         for stage, plan in plans.items() if applies(stage, w.gen_tokens)))
    return [x for x, v in zip(stage_shares, peaks) if v >= max(peaks) - PEAK_MARGIN_BYTES]


def applies(stage: str, gen_tokens: int) -> bool:
    """decode1 holds the first generated token's moments, decode the g-th's for g >= 2."""
    return (stage != "decode1" or gen_tokens >= 1) and (stage != "decode" or gen_tokens >= 2)


_PLANS: dict = {}


def stage_plans(model, prof, w, p, tw, sh, options, piece):
    """The Swap and the stage plans for (model, workload, parallel, stage share, piece), memoised: only the
    sizes change between calls of a search or a sweep (the k form depends on them, so it is not memoised)."""
    key = (model, class_key(w), p, sh, options.activation_k, options.overhead,
           id(piece))
    hit = _PLANS.get(key)
    if hit is None:
        swap = Swap(model, w, p, tw, sh, options.activation_k, options.overhead,
                    tp_rank=traced_rank(prof.parallel_class))
        hit = (swap, {st: StagePlan(piece, st, swap) for st in prof.stages if st in piece._arrays})
        if len(_PLANS) > 4096:
            _PLANS.clear()
        _PLANS[key] = hit
    return hit


def traced_rank(parallel_class: dict) -> bool:
    """Whether a profile's parallel class is of one traced rank as it is (a TP rank, a pipeline rank)."""
    return "tp" in parallel_class or "pp" in parallel_class


def clear_plans() -> None:
    """Forget the memoised stage plans (a cold estimate builds them again)."""
    _PLANS.clear()
