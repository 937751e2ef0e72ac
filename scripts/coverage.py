"""Coverage: every model type of transformers' causal-LM, masked-LM, image-classification, seq2seq, speech seq2seq and
image-text-to-text auto classes, built from its config class's defaults.

    python scripts/coverage.py                      # all types, resumable (results in build/coverage.jsonl)
    python scripts/coverage.py --types llama,gemma3 # some
    python scripts/coverage.py --report             # only rewrite docs/architectures.md from the results
    python scripts/coverage.py --from-doc --redo --types mamba2,bamba   # a fresh clone: the shipped table's rows,
                                                                        # those types run again

For each model type of transformers' MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, MODEL_FOR_MASKED_LM_MAPPING_NAMES and
MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES (kind "image": those with no text model), in a subprocess of its own (a
crash or a hang costs one type, `--timeout` seconds at most):
1. the inventory (estimator.inventory, read from a meta-device build), its parameter count checked against an
   independent `sum(p.numel())` of `AutoModelFor{CausalLM,MaskedLM}.from_config(AutoConfig.for_model(type))`;
2. the profile for training (full fine-tuning, pure bf16, SDPA, or eager where transformers refuses SDPA),
   derived at reduced depth (tracer.derive), with the time it took, or the reason it was refused;
3. the estimate against a full-depth trace (tracer.session.run_traced) at a size the fit did not use
   (batch 3, a sequence between the fitted ones; for an image model the tokens of an image one patch (grid unit)
   wider than the config's, rounded down to a whole unit first): every stage's peak, the largest relative error.
The types only the seq2seq, speech seq2seq or image-text-to-text classes list (kinds "seq2seq", "speech",
"image-text") get their inventory only (status "text only", not counted), except the vision-language models priced
whole (estimator.families.VLM_TYPES: the three steps above with one image per sample, checked at the image's tokens
plus a text length the fit did not use), the audio-language ones (AUDIO_TYPES: one 30-s clip per sample), the
encoder-decoder ones (tracer.seq2seq: the decoder as long as the encoder; Whisper's on its fixed audio window) and
those whose image-text-to-text class is a causal LM of text alone (tracer.meta.causal_image_text: Mistral-4).
docs/architectures.md gets one row per type (status, parameters, error, times, reason).
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

# no torch: the types priced with their images or audio
from estimator.families import AUDIO_TYPES, GRID_IMAGE_SIZE, VLM_TYPES  # noqa: E402

OUT = ROOT / "build" / "coverage.jsonl"
DOC = ROOT / "docs" / "architectures.md"
TOLERANCE = 0.01


def all_types() -> list[tuple[str, str]]:
    from transformers.models.auto.modeling_auto import (MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
                                                        MODEL_FOR_MASKED_LM_MAPPING_NAMES)

    from transformers.models.auto import modeling_auto
    from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES

    types = [(t, "causal") for t in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES]
    types += [(t, "masked") for t in MODEL_FOR_MASKED_LM_MAPPING_NAMES if t not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES]
    text = {t for t, _ in types}
    types += [(t, "image") for t in MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES if t not in text]
    for kind, mapping in WHOLE_MODEL_KINDS.items():   # each type once, under the first kind that lists it
        seen = {t for t, _ in types}
        types += [(t, kind) for t in getattr(modeling_auto, mapping) if t not in seen]
    return sorted(types)


# Auto classes whose models willitfit does not price whole yet (issue "The models people bring in 2026"): a type
# of these that transformers builds is priced as its language model alone (status "text only", not counted as
# priced), or refused in one line (encoder-decoder models)
WHOLE_MODEL_KINDS = {"seq2seq": "MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES",
                     "speech": "MODEL_FOR_SPEECH_SEQ_2_SEQ_MAPPING_NAMES",
                     "image-text": "MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES"}


def independent_params(model_type: str) -> int:
    """sum(numel) of the model transformers builds from the config class's defaults, on meta (deduplicated)."""
    import torch
    from tracer.meta import causal_image_text
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForMaskedLM
    from transformers.models.auto.modeling_auto import (MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
                                                        MODEL_FOR_MASKED_LM_MAPPING_NAMES)

    cfg = AutoConfig.for_model(model_type)
    if getattr(cfg, "is_encoder_decoder", False):   # priced whole (tracer.seq2seq): its seq2seq model
        from transformers import AutoModelForSeq2SeqLM, AutoModelForSpeechSeq2Seq
        from transformers.models.auto.modeling_auto import MODEL_FOR_SPEECH_SEQ_2_SEQ_MAPPING_NAMES

        cls = AutoModelForSpeechSeq2Seq if model_type in MODEL_FOR_SPEECH_SEQ_2_SEQ_MAPPING_NAMES else \
            AutoModelForSeq2SeqLM
        with torch.device("meta"):
            return sum(p.numel() for p in cls.from_config(cfg).parameters())
    if model_type in VLM_TYPES + AUDIO_TYPES or causal_image_text(model_type):   # priced whole with its images
        from tracer.audio import audio_class    # (audio), or the causal LM an image-text-to-text type maps to
        from transformers import AutoModelForImageTextToText

        cls = audio_class(model_type) if model_type in AUDIO_TYPES else AutoModelForImageTextToText
        with torch.device("meta"):
            return sum(p.numel() for p in cls.from_config(cfg).parameters())
    image = _image_class(model_type)
    if image is not None:   # the image-classification model a training step builds (the first class transformers
        with torch.device("meta"):                           # maps the type to: DeiT's without a teacher)
            return sum(p.numel() for p in image._from_config(cfg).parameters())
    if model_type in MODEL_FOR_MASKED_LM_MAPPING_NAMES and not getattr(cfg, "is_decoder", False):
        cls = AutoModelForMaskedLM
    elif model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        cls = AutoModelForCausalLM
    else:
        cls, cfg = AutoModelForCausalLM, cfg.text_config
    with torch.device("meta"):
        model = cls.from_config(cfg)
    return sum(p.numel() for p in model.parameters())


