"""Where inventories and profiles live, and deriving them on first use.

Places searched, in order, after an in-memory memo:
- shipped: `data/profiles/<config hash[:16]>/` (every preset's inventory and its common profiles, committed);
- cache: `$WILLITFIT_CACHE`, else `~/.cache/willitfit/`, same layout (what this machine derived or fetched);
- bank: `$WILLITFIT_PROFILES`, a directory or URL many machines share (estimator.bank), same layout; a file taken
  from it is checked to be what its address names and kept in the cache.
A miss derives the file (torch + transformers: `tracer.derive`, the one lazy hand-over to the tier above),
reporting progress through the caller's callback, and writes it to the cache atomically. `derive=False` raises
`ProfileMissing` instead, naming the command that derives it.

Files are keyed by the config's sha256 (`estimator.presets.config_hash`) and, for profiles, a hash of the
workload class (`profile_key`). A LoRA class leaves the rank out ("lora_rank": "r": one profile answers every rank,
`Profile.at_rank`); a per-rank file written before that is still read where no rank-free one is found
(`profile_keys`). Evaluating a profile never imports torch: only a miss does.
"""
from __future__ import annotations

import hashlib
import json
import os
import tempfile
from dataclasses import replace
from functools import lru_cache
from pathlib import Path

from estimator import bank, cp, knobs
from estimator.families import AUDIO_ROUTE, AUDIO_TYPES, VLM_TYPES, vlm_route
from estimator.inventory import Inventory
from estimator.parallel import TRACED_SHARDING
from estimator.presets import DATA_DIR, config_hash
from estimator.profile.profile import RANK_MARK, Profile
from estimator.spec import SIZE_FIELDS, Parallel, Workload, spec_dict

SHIPPED_DIR = DATA_DIR / "profiles"
_MEMO: dict[tuple, object] = {}


class ProfileMissing(ValueError):
    """No inventory or profile on disk, and deriving one was not allowed (or torch is missing)."""


def cache_dir() -> Path:
    env = os.environ.get("WILLITFIT_CACHE", "").strip()
    return Path(env) if env else Path.home() / ".cache" / "willitfit"


def _dirs(h: str) -> list[Path]:
    return [SHIPPED_DIR / h[:16], cache_dir() / h[:16]]


# Gradient accumulation: the tracer runs two optimizer steps of grad_accum micro-batches and keeps the last step's
# ticks; from the second micro-batch on, every micro-batch runs with the gradients of the ones before it already
# held, so a third or seventh one repeats the second's ticks byte for byte. Checked with full traces of the tiny
# models (tests/test_canonical.py, slow tier): grad_accum 2, 3, 4 and 7 gave the same load, forward, backward and
# optimizer peaks at (b, s) = (2, 64) and (1, 37) in all 20 cases tried: llama full, LoRA, amp, mixed, checkpointing
# full/selective/op-sac, chunked and fused-linear losses, keep-output, activation offload, SGD, fused AdamW,
# compile, FSDP and FSDP grad-op on 2 ranks; gpt2, mixtral (routed experts), bert, gemma2 eager. grad_accum 1 differs
# (no gradients live through its forward), so it stays its own class. Where tracer.replay allows it, both classes come
# from one derivation (docs/estimator.md, "Replayed classes").
GRAD_ACCUM_CLASS = 2

# The tracer's revision, written into every derived profile's provenance (tracer.derive). A fix that changes what a
# class's traces read raises it, and `OUTDATED` names the classes whose cached or banked profiles from before are
# derived again (the shipped ones are re-derived in the repository with the fix). 2 (2026-11-28): selective
# checkpointing's wrapped attention got its mask (eager attention ran unmasked, windows were not applied).
TRACER_REVISION = 2
OUTDATED = ((2, lambda wc: wc.get("checkpointing") == "selective"),)


def outdated(prof: Profile) -> bool:
    """Whether a cached or banked profile comes from a tracer a later fix changed for its class (`OUTDATED`)."""
    rev = int(prof.provenance.get("tracer_revision", 1))
    return any(rev < needed and applies(prof.workload_class) for needed, applies in OUTDATED)


