"""The derivation tier (docs/architecture.md): a transformers model built from its config, run on fake CPU tensors, every
allocation counted. torch and transformers live here (and above); nothing that evaluates an
estimate imports this package (tests/test_imports.py checks it): it runs to derive a model's inventory and
memory profile (`tracer.derive`), and for `python -m bench trace` / `measure`.

- `runner`: a `Workload` becomes a model, optimizer, inputs and a sequence of stages (used on fake tensors and,
  by `bench.measure.harness`, on a real GPU).
- `counters`: the allocation counter (every storage's bytes, lifetime and role) and its event stream.
- `session`: one traced run: build the case inside FakeTensorMode (single GPU, DDP buckets, FSDP2 with a fake
  process group), run it, read the counter.
- `recipes` (with `losses`, `offload`, `compiled`): the knobs of torchtune, torchtitan, litgpt and Liger (chunked
  and fused-linear losses, optimizer in backward, activation offloading, op-sac, FSDP2 mixed precision, float8,
  compile), run as their sources run them (docs/recipes.md).
"""

import functools
import logging
import threading

# transformers imports torchao (float8 training) when it is installed; torchao then logs, at import, every CUDA
# extension it cannot load on a CPU build, and torch's pytree warns about torchao's enums. Neither concerns a
# traced run; errors still show.
for _name in ("torchao", "torch.utils._pytree"):
    logging.getLogger(_name).setLevel(logging.ERROR)

# tqdm starts a monitor thread with its first progress bar (AOTAutograd's compile of a traced step makes one). A
# process with a second thread is one tracer.forked does not fork (a copy could inherit a lock held), so a compiled
# workload's traces ran one after another; tqdm's own switch turns the monitor off.
try:
    import tqdm as _tqdm

    _tqdm.tqdm.monitor_interval = 0
except ImportError:  # transformers requires tqdm; without it there is no monitor either
    pass

# One traced run at a time per process: a trace sets torch's global state (the default dtype while a model is built,
# FakeTensorMode, the fake process group of FSDP), so two at once (two app sessions deriving, a page's background
# derivation beside a test) would read each other's. Re-entrant: a derivation runs many traces.
TRACER_LOCK = threading.RLock()


def serialized(fn):
    """Run `fn` holding TRACER_LOCK (the tracer's entry points: build, trace, derive, read an inventory)."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        with TRACER_LOCK:
            return fn(*args, **kwargs)
    return wrapper


def source_is(fn, digest: str) -> bool:
    """Whether `fn`'s source hashes (sha256, first 16 hex digits) to `digest`: the tracer's op-for-op copies of
    transformers code (tracer.time_loop's MiniMax forward, tracer.vlm_loop's Cosmos-3-Edge position grid) run only
    while the code they copy is the one they were copied from."""
    import hashlib
    import inspect

    return hashlib.sha256(inspect.getsource(fn).encode()).hexdigest()[:16] == digest