def _image_class(model_type: str):
    """transformers' image-classification class of a type with no text model, else None."""
    import transformers
    from transformers.models.auto import modeling_auto as auto

    names = auto.MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES.get(model_type)
    if names is None or model_type in auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES | auto.MODEL_FOR_MASKED_LM_MAPPING_NAMES:
        return None
    return getattr(transformers, names[0] if isinstance(names, tuple) else names)


def text_only(model_type: str, kind: str) -> dict:
    """A type of a kind willitfit does not price whole (WHOLE_MODEL_KINDS): its inventory, and what an estimate of it
    would cover (runs in the child process; nothing is derived)."""
    from estimator.model import from_hf_config

    row: dict = {"model_type": model_type}
    t = time.perf_counter()
    try:
        model = from_hf_config({"model_type": model_type}, model_type)
    except Exception as e:  # noqa: BLE001 - recorded as the type's reason
        return {**row, "status": "refused", "stage": "inventory", "reason": _line(e)}
    inv = model.inventory
    return {**row, "status": "text only", "stage": "scope", "inventory_s": round(time.perf_counter() - t, 2),
            "params": model.params, "layers": model.layers, "layer_types": len(set(inv.layer_types)),
            "built_as": inv.built_as,
            "reason": f"{KIND_WORDS[kind]} model priced as its language model alone ({inv.built_as}, text-only "
                      "steps: a scope note says so); the rest of the model and its inputs are not priced"}


def _encoder_decoder(model_type: str) -> bool:
    """An encoder-decoder config (priced whole, tracer.seq2seq: its row runs the three steps, or says why not)."""
    from transformers import AutoConfig

    try:
        return bool(getattr(AutoConfig.for_model(model_type), "is_encoder_decoder", False))
    except Exception:  # noqa: BLE001 - a config class that cannot be built: text_only says why
        return False


KIND_WORDS = {"seq2seq": "a seq2seq", "speech": "a speech seq2seq", "image-text": "an image-text-to-text"}