@lru_cache(maxsize=1024)
def canonical_class(w: Workload) -> Workload:
    """The one workload that names w's profile class, used for its key and for its derivation alike.

    Every knob that does not apply to w (its `Knob.applies` for w's mode and method: an inference run's optimizer
    or recipe, a full fine-tune's LoRA rank) takes its default, so it cannot split profiles; QLoRA's double_quant
    only means something with method='qlora'. weight_format is declared 'frozen' (the app offers it for frozen
    weights only), but a full fine-tune's float weight_format is honoured by the runner (tracer.runner
    .weight_dtype stores the trainable weights in it), so it is kept. Every grad_accum >= 2 is GRAD_ACCUM_CLASS.
    LoRA targets are sorted: PEFT matches each module's name against the set (peft.tuners.tuners_utils
    .BaseTuner.inject_adapter walks model.named_modules()), so their order changes no tensor. Sizes (batch, seq,
    gen_tokens) are left as they are."""
    change = {}
    for d in knobs.declared():
        # images, audios, target_seq: whether the model takes them is the model's, not the class's; others' are
        # refused earlier
        if d.name in SIZE_FIELDS or d.name == "weight_format" or knobs.applies(d, w.mode, w.method, vlm=True,
                                                                                seq2seq=True, audio=True, speech=True):
            continue
        if getattr(w, d.name) != d.default:
            change[d.name] = d.default
    if w.method != "qlora" and not w.double_quant:
        change["double_quant"] = True
    if w.grad_accum > GRAD_ACCUM_CLASS:
        change["grad_accum"] = GRAD_ACCUM_CLASS
    if "lora_targets" not in change and list(w.lora_targets) != sorted(w.lora_targets):
        change["lora_targets"] = tuple(sorted(w.lora_targets))
    return replace(w, **change) if change else w


def workload_class(w: Workload, rank_variable: bool | None = None) -> dict:
    """The canonical workload less its sizes: what one profile covers (canonical_class). A LoRA profile covers every
    rank (its class says "lora_rank": "r", profile.RANK_MARK); `rank_variable=False` gives the class of a profile
    derived for this one rank only (every LoRA profile written before the rank was a variable)."""
    out = {k: v for k, v in spec_dict(canonical_class(w)).items() if k not in SIZE_FIELDS}
    # 0: the class every profile written before these existed names
    for name in ("images", "audios", "audio_seconds", "target_seq"):
        if not out.get(name):
            out.pop(name, None)
    if w.images and w.image_size:   # a grid VLM's images (estimator.vision.sized): their size is the class's
        out["image_size"] = w.image_size
    if (is_rank_variable(w) if rank_variable is None else rank_variable):
        out["lora_rank"] = RANK_MARK
    return out


def is_rank_variable(w: Workload) -> bool:
    """Whether this workload's profile has the LoRA rank as a variable (LoRA and QLoRA training)."""
    return w.mode == "train" and w.method in ("lora", "qlora")


def parallel_class(p: Parallel, pp_rank: int = 0) -> dict:
    """What a profile of this parallel setting is of: the strategy, and for a traced TP rank (strategy tp, or
    FSDP x TP) its degree: a TP profile is fit at one tp; an FSDP one holds n = the dp group as a variable. A
    pipeline rank's (tracer.pp) names its degree, schedule, micro-batches and the rank (its stage), and with TP
    inside the stages the tp degree and sequence parallelism."""
    if p.pp_size > 1 and p.strategy in ("pp", *TRACED_SHARDING) and p.ep_size == 1:
        tp = {"tp": p.tp_size, **({"sp": True} if p.sequence_parallel else {})} if p.tp_size > 1 else {}
        return {"strategy": p.strategy, "pp": p.pp_size, "schedule": p.pp_schedule, "microbatches": p.microbatches,
                "rank": pp_rank, **tp}
    wrap = {"wrap": p.fsdp_wrap} if p.fsdp_wrap != "layers" else {}   # FSDP2's units (spec.FSDP_WRAPS)
    if p.cp > 1:   # one CP rank of this degree: an FSDP profile over n = dp_shard x cp (tracer.cp), with its TP
        if not 0 <= pp_rank < p.cp:
            raise ValueError(f"pp_rank: {pp_rank} is not a rank of a context-parallel group of {p.cp}")
        tp = {"tp": p.tp_size, **({"sp": True} if p.sequence_parallel else {})} if p.tp_size > 1 else {}
        return {"strategy": p.strategy, "cp": p.cp, "rank": pp_rank, **tp, **wrap}
    if pp_rank:
        raise ValueError(f"pp_rank: only a pipeline's or a context-parallel group's ranks have profiles of their own; "
                         f"got rank {pp_rank}")
    if p.tp_size > 1:
        return {"strategy": p.strategy, "tp": p.tp_size, **({"sp": True} if p.sequence_parallel else {}), **wrap}
    return {"strategy": p.strategy, **wrap}


