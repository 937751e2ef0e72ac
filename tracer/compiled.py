"""torch.compile's memory decision, on fake tensors: what AOTAutograd's partitioner saves for backward.

``torch.compile`` (inductor) traces forward and backward into one joint graph with AOTAutograd and splits it with
``min_cut_rematerialization_partition`` (torch/_functorch/partitioners.py), which chooses which forward values to
save and which to recompute in backward; inductor then generates kernels that fuse the pointwise ops.
TorchDynamo refuses to run while a user TorchDispatchMode is active ("non-infra torch dispatch mode present"),
and the tracer's counter is one, so the model is not compiled through dynamo here: AOTAutograd's ``aot_function``
traces the whole training forward (``torch.func.functional_call`` of the model on its parameters, buffers and
inputs, loss included) once, outside the counter, with that partitioner; the two graphs then run op by op as
inductor's wrapper runs them (inputs released on entry, every value freed after its last use:
``torch.fx.Interpreter(garbage_collect_values=True).boxed_run``), with no code generation.

What this counts: exactly the tensors the partitioner saves between forward and backward, and the gradients.
What it does not: inductor's fusion (pointwise intermediates inside one graph are materialised here, so transient
peaks inside forward or backward can be higher than a compiled run's), and dynamo's graph breaks (one graph here).
"""
from __future__ import annotations

import functools

import torch


def _boxed_interpreter(gm: torch.fx.GraphModule, example_inputs):
    def run(args):
        return torch.fx.Interpreter(gm, garbage_collect_values=True).boxed_run(args)

    run._boxed_call = True
    return run


def _untraced():
    """Pop the counter (and every other mode) off the mode stack, keeping only the fake tensor mode, so that tracing
    the graphs is not counted as part of the step."""
    import contextlib

    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils._python_dispatch import _disable_current_modes

    @contextlib.contextmanager
    def ctx():
        with _disable_current_modes() as modes:
            fake = next((m for m in modes if isinstance(m, FakeTensorMode)), None)
            with (fake if fake is not None else contextlib.nullcontext()):
                yield

    return ctx()


class CompiledStep:
    """The model's training forward as one AOTAutograd-compiled function of (params, buffers, inputs)."""

    def __init__(self, model: torch.nn.Module):
        from functorch.compile import aot_function, min_cut_rematerialization_partition

        self.model = model
        # one name per tensor: functional_call re-ties tied weights (tie_weights=True) from the name given
        self.names = [n for n, _ in model.named_parameters()]
        self.bnames = [n for n, _ in model.named_buffers()]
        self.fn = aot_function(self._call, fw_compiler=_boxed_interpreter, bw_compiler=_boxed_interpreter,
                               partition_fn=min_cut_rematerialization_partition)
        self.shapes = None

    def _call(self, params, buffers, inputs):
        from torch.func import functional_call

        state = {**dict(zip(self.names, params)), **dict(zip(self.bnames, buffers))}
        return functional_call(self.model, state, args=(), kwargs={**inputs, "use_cache": False}).loss

    def __call__(self, inputs: dict) -> torch.Tensor:
        params = [p for _, p in self.model.named_parameters()]
        buffers = [b for _, b in self.model.named_buffers()]
        shapes = tuple((k, tuple(v.shape)) for k, v in inputs.items())
        if shapes != self.shapes:  # first call at these sizes: trace and partition, uncounted, then drop the result
            try:
                with _untraced():
                    loss = self.fn(params, buffers, inputs)
                    loss.backward()
                    del loss
            except RuntimeError as e:
                raise ValueError(f"compile: AOTAutograd could not trace {self.model.config.model_type} on fake "
                                 f"tensors here: {str(e).splitlines()[0]}") from None
            finally:
                for p in params:
                    p.grad = None
            self.shapes = shapes
        return self.fn(params, buffers, inputs)


def forward(model: torch.nn.Module, inputs: dict) -> torch.Tensor:
    step = getattr(model, "_willitfit_compiled", None)
    if step is None:
        step = model._willitfit_compiled = CompiledStep(model)
    return step(inputs)


# ------------------------------------------------------------------------------------------------- torchtitan's units

