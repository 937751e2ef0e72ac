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
