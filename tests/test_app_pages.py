"""Every page of the Streamlit app, run from app.py with AppTest, on a temporary database.

Each test changes a widget and checks that the number on screen is the library's answer for the same inputs,
computed here by calling `estimator` / `bench` (never re-derived). No test touches the shipped database
(WILLITFIT_DB points at a temp copy), the shipped calibration file (WILLITFIT_CALIBRATION) or the network
(HF_HUB_OFFLINE=1).
"""
from __future__ import annotations

import json
import threading
import shutil
from pathlib import Path

import pandas as pd
import pytest
from streamlit.testing.v1 import AppTest

from bench.store import app_data

from bench.accuracy import calibrate

from bench.share import pull as share_pull
from bench.share import push as share_push
from bench.share import remote as share_remote
from bench.store import db
from bench.accuracy.calibrate import parallel_from_row, workload_from_row
from bench.store.ingest import ingest_files
from estimator import search
from estimator.estimate import Options, estimate
from estimator.device import capacity_bytes
from estimator.components import model_state_bytes
from estimator.gpus import get_gpu
from estimator.layouts import layouts
from estimator.model import from_hf_config
from estimator.presets import load_config
from estimator.spec import Parallel, Workload
from estimator.units import GiB, fmt_bytes
from rowfactory import make_row

APP = str(Path(__file__).resolve().parent.parent / "app.py")
PAGES = ("pages/fit.py", "pages/benchmarks.py", "pages/curves.py", "pages/calibrate.py", "pages/multi_gpu.py",
         "pages/contribute.py", "pages/replay.py")
MODEL = "llama-3.2-1b"
H100 = "h100-sxm-80gb"
ON_H100 = Options(gpu=H100)                          # the pages price on the chosen GPU: its measured CUDA context
ON_H100_NO_TRACE = Options(gpu=H100, derive=False)
TIMEOUT_S = 60
NO_STAGE_PEAKS = {f"{st}_peak_alloc_bytes": None for st in ("load", "forward", "backward", "optimizer")}


def model_rows() -> list[dict]:
    """Traced and measured rows of MODEL: batch x seq, an OOM, and traced FSDP runs at 2 and 4 GPUs.

    Their peaks are the estimator's allocated bytes scaled by a per-source factor, so fits and residuals are
    non-trivial but known; the numbers the tests check come from calling the library on these rows."""
    name, cfg = load_config(MODEL)
    model = from_hf_config(cfg, name)
    rows = []
    for source, factor, gpu in (("traced", 0.97, "fake-cpu"), ("measured", 1.04, "NVIDIA H100 80GB HBM3")):
        for i, (b, s) in enumerate((b, s) for b in (1, 2, 4, 8) for s in (512, 1024, 2048)):
            est = estimate(model, Workload(batch=b, seq=s))
            peak = int(est.allocated_bytes * (factor + 0.005 * (i % 3)))
            rows.append(make_row(config=cfg, model_name=name, params=model.params, trainable_params=model.params,
                                 source=source, gpu_name=gpu, batch=b, seq=s, peak_alloc_bytes=peak,
                                 forward_peak_alloc_bytes=peak, backward_peak_alloc_bytes=peak,
                                 optimizer_peak_alloc_bytes=None, load_peak_alloc_bytes=None,
                                 peak_reserved_bytes=peak + 2**30, breakdown_json=None,
                                 gpu_total_bytes=get_gpu(H100).memory_bytes if source == "measured" else None))
    rows.append(make_row(config=cfg, model_name=name, params=model.params, source="measured", batch=64, seq=2048,
                         gpu_name="NVIDIA H100 80GB HBM3", oom=True, oom_stage="forward", peak_alloc_bytes=None,
                         **NO_STAGE_PEAKS))
    for n in (2, 4):
        est = estimate(model, Workload(batch=4, seq=1024), Parallel(strategy="fsdp", gpus=n))
        rows.append(make_row(config=cfg, model_name=name, params=model.params, strategy="fsdp", world_size=n,
                             gpu_count=n, batch=4, seq=1024, peak_alloc_bytes=est.allocated_bytes,
                             breakdown_json=None, **NO_STAGE_PEAKS))
    return rows + [make_row()]  # and one row of the tiny test model


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