def class_ranks(p: Parallel) -> tuple[int, ...]:
    """The ranks of a traced parallel class that have profiles of their own (`parallel_class`'s rank): every rank
    of a pipeline, a context-parallel group's two derived ranks (estimator.cp.ranks), else rank 0 alone."""
    if p.pp_size > 1 and p.strategy in ("pp", *TRACED_SHARDING) and p.ep_size == 1:
        return tuple(range(p.pp_size))
    return cp.ranks(p.cp) if p.cp > 1 else (0,)


def profile_key(w: Workload, p: Parallel, kernels: str = "cuda", pp_rank: int = 0) -> str:
    """16 hex digits naming a (workload class, parallel class, kernels) profile file: the one a derivation
    writes (for LoRA, the rank-free class). `pp_rank`: a pipeline's rank (parallel_class)."""
    return class_key(workload_class(w), parallel_class(p, pp_rank), kernels)


def profile_keys(w: Workload, p: Parallel, kernels: str = "cuda", pp_rank: int = 0) -> tuple[str, ...]:
    """The keys a lookup tries, in order: `profile_key`, then for LoRA the legacy key of a profile derived for this
    one rank (the shipped per-rank files stay valid)."""
    keys = (profile_key(w, p, kernels, pp_rank),)
    if is_rank_variable(w):
        keys += (class_key(workload_class(w, rank_variable=False), parallel_class(p, pp_rank), kernels),)
    return keys


