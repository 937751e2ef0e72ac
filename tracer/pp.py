"""Pipeline parallelism on one rank, as torchtitan runs a transformers model, in a fake world.

    with pp_case(config, workload, Parallel("pp", gpus=4, microbatches=8), rank=0) as (model, inputs, step): ...

torchtitan's transformers backend (torchtitan/experiments/transformers_modeling_backend/pipeline.py, the same rules
as torchtitan/distributed/pipeline_parallel.py for its own models) splits a causal LM into pipeline stages and runs
them with torch.distributed.pipelining:

- **the split** (`estimator.parallel.pp_stage_layers`, torchtitan's `generate_llm_fqn_per_model_part`): the
  embedding and the norm + head count as one layer each (`pipeline_parallel_first_stage_less_layers` = `..._last_stage_less_layers` = 1, its
  defaults), the L + 2 "effective layers" are dealt out evenly with the remainder to the first stages, and the first
  stage holds the embedding, the last the final norm and the head; every stage keeps the rotary embedding;
- **a stage's module** (`pipeline_module_split`): a copy of the whole model with the other stages' layers deleted and
  the embedding, norm and head of the other stages replaced by Identity (here: deleted, or Identity for the norm, so
  that the model's own forward runs unchanged: a stage after the first passes its input as `inputs_embeds`);
- **the schedule**: one `PipelineStage` per rank under 1F1B and GPipe, one per stage the rank runs under the
  multi-stage ones (interleaved 1F1B, interleaved zero bubble, ZBV, DualPipeV: two,
  `estimator.parallel.pp_rank_stages`; the rank's model is then a `RankStages`, traced whole: `LOOPED_WHOLE`),
  `n_microbatches` micro-batches of `workload.batch` sequences each (torchtitan's local batch / `pipeline_parallel_microbatch_size`), the loss
  computed on the last stage by the model's own loss function, gradients scaled by 1 / n_microbatches
  (`scale_grads`, the schedule's default), `return_outputs=False` (torchtitan's trainer);
- **FSDP2 x PP** (fsdp, zero3, fsdp-grad-op with pp > 1): the (pp, dp) mesh with pp outermost, `fully_shard` per
  decoder layer and then on the stage's module over the dp dimension with `reshard_after_forward=False` (torchtitan's
  default with PP), the stage's first dp rank traced; HSDP on the 2-D (dp_replicate, dp_shard) mesh;
- **TP inside every stage** (`tp` > 1): torchtitan's (pp, dp, tp) mesh; each stage's model part built on the meta
  device, pruned, tensor-parallelised (`tracer.tp.parallelize`, torchtitan's apply_tp per model part), then sharded
  over dp where FSDP is asked, and materialised with `to_empty`; the last stage's loss under `loss_parallel()`. With
  sequence parallelism a stage sends its local (b, s / tp, h) slice of the hidden states and the next one makes it a
  Shard(1) DTensor again (`StageModule`), as torchtitan's stages pass local tensors.

What differs from a GPU run, and why it does not change the bytes: the fake process group's send and receive move
no data (the receive buffers the stage allocates are real, and counted); the schedules' start-up vote (two ranks
agreeing whether shapes are static, `_warmup_p2p`) reads a received tensor's value, which a fake tensor has not, so it
is decided here as the ranks would decide it (static: every stage's input and output shapes are given up front, as
torchtitan can give them, `PipelineStage(input_args=, output_args=)`), and checked: a stage whose output is not the
shape or dtype it declared raises.
"""
from __future__ import annotations

import contextlib

import torch

from estimator.parallel import FSDP_FAMILY, pp_microbatches, pp_rank_layers, pp_rank_stages, pp_untraced
from estimator.spec import PP_STAGES_PER_RANK, Parallel, Workload
from tracer import compiled, runner, tp
from tracer.depth import decoder_layer_list


