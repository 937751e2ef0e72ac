"""List what autograd saves for backward in one forward pass of a small real model, grouped by the op that saves it.

    python scripts/saved_tensors.py tests/data/tiny/t-neox.json sdpa

Real CPU tensors (tiny configs only). Prints bytes per token per (op, saved attribute); parameters are excluded.
This is the tool used to build estimator/activations.py tensor by tensor.
"""
import json, sys, torch
from transformers import AutoConfig, AutoModelForCausalLM
cfg = json.load(open(sys.argv[1])); attn = sys.argv[2] if len(sys.argv) > 2 else "sdpa"
mt = cfg.pop("model_type")
c = AutoConfig.for_model(mt, **cfg)
torch.set_default_dtype(torch.bfloat16)
m = AutoModelForCausalLM.from_config(c, attn_implementation=attn); m.train()
b, s = 2, 64
ids = torch.randint(0, 500, (b, s))
out = m(input_ids=ids, labels=ids)
params = {p.untyped_storage().data_ptr() for p in m.parameters()}
seen = {}; stack = [out.loss.grad_fn]; visited = set()
while stack:
    n = stack.pop()
    if n is None or n in visited: continue
    visited.add(n)
    for a in dir(n):
        if a.startswith("_saved_"):
            try: v = getattr(n, a)
            except Exception: continue
            for t in (v if isinstance(v, (tuple, list)) else [v]):
                if isinstance(t, torch.Tensor):
                    k = t.untyped_storage().data_ptr()
                    if k not in params:
                        seen.setdefault(k, (t.untyped_storage().nbytes(), []))[1].append(f"{n.name()}.{a}{tuple(t.shape)}{str(t.dtype)[6:]}")
    stack += [f for f, _ in n.next_functions]
tot = sum(nb for nb, _ in seen.values())
big = sorted(seen.values(), key=lambda x: -x[0])
from collections import Counter
cnt = Counter()
for nb, users in big:
    cnt[" | ".join(sorted(set(u.split('.')[0] + "." + u.split('.')[1].split('(')[0] for u in users)))[:110]] += nb
for k, v in cnt.most_common(40): print(f"{v/(b*s):10.1f} B/tok  {k}")
print("total saved (all layers+head)", tot/(b*s), "B/token")