def class_key(workload_cls: dict, parallel_cls: dict, kernels: str = "cuda") -> str:
    """The key of a profile from its classes as stored in it: how a file from a shared bank is checked to be what
    its address says."""
    ident = json.dumps({"workload": workload_cls, "parallel": parallel_cls, "kernels": kernels},
                       sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(ident.encode()).hexdigest()[:16]


def _read(path: Path) -> str | None:
    try:
        return path.read_text()
    except (FileNotFoundError, NotADirectoryError):
        return None


def _write(path: Path, text: str) -> None:
    """Atomic: a reader never sees half a file (write a temporary file beside it, then rename)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.chmod(tmp, 0o644)  # mkstemp makes 0600; a shipped or shared cache file is readable by all
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def where(config: dict, name: str = "inventory", key: str | None = None) -> str | None:
    """'shipped' or 'cache' for the file that would answer, or None if it must be derived."""
    h = config_hash(config)
    fname = "inventory.json" if key is None else f"{key}.json"
    for label, d in zip(("shipped", "cache"), _dirs(h)):
        if (d / fname).is_file():
            return label
    return None


def stored_key(config: dict, w: Workload, p: Parallel, *, ship: bool = False, pp_rank: int = 0) -> str | None:
    """The key of the profile file on disk (shipped, else cached; `ship`: shipped only) that `profile` would read
    for this class, in `profile_keys` order: the rank-free one, else a per-rank one; None if neither is there."""
    h = config_hash(config)
    for key in profile_keys(w, p, pp_rank=pp_rank):
        for d in _dirs(h)[:1] if ship else _dirs(h):
            if (d / f"{key}.json").is_file():
                return key
    return None


# Keys an inventory written by this version has beyond the dataclass fields; a cached one without them is stale
INVENTORY_KEYS = ("sdpa", "decoder_path", "text_model_type", "forloop_elems", "linear_runs")


def _stale(config: dict, data: dict) -> bool:
    """An inventory written by an older willitfit: fields this one reads are missing (a vision-language model's
    images, tracer.vlm, or the reason they are refused; the parameters its steps leave without a gradient, a vision
    encoder's read from a step, tracer.vision.unreached_params)."""
    if any(k not in data for k in INVENTORY_KEYS):
        return True
    if config.get("model_type") in AUDIO_TYPES:   # its audio, or why it is refused, by this version (tracer.audio)
        return data.get("audio_route") != AUDIO_ROUTE or "image_side" not in data or (
            "unreached" not in data["audio"] if "audio" in data else "audio_refused" not in data)
    if "vision" in data and "unreached_read" not in data["vision"]:   # read by name only (mask_token) before
        return True
    if config.get("model_type") not in VLM_TYPES:
        return False
    if data.get("vlm_route") != vlm_route(config["model_type"]):   # built another way (or priced text-only) then
        return True
    if "vlm" in data and not data.get("image_side"):   # Idefics2/3, SmolVLM: their text_model was not found before
        return True
    return "image_side" not in data or ("unreached" not in data["vlm"] if "vlm" in data else "vlm_refused" not in data)


def inventory(config: dict, name: str, *, derive: bool = True, progress=None, ship: bool = False) -> Inventory:
    h = config_hash(config)
    memo = ("inv", h, name)
    if memo in _MEMO:
        return _MEMO[memo]
    for d in _dirs(h)[:1] if ship else _dirs(h):
        text = _read(d / "inventory.json")
        if text is not None:
            data = json.loads(text)
            if _stale(config, data) and d.parent != SHIPPED_DIR:
                continue  # a cached file from an older willitfit (fewer fields): read again below
            inv = Inventory.from_dict(data, name, h)
            _MEMO[memo] = inv
            return inv
    check_model_type(config)
    if not ship:
        text = _from_bank(h, "inventory.json", progress)
        if text is not None:
            try:
                inv = Inventory.from_dict(json.loads(text), name, h)
            except (ValueError, TypeError, KeyError) as e:
                _say(progress, f"{bank.ENV_VAR}: {h[:16]}/inventory.json is not a willitfit inventory ({e}); skipped")
            else:
                _write(cache_dir() / h[:16] / "inventory.json", text)
                _MEMO[memo] = inv
                return inv
    if not derive:
        raise ProfileMissing(f"model: no inventory for {name!r} on disk; run `python -m bench derive --model "
                             f"{name}` (needs torch and transformers)")
    _config_check().check(config)   # transformers' own refusal, in about a second, before torch loads here
    if progress:
        progress(0, 1, f"reading {name}'s parameters from a meta-device build (transformers)")
    data = _derivation().read_inventory(config)
    _write((SHIPPED_DIR if ship else cache_dir()) / h[:16] / "inventory.json",
           json.dumps(data, sort_keys=True, separators=(",", ":")))
    inv = Inventory.from_dict(data, name, h)
    _MEMO[memo] = inv
    return inv


def profile(config: dict, w: Workload, p: Parallel, *, name: str = "model", derive: bool = True,
            progress=None, ship: bool = False, pp_rank: int = 0) -> Profile:
    """The profile of (config, workload class, parallel class) at this workload's LoRA rank; derived and cached on a
    miss. LoRA: the rank-free profile (any rank, `Profile.at_rank`) is looked for first, then one derived for this
    rank (`profile_keys`), everywhere (shipped, cache, bank) before deriving; a derivation writes the rank-free one.
    What is derived is the canonical class (canonical_class), the one its key names. `pp_rank`: which pipeline rank's
    profile (strategy pp: each rank is traced and derived on its own, tracer.pp)."""
    return stored_profile(config, w, p, name=name, derive=derive, progress=progress, ship=ship,
                          pp_rank=pp_rank).at_rank(w.lora_rank)


def stored_profile(config: dict, w: Workload, p: Parallel, *, name: str = "model", derive: bool = True,
                   progress=None, ship: bool = False, legacy: bool = True, pp_rank: int = 0) -> Profile:
    """The profile as stored: for LoRA, rank-variable where one is found or derived (see `profile`). `legacy=False`
    takes no per-rank file (scripts/ship_profiles.py: a rank-free one is derived where only those are shipped)."""
    w = canonical_class(w)
    h = config_hash(config)
    keys = profile_keys(w, p, pp_rank=pp_rank) if legacy else profile_keys(w, p, pp_rank=pp_rank)[:1]
    for key in keys:
        hit = _MEMO.get(("prof", h, key))
        if hit is not None:
            return hit
    for key in keys:
        for d in _dirs(h)[:1] if ship else _dirs(h):  # shipping never takes a user's cached copy
            text = _read(d / f"{key}.json")
            if text is not None:
                try:
                    prof = Profile.from_json(text)
                except ValueError:
                    if d.parent == SHIPPED_DIR:
                        raise
                    continue  # a cached file from an older willitfit (another format): derived again below
                if d.parent != SHIPPED_DIR and outdated(prof):
                    continue  # derived before a fix of the tracer that changed its class: derived again below
                _MEMO[("prof", h, key)] = prof
                return prof
    if not ship:
        for key in keys:
            prof = _bank_profile(h, key, progress)
            if prof is not None:
                _MEMO[("prof", h, key)] = prof
                return prof
    if not derive:
        raise ProfileMissing(f"profile: {name!r} has no profile on disk for this workload class; it is derived on "
                             "first use (needs torch and transformers), e.g. `python -m bench derive --model "
                             f"{name}` with the same workload flags")
    key = keys[0]
    try:
        # with it, where the tracer replays it from the same traces, the class of the other grad_accum (tracer.replay)
        prof, *more = _derivation().derive_profiles(config, w, p, progress=progress, config_hash=h,
                                                     **({"pp_rank": pp_rank} if pp_rank else {}))
    except (RuntimeError, NotImplementedError, KeyError, IndexError, AttributeError, TypeError) as e:
        # the model's own code failed under this workload on fake tensors (e.g. transformers' grouped_mm experts,
        # which take bf16 inputs only, under the amp or fp32 recipe; a KeyError of the whole model): one line
        first = (str(e).strip().splitlines() or [""])[0][:240]
        first = first if isinstance(e, (RuntimeError, NotImplementedError)) else f"{type(e).__name__}: {first}"
        raise ValueError(f"trace: {name!r} cannot run this workload class on fake tensors ({first}); no profile can "
                         "be derived for it") from None
    _write((SHIPPED_DIR if ship else cache_dir()) / h[:16] / f"{key}.json", prof.to_json())
    _MEMO[("prof", h, key)] = prof
    for other in more:   # kept where no file of its class is (a shipped or cached one is never replaced)
        other_key = class_key(other.workload_class, other.parallel_class, other.provenance.get("kernels", "cuda"))
        if not any((d / f"{other_key}.json").is_file() for d in _dirs(h)):
            _write((SHIPPED_DIR if ship else cache_dir()) / h[:16] / f"{other_key}.json", other.to_json())
    return prof


def _bank_profile(h: str, key: str, progress) -> Profile | None:
    """The bank's profile under this key, checked to be what its address names and kept in the cache; None if the
    bank has none (or a file that fails the check: skipped with one line)."""
    text = _from_bank(h, f"{key}.json", progress)
    if text is None:
        return None
    try:
        prof = Profile.from_json(text)
        if prof.config_hash != h or class_key(prof.workload_class, prof.parallel_class,
                                              prof.provenance.get("kernels", "cuda")) != key:
            raise ValueError("its config hash or class is not the one its address names")
        if outdated(prof):
            raise ValueError(f"derived by a tracer before revision {TRACER_REVISION}, which changed its class")
    except ValueError as e:
        _say(progress, f"{bank.ENV_VAR}: {h[:16]}/{key}.json skipped: {e}")
        return None
    _write(cache_dir() / h[:16] / f"{key}.json", text)
    return prof


def _say(progress, message: str) -> None:
    if progress:
        progress(0, 1, message)


def _from_bank(h: str, fname: str, progress) -> str | None:
    """A file from the shared bank (WILLITFIT_PROFILES), or None: no bank, not there, or unreachable (then the
    caller derives, and `progress` hears why)."""
    bank_url = bank.url()
    if bank_url is None:
        return None
    try:
        return bank.fetch(bank_url, h[:16], fname)
    except bank.BankError as e:
        _say(progress, f"{e}; deriving here instead")
        return None


def _derivation():
    """The derivation tier (`tracer.derive`: torch, transformers), imported on the first miss only.

    This is the one import in `estimator` of a higher tier (docs/architecture.md): evaluating what is on disk never
    loads torch, and a miss hands over to the code that traces the model."""
    try:
        from tracer import derive
    except ImportError as e:  # torch/transformers missing: say so in one line
        raise ProfileMissing(f"profile: deriving one needs torch and transformers ({e})") from None
    return derive


def local_text(config: dict, fname: str) -> str | None:
    """The text of a shipped or cached file of this config ('inventory.json' or '<profile key>.json'), or None."""
    for d in _dirs(config_hash(config)):
        text = _read(d / fname)
        if text is not None:
            return text
    return None


def check_model_type(config: dict) -> None:
    """An unknown model_type (or remote code), refused in one line before transformers is imported: the model types
    transformers has, read from its source (tracer.model_types)."""
    _model_types().check_model_type(config)


def _model_types():
    """tracer.model_types (the model types transformers has, read from its source without importing it or torch):
    the derivation tier's fast check, imported on an inventory miss, before the derivation itself."""
    from tracer import model_types

    return model_types


def _config_check():
    """tracer.config_check (transformers' config class asked in a child process without torch): the derivation
    tier's second fast check, imported on an inventory miss, before the derivation itself."""
    from tracer import config_check

    return config_check


def forget(config: dict, key: str, *, ship: bool = False) -> None:
    """Delete one profile file (shipped or cached) and its memo, so that it is derived again. The key
    "inventory" deletes the model's inventory (read again from a meta-device build on next use)."""
    h = config_hash(config)
    (((SHIPPED_DIR if ship else cache_dir()) / h[:16]) / f"{key}.json").unlink(missing_ok=True)
    if key == "inventory":
        for memo in [m for m in _MEMO if m[0] == "inv" and m[1] == h]:
            del _MEMO[memo]
    else:
        _MEMO.pop(("prof", h, key), None)


def clear_memo() -> None:
    """Forget what was loaded (a cold estimate re-reads the files)."""
    _MEMO.clear()