def check(workload: Workload, parallel: Parallel) -> None:
    """One line for what a traced pipeline rank cannot run (before any torch work): estimator.parallel.pp_untraced."""
    why = pp_untraced(workload, parallel)
    if why:
        raise ValueError(why)


class StageModule(torch.nn.Module):
    """One pipeline stage of a causal LM, running the model's own forward: the first stage from token ids, the
    others from the previous stage's hidden states (`inputs_embeds`); the last returns the logits, the others the
    hidden states (the final norm replaced by Identity before the last stage).

    Under sequence parallelism (`sp_mesh`, TP's mesh) the hidden states between stages are sequence-sharded: a stage
    sends its local (b, s / tp, h) slice, as torchtitan's stages do (`use_local_output=True`), and the next one makes
    it the Shard(1) DTensor its layers take again (no copy either way)."""

    def __init__(self, lm: torch.nn.Module, first: bool, last: bool, out_meta: tuple, sp_mesh=None):
        super().__init__()
        self.lm, self.first, self.last = lm, first, last
        self._out_meta = out_meta     # (shape, dtype) the stage declared to the schedule; checked at every call
        self._sp_mesh = sp_mesh

    @property
    def config(self):
        """The model's config (tracer.depth finds the stage's decoder layers by it)."""
        return self.lm.config

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._sp_mesh is not None and not self.first:
            from torch.distributed.tensor import DTensor, Shard

            x = DTensor.from_local(x, self._sp_mesh, [Shard(1)], run_check=False)
        kw = {"input_ids": x} if self.first else {"inputs_embeds": x}
        if self.last:
            out = self.lm(**kw, use_cache=False).logits
        else:
            out = self.lm.get_decoder()(**kw, use_cache=False).last_hidden_state
            if self._sp_mesh is not None:
                out = out.to_local()
        if (tuple(out.shape), out.dtype) != self._out_meta:
            raise ValueError(f"pp: the stage's output is {tuple(out.shape)} {out.dtype}, not the declared "
                             f"{self._out_meta[0]} {self._out_meta[1]}: this model's stages cannot be traced")
        return out


class RankStages(torch.nn.Module):
    """The stages one rank runs under a multi-stage schedule (interleaved 1F1B and zero bubble: stages r and r + pp;
    ZBV: r and 2 pp - 1 - r), in stage order:
    the rank's model for the optimizer (every stage's parameters) and for tracer.depth, which reads each stage's
    decoder layers as one stack (`layer_stacks`), so ticks are tagged with the rank's layers in stage order."""

    def __init__(self, stages: list[StageModule]):
        super().__init__()
        self.stages = torch.nn.ModuleList(stages)

    @property
    def config(self):
        return self.stages[0].config

    @property
    def pipeline_parts(self) -> list[StageModule]:
        return list(self.stages)


# Why a rank of a multi-stage pipeline schedule is traced whole (its stages' layers at full depth, every size): the
# extension adds one more layer's effect on ticks outside it per stage of the step (tracer.extend._stage_effects),
# measured in the first micro-batch's window, and under interleaved 1F1B a rank's stages hold different numbers of
# micro-batches in flight at each of its windows. Cut to reduced depth, a tiny 16-layer Llama's second rank (pp 2,
# 4 micro-batches) read 1.8 MB (8%) low in forward at batch 5, seq 100.
LOOPED_WHOLE = ("a rank of a multi-stage pipeline schedule runs several stages, each holding its own number of "
                "micro-batches in flight, which the reduced-depth extension does not measure; traced whole")


def rank_signatures(sigs: list[str], parallel: Parallel, pp_rank: int) -> tuple[list[str], list[int]]:
    """(signatures, the model's index) of the layers pipeline rank `pp_rank` holds (estimator.parallel.pp_rank_layers),
    its stages' in order: one range under a single-stage schedule, several under a multi-stage one (traced whole:
    LOOPED_WHOLE)."""
    held = [i for chunk in pp_rank_layers(len(sigs), parallel.pp_size, pp_rank, parallel.pp_schedule) for i in chunk]
    return [sigs[i] for i in held], held