class CompiledCall:
    """`fn(*args, **kwargs)` (a decoder layer's own forward, or the loss) as torchtitan's `torch.compile` of that unit
    runs it: one AOTAutograd graph pair per call signature, partitioned by `min_cut_rematerialization_partition`, its
    tensors the call's tensor arguments (and, for a module, the module's parameters and buffers as they are at the
    call: FSDP2's unsharded ones inside its hooks), everything else a constant of the graph. The first call at a
    signature traces the graphs, forward and backward, uncounted, on copies of its own (no gradient reaches the real
    parameters: `_warm`); every call then runs the graphs op by op as inductor's wrapper does (`_boxed_interpreter`)."""

    def __init__(self, fn, module: torch.nn.Module | None = None):
        self.fn, self.module, self.graphs = fn, module, {}

    def _state(self):
        if self.module is None:
            return [], [], [], []
        params, buffers = list(self.module.named_parameters()), list(self.module.named_buffers())
        return [n for n, _ in params], [p for _, p in params], [n for n, _ in buffers], [b for _, b in buffers]

    def __call__(self, *args, **kwargs):
        from torch.utils._pytree import tree_flatten, tree_unflatten

        leaves, spec = tree_flatten((args, kwargs))
        tensors = [x for x in leaves if isinstance(x, torch.Tensor)]
        consts = tuple(_TENSOR if isinstance(x, torch.Tensor) else x for x in leaves)
        pnames, params, bnames, buffers = self._state()
        key = (spec, repr(consts), tuple((tuple(t.shape), t.dtype, t.requires_grad) for t in (*params, *tensors)))
        graph = self.graphs.get(key)
        if graph is None:
            graph = self.graphs[key] = self._compile(spec, consts, pnames, bnames)
            try:
                self._warm(graph, params, buffers, tensors)
            except RuntimeError as e:
                del self.graphs[key]
                raise ValueError(f"compile: AOTAutograd could not trace {type(self.module or self.fn).__name__} on "
                                 f"fake tensors here: {str(e).splitlines()[0] if str(e) else type(e).__name__}") \
                    from None
        flat = graph["fn"](params, buffers, tensors)
        return tree_unflatten(list(_merge(flat, graph["out"])), graph["out_spec"])

    @staticmethod
    def _warm(graph: dict, params, buffers, tensors) -> None:
        """Trace and partition both graphs on copies, uncounted. The copies have storages of their own: a graph keeps
        its example inputs (each placeholder's meta "val"), which must not keep the step's tensors alive (sharing
        them, detached views kept the first step's layer inputs, position embeddings and logits into the next
        optimizer step: 238,080 B on a tiny Llama)."""
        # identity saved-tensor hooks on top: a checkpoint around the block (whose pack hooks would count these
        # saves as its own) sees none of the warm-up
        with _untraced(), torch.autograd.graph.saved_tensors_hooks(_same, _same):
            copies = [torch.empty_like(t).requires_grad_(t.requires_grad) for t in (*params, *tensors)]
            out = graph["fn"](copies[:len(params)], [torch.empty_like(b) for b in buffers], copies[len(params):])
            grads = [o for o in out if isinstance(o, torch.Tensor) and o.requires_grad]
            if grads:
                torch.autograd.backward(grads, [torch.zeros_like(o) for o in grads])

    def _compile(self, spec, consts, pnames, bnames) -> dict:
        from functorch.compile import aot_function, min_cut_rematerialization_partition
        from torch.nn.utils.stateless import _reparametrize_module
        from torch.utils._pytree import tree_flatten, tree_unflatten

        graph: dict = {}

        def call(params, buffers, tensors):
            it = iter(tensors)
            args, kwargs = tree_unflatten([next(it) if c is _TENSOR else c for c in consts], spec)
            if self.module is None:
                out = self.fn(*args, **kwargs)
            else:
                with _reparametrize_module(self.module, {**dict(zip(pnames, params)), **dict(zip(bnames, buffers))}):
                    out = self.fn(*args, **kwargs)
            leaves, graph["out_spec"] = tree_flatten(out)
            graph["out"] = [_TENSOR if isinstance(x, torch.Tensor) else x for x in leaves]
            return tuple(x for x in leaves if isinstance(x, torch.Tensor))

        graph["fn"] = aot_function(call, fw_compiler=_boxed_interpreter, bw_compiler=_boxed_interpreter,
                                   partition_fn=min_cut_rematerialization_partition)
        return graph


def _checkpointed(ck, call, *args, **kwargs):
    return ck(functools.partial(call, **kwargs), *args)


class _Slot:
    """Where a tensor goes in a flattened call or output (None is a constant of its own: an absent mask)."""

    def __repr__(self) -> str:
        return "<tensor>"


_TENSOR = _Slot()


def _merge(tensors, template):
    it = iter(tensors)
    for x in template:
        yield next(it) if x is _TENSOR else x


def _same(x):
    return x


def _inner_forward(cls):
    """The layer class's own forward, under transformers' checkpointing wrapper(s) (modeling_layers.
    GradientCheckpointingLayer wraps `forward`, FSDP2's subclass's too)."""
    f = cls.forward
    while getattr(getattr(f, "__code__", None), "co_name", "") == "forward_with_checkpointing":
        f = f.__wrapped__
    return f


def compile_units(model: torch.nn.Module, layers: list[torch.nn.Module]) -> None:
    """torchtitan's `apply_compile` (torchtitan/models/llama3/infra/parallelize.py) and torchtune's `compile_model`
    (torchtune/training/_compile.py): every transformer block compiled on its own (`torch.compile(block)`, FSDP2's
    hooks outside the graph), and the loss (torchtitan/components/loss.py, torchtune's `compile_loss`: its fp32
    upcast of the logits is inside the graph rather than kept); the embedding, the final norm and the head run
    eagerly. With activation checkpointing the checkpoint is around the compiled block (torchtitan applies AC before
    compile, torchtune wraps each compiled layer in its checkpoint wrapper): a block's backward recomputes its
    compiled forward."""
    for layer in layers:
        call = CompiledCall(functools.partial(_inner_forward(type(layer)), layer), layer)
        if layer.gradient_checkpointing and layer.training:
            ck = layer._gradient_checkpointing_func
            layer.forward = functools.partial(_checkpointed, ck, call)
        else:
            layer.forward = call
    lm = getattr(model, "get_base_model", lambda: model)()   # PEFT's wrapper: the *ForCausalLM inside
    lm.loss_function = CompiledCall(lm.loss_function)
    model._willitfit_units_compiled = True