@pytest.fixture(scope="module")
def built_db(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("appdb")
    path = tmp / "bench.duckdb"
    report = ingest_files([write_jsonl(tmp / "rows.jsonl", model_rows())], path)
    assert report.written and report.n_rejected == 0
    return path


@pytest.fixture
def env(monkeypatch, tmp_path, built_db) -> Path:
    """A private copy of the database; calibration JSON in tmp; the hub switched off."""
    path = tmp_path / "bench.duckdb"
    shutil.copy(built_db, path)
    monkeypatch.setenv("WILLITFIT_DB", str(path))
    monkeypatch.setenv("WILLITFIT_CALIBRATION", str(tmp_path / "calibration.json"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))  # an empty hub cache: nothing is served from the user's
    # unpriced advice rows are not derived in the background (test_fit_prices_every_advice_row_in_the_background)
    monkeypatch.setenv("WILLITFIT_PRICE_ADVICE", "0")
    return path


def app(page: str | None = None, query: dict | None = None) -> AppTest:
    at = AppTest.from_file(APP, default_timeout=TIMEOUT_S)
    if query:
        at.query_params.update(query)
    at.run()
    if page:
        at.switch_page(page).run()
    assert not at.exception, [e.value for e in at.exception]
    return at


def finish_derivations(page: str) -> None:
    """Wait for the background derivations a page started (pages/_derive.py): a test's stand-in for the user
    watching the progress bar; the page's next run then shows the whole answer."""
    for thread in threading.enumerate():
        if thread.name.startswith(f"{page}:derive:"):
            thread.join(timeout=900)


def metric(at: AppTest, label: str) -> str:
    found = [m.value for m in at.metric if m.label == label]
    assert found, f"no metric {label!r}; have {[m.label for m in at.metric]}"
    return found[0]


def gib(n_bytes: int) -> str:
    return fmt_bytes(n_bytes, "GiB")


def the_model(name: str = MODEL):
    n, cfg = load_config(name)
    return from_hf_config(cfg, n)


# ---------------------------------------------------------------- Will it fit?

def test_fit_default_view_is_the_library_answer(env):
    at = app()
    model, gpu = the_model("llama-3.1-8b"), get_gpu(H100)
    est = estimate(model, Workload(), Parallel(), Options(gpu=gpu.name))  # the GPU's measured context
    assert metric(at, "Peak per GPU") == gib(est.total_bytes)
    assert metric(at, "GPU usable") == gib(capacity_bytes(gpu))
    assert metric(at, "torch peak reserved") == gib(est.reserved_bytes)
    assert metric(at, "torch peak allocated") == gib(est.allocated_bytes)
    assert metric(at, "Largest micro-batch that fits") == \
        f"{search.max_batch(model, Workload(), Parallel(), capacity_bytes(gpu), Options(gpu=gpu.name)):,}"
    assert metric(at, "Longest sequence that fits") == \
        f"{search.max_seq(model, Workload(), Parallel(), capacity_bytes(gpu), ON_H100):,} tokens"
    advice = search.advice(model, Workload(), Parallel(), capacity_bytes(gpu))
    table = next(d.value for d in at.dataframe if "change" in d.value.columns)
    assert table["change"].tolist() == [a.title for a in advice]
    assert at.query_params["model"] == "llama-3.1-8b" and at.query_params["batch"] == "1"


def test_fit_prices_every_advice_row_in_the_background(env, monkeypatch):
    """The rows of "What to change" whose profile is not on disk are derived in a background thread, one after
    another, with the row and the trace on a progress bar; the page reruns when they end. Here the derivation is a
    stand-in that reports two traces and refuses: the test sees which classes it was asked for, the progress, and
    the one-line reasons; that real derivations fill the table is the slow test below."""
    from pages import _derive

    monkeypatch.setenv("WILLITFIT_PRICE_ADVICE", "1")
    real, release, asked = _derive.derive, threading.Event(), []

    def derivation(model, w, par, progress, started=None):
        if ":advice:" not in threading.current_thread().name:
            return real(model, w, par, progress, started)  # the page's own (shipped) profile
        asked.append((w, par))
        progress(1, 2, "trace 1")
        assert release.wait(TIMEOUT_S)
        progress(2, 2, "trace 2")
        raise ValueError(f"stand-in refusal {len(asked)}")

    monkeypatch.setattr(_derive, "derive", derivation)
    # amp's classes ship for the traced grid's presets, their advice classes (checkpointing, accumulation) do not
    at = app(query={"model": "llama-3.2-1b", "batch": "64", "recipe": "amp"})
    model, w = the_model("llama-3.2-1b"), Workload(batch=64, recipe="amp")
    items = search.advice(model, w, Parallel(), capacity_bytes(get_gpu(H100)), Options(derive=False))
    todo = search.unpriced(w, Parallel(), items)
    assert todo, "batch 64 with amp must leave a row unpriced (scripts/ship_profiles.py ships no amp advice class)"
    assert any(todo[0][0] in c.value and "derived in the background now" in c.value for c in at.caption)
    job = next(t.job for t in threading.enumerate() if t.name.startswith("fit:advice:"))
    while not asked and not job.finished:
        job.thread.join(0.05)
    at.run()
    bar = [e.proto.text for e in at.get("progress")]
    assert any(f"change 1 of {len(todo)}" in t and todo[0][0] in t and "trace 1/2" in t for t in bar), bar
    release.set()
    job.thread.join(TIMEOUT_S)
    at.run()
    assert [(w_, p_) for w_, p_ in asked] == [(w_, p_) for _, w_, p_ in todo]  # each unpriced row's class, once
    reasons = [c.value for c in at.caption if c.value.startswith("Cannot be priced")]
    assert reasons == [f"Cannot be priced: {title}: stand-in refusal {i}" for i, (title, _, _) in enumerate(todo, 1)]
    at.run()
    assert len(asked) == len(todo) and not at.exception  # a refused row is not derived again in this session


@pytest.mark.slow
def test_fit_background_pricing_fills_the_advice_table(env, monkeypatch):
    """End to end on a pasted tiny config (nothing shipped for it): the page's profile, then every advice row's
    profile derive in the background; when they end every row of "What to change" has the library's number."""
    monkeypatch.setenv("WILLITFIT_PRICE_ADVICE", "1")
    tiny = {"model_type": "gpt_bigcode", "n_layer": 2, "n_embd": 64, "n_head": 4, "vocab_size": 128,
            "n_positions": 4096}
    at = app()
    at.selectbox(key="fit:source").set_value("paste").run()
    at.text_area(key="fit:paste").set_value(json.dumps(tiny)).run()
    at.number_input(key="fit:batch").set_value(4).run()
    finish_derivations("fit")
    at.run()
    for thread in threading.enumerate():
        if thread.name.startswith("fit:advice:"):
            thread.join(900)
    at.run()
    model, w = from_hf_config(tiny, "x"), Workload(batch=4)
    items = search.advice(model, w, Parallel(), capacity_bytes(get_gpu(H100)), Options(derive=False))
    assert items and all(a.priced for a in items), [a.title for a in items if not a.priced]
    table = next(d.value for d in at.dataframe if "change" in d.value.columns)
    assert table["change"].tolist() == [a.title for a in items]
    assert not [c for c in at.caption if "Not priced yet" in c.value]


def test_fit_says_which_gpu_kernels_a_hybrid_model_is_priced_on(env):
    """A pasted Nemotron-H config (Mamba-2 mixers beside attention), trained: the profile derives in the background and
    the caption says it assumes mamba_ssm's fused training kernel, and, at a size where a 132-SM GPU splits the
    backward sums more than the trace did, by how much the estimate can be under."""
    cfg = json.loads((Path(__file__).parent / "data" / "tiny" / "t-nemotron_h.json").read_text())
    at = app()
    at.selectbox(key="fit:source").set_value("paste").run()
    at.text_area(key="fit:paste").set_value(json.dumps(cfg)).run()
    at.number_input(key="fit:batch").set_value(2).run()
    at.number_input(key="fit:seq").set_value(100).run()
    finish_derivations("fit")
    at.run()
    assert not at.exception
    caption = next(c.value for c in at.caption if "It assumes" in c.value)
    assert "fused mamba_split_conv1d_scan_combined" in caption
    assert "Note: mamba_ssm: at batch 2 x seq 100 a 132-SM GPU splits" in caption


def test_fit_changing_batch_flips_the_verdict_and_the_url(env):
    # llama-3.2-3b full fine-tuning at batch 1 on an H100 fits with room (measured there at seq 2048: 32.2 GB allocated
    # of 85 GB; data/measured/). llama-3.1-8b's batch 1 is tight (79.0 GiB of 79.18 GiB in use when it ran), so its
    # verdict hangs on a fraction of a GiB
    at = app(query={"model": "llama-3.2-3b"})
    assert at.success and "Fits" in at.success[0].value
    at.number_input(key="fit:batch").set_value(64).run()
    est = estimate(the_model("llama-3.2-3b"), Workload(batch=64), Parallel(), ON_H100)
    over = est.total_bytes - capacity_bytes(get_gpu(H100))
    assert over > 0
    verdict = next(e.value for e in at.error if "Out of memory" in e.value)
    assert f"OOM by {fmt_bytes(over, 'GiB')} ({fmt_bytes(over, 'GB')})" in verdict
    assert metric(at, "Peak per GPU") == gib(est.total_bytes)
    assert metric(at, "Over by") == gib(over)
    assert at.query_params["batch"] == "64"


def test_fit_link_reproduces_the_view_and_bad_values_fall_back(env):
    query = {"model": "qwen2.5-7b", "mode": "infer", "seq": "8192", "gen_tokens": "512", "batch": "4",
             "kv_dtype": "fp8", "gpu": "l40s", "strategy": "tp", "gpus": "2", "precision": "nope", "attention": "1"}
    at = app(query=query)
    warning = " ".join(w.value for w in at.warning)
    assert "precision: 'nope'" in warning and "attention: '1'" in warning
    w = Workload(mode="infer", seq=8192, gen_tokens=512, batch=4, kv_dtype="fp8")  # precision, attention: defaults
    est = estimate(the_model("qwen2.5-7b"), w, Parallel(strategy="tp", gpus=2))
    assert metric(at, "Peak per GPU") == gib(est.total_bytes)
    assert metric(at, "GPU usable") == gib(capacity_bytes(get_gpu("l40s")))
    assert at.query_params["precision"] == "bf16" and at.query_params["kv_dtype"] == "fp8"
    assert "method" not in at.query_params  # inference shows no training inputs


def test_fit_vision_encoder_asks_for_the_image_size_and_shows_the_library_answer(env):
    at = app(query={"model": "dinov2-giant"})
    assert not [n for n in at.number_input if n.key == "fit:seq"]   # no sequence length for an image model
    at.number_input(key="fit:image_size").set_value(224).run()
    at.number_input(key="fit:batch").set_value(16).run()
    model, gpu = the_model("dinov2-giant"), get_gpu(H100)
    w = Workload(batch=16, image_size=224)                            # 16 x 16 patches + CLS = 257 tokens
    est = estimate(model, w, Parallel(), ON_H100)
    assert est.workload.seq == 257
    assert metric(at, "Peak per GPU") == gib(est.total_bytes)
    assert metric(at, "Largest micro-batch that fits") == \
        f"{search.max_batch(model, w, Parallel(), capacity_bytes(gpu), ON_H100):,}"
    at.number_input(key="fit:image_size").set_value(230).run()      # no multiple of 14: one line, no traceback
    assert any("image_size: 230 is not a multiple" in e.value for e in at.error) and not at.exception


def test_fit_vision_language_model_starts_with_one_image_and_prices_it_whole(env):
    at = app(query={"model": "llava-1.5-7b"})
    assert at.number_input(key="fit:images").value == 1              # its first VLM: one image per sample
    model = the_model("llava-1.5-7b")
    est = estimate(model, Workload(images=1), Parallel(), ON_H100)    # the shipped profile, 7.06B whole
    assert metric(at, "Peak per GPU") == gib(est.total_bytes)
    assert any("1 image of 336x336 px (576 image tokens) per sample" in c.value for c in at.caption)
    at.number_input(key="fit:seq").set_value(500).run()              # too short for 576 image tokens: one line
    assert any(e.value.startswith("seq: 500 tokens cannot hold 1 image(s) of 576 tokens each") for e in at.error)
    assert not at.exception
    at.number_input(key="fit:images").set_value(0).run()             # text only: the scope note says how to price
    assert not at.error and any("--images N prices N images" in c.value for c in at.caption)


def test_fit_qwen_vl_takes_an_image_size_and_starts_under_flash_attention(env):
    at = app(query={"model": "qwen2.5-vl-7b"})
    assert at.number_input(key="fit:images").value == 1 and at.selectbox(key="fit:attention").value == "flash"
    model = the_model("qwen2.5-vl-7b")
    est = estimate(model, Workload(images=1, attention="flash"), Parallel(), ON_H100)   # shipped: 448 px, 8.29B
    assert metric(at, "Peak per GPU") == gib(est.total_bytes) and not at.exception
    assert any("1 image of 448x448 px (256 image tokens) per sample" in c.value for c in at.caption)
    at.number_input(key="fit:image_size").set_value(450).run()       # no multiple of 28: one line
    assert any(e.value.startswith("image_size: 450 is not a multiple of qwen2.5-vl-7b's 28-px merged patch")
               for e in at.error) and not at.exception
    at.number_input(key="fit:image_size").set_value(448).run()
    at.selectbox(key="fit:attention").set_value("sdpa").run()        # the vision tower's per-image loop: one line
    assert any(e.value.startswith("attention: under sdpa qwen2.5-vl-7b's vision tower") and
               "More settings" in e.value for e in at.error) and not at.exception


def test_fit_prices_mistral_small_whole_with_a_pixtral_image_under_flash(env):
    # Mistral-3 (Pixtral's tower): whole (24.0B), its first image at the config's 1540 px under flash, the shipped
    # profile; an image side that is no multiple of 28 px, and SDPA, each get one line
    at = app(query={"model": "mistral-small-3.1-24b", "seq": "4096"})
    assert at.number_input(key="fit:images").value == 1 and at.selectbox(key="fit:attention").value == "flash"
    model = the_model("mistral-small-3.1-24b")
    est = estimate(model, Workload(images=1, attention="flash", seq=4096), Parallel(), ON_H100)
    assert metric(at, "Peak per GPU") == gib(est.total_bytes) and not at.exception
    assert any("1 image of 1540x1540 px (3,025 image tokens) per sample" in c.value for c in at.caption)
    at.number_input(key="fit:image_size").set_value(1000).run()
    assert any(e.value.startswith("image_size: 1000 is not a multiple of mistral-small-3.1-24b's 28-px merged patch")
               for e in at.error) and not at.exception
    at.number_input(key="fit:image_size").set_value(1540).run()
    at.selectbox(key="fit:attention").set_value("sdpa").run()
    assert any(e.value.startswith("attention: under sdpa mistral-small-3.1-24b's vision tower masks every image")
               for e in at.error) and not at.exception


def test_fit_prices_an_encoder_decoder_model_whole_with_its_target_length(env):
    at = app(query={"model": "t5-large", "seq": "512"})
    model = the_model("t5-large")
    est = estimate(model, Workload(seq=512), Parallel(), ON_H100)     # the shipped profile: both stacks, 738M
    assert metric(at, "Peak per GPU") == gib(est.total_bytes) and not at.exception
    assert any("encoder 512 tokens, decoder 512 tokens" in c.value for c in at.caption)
    assert [n for n in at.number_input if n.key == "fit:target_seq"]  # a text-to-text model's decoder length
    at.selectbox(key="fit:mode").set_value("infer").run()            # T5's SDPA bias in decoding: one line
    assert any(e.value.startswith("attention: t5-large's position bias runs as an SDPA mask") for e in at.error)
    assert not at.exception
    speech = app(query={"model": "whisper-large-v3", "seq": "448"})  # its seq is the transcript: no target input
    assert not [n for n in speech.number_input if n.key == "fit:target_seq"] and not speech.exception
    assert any("3,000 mel frames (30 s of audio), decoder 448 transcript tokens" in c.value for c in speech.caption)


def test_fit_audio_language_model_starts_with_one_clip_and_refuses_a_short_seq(env):
    """A pasted GLM-ASR config (an audio-language model): the page asks for audio clips per sample, starts at one,
    and refuses a sequence too short for the clip's 375 tokens in one line, before any derivation."""
    cfg = json.loads((Path(__file__).parent / "data" / "tiny" / "t-glmasr.json").read_text())
    at = app()
    at.selectbox(key="fit:source").set_value("paste").run()
    at.text_area(key="fit:paste").set_value(json.dumps(cfg)).run()
    assert at.number_input(key="fit:audios").value == 1 and not [n for n in at.number_input if n.key == "fit:images"]
    at.number_input(key="fit:seq").set_value(300).run()
    assert [e.value for e in at.error] == ["seq: 300 tokens cannot hold 1 audio clip(s) of 375 tokens each (30 s); use "
                                           "a seq over 375. Change the sequence length or the audio clips per sample "
                                           "in the sidebar."]
    assert not at.exception


def test_fit_asks_for_the_audio_length_where_the_speech_encoder_takes_any(env):
    """A pasted Speech2Text config (its encoder takes any length): the page asks for the audio's seconds; Whisper's
    (a fixed 30-s window) does not."""
    cfg = json.loads((Path(__file__).parent / "data" / "tiny" / "t-speech_to_text.json").read_text())
    at = app()
    at.selectbox(key="fit:source").set_value("paste").run()
    at.text_area(key="fit:paste").set_value(json.dumps(cfg)).run()
    assert at.number_input(key="fit:audio_seconds").value == 0 and not at.exception
    whisper = app(query={"model": "whisper-large-v3"})
    assert not [n for n in whisper.number_input if n.key == "fit:audio_seconds"] and not whisper.exception


@pytest.mark.slow  # a derivation in the page's background thread: half a minute
def test_fit_prices_a_pasted_audio_language_model_whole(env):
    cfg = json.loads((Path(__file__).parent / "data" / "tiny" / "t-glmasr.json").read_text())
    at = app()
    at.selectbox(key="fit:source").set_value("paste").run()
    at.text_area(key="fit:paste").set_value(json.dumps(cfg)).run()
    at.number_input(key="fit:batch").set_value(2).run()
    at.number_input(key="fit:seq").set_value(800).run()
    finish_derivations("fit")
    at.run()
    assert not at.exception
    assert any("1 audio clip of 30 s (375 audio tokens) per sample" in c.value for c in at.caption)
    from estimator.model import from_hf_config

    est = estimate(from_hf_config(cfg, "pasted"), Workload(batch=2, seq=800, audios=1), Parallel(), ON_H100)
    assert metric(at, "Peak per GPU") == gib(est.total_bytes)
    at.number_input(key="fit:audios").set_value(0).run()             # text only: the scope note says how to price
    finish_derivations("fit")
    at.run()
    assert any("--audios N prices N 30-s audio clips" in c.value for c in at.caption) and not at.exception


@pytest.mark.slow  # a derivation in the page's background thread: half a minute
def test_fit_prices_a_pasted_conv_net_in_grid_units(env):
    """A pasted ResNet config (no patch tokens): the page asks for the image size, derives the profile (traced whole)
    in the background, says what the size counts, and refuses LoRA (no Linear to adapt) in one line, no traceback."""
    cfg = json.loads((Path(__file__).parent / "data" / "tiny" / "t-resnet.json").read_text())
    at = app()
    at.selectbox(key="fit:source").set_value("paste").run()
    at.text_area(key="fit:paste").set_value(json.dumps(cfg)).run()
    assert not [n for n in at.number_input if n.key == "fit:seq"]
    at.number_input(key="fit:image_size").set_value(256).run()
    at.number_input(key="fit:batch").set_value(4).run()
    finish_derivations("fit")
    at.run()
    assert not at.exception
    captions = " ".join(c.value for c in at.caption)
    assert "256 x 256 px images (64 grid units of 32 px)" in captions and "traces of the whole model" in captions
    from estimator.model import from_hf_config

    est = estimate(from_hf_config(cfg, "pasted"), Workload(batch=4, image_size=256), Parallel(), ON_H100)
    assert metric(at, "Peak per GPU") == gib(est.total_bytes)
    at.selectbox(key="fit:method").set_value("lora").run()
    assert [e.value for e in at.error] == ["lora_targets: pasted config has no Linear module in its layers to adapt "
                                           "(a conv net). Choose full fine-tuning in the sidebar."]
    assert not at.exception


def test_fit_lora_and_multi_gpu_inputs(env):
    at = app()
    at.selectbox(key="fit:model").set_value(MODEL).run()
    at.selectbox(key="fit:method").set_value("lora").run()
    at.number_input(key="fit:lora_rank").set_value(64).run()
    at.multiselect(key="fit:lora_targets").set_value(["q_proj", "v_proj"]).run()
    at.selectbox(key="fit:strategy").set_value("zero2").run()
    at.number_input(key="fit:gpus").set_value(4).run()
    finish_derivations("fit")  # rank 64 is not shipped: the page derived its profile in the background
    at.run()
    w = Workload(method="lora", lora_rank=64, lora_targets=("q_proj", "v_proj"))
    est = estimate(the_model(), w, Parallel(strategy="zero2", gpus=4), ON_H100)
    assert metric(at, "Peak per GPU") == gib(est.total_bytes)
    assert at.query_params["lora_targets"] == "q_proj,v_proj"
    assert not at.exception


def test_fit_contradictory_inputs_show_an_error_not_a_traceback(env):
    at = app()
    at.selectbox(key="fit:method").set_value("qlora").run()
    at.selectbox(key="fit:precision").set_value("fp32").run()
    assert not at.exception
    assert any("recipe" in e.value or "precision" in e.value for e in at.error)


def test_fit_custom_configs_untrusted(env):
    at = app()
    at.selectbox(key="fit:source").set_value("paste").run()
    at.text_area(key="fit:paste").set_value('{"model_type": "llama", ').run()
    assert any("not valid JSON" in e.value for e in at.error)
    sized = {"num_hidden_layers": 2, "num_attention_heads": 4, "hidden_size": 64, "intermediate_size": 128,
             "vocab_size": 128}  # (a config without its sizes is refused first, without torch: see below)
    at.text_area(key="fit:paste").set_value(json.dumps({"model_type": "no-such-arch", **sized})).run()
    assert any("does not know 'no-such-arch'" in e.value for e in at.error)
    # an architecture no one wrote code for: its inventory and profile come from transformers' own class, the
    # profile derived on the spot (a tiny config: seconds) with its provenance shown
    tiny = {"model_type": "gpt_bigcode", "n_layer": 2, "n_embd": 64, "n_head": 4, "vocab_size": 128,
            "n_positions": 4096}
    at.text_area(key="fit:paste").set_value(json.dumps(tiny)).run()
    assert not at.error, [e.value for e in at.error]
    # the page does not wait for the derivation: the model states show at once, the profile derives in a thread
    tiny_model = from_hf_config(tiny, "x", derive=True)
    assert metric(at, "model states") == gib(sum(model_state_bytes(tiny_model.inventory, Workload()).values()))
    assert not [m for m in at.metric if m.label == "Peak per GPU"]
    finish_derivations("fit")
    at.run()
    assert metric(at, "Peak per GPU") == gib(estimate(from_hf_config(tiny, "x"), Workload(), Parallel(), ON_H100).total_bytes)
    assert any("Memory profile derived" in c.value for c in at.caption)
    _, cfg = load_config("gpt2")
    at.text_area(key="fit:paste").set_value(json.dumps(cfg)).run()
    # the default 2048 tokens exceed GPT-2's 1024 learned positions: an error naming seq, not a number
    assert any("seq:" in e.value and "1024" in e.value for e in at.error)
    _, cfg = load_config("qwen2.5-0.5b")
    at.text_area(key="fit:paste").set_value(json.dumps(cfg)).run()
    assert metric(at, "Peak per GPU") == gib(estimate(from_hf_config(cfg, "x"), Workload(), Parallel(), ON_H100).total_bytes)
    at.selectbox(key="fit:source").set_value("upload").run()
    at.file_uploader(key="fit:upload").set_value(("config.json", b" " * (2 << 20), "application/json")).run()
    assert any("at most" in e.value for e in at.error)
    assert not at.exception


def test_fit_pasted_partial_config_is_refused_or_answered_with_its_defaults_listed(env):
    at = app()
    at.selectbox(key="fit:source").set_value("paste").run()
    at.text_area(key="fit:paste").set_value('{"model_type": "llama", "hidden_size": 4096}').run()
    assert not at.exception
    assert any("num_hidden_layers" in e.value and "vocab_size" in e.value for e in at.error), [e.value for e in at.error]
    assert not at.metric
    at.checkbox(key="fit:allow_defaults").check().run()
    assert not at.exception and not at.error, [e.value for e in at.error]
    assert any("defaults filled in" in w.value and "num_hidden_layers=32" in w.value for w in at.warning)


def test_fit_seq_beyond_the_context_is_refused_until_allowed_then_noted(env):
    at = app(query={"model": "llama-2-7b", "seq": "8192"})
    assert any("max_position_embeddings" in e.value and "4096" in e.value for e in at.error)
    assert not at.metric
    at.checkbox(key="fit:beyond_context").check().run()
    assert not at.exception and not any("max_position_embeddings" in e.value for e in at.error)
    assert any("beyond llama-2-7b's context of 4096" in w.value for w in at.warning)
    assert at.metric


def test_fit_hub_offline_says_what_to_do(env):
    at = app(query={"source": "hub", "hf": "Qwen/Qwen2.5-0.5B"})
    assert any("Could not reach the Hugging Face hub" in e.value and "upload it" in e.value for e in at.error)
    at.text_input(key="fit:hf").set_value("not a valid id!").run()
    assert any("not a Hugging Face model id" in e.value for e in at.error)
    at.text_input(key="fit:hf").set_value("Qwen/Qwen2.5-0.5B").run()
    at.text_input(key="fit:rev").set_value("../main").run()
    assert any(e.value.startswith("revision:") for e in at.error)
    assert not at.exception


def test_fit_closest_runs_sit_beside_their_estimates(env):
    at = app(query={"model": MODEL, "batch": "2", "seq": "1024"})
    table = next(d.value for d in at.dataframe if "estimate for that run (GiB)" in d.value.columns)
    _, cfg = load_config(MODEL)
    expected = app_data.closest_runs(env, cfg, MODEL, Workload(batch=2, seq=1024), Parallel())
    assert table["run_id"].tolist() == expected["run_id"].tolist()
    first = expected.iloc[0].to_dict()
    assert (first["batch"], first["seq"]) == (2, 1024)
    est = estimate(the_model(), workload_from_row(first), parallel_from_row(first))
    expected_gib = app_data.comparable_allocated_bytes(est, first["source"]) / GiB
    assert table["estimate for that run (GiB)"].iloc[0] == pytest.approx(expected_gib, rel=1e-12)
    assert table["stored peak alloc (GiB)"].iloc[0] == pytest.approx(first["peak_alloc_bytes"] / GiB)


def test_fit_calibrated_k_toggle_uses_the_saved_fit(env):
    at = app(query={"model": MODEL})
    assert at.toggle(key="fit:calibrated_off").disabled  # nothing saved yet
    points = calibrate.collect_points(env, "llama", ("traced",))
    pts = points[points["attention"] == "sdpa"]
    fit = calibrate.fit_family(pts)
    calibrate.save_calibration(fit, pts, env)
    at = app(query={"model": MODEL, "calibrated": "true"})
    assert not at.toggle(key="fit:calibrated").disabled and at.toggle(key="fit:calibrated").value
    est = estimate(the_model(), Workload(), Parallel(), Options(activation_k=fit.k, gpu=H100))
    assert metric(at, "Peak per GPU") == gib(est.total_bytes)
    at.toggle(key="fit:calibrated").set_value(False).run()
    assert metric(at, "Peak per GPU") == gib(estimate(the_model(), Workload(), Parallel(), ON_H100).total_bytes)


# ---------------------------------------------------------------- the other pages

def test_every_page_handles_a_missing_database_without_creating_it(monkeypatch, tmp_path):
    missing = tmp_path / "nowhere" / "none.duckdb"
    monkeypatch.setenv("WILLITFIT_DB", str(missing))
    monkeypatch.setenv("WILLITFIT_CALIBRATION", str(tmp_path / "calibration.json"))
    at = app()
    for page in PAGES[1:]:
        at.switch_page(page).run()
        assert not at.exception, (page, [e.value for e in at.exception])
        assert not at.error, (page, [e.value for e in at.error])
    assert not missing.exists()
    assert any("No benchmark database" in i.value for i in app("pages/benchmarks.py").info)


def test_a_corrupt_database_is_an_error_message_and_the_estimates_still_show(monkeypatch, tmp_path):
    bad = tmp_path / "corrupt.duckdb"
    bad.write_bytes(b"this is not a DuckDB file" * 100)
    monkeypatch.setenv("WILLITFIT_DB", str(bad))
    at = app()
    assert metric(at, "Peak per GPU") == gib(estimate(the_model("llama-3.1-8b"), Workload(), Parallel(),
                                                      ON_H100).total_bytes)
    assert any("Could not read the database" in e.value for e in at.error)
    for page in PAGES[1:-2]:  # Contribute reads the database only when inserting; the replay page never
        at.switch_page(page).run()
        assert not at.exception, page
        assert any("Could not read the database" in e.value for e in at.error), page


def test_benchmarks_counts_filters_detail_and_download(env):
    at = app("pages/benchmarks.py")
    counts = app_data.counts(env)
    assert metric(at, "Runs") == f"{counts['n_runs'].sum():,}"
    assert metric(at, "OOM runs") == f"{counts['n_oom'].sum():,}"
    at.multiselect(key="bench:source").set_value(["measured"]).run()
    measured = app_data.counts(env, {"source": ["measured"]})
    assert metric(at, "Runs") == f"{measured['n_runs'].sum():,}" and metric(at, "Traced runs") == "0"
    at.radio(key="bench:oom").set_value("oom").run()
    assert metric(at, "Runs") == "1"
    run_id = at.selectbox(key="bench:run").value
    assert app_data.run_detail(env, run_id)["oom"]
    assert any(j.value for j in at.json)  # the config.json of the run
    assert at.get("download_button")
    csv = app_data.export_bytes(env, {"source": ["measured"], "oom": True}, "csv").decode()
    assert len(csv.strip().splitlines()) == 2 and run_id in csv


def test_curves_of_a_vision_language_model_start_past_its_images(env):
    at = app("pages/curves.py", query={"model": "llava-1.5-7b", "seq": "1024"})
    model, gpu = the_model("llava-1.5-7b"), get_gpu(H100)
    w = Workload(seq=1024, images=1)                                   # one 336-px image: 576 tokens of every seq
    assert at.number_input(key="curves:images").value == 1 and not at.exception
    assert metric(at, "Longest sequence at batch 1") == \
        f"{search.max_seq(model, w, Parallel(), capacity_bytes(gpu), ON_H100_NO_TRACE, limit=4 * model.max_positions):,} tokens"
    at.number_input(key="curves:seq").set_value(300).run()             # shorter than its image: one line
    assert any(e.value.startswith("seq: 300 tokens cannot hold 1 image(s)") for e in at.error) and not at.exception


def test_curves_of_a_qwen_vl_model_take_its_image_size_and_start_past_its_images(env):
    at = app("pages/curves.py", query={"model": "qwen2.5-vl-7b", "seq": "1024", "method": "lora"})
    model, gpu = the_model("qwen2.5-vl-7b"), get_gpu(H100)
    w = Workload(seq=1024, images=1, attention="flash", method="lora")  # one 448-px image: 256 tokens + its end
    assert at.number_input(key="curves:image_size").value == 0 and at.selectbox(key="curves:attention").value == "flash"
    assert metric(at, "Longest sequence at batch 1") == \
        f"{search.max_seq(model, w, Parallel(), capacity_bytes(gpu), ON_H100_NO_TRACE, limit=4 * model.max_positions):,} tokens"
    at.number_input(key="curves:seq").set_value(200).run()             # shorter than its image: one line
    assert any(e.value.startswith("seq: 200 tokens cannot hold 1 image(s) of 256 tokens each (448x448 px)")
               for e in at.error) and not at.exception


def test_curves_of_a_speech_model_stop_at_its_decoders_positions(env):
    at = app("pages/curves.py", query={"model": "whisper-large-v3", "seq": "256"})
    model, gpu = the_model("whisper-large-v3"), get_gpu(H100)
    assert not at.exception and not at.error
    s_max = search.max_seq(model, Workload(seq=256), Parallel(), capacity_bytes(gpu), ON_H100_NO_TRACE, limit=448)
    assert metric(at, "Longest sequence at batch 1") == f"{s_max:,} tokens" and s_max <= 448


def test_curves_limits_points_and_residuals(env):
    at = app("pages/curves.py", query={"model": MODEL, "seq": "1024"})
    model, gpu = the_model(), get_gpu(H100)
    w = Workload(seq=1024)
    assert metric(at, "Largest micro-batch at seq 1,024") == \
        f"{search.max_batch(model, w, Parallel(), capacity_bytes(gpu), ON_H100_NO_TRACE):,}"
    table = next(d.value for d in at.dataframe if "relative error" in d.value.columns)
    pts = app_data.points(env, load_config(MODEL)[1], MODEL, 1, 1024, {"mode": "train", "method": "full", "recipe": "pure",
                                                              "precision": "bf16", "optimizer": "adamw",
                                                              "checkpointing": "none", "attention": "sdpa",
                                                              "grad_accum": 1, "strategy": "single", "world_size": 1})
    expected = app_data.with_estimates(pts, model)
    assert sorted(table["run_id"]) == sorted(expected["run_id"])
    med = expected.dropna(subset=["rel_error"]).groupby("source")["rel_error"].apply(lambda e: e.abs().median())
    assert metric(at, "measured: median |relative error|") == f"{med['measured']:.1%}"
    at.number_input(key="curves:batch").set_value(8).run()
    s = search.max_seq(model, Workload(batch=8, seq=1024), Parallel(), capacity_bytes(gpu), ON_H100_NO_TRACE,
                       limit=4 * model.max_positions)
    assert metric(at, "Longest sequence at batch 8") == f"{s:,} tokens"


def test_calibrate_fits_and_saves(env, tmp_path):
    """The page fits on the profiles on disk (derive=False: it never traces); so does the expectation, or the count
    would depend on whether an earlier test in this process derived a profile the shipped set lacks."""
    at = app("pages/calibrate.py")
    points = calibrate.collect_points(env, "llama", ("measured", "traced"), derive=False)
    fit = calibrate.fit_family(points[(points.attention == "sdpa") & (points.checkpointing == "none")])
    assert metric(at, "Fitted k") == f"{fit.k:.3f}"
    assert metric(at, "Runs used") == str(fit.n_points)
    at.multiselect(key="calib:sources").set_value(["traced"]).run()
    traced = calibrate.fit_family(calibrate.collect_points(env, "llama", ("traced",), derive=False))
    assert metric(at, "Fitted k") == f"{traced.k:.3f}"
    assert db.latest_calibrations(db_path=env) == []
    at.button(key="calib:save").click().run()
    assert not at.exception and at.success
    saved = db.latest_calibrations(db_path=env)
    assert len(saved) == 1 and saved[0].k == pytest.approx(traced.k) and saved[0].n_points == traced.n_points
    assert json.loads((tmp_path / "calibration.json").read_text())["calibrations"][0]["k"] == pytest.approx(traced.k)


def test_calibrate_accuracy_table_is_the_library_summary(env):
    """The accuracy section shows bench.accuracy.report.accuracy_summary for the chosen truth tier, in percent."""
    from bench.accuracy.report import accuracy_summary

    at = app("pages/calibrate.py")
    assert not [d for d in at.dataframe if "median |err| (%)" in d.value.columns]  # off until asked
    at.toggle(key="calib:accuracy").set_value(True).run()
    assert not at.exception
    table = next(d.value for d in at.dataframe if "median |err| (%)" in d.value.columns)
    expected = accuracy_summary(env)
    expected = expected[expected.tier == "traced"].reset_index(drop=True)
    assert table["method"].tolist() == expected["method"].tolist()
    assert table["median |err| (%)"].tolist() == pytest.approx((expected["median"] * 100).tolist())


def test_multi_gpu_fewest_gpus_and_comparison(env):
    at = app("pages/multi_gpu.py", query={"model": "llama-3.1-70b", "compare_a": "zero3", "compare_b": "tp",
                                          "compare_n": "8"})
    model, gpu, w = the_model("llama-3.1-70b"), get_gpu(H100), Workload()
    table = next(d.value for d in at.dataframe if "fewest GPUs" in d.value.columns)
    for row in table.to_dict("records"):
        n = search.min_gpus(model, w, row["strategy"], capacity_bytes(gpu), max_gpus=1024, options=ON_H100)
        assert (None if row["fewest GPUs"] != row["fewest GPUs"] else row["fewest GPUs"]) == n, row
        if n is None and row["strategy"] in ("fsdp", "zero3"):  # the cause and the fix, not just "does not fit"
            assert "activations alone" in row["note"] and "activation checkpointing (full)" in row["note"], row
    shown = [m.value for m in at.metric if m.label == "Peak per GPU"]
    assert shown == [gib(estimate(model, w, Parallel(strategy=s, gpus=8), ON_H100).total_bytes) for s in ("zero3", "tp")]
    at.number_input(key="multi:compare_n").set_value(16).run()
    shown = [m.value for m in at.metric if m.label == "Peak per GPU"]
    assert shown == [gib(estimate(model, w, Parallel(strategy=s, gpus=16), ON_H100).total_bytes)
                     for s in ("zero3", "tp")]


def test_multi_gpu_layouts_are_the_library_ranking(env):
    at = app("pages/multi_gpu.py", query={"model": "llama-3.1-70b", "layout_n": "8"})
    model, gpu, w = the_model("llama-3.1-70b"), get_gpu(H100), Workload()
    table = next(d.value for d in at.dataframe if "worst rank (GiB)" in d.value.columns)
    expected = layouts(model, w, 8, capacity_bytes(gpu), ON_H100)  # priced on the page's GPU, as Will it fit?
    assert table["layout"].tolist() == [lay.label for lay in expected]
    assert table["worst rank (GiB)"].tolist() == [lay.device_bytes / GiB for lay in expected]
    assert table["why"].tolist() == [lay.why(capacity_bytes(gpu)) for lay in expected]
    # the pipeline schedule and micro-batches of the PP layouts: interleaved 1F1B over 8 (rank r: stages r, r + pp)
    at.selectbox(key="multi:pp_schedule").set_value("interleaved-1f1b").run()
    at.number_input(key="multi:microbatches").set_value(8).run()
    assert not at.exception
    table = next(d.value for d in at.dataframe if "worst rank (GiB)" in d.value.columns)
    looped = layouts(model, w, 8, capacity_bytes(gpu), ON_H100, pp_schedule="interleaved-1f1b", microbatches=8)
    assert table["layout"].tolist() == [lay.label for lay in looped]
    assert table["worst rank (GiB)"].tolist() == [lay.device_bytes / GiB for lay in looped]
    assert any(lay.parallel.pp_schedule == "interleaved-1f1b" for lay in looped if lay.pp > 1)
    assert table["worst rank (GiB)"].tolist() != [lay.device_bytes / GiB for lay in expected]


def test_multi_gpu_derives_a_pipeline_layouts_ranks_on_request(env, tmp_path, monkeypatch):
    """A PP layout priced by the analytic rule: why its ranks are not traced (1F1B over one micro-batch), then, with
    enough micro-batches, a button that derives every rank in the background (started here, then cancelled)."""
    monkeypatch.setenv("WILLITFIT_CACHE", str(tmp_path / "cache"))   # no traced rank on disk
    at = app("pages/multi_gpu.py", query={"model": "llama-3.2-1b"})
    at.number_input(key="multi:layout_n").set_value(2).run()
    at.selectbox(key="multi:layout").set_value("FSDP 1 x TP 1 x PP 2").run()
    assert any(c.value.startswith("Its pipeline ranks are not traced here: microbatches: 1F1B needs")
               for c in at.caption)
    at.number_input(key="multi:microbatches").set_value(4).run()
    at.selectbox(key="multi:layout").set_value("FSDP 1 x TP 1 x PP 2").run()
    assert not at.exception, [e.value for e in at.exception]
    at.button(key="multi:derive-ranks").click().run()
    jobs = [t for t in threading.enumerate() if t.name.startswith("multi:derive:") and t.name.endswith(":ranks")]
    assert len(jobs) == 1 and "its 2 pipeline ranks (1f1b, 4 micro-batches)" in jobs[0].job.label
    jobs[0].job.cancel()
    jobs[0].join(timeout=60)


def test_multi_gpu_compares_fsdp_units(env):
    """HF Accelerate's FSDP units beside torchtitan's (docs/parallel.md, "FSDP2's units"), both shipped for the
    page's default workload on a text preset: the library's estimates, at once."""
    at = app("pages/multi_gpu.py", query={"model": "llama-3.2-1b"})
    assert not at.exception, [e.value for e in at.exception]
    assert any(h.value == "FSDP units: HF Accelerate's or torchtitan's" for h in at.subheader)
    table = next(d.value for d in at.dataframe if "FSDP units" in d.value.columns)
    model, w = the_model("llama-3.2-1b"), Workload()
    want = [estimate(model, w, Parallel(strategy="fsdp", gpus=8, fsdp_wrap=u), ON_H100).total_bytes / GiB
            for u in ("layers", "torchtitan")]
    assert table["peak per GPU (GiB)"].tolist() == want


def test_multi_gpu_derives_torchtitans_fsdp_units_on_request(env, tmp_path, monkeypatch):
    """Where torchtitan's class is on no disk (LoRA here), HF Accelerate's units are priced at once and torchtitan's
    derived on request in the background (started here, then cancelled)."""
    monkeypatch.setenv("WILLITFIT_CACHE", str(tmp_path / "cache"))
    at = app("pages/multi_gpu.py", query={"model": "llama-2-7b", "method": "lora"})
    assert not at.exception, [e.value for e in at.exception]
    model = the_model("llama-2-7b")
    w = Workload(method="lora", lora_targets=("q_proj", "v_proj"))
    alone = estimate(model, w, Parallel(strategy="fsdp", gpus=8), ON_H100)
    assert any(c.value.startswith(f"HF Accelerate's units over 8 GPUs: {fmt_bytes(alone.total_bytes, 'GiB')}")
               for c in at.caption), [c.value for c in at.caption]
    button = next(b for b in at.button if b.label == "Derive torchtitan's FSDP units (in the background)")
    button.click().run()
    jobs = [t for t in threading.enumerate() if t.name.startswith("multi:derive:") and not t.name.endswith(":ranks")]
    assert len(jobs) == 1 and jobs[0].job.label.endswith(", fsdp")
    jobs[0].job.cancel()
    jobs[0].join(timeout=60)


def test_multi_gpu_prices_fused_sgd_with_its_foreach_step(env):
    """Fused SGD cannot step DTensor parameters (estimator.parallel.check_optimizer refuses it under FSDP2 and TP): the
    page, which compares those strategies, prices the foreach step and says so, instead of one error line."""
    at = app("pages/multi_gpu.py", query={"model": "llama-3.2-1b", "optimizer": "sgd", "optimizer_impl": "fused"})
    assert not at.exception and not at.error, [e.value for e in at.error]
    assert any(i.value.startswith("Fused SGD cannot step FSDP2's or TP's parameters") for i in at.info)
    assert any(h.value.startswith("Layouts: FSDP x TP x PP") for h in at.subheader)


def test_multi_gpu_context_parallel_is_the_library_estimate(env):
    """FSDP x CP on the layouts' GPUs: the worse derived CP rank (shipped profiles of llama-3.2-1b at cp 2), beside FSDP
    alone; a degree that does not divide the GPUs is one warning line."""
    at = app("pages/multi_gpu.py", query={"model": "llama-3.2-1b"})
    assert any(c.value.startswith("Pick a context-parallel degree") for c in at.caption)   # off by default
    at.number_input(key="multi:cp").set_value(2).run()
    assert not at.exception, [e.value for e in at.exception]
    model, w = the_model("llama-3.2-1b"), Workload()
    est = estimate(model, w, Parallel(strategy="fsdp", gpus=8, cp=2), ON_H100)
    shown = next(m for m in at.metric if m.label.startswith("Worst CP rank"))
    assert shown.value == gib(est.total_bytes) and est.pipeline_stage in shown.label
    alone = next(m for m in at.metric if m.label == "FSDP over 8, no CP")
    assert alone.value == gib(estimate(model, w, Parallel(strategy="fsdp", gpus=8), ON_H100).total_bytes)
    assert est.total_bytes < estimate(model, w, Parallel(strategy="fsdp", gpus=8), ON_H100).total_bytes
    at.number_input(key="multi:cp").set_value(3).run()
    assert not at.exception
    assert any(x.value == "cp: 3 must divide the 8 GPUs to lay out" for x in at.warning)


def test_multi_gpu_overlays_traced_fsdp_points(env):
    at = app("pages/multi_gpu.py", query={"model": MODEL, "batch": "4", "seq": "1024"})
    assert any("2 traced FSDP2 run(s)" in c.value for c in at.caption)


def test_contribute_bad_file_changes_nothing_good_file_adds_its_rows(env):
    at = app("pages/contribute.py")
    assert "python -m bench measure --model llama-3.2-1b" in at.code[0].value
    before = db.count_runs(env)
    good = [make_row(batch=b, seq=4096) for b in (3, 5, 7)]
    bad = good + [{**make_row(batch=9), "optimizer": "adamx"}]
    at.file_uploader(key="contrib:upload").set_value(("runs.jsonl", write_bytes(bad), "application/json")).run()
    assert any("invalid" in e.value for e in at.error)
    assert metric(at, "Invalid") == "1" and at.button(key="contrib:insert").disabled
    assert db.count_runs(env) == before
    at.file_uploader(key="contrib:upload").set_value(("runs.jsonl", b"\x00garbage{", "application/json")).run()
    assert at.error and not at.exception and db.count_runs(env) == before
    at.file_uploader(key="contrib:upload").set_value(("runs.jsonl", write_bytes(good), "application/json")).run()
    assert metric(at, "Valid") == "3"
    at.button(key="contrib:insert").click().run()
    assert any("Inserted 3 new row(s)" in s.value for s in at.success)
    assert db.count_runs(env) == before + 3
    at.button(key="contrib:insert").click().run()  # the same file again: nothing new, said so
    assert not any("Inserted" in s.value for s in at.success)
    assert any("Nothing new: all 3 row(s) are already stored" in i.value for i in at.info)
    at.switch_page("pages/benchmarks.py").run()  # the new rows show up (the cache follows the file)
    assert metric(at, "Runs") == f"{before + 3:,}"


def test_contribute_command_is_built_and_checked_by_bench_grid(env):
    at = app("pages/contribute.py")
    at.selectbox(key="contrib:strategy").set_value("fsdp").run()
    at.text_input(key="contrib:gpus").set_value("2,4").run()
    at.text_input(key="contrib:batches").set_value("1,2").run()
    cmd = at.code[0].value
    assert cmd.startswith("python -m bench measure --model llama-3.2-1b --mode train --method full")
    assert "--strategy fsdp" in cmd and "--batch 1,2" in cmd and "--gpus 2,4" in cmd and cmd.endswith("--out runs.jsonl")
    assert any(c.value.startswith("4 case(s).") for c in at.caption)  # 2 batches x 2 GPU counts
    at.text_input(key="contrib:batches").set_value("1,two").run()
    assert any("batch: 'two' is not an integer" in e.value for e in at.error) and not at.exception


def write_bytes(rows: list[dict]) -> bytes:
    return "".join(json.dumps(r) + "\n" for r in rows).encode()


# ---------------------------------------------------------------- the published tier

def test_benchmarks_published_filter_shows_published_runs_with_their_estimates(env):
    from bench.published import importer as published

    published.import_published(env)
    at = app("pages/benchmarks.py")
    assert metric(at, "Published runs") == "169"
    at.multiselect(key="bench:source").set_value(["published"]).run()
    assert metric(at, "Runs") == "169" and metric(at, "Traced runs") == "0"
    at.multiselect(key="bench:metric").set_value(["allocated"]).run()
    table = next(d.value for d in at.dataframe if "estimate_gib" in d.value.columns)
    assert set(table["source"]) == {"published"} and set(table["metric"]) == {"allocated"}
    runs = app_data.runs_table(env, {"source": ["published"], "metric": ["allocated"]})
    assert sorted(table["run_id"]) == sorted(runs["run_id"])
    est = app_data.published_estimates(env, tuple(runs["run_id"]))
    assert est  # shipped profiles price some of them
    shown = table.set_index("run_id")["estimate_gib"].dropna()
    assert {k: round(v * GiB) for k, v in shown.items()} == est   # the library's bytes, shown in GiB


def test_fit_shows_the_closest_published_run(env):
    from bench.published import importer as published

    published.import_published(env)
    at = app(query={"model": "llama-3.2-1b", "batch": "4", "seq": "512"})
    line = [c.value for c in at.caption if c.value.startswith("Closest published run")]
    assert line and "litgpt" in line[0]


# ---------------------------------------------------------------- the shared dataset (bench/share/)

@pytest.fixture
def shared(env, tmp_path, monkeypatch) -> str:
    """A local-directory remote and a private willitfit cache; WILLITFIT_DATASET is left to each test."""
    monkeypatch.setenv("WILLITFIT_CACHE", str(tmp_path / "wcache"))
    monkeypatch.delenv(share_remote.ENV, raising=False)
    return str(tmp_path / "remote")


def test_contribute_pushes_to_the_shared_dataset_after_a_local_ingest(env, shared, monkeypatch, tmp_path):
    at = app("pages/contribute.py")
    good = [make_row(batch=b, seq=3072) for b in (3, 5, 7)]
    at.file_uploader(key="contrib:upload").set_value(("runs.jsonl", write_bytes(good), "application/json")).run()
    assert not at.button(key="contrib:insert").disabled
    assert not [b for b in at.button if b.key == "contrib:push"]  # offered only after the local ingest
    at.button(key="contrib:insert").click().run()
    at.button(key="contrib:push").click().run()  # WILLITFIT_DATASET not set: one line, nothing pushed
    assert [e.value for e in at.error] == [f"dataset: not set; set {share_remote.ENV} or pass --dataset "
                                           f"({share_remote.ALLOWED}). Nothing was pushed."]
    assert not at.exception and not Path(shared).exists()
    monkeypatch.setenv(share_remote.ENV, shared)
    at.button(key="contrib:push").click().run()
    assert not at.error and any("Pushed 3 row(s) as contribution" in s.value for s in at.success)
    got = share_pull.pull(shared, tmp_path / "other.duckdb")
    assert got.skipped == [] and got.inserted == 3
    assert {r for (r,) in db.fetch_runs(db_path=tmp_path / "other.duckdb")[["run_id"]].values} == \
        {r["run_id"] for r in good}


def test_benchmarks_browses_the_shared_dataset_read_only(env, shared, monkeypatch, tmp_path):
    at = app("pages/benchmarks.py")
    assert not [r for r in at.radio if r.key == "bench:dataset"]  # no dataset configured: the local database only
    contributed = [make_row(batch=b, seq=6144, gpu_name="NVIDIA A100-SXM4-80GB", source="measured") for b in (1, 2)]
    jsonl = tmp_path / "contrib.jsonl"
    jsonl.write_bytes(write_bytes(contributed))
    first = share_push.push([jsonl], shared).name
    jsonl.write_bytes(write_bytes([make_row(batch=4, seq=6144)]))
    second = share_push.push([jsonl], shared).name
    bad = Path(shared) / "contributions" / f"{second}.parquet"
    bad.write_bytes(bad.read_bytes()[:-40] + bytes(40))   # corrupted on the remote
    monkeypatch.setenv(share_remote.ENV, shared)
    local_runs = db.count_runs(env)
    at = app("pages/benchmarks.py")
    assert at.radio(key="bench:dataset").value == "local" and metric(at, "Runs") == f"{local_runs:,}"
    at.radio(key="bench:dataset").set_value("shared").run()
    assert any("No contribution of the shared dataset is cached here yet" in i.value for i in at.info)
    at.button(key="bench:fetch").click().run()
    assert not at.exception
    warnings = [w.value for w in at.warning]
    assert len(warnings) == 1 and warnings[0].startswith(f"Skipped contributions/{second}.parquet: sha256: ")
    assert metric(at, "Runs") == "2" and metric(at, "Measured runs") == "2"
    at.multiselect(key="bench:gpu_name").set_value(["NVIDIA A100-SXM4-80GB"]).run()
    run_id = at.selectbox(key="bench:run").value
    assert run_id in {r["run_id"] for r in contributed}
    assert db.count_runs(env) == local_runs   # browsing wrote nothing to the local database
    at.radio(key="bench:dataset").set_value("local").run()   # the A100 filter is not an option there: dropped
    assert not at.exception and metric(at, "Runs") == f"{local_runs:,}"
    assert first in {p.stem for p in (share_pull.cache_root(share_remote.parse_dataset(shared))
                                      / "contributions").glob("*.parquet")}


def test_benchmarks_names_a_malformed_dataset_address(env, shared, monkeypatch):
    monkeypatch.setenv(share_remote.ENV, "ftp://example.org/runs")
    at = app("pages/benchmarks.py")
    at.radio(key="bench:dataset").set_value("shared").run()
    assert not at.exception
    assert [e.value for e in at.error] == [f"dataset: scheme 'ftp://' not supported; use {share_remote.ALLOWED}. "
                                           f"Fix {share_remote.ENV} and restart the app."]


def test_fit_closest_published_run_names_inferred_settings_and_prefers_stated_ones(env):
    from bench.published import importer as published

    published.import_published(env)
    # torchtune's P021 (llama-3.1-8b full bf16, batch 2, seq 2048) states neither optimizer, checkpointing nor
    # recipe: they are willitfit's inferences, so it does not count as "0 settings differ"
    _, cfg = load_config("llama-3.1-8b")
    rows = app_data.closest_runs(env, cfg, "llama-3.1-8b", Workload(batch=2, seq=2048), Parallel(),
                                 sources=("published",))
    p021 = rows.set_index("published_id").loc["P021"]
    assert int(p021["n_differences"]) == 0 and int(p021["n_inferred_same"]) == 3
    assert set(p021["inferred_same"].split(", ")) == {"checkpointing", "optimizer", "recipe"}
    first = rows.iloc[0]
    assert int(first["n_differences"]) + int(first["n_inferred_same"]) < 3   # a stated match is preferred
    at = app(query={"model": "llama-3.1-8b", "batch": "2", "seq": "2048"})
    line = next(c.value for c in at.caption if c.value.startswith("Closest published run"))
    assert first["published_id"] in line and f"reliability **{first['reliability']}**" in line
    assert "0 settings differ" not in line
    assert f"the source does not state {first['inferred_same']}" in line   # its own inferred settings, named


# ---------------------------------------------------------------- what people would rather look at (issue 22 item 7)

def test_calibrate_says_why_a_saved_k_differs_from_the_fit(env, tmp_path):
    """A saved k fitted on other runs of the same group is named beside the new fit, with why they differ."""
    points = calibrate.collect_points(env, "llama", ("measured", "traced"), derive=False)
    group = points[(points.attention == "sdpa") & (points.checkpointing == "none")]
    fewer = group.iloc[: len(group) // 2]
    calibrate.save_calibration(calibrate.fit_family(fewer), fewer, env)
    at = app("pages/calibrate.py")
    saved = calibrate.fit_family(fewer)
    assert any(f"saved k for this group is {saved.k:.3f}" in w.value and "fitted on other runs" in w.value
               for w in at.warning), [w.value for w in at.warning]
    calibrate.save_calibration(calibrate.fit_family(group), group, env)
    at = app("pages/calibrate.py")
    assert any("agrees with this fit" in c.value for c in at.caption)


def test_benchmarks_table_shows_no_none_cells(env):
    at = app("pages/benchmarks.py")
    table = next(d.value for d in at.dataframe if "run_id" in d.value.columns and "source" in d.value.columns)
    text = [c for c in table.columns if pd.api.types.is_string_dtype(table[c])]
    assert text and not any(table[c].isna().any() or (table[c] == "None").any() for c in text)


def test_charts_keep_whole_legends_visible_lines_and_no_orphan_axis():
    from pages import _charts as charts

    curve = pd.DataFrame({"batch": [1, 2] * 3, "series": ["estimate: device (nvidia-smi)"] * 2
                          + ["estimate: torch allocated"] * 2 + ["estimate: torch reserved"] * 2,
                          "gib": [1, 2, 0.8, 1.8, 0.9, 1.9], "gb": [1, 2, 0.8, 1.8, 0.9, 1.9]})
    spec = charts.curve_chart(curve, pd.DataFrame(), "batch", "batch", 80 * GiB, "H100").to_dict()
    line = spec["layer"][0]["encoding"]
    assert line["color"]["legend"]["labelLimit"] == 0 and line["size"]["scale"]["range"][0] > 2
    rows = pd.DataFrame([{"strategy": s, "gpus": n, "component": "weights", "bytes": GiB, "gib": 1.0, "gb": 1.07}
                         for s in ("ddp", "zero1", "zero2", "zero3", "fsdp", "tp", "pp") for n in (1, 2)])
    spec = charts.strategy_chart(rows, 80 * GiB, "H100").to_dict()
    assert spec["resolve"]["axis"]["x"] == "independent" and spec["columns"] == 4


def test_fit_tight_when_only_the_allocators_cache_does_not_fit(env):
    # llama-3.1-8b full fine-tuning at seq 4096 on an H100: the tensors and the CUDA context fit, the allocator's
    # estimated cache does not (measured there: it ran, 78.42 GiB reserved of 79.18 GiB)
    at = app(query={"model": "llama-3.1-8b", "seq": "4096"})
    est = estimate(the_model("llama-3.1-8b"), Workload(seq=4096), Parallel(), ON_H100)
    assert est.verdict(capacity_bytes(get_gpu(H100))) == "tight"
    assert not at.success and not at.error, [e.value for e in at.error]
    assert "Tight" in at.warning[0].value and "expandable_segments:True" in at.warning[0].value
    assert metric(at, "Peak per GPU") == gib(est.total_bytes)
