"""`python -m bench derive`: read models' inventories and derive their memory profiles (traced on fake tensors).

    python -m bench derive --model llama-3.1-8b                       # the default training class
    python -m bench derive --model qwen3-8b --method lora --mode train,infer
    python -m bench derive --model all --ship                         # every preset's shipped profiles
    python -m bench derive --model qwen3-8b --method lora --push /shared/willitfit-profiles   # share them
    python -m bench derive --model qwen3-8b --method lora --pull hf://datasets/org/profiles   # fetch, no tracing
    python -m bench derive --model llama-3.2-1b --strategy pp --gpus 4 --microbatches 8   # every pipeline rank

Each distinct (model, workload class, strategy) of the grid is derived once: batch, seq, gen tokens and the
world size are the profile's variables, not part of its class. Files go to the user's cache
($WILLITFIT_CACHE, else ~/.cache/willitfit) or, with --ship, to data/profiles/ (committed with the project).
A profile already on disk is skipped unless --force. Prints one line per trace while deriving, and a summary
with the seconds each profile took. --push URL then copies each inventory and profile to a shared bank
(estimator.bank: content-addressed, never overwritten); --pull URL fetches them from one instead of tracing.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

from bench.trace import grid
from estimator.store import profile_keys
from estimator import bank, store
from estimator.presets import config_hash
from estimator.estimate import traced_class
from estimator.presets import preset_names


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "derive", help="derive models' inventories and memory profiles (traces a reduced-depth model)",
        description="\n\n".join(__doc__.split("\n\n")[:3]), formatter_class=argparse.RawDescriptionHelpFormatter)
    grid.add_arguments(p)
    p.add_argument("--ship", action="store_true", help="write into data/profiles/ (the shipped set) instead of "
                   "the user cache")
    p.add_argument("--force", action="store_true", help="derive again even if the profile is on disk")
    p.add_argument("--quiet", action="store_true", help="no per-trace progress lines")
    p.add_argument("--inventory-only", action="store_true", help="read the models' inventories, derive no profile")
    share = p.add_mutually_exclusive_group()
    share.add_argument("--push", metavar="URL", help="after deriving, copy the inventories and profiles to this "
                       "shared bank (a directory, hf://datasets/..., s3://...; WILLITFIT_PROFILES readers use it)")
    share.add_argument("--pull", metavar="URL", help="fetch the inventories and profiles from this shared bank into "
                       "the local cache; trace nothing (a class the bank lacks is reported)")
    p.set_defaults(func=run_derive)


def _classes(cases) -> list:

    seen, out = set(), []
    for c in cases:
        # LoRA: ranks share the rank-free key, but where a per-rank file answers one rank the others still need
        # theirs (a rank-free derivation), so the per-rank key tells them apart (store.profile_keys)
        key = (c.model_name, profile_keys(c.workload, c.parallel))
        if key not in seen:
            seen.add(key)
            out.append(c)
    return out


def run_derive(args: argparse.Namespace) -> int:

    try:
        models = preset_names() if args.model == "all" else grid.parse_list("model", args.model, str, None)
        cases, skipped = grid.expand(models, grid.axes_from_args(args))
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.inventory_only:
        return _inventories(sorted({c.model_name: c for c in cases}.values(), key=lambda c: c.model_name), args)
    todo = []
    for c in _classes(cases):
        tw, tp, _ = traced_class(c.workload, c.parallel)
        todo.append((c, tw, tp))
    progress = None if args.quiet else (lambda d, t, m: print(f"    [{d}/{t}] {m}", file=sys.stderr, flush=True))
    if args.pull:
        if args.ship:
            print("error: ship: --pull fills the user cache; drop --ship", file=sys.stderr)
            return 2
        os.environ[bank.ENV_VAR] = args.pull  # this process only: the store asks the bank before deriving
    derive = not args.pull
    failed = 0
    pushed: dict[str, int] = {}
    for i, (c, tw, tp) in enumerate(todo, 1):
        label = f"[{i}/{len(todo)}] {c.model_name} {tw.mode} {tw.method} {tw.recipe} {tw.attention} " \
                f"ckpt={tw.checkpointing} {tp.strategy}" + (f" cp {tp.cp}" if tp.cp > 1 else "")
        start = time.perf_counter()
        try:
            store.inventory(c.config, c.model_name, ship=args.ship, progress=progress, derive=derive)
            # a pipeline (alone or under FSDP): every rank's profile (tracer.pp), each a derivation of its own;
            # context parallelism: its two derived ranks (estimator.cp.ranks)
            ranks = store.class_ranks(tp)
            if args.force and derive:
                for r in ranks:
                    for key in store.profile_keys(tw, tp, pp_rank=r):  # LoRA: the rank-free file and a per-rank one
                        store.forget(c.config, key, ship=args.ship)
            profs = [store.stored_profile(c.config, tw, tp, name=c.model_name, progress=progress, ship=args.ship,
                                          derive=derive, pp_rank=r) for r in ranks]
            prof = profs[0]
            keys = [store.stored_key(c.config, tw, tp, ship=args.ship, pp_rank=r) for r in ranks]
            if args.push:
                for fname in ("inventory.json", *(f"{key}.json" for key in keys)):
                    status = bank.put(args.push, config_hash(c.config)[:16], fname, store.local_text(c.config, fname))
                    pushed[status] = pushed.get(status, 0) + 1
                    if status == "conflict":
                        print(f"{label}: {fname} differs from the bank's copy; the bank keeps its own", flush=True)
        except ValueError as e:
            failed += 1
            print(f"{label}: refused: {' '.join(str(e).split())}", flush=True)
            continue
        moments = sum(len(p.moments) for prof in profs for p in prof.pieces)
        print(f"{label}: {moments} moments in {len(prof.pieces)} pieces"
              + (f" x {len(profs)} {'CP' if tp.cp > 1 else 'pipeline'} ranks" if len(profs) > 1 else "") + ", "
              f"{time.perf_counter() - start:.1f} s", flush=True)
    print(f"{len(todo) - failed} profile(s) ready, {failed} {'missing from the bank' if args.pull else 'refused'}, "
          f"{sum(skipped.values())} grid combination(s) skipped")
    if args.push:
        print(f"bank {args.push}: " + ", ".join(f"{n} {s}" for s, n in sorted(pushed.items())) if pushed else
              f"bank {args.push}: nothing pushed")
    return 1 if failed and failed == len(todo) else 0


def _inventories(cases, args) -> int:

    failed = 0
    for c in cases:
        start = time.perf_counter()
        try:
            if args.force:
                store.forget(c.config, "inventory", ship=args.ship)
            inv = store.inventory(c.config, c.model_name, ship=args.ship)
        except ValueError as e:
            failed += 1
            print(f"{c.model_name}: refused: {' '.join(str(e).split())}", flush=True)
            continue
        print(f"{c.model_name}: {inv.built_as}, {inv.params:,} parameters, {inv.layers} layers "
              f"({len(set(inv.layer_types))} types), {time.perf_counter() - start:.2f} s", flush=True)
    return 1 if failed == len(cases) else 0