def _child_owner(root: torch.nn.Module, target: torch.nn.Module) -> tuple[torch.nn.Module, str]:
    for module in root.modules():
        for name, child in module.named_children():
            if child is target:
                return module, name
    raise ValueError("pp: the model's embedding or head is not a submodule it owns")


def _prune(lm: torch.nn.Module, first: bool, last: bool) -> None:
    """Delete what other stages hold: the embedding before the first stage's layers, the final norm and the head
    after the last's (torchtitan's pipeline_module_split)."""
    base = lm.get_decoder()
    norm = getattr(base, "norm", None)
    if not isinstance(norm, torch.nn.Module) or lm.get_input_embeddings() is None or lm.get_output_embeddings() is None:
        raise ValueError(f"model_type: {lm.config.model_type!r} is not split into pipeline stages here (the split needs "
                         "an input embedding, a final `norm` and an output head, as torchtitan's transformers backend)")
    if not first:
        owner, name = _child_owner(lm, lm.get_input_embeddings())
        setattr(owner, name, None)
    if not last:
        base.norm = torch.nn.Identity()
        owner, name = _child_owner(lm, lm.get_output_embeddings())
        setattr(owner, name, None)


def _text_config(lm):
    get = getattr(lm.config, "get_text_config", None)
    return get() if get else lm.config