def one(model_type: str) -> dict:
    """Everything for one type (runs in the child process)."""
    from dataclasses import replace

    from estimator import audio, vision
    from estimator.model import from_hf_config
    from tracer.derive import derive_profile, pieces_for, max_positions
    from estimator.spec import Parallel, Workload
    from tracer.session import run_traced

    row: dict = {"model_type": model_type}
    config = {"model_type": model_type}
    t = time.perf_counter()
    try:
        model = from_hf_config(config, model_type)
    except Exception as e:  # noqa: BLE001 - recorded as the type's reason
        return {**row, "status": "refused", "stage": "inventory", "reason": _line(e)}
    row.update(inventory_s=round(time.perf_counter() - t, 2), params=model.params, layers=model.layers,
               layer_types=len(set(model.inventory.layer_types)), built_as=model.inventory.built_as)
    try:
        row["params_independent"] = independent_params(model_type)
    except Exception as e:  # noqa: BLE001
        row["params_independent_error"] = _line(e)
    row["params_exact"] = row.get("params_independent") == model.params
    refused = model.inventory.extra.get("vlm_refused")
    if refused is not None and not _causal(model_type):   # its images fail on its defaults: a text-only step is no row
        return {**row, "status": "refused", "stage": "images",
                "reason": f"its image path fails on its own config's defaults ({refused}); only a text-only step "
                          "would be priced"}
    if model.inventory.extra.get("audio_refused") is not None:   # its audio path fails on its defaults: likewise
        return {**row, "status": "refused", "stage": "audio", "reason": "its audio path fails on its own config's "
                f"defaults ({model.inventory.extra['audio_refused']}); only a text-only step would be priced"}
    prof, err = None, None
    # pure bf16 with the attention transformers runs by default (SDPA where the model has it, else eager), then the
    # other one; fp32 where the model's code cannot run in bf16 (FNet's FFT, DeBERTa's disentangled attention): the
    # first that derives is the type's row; a refusal gives the default attention's reason
    first, other = model.default_attention, ("eager" if model.default_attention == "sdpa" else "sdpa")
    grid = vision.grid(model) is not None   # Qwen2-VL's family: its vision tower is priced under flash only
    if grid or vision.pixtral(model) is not None:   # so is Pixtral's (Mistral-3, LightOnOCR)
        first = other = "flash"
    first_err, errors = None, {}
    for attention, recipe in ((first, "pure"), (other, "pure"), (first, "fp32"), (other, "fp32")):
        if recipe == "fp32" and not any(_dtype_error(e) for e in (first_err, err) if e is not None):
            break
        if (attention, recipe) in errors:
            continue
        w = Workload(attention=attention, recipe=recipe, precision="fp32" if recipe == "fp32" else "bf16",
                     images=1 if vision.images_of(model) is not None else 0,   # a vision-language model: one image
                     audios=1 if audio.audio_of(model) is not None else 0,   # an audio-language model: one clip
                     image_size=GRID_IMAGE_SIZE if grid else 0)
        t = time.perf_counter()
        try:
            prof = derive_profile(config, w, Parallel())
            row.update(attention=attention, recipe=recipe, derive_s=round(time.perf_counter() - t, 1),
                       traces=prof.provenance["traces"], reduced=prof.provenance["reduced_depths"],
                       moments=sum(len(p.moments) for p in prof.pieces))
            break
        except Exception as e:  # noqa: BLE001
            err = e
            first_err = first_err or e
            errors[(attention, recipe)] = e
    if prof is None:
        # a bf16 dtype error sent it to fp32: the default attention's fp32 error is the reason that remains
        reason = errors.get((first, "fp32"), first_err) if _dtype_error(first_err) else first_err
        return {**row, "status": "refused", "stage": "profile", "reason": _line(reason)}
    # a size the fit did not use: batch 3, a sequence halfway between the first two fitted ones
    from tracer.meta import hf_config
    if vision.is_vision(model):   # an image one patch wider than the config's: a token count no fit traces
        geo = vision.geometry(model)
        unit = int(geo["patch_size"])
        b, s = 3, vision.tokens(model, (int(geo["image_size"]) // unit + 1) * unit)
    else:
        lo, hi, seqs, _ = pieces_for(hf_config(config), max_positions(hf_config(config)), False)[0]
        b, s = 3, (seqs[0] + seqs[1]) // 2
        if w.images:   # the image's tokens and that much text
            s += vision.image_tokens(model, w)
        s += audio.audio_tokens(model, w)   # a clip's tokens and that much text
    w = replace(w, batch=b, seq=s)
    t = time.perf_counter()
    try:
        traced = {st.stage: st.peak_bytes for st in run_traced(config, w, Parallel()).log.stages}
    except Exception as e:  # noqa: BLE001
        return {**row, "status": "profile only", "stage": "full-depth trace", "reason": _line(e)}
    row["trace_s"] = round(time.perf_counter() - t, 1)
    piece = prof.piece_for(b, s)
    est = {}
    for m in piece.moments:
        est[m.stage] = max(est.get(m.stage, 0), sum(m.bytes_at(b, s).values()))
    errs = {k: (est.get(k, 0) - v) / v for k, v in traced.items() if v}
    worst = max(errs.values(), key=abs)
    row.update(check_batch=b, check_seq=s, worst_error=worst, exact=all(est.get(k) == v for k, v in traced.items()),
               status="exact" if all(est.get(k) == v for k, v in traced.items()) else
               ("within 1%" if abs(worst) <= TOLERANCE else "off"))
    return row


def _causal(model_type: str) -> bool:
    """A type the causal-LM auto class lists (Gemma-3: a text-only step is that class's step)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES


def _dtype_error(e: BaseException) -> bool:
    """An error of the model's code under bf16 (an op without a bf16 kernel, a dtype mismatch it makes itself)."""
    text = str(e).lower()
    return any(k in text for k in ("bfloat16", "dtype", "scalar type"))


def _line(e: BaseException | None) -> str:
    text = " ".join(str(e).split()) if e is not None else ""
    return (f"{type(e).__name__}: {text}" if text else type(e).__name__)[:300]


def _revision() -> str:
    """The commit the results come from (the tracer's code), with '+' when the work tree has changes."""
    def git(*args) -> str:
        return subprocess.run(["git", *args], capture_output=True, text=True, cwd=ROOT, timeout=10).stdout.strip()
    try:
        head, dirty = git("rev-parse", "--short", "HEAD"), git("status", "--porcelain", "--", "estimator")
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return (head or "unknown") + ("+" if dirty else "")


def run(types, timeout: int) -> None:
    OUT.parent.mkdir(parents=True, exist_ok=True)
    revision = _revision()
    done = {json.loads(x)["model_type"] for x in OUT.read_text().splitlines()} if OUT.exists() else set()
    todo = [t for t in types if t[0] not in done]
    for i, (mt, kind) in enumerate(todo, 1):
        start = time.perf_counter()
        proc = subprocess.Popen([sys.executable, __file__, "--child", mt, "--child-kind", kind],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
                                start_new_session=True)   # a timeout kills it with the trace workers it forked
        try:
            stdout, stderr = proc.communicate(timeout=timeout)
            lines = [x for x in stdout.splitlines() if x.startswith("{")]
            row = json.loads(lines[-1]) if lines else {"model_type": mt, "status": "error", "reason":
                                                      (stderr.strip().splitlines() or ["no output"])[-1][:300]}
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
            row = {"model_type": mt, "status": "timeout", "reason": f"more than {timeout} s"}
        row.update(kind=kind, seconds=round(time.perf_counter() - start, 1))
        row.setdefault("revision", revision)  # the child's own (the tree can change during a long run)
        with OUT.open("a") as f:
            f.write(json.dumps(row) + "\n")
        print(f"[{i}/{len(todo)}] {mt}: {row['status']} {row.get('worst_error', '')} {row.get('reason', '')[:100]}",
              flush=True)


CANNOT_BUILD = "transformers cannot build it from its config class's defaults (a checkpoint's own config.json may build)"
OWN_CODE_FAILS = "the model's own code fails on its defaults (its error in the table)"
REFUSAL_KINDS = (  # (what the reason says, how the summary names it); first match wins
    ("encoder-decoder model whose inputs willitfit does not build", "encoder-decoder model whose inputs are not "
     "text tokens or Whisper's mel window (speech features of other shapes, music, raw audio): not built"),
    ("encoder-decoder model willitfit does not price", "encoder-decoder model whose attention blocks or routes by "
     "length or value (block-sparse, sliding-window, n-stream, expert routing by nonzero), or a composite config: "
     "refused"),
    ("cannot build", CANNOT_BUILD),
    ("runs other operations", "recurrent or chunked code: the ops themselves change with seq"),
    ("changes shape with the sizes", "recurrent or chunked code: the ops themselves change with seq"),
    ("state-space scan", "chunked state-space scan priced on mamba_ssm's kernels only (kernels cuda)"),
    ("DataDependent", "reads tensor values (`.item()`, `nonzero`): fake tensors have none"),
    ("DynamicOutputShape", "reads tensor values (`.item()`, `nonzero`): fake tensors have none"),
    ("not exact", "the fit is not exact at a further size"),
    ("has no causal-LM or masked-LM model", "multimodal model whose language model has no causal-LM class of its "
                                            "own in transformers: refused (nothing priced)"),
    ("priced as its language model alone", "vision-language, audio-language or encoder-decoder model priced as "
                                           "its language model alone (text-only steps): the whole model not yet"),
    ("is not priced: its derivation's check", "image model whose memory has terms in the image's height + width "
                                              "that a polynomial in its grid units does not have (padded or unfolded "
                                              "copies of feature maps)"),
    ("runs only at its config's image size", "image model whose code runs at its config's image size only (no "
                                             "profile in the image size)"),
    ("image model willitfit does not model", "image model not modelled yet (not tried, or it needs what the tracer "
                                             "lacks: natten's kernels, NaFlex inputs, a VLM classifier)"),
    ("host per image grid", "an option whose memory lives on the host (relative position bias index): refused"),
    ("takes no labels", "image model whose classification class returns no loss: no training step to price"),
    ("states no audio token id", "audio-language model whose default config states no audio token id (a "
                                 "checkpoint's config.json states it): refused with audio"),
    ("audio features are", "audio-language model whose default config's audio features are not as wide as its text "
                           "model (a checkpoint's config.json matches them): refused with audio"),
)


def refusal_kind(reason: str) -> str:
    """The summary line a refusal's reason belongs to (docs/architectures.md, "Why the others have no profile")."""
    for needle, kind in REFUSAL_KINDS:
        if needle in reason:
            return kind
    return OWN_CODE_FAILS


# Vision models are also checked by tests/test_vision.py (tiny configs, to the byte, at image sizes no fit used) and
# scripts/vision_check.py (default configs at full size); their section of the doc is kept as written
# (scripts/coverage_vision.md) below the generated tables.
# likewise the sections on vision-language (tests/test_vlm.py, scripts/vlm_check.py), audio-language
# (tests/test_audio.py) and encoder-decoder models (tests/test_seq2seq.py), in the doc's order
SECTIONS = [(ROOT / "scripts" / f"coverage_{k}.md").read_text() for k in ("vision", "vlm", "audio", "seq2seq")]


def report() -> None:
    rows = [json.loads(x) for x in OUT.read_text().splitlines()]
    rows.sort(key=lambda r: r["model_type"])
    by = {}
    for r in rows:
        by[r["status"]] = by.get(r["status"], 0) + 1
    exact_params = sum(1 for r in rows if r.get("params_exact"))
    good = sum(1 for r in rows if r["status"] in ("exact", "within 1%") and r.get("params_exact"))
    kinds = {}
    for r in rows:
        k = kinds.setdefault(r.get("kind", ""), [0, 0])
        k[0] += 1
        k[1] += r["status"] in ("exact", "within 1%") and bool(r.get("params_exact"))
    per_kind = "; ".join(f"{name or '?'}: {good_k} of {n}" for name, (n, good_k) in sorted(kinds.items()))
    # the share issue "The models people bring" measures: of the types whose config defaults build (and then run)
    unbuilt = sum(1 for r in rows if r["status"] not in ("exact", "within 1%")
                  and refusal_kind(r.get("reason", "")) == CANNOT_BUILD)
    failing = sum(1 for r in rows if r["status"] not in ("exact", "within 1%")
                  and refusal_kind(r.get("reason", "")) == OWN_CODE_FAILS)
    built, ran = len(rows) - unbuilt, len(rows) - unbuilt - failing
    share = (f" Of the {built} types whose defaults transformers builds: {good} ({good / max(built, 1):.1%}); of "
             f"the {ran} whose own code also runs on them: {good / max(ran, 1):.1%} (the target: 90%).")
    lines = ["# Architectures: every model type of transformers' causal-LM, masked-LM, image-classification, seq2seq, "
             "speech seq2seq and image-text-to-text auto classes", "",
             "Generated by `python scripts/coverage.py` (then `--report`), transformers and torch as in",
             "requirements.txt. Each type is built from its config class's defaults (`AutoConfig.for_model(type)`);",
             "its inventory is read on the meta device and its parameter count compared with an independent",
             "`sum(p.numel())`; its training profile (full fine-tuning, pure bf16, SDPA or eager; fp32 where the code has no bf16 path) is derived at reduced",
             "depth; the estimate is compared with a full-depth trace at a batch and sequence the fit did not use",
             "(an image model: at an image one patch or grid unit wider than its config's, batch 3; \"Vision encoders\""
             " below; an encoder-decoder model: its decoder as long as its encoder, \"Encoder-decoder models\" below).",
             "The revision column is the commit whose tracer produced the row; rows marked `pre-kernels` were traced",
             "before the CUDA-kernel emulation (tracer/kernels.py) landed, with the CPU's SDPA made",
             "CUDA-like by hand; profile and trace of a row always come from the same tracer.", "",
             f"**{len(rows)} model types**: " + ", ".join(f"{n} {k}" for k, n in sorted(by.items())) +
             f". Parameters exact: {exact_params}. Exact parameters and the estimate within 1% of the full-depth trace:"
             f" **{good}**. By kind (each type counted once, under the first of causal, masked, image, "
             f"seq2seq, speech, image-text that lists it): {per_kind}.{share}", "",
             "| model type | kind | status | built as | parameters | params exact | layers (types) | profile: traces, s |"
             " check (b, s) | worst stage error | revision | reason |",
             "|---|---|---|---|---:|---|---|---|---|---:|---|---|"]
    refused = [r for r in rows if r["status"] not in ("exact", "within 1%")]
    if refused:
        groups: dict[str, list[str]] = {}
        for r in refused:
            groups.setdefault(refusal_kind(r.get("reason", "")), []).append(r["model_type"])
        head = lines[:-3]
        head += ["", "## Why the others have no profile", "",
                 "`python -m estimator` refuses these in one line with the reason in the table; most can still be "
                 "traced at one size (`python -m bench trace`).", "",
                 "| reason | types | which |", "|---|---:|---|"]
        head += [f"| {k} | {len(v)} | {', '.join(sorted(v))} |"
                 for k, v in sorted(groups.items(), key=lambda kv: -len(kv[1]))]
        lines = head + ["", "## Every type"] + lines[-3:]
    for r in rows:
        err = f"{100 * r['worst_error']:+.4f}%" if "worst_error" in r else ""
        prof = f"{r['traces']}, {r['derive_s']}" if "traces" in r else ""
        if "traces" in r and (r.get("attention"), r.get("recipe", "pure")) != ("sdpa", "pure"):
            prof += f" ({r.get('attention')}, {r.get('recipe', 'pure')})"
        lines.append(f"| {r['model_type']} | {r.get('kind', '')} | {r['status']} | {r.get('built_as', '')} | "
                     f"{r.get('params', 0):,} | {'yes' if r.get('params_exact') else 'no'} | "
                     f"{r.get('layers', '')} ({r.get('layer_types', '')}) | {prof} | "
                     f"{r.get('check_batch', '')}, {r.get('check_seq', '')} | {err} | {r.get('revision', 'pre-kernels')} | "
                     f"{r.get('reason', '').replace('|', '/')} |")
    DOC.write_text("\n".join(lines) + "\n\n" + "\n".join(SECTIONS))
    print(f"wrote {DOC} ({len(rows)} types, {good} exact and within 1%)")


def rows_from_doc(text: str) -> list[dict]:
    """The rows docs/architectures.md's "Every type" table was written from (what `report` renders of them: the
    error to 4 decimals), so a clone without build/coverage.jsonl can run some types again and rewrite the doc."""
    body = text[text.index("## Every type"):]
    body = body[:body.index("## Vision encoders")] if "## Vision encoders" in body else body
    out = []
    for line in body.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 12 or cells[0] in ("model type", "---"):
            continue
        mt, kind, status, built, params, exact, layers, prof, check, err, rev, reason = cells
        row = {"model_type": mt, "kind": kind, "status": status, "params": int(params.replace(",", "") or 0),
               "params_exact": exact == "yes", "revision": rev}
        if built:
            row["built_as"] = built
        n, _, t = layers.partition(" (")
        if n and not n.startswith("("):
            row["layers"], row["layer_types"] = int(n), int(t.rstrip(")"))
        if prof:
            head, _, how = prof.partition(" (")
            traces, derive_s = head.split(", ")
            row.update(traces=int(traces), derive_s=float(derive_s))
            if how:
                row["attention"], row["recipe"] = how.rstrip(")").split(", ")
            else:
                row["attention"], row["recipe"] = "sdpa", "pure"
        b, _, sq = check.partition(",")
        if b.strip():
            row["check_batch"], row["check_seq"] = int(b), int(sq)
        if err:
            row["worst_error"] = float(err.rstrip("%")) / 100
        if reason:
            row["reason"] = reason
        out.append(row)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--types", help="comma-separated model types (default: all)")
    ap.add_argument("--timeout", type=int, default=600, help="seconds per type (default 600)")
    ap.add_argument("--report", action="store_true", help="only rewrite docs/architectures.md")
    ap.add_argument("--from-doc", action="store_true", help="start build/coverage.jsonl from docs/architectures.md's "
                    "table (a clone has no results)")
    ap.add_argument("--redo", action="store_true", help="with --types: run those types again (their rows replaced)")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--child-kind", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.redo and not args.types:
        ap.error("--redo: name the types to run again with --types")
    if args.from_doc:
        OUT.parent.mkdir(parents=True, exist_ok=True)
        OUT.write_text("".join(json.dumps(r) + "\n" for r in rows_from_doc(DOC.read_text())))
    if args.redo and OUT.exists():   # those types' rows dropped, run again below
        OUT.write_text("".join(x + "\n" for x in OUT.read_text().splitlines()
                               if json.loads(x)["model_type"] not in set(args.types.split(","))))
    if args.child:
        from tracer.meta import causal_image_text

        row = text_only(args.child, args.child_kind) if args.child_kind in WHOLE_MODEL_KINDS and \
            args.child not in VLM_TYPES + AUDIO_TYPES and not _encoder_decoder(args.child) and \
            not causal_image_text(args.child) else one(args.child)
        print(json.dumps({**row, "revision": _revision()}))
        return 0
    if not args.report:
        want = set(args.types.split(",")) if args.types else None
        run([t for t in all_types() if want is None or t[0] in want], args.timeout)
    report()
    return 0


if __name__ == "__main__":
    sys.exit(main())