@contextlib.contextmanager
def pp_case(config: dict, workload: Workload, parallel: Parallel, rank: int = 0, layers: list[int] | None = None):
    """Yield (the rank's model, inputs, step) for pipeline rank `rank` inside a fake world of pp ranks, with fake
    parameters: its stage module under a single-stage schedule, a `RankStages` of its stages under a looped one.
    `step(on_stage)` runs one schedule step (every micro-batch's forward and backward on each of the rank's stages),
    calling on_stage("forward") after each forward (and, on the last stage, its loss), on_stage("backward") after
    each backward and once more when the schedule's step returns. `layers` overrides the rank's layers (reduced
    depth: global layer indices, each kept in the stage whose range holds it)."""
    import torch.distributed as dist
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed.pipelining import (PipelineStage, Schedule1F1B, ScheduleDualPipeV, ScheduleGPipe,
                                              ScheduleInterleaved1F1B, ScheduleInterleavedZeroBubble,
                                              ScheduleZBVZeroBubble)
    from torch.testing._internal.distributed.fake_pg import FakeStore

    check(workload, parallel)
    pp, m = parallel.pp_size, pp_microbatches(workload, parallel)
    v = PP_STAGES_PER_RANK[parallel.pp_schedule]
    n_stages = pp * v
    ids_here = list(pp_rank_stages(pp, rank, parallel.pp_schedule))   # its stage indices, in order
    fsdp = parallel.strategy in FSDP_FAMILY   # FSDP2 (HSDP: on a 2-D dp mesh) over the dp ranks of each stage
    dp, tp_n = parallel.dp_size if fsdp else 1, parallel.tp_size
    sp = parallel.sequence_parallel
    hf = runner._hf_config(config)
    n_layers = int(getattr(hf.get_text_config() if hasattr(hf, "get_text_config") else hf, "num_hidden_layers"))
    chunks = pp_rank_layers(n_layers, pp, rank, parallel.pp_schedule)
    keeps = [list(c) if layers is None else [i for i in layers if i in c] for c in chunks]
    empty = next((index for index, keep in zip(ids_here, keeps) if not keep), None)
    if empty is not None:
        held = "the embedding" if empty == 0 else "the final norm and the head" if empty == n_stages - 1 else "nothing"
        raise ValueError(f"pp: pipeline stage {empty} of {n_stages} holds no decoder layer (torchtitan's split of "
                         f"{n_layers} layers, the embedding and the head weighing one each: {held} alone), which is "
                         "not traced here; use fewer pipeline stages")
    if dist.is_initialized():
        raise RuntimeError("a process group is already initialised; pipeline tracing needs its own fake one")
    # torchtitan's mesh puts pp outermost, then dp, then tp: stage r's ranks are r * dp * tp ..; the first is traced
    dist.init_process_group("fake", store=FakeStore(), rank=rank * dp * tp_n, world_size=pp * dp * tp_n)
    try:
        group, mesh = None, None
        if fsdp or tp_n > 1:   # torchtitan's ParallelDims (pp, dp_replicate, dp_shard, tp), pp outermost
            mesh, dp_mesh = tp.world_mesh(parallel, pp, dp)
            group = mesh["pp"].get_group()
        on_meta = fsdp or tp_n > 1   # DTensor's and FSDP2's meta-device init: parallelise, then to_empty

        def stage_module(index: int, keep: list[int]):
            first, last = index == 0, index == n_stages - 1
            lm = runner.build_model(config, workload, "meta" if on_meta else "cpu", meta_then_empty=not on_meta,
                                    layers=keep)
            vocab, hidden = int(lm.get_input_embeddings().num_embeddings), int(_text_config(lm).hidden_size)
            _prune(lm, first, last)
            if tp_n > 1:   # torchtitan: TP on each stage's model part first (apply_tp), then FSDP over dp
                tp.parallelize(lm, mesh["tp"], True, sp)
            out_meta = ((b, s, vocab), logits) if last else ((b, s // tp_n if sp else s, hidden), stream)
            module = StageModule(lm, first, last, out_meta, mesh["tp"] if sp else None)
            if fsdp:  # torchtitan: fully_shard every block, then the stage's module, on the dp mesh
                _shard(module, dp_mesh)
            if workload.compile:   # torchtitan: each block and the loss compiled (tracer.compiled.compile_units)
                compiled.compile_units(lm, list(decoder_layer_list(lm)[2]))
            return lm, module, vocab, hidden, out_meta

        def stage_modules():
            return [stage_module(index, keep) for index, keep in zip(ids_here, keeps)]

        b, s = workload.batch, workload.seq
        stream = runner.weight_dtype(workload)  # the residual stream between stages: the weights' dtype
        logits = runner.DTYPES[workload.precision] if workload.recipe == "amp" else stream
        if sp and s % tp_n:
            raise ValueError(f"seq: sequence parallelism between pipeline stages needs tp ({tp_n}) to divide seq "
                             f"({s})")
        # parallelised on the meta device outside fake mode (the device mesh's own bookkeeping runs real ops), as
        # fsdp.fsdp_model and tp.tp_model do; given fake storage by to_empty inside it
        built = stage_modules() if on_meta else None
        with FakeTensorMode(allow_non_fake_inputs=True):
            parts = built or stage_modules()
            if on_meta:
                for part in parts:
                    part[1].to_empty(device="cpu")
            vocab = parts[0][2]
            ids = torch.randint(0, vocab, (b * m, s))
            labels = ids.clone()  # a data collator's copy (DataCollatorForLanguageModeling)
            stages = []
            for index, (_, module, _, hidden, out_meta) in zip(ids_here, parts):
                in_arg = ids[:b] if index == 0 else torch.empty(b, s // tp_n if sp else s, hidden, dtype=stream,
                                                                requires_grad=True)
                out_arg = torch.empty(*out_meta[0], dtype=out_meta[1], requires_grad=index != n_stages - 1)
                stages.append(PipelineStage(module, index, n_stages, torch.device("cpu"), input_args=(in_arg,),
                                            output_args=(out_arg,), group=group))
                del in_arg, out_arg
            lm_last = parts[-1][0]
            first, last = ids_here[0] == 0, ids_here[-1] == n_stages - 1

            def loss_fn(out, target):
                return lm_last.loss_function(logits=out, labels=target, vocab_size=out.shape[-1])

            if v > 1:
                cls = {"interleaved-1f1b": ScheduleInterleaved1F1B, "interleaved-zb": ScheduleInterleavedZeroBubble,
                       "zbv": ScheduleZBVZeroBubble, "dualpipev": ScheduleDualPipeV}[parallel.pp_schedule]
                schedule = cls(stages, n_microbatches=m, loss_fn=loss_fn)
            else:
                cls = Schedule1F1B if parallel.pp_schedule == "1f1b" else ScheduleGPipe
                schedule = cls(stages[0], n_microbatches=m, loss_fn=loss_fn)
            _static_warmup(schedule)
            inputs = {"input_ids": ids} if first else {}
            if last:
                inputs["labels"] = labels
            del ids, labels

            def step(on_stage) -> None:
                compute_loss = schedule._maybe_compute_loss

                def after_forward(*args, **kwargs):
                    compute_loss(*args, **kwargs)
                    on_stage("forward")

                def after_backward(backward):
                    def run(*args, **kwargs):
                        out = backward(*args, **kwargs)
                        on_stage("backward")
                        return out
                    return run

                schedule._maybe_compute_loss = after_forward
                for stage in stages:   # the instance attributes shadow the class's methods until deleted below
                    stage.backward_one_chunk = after_backward(stage.backward_one_chunk)
                    # a zero-bubble schedule's weight gradients, run apart from (after) the input gradients
                    stage.backward_weight_one_chunk = after_backward(stage.backward_weight_one_chunk)
                try:
                    args = (inputs["input_ids"],) if first else ()
                    kw = {"target": inputs["labels"], "losses": []} if last else {}
                    # torchtitan's train_context: loss_parallel around the step under TP (the logits stay sharded)
                    with runner.step_autocast(workload, lm_last), (tp.loss_context(workload) if tp_n > 1
                                                               else contextlib.nullcontext()):
                        schedule.step(*args, **kw, return_outputs=False)  # torchtitan: return_outputs=False
                finally:
                    del schedule._maybe_compute_loss
                    for stage in stages:
                        del stage.backward_one_chunk, stage.backward_weight_one_chunk
                # the schedule's own end of step (gradients scaled, its caches of the last micro-batches dropped)
                # closes the backward stage, so that the optimizer's stage starts from what the step leaves
                on_stage("backward")

            model = parts[0][1] if v == 1 else RankStages([part[1] for part in parts])
            yield model, inputs, step
    finally:
        dist.destroy_process_group()
        tp.forget_meshes()


def _shard(module: StageModule, mesh) -> None:
    """FSDP2 on one stage as torchtitan applies it under PP: `fully_shard` per decoder layer, then the stage's own
    module (its root), over the stage's dp ranks, with `reshard_after_forward=False`: torchtitan's default policy
    with PP ("default": `not pp_enabled`, torchtitan/distributed/fsdp.py get_fsdp_reshard_after_forward_policy; no
    all-gather per micro-batch), so fsdp, zero3 and fsdp-grad-op are the same under a pipeline."""
    from torch.distributed.fsdp import fully_shard

    # fsdp-mp (a MixedPrecisionPolicy) is not traced under a pipeline: estimator.parallel.pp_untraced refuses it
    for layer in decoder_layer_list(module)[2]:
        fully_shard(layer, mesh=mesh, reshard_after_forward=False)
    fully_shard(module, mesh=mesh, reshard_after_forward=False)


def _static_warmup(schedule) -> None:
    """Decide the schedule's start-up vote as every rank would (static: each stage gave its shapes), instead of
    exchanging it: the vote reads a received tensor's value (`.item()`), which a fake receive does not fill."""
    from torch.distributed.pipelining._utils import InferenceMode

    def warmup(stages, has_backward, p2p_done):
        for st in stages:
            if InferenceMode.needs_dynamic(st._user_meta, has_backward):
                raise ValueError("pp: this stage's shapes are not static; the schedule would infer them at run time")
            st._inference_mode = InferenceMode.STATIC

    schedule._warmup_p2p = warmup
