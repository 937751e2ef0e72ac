"""`python -m estimator`: flags, JSON and text output, errors (exit 2, one line), --calibrated."""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from estimator import cli
from estimator.calibration_file import SEED_K
from estimator.calibration_file import MISSING_HINT, load_calibration
from estimator.breakdown import COMPONENTS
from estimator.estimate import Options, estimate
from estimator.device import capacity_bytes
from estimator.gpus import get_gpu
from estimator.presets import MODELS_DIR
from estimator.spec import Workload
from strategies import model

ROOT = Path(__file__).resolve().parent.parent
FLAGS = {"--model", "--mode", "--method", "--lora-rank", "--lora-targets", "--recipe", "--precision",
         "--weight-format", "--optimizer", "--optimizer-impl", "--batch", "--seq", "--image-size", "--images", "--audios", "--audio-seconds", "--target-seq", "--gen-tokens", "--grad-accum",
         "--checkpointing", "--attention", "--kv-dtype", "--gpu", "--gpus", "--strategy", "--tp", "--pp", "--ep",
         "--sequence-parallel", "--offload", "--activation-model", "--k", "--calibrated", "--json", "--list-models",
         "--list-gpus", "--loop", "--loss", "--loss-chunks", "--optimizer-in-backward", "--activation-offload",
         "--quantize-scope", "--no-double-quant", "--float8", "--compile", "--no-derive", "--alloc-conf",
         "--cuda-context", "--derive-ranks", "--pp-schedule", "--microbatches", "--cp", "--dp-shard", "--dp-replicate", "--fsdp-wrap",
         "--allow-defaults",
         "--allow-beyond-context", "--price-advice"}


def run_cli(*args, env=None):
    return subprocess.run([sys.executable, "-m", "estimator", *args], cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, **(env or {})}, timeout=120)


def run_json(capsys, *args) -> dict:
    assert cli.main(list(args)) == 0
    return json.loads(capsys.readouterr().out)


def test_acceptance_llama31_8b_inference_subprocess():
    r = run_cli("--model", "llama-3.1-8b", "--mode", "infer", "--batch", "4", "--seq", "2048", "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["components"]["kv_cache"] == 4 * 2048 * 131072
    assert out["components"]["weights"] == 2 * 8030261248


def test_flags_are_exactly_the_documented_ones_and_all_have_help():
    parser = cli.build_parser()
    options = {s for a in parser._actions for s in a.option_strings if s.startswith("--")} - {"--help"}
    assert options == FLAGS
    for action in parser._actions:
        if not isinstance(action, argparse._HelpAction):
            assert action.help and len(action.help) > 10, action.option_strings


def test_json_fields(capsys):
    out = run_json(capsys, "--model", "mixtral-8x7b", "--gpu", "h100-sxm-80gb", "--method", "lora", "--weight-format",
                   "nf4", "--json")
    for key in ("params", "trainable_params", "active_params", "total_bytes", "allocated_bytes", "peak_stage",
                "components", "stages", "gpu", "gpu_bytes", "fits", "headroom_bytes", "max_batch", "max_seq"):
        assert key in out, key
    assert set(out["components"]) == set(COMPONENTS)
    assert out["active_params"] == 12_879_925_248 < out["params"]
    for st in out["stages"].values():
        assert st["total_bytes"] == sum(st[c] for c in COMPONENTS)
    assert out["total_bytes"] == out["stages"][out["peak_stage"]]["total_bytes"]
    assert out["gpu_bytes"] == capacity_bytes(get_gpu("h100-sxm-80gb")) < get_gpu("h100-sxm-80gb").memory_bytes
    assert out["headroom_bytes"] == out["gpu_bytes"] - out["device_bytes"]
    # transformers 5's bitsandbytes quantizes nn.Linear modules only (quantizer_bnb_4bit.param_needs_quantization):
    # Mixtral's fused 3-D experts stay bf16, 90 GB of them, so a "4-bit" Mixtral does not fit one H100
    assert out["fits"] is False and out["verdict"] == "oom" and out["advice"]
    assert out["components"]["weights"] > 2 * out["params"] * 0.96


def test_json_matches_library(capsys):
    out = run_json(capsys, "--model", "llama-2-7b", "--method", "lora", "--batch", "2", "--seq", "1024", "--json")
    e = estimate(model("llama-2-7b"), Workload(method="lora", batch=2, seq=1024))
    assert out["total_bytes"] == e.total_bytes and out["trainable_params"] == 4_194_304
    assert out["components"] == e.components.as_dict()


def test_oom_gets_advice(capsys):
    out = run_json(capsys, "--model", "llama-3.1-8b", "--gpu", "rtx-4090", "--batch", "4", "--json")
    assert out["fits"] is False and out["verdict"] == "oom" and out["max_batch"] == 0
    assert out["advice"] and all({"title", "change", "saving_bytes", "new_total_bytes", "fits", "note"} <= set(a)
                                 for a in out["advice"])
    assert any(a["fits"] for a in out["advice"])  # the combined plan


def test_text_output(capsys):
    assert cli.main(["--model", "llama-3.1-8b", "--gpu", "rtx-4090", "--batch", "4"]) == 0
    text = capsys.readouterr().out
    assert "GiB" in text and "GB" in text and "OOM by" in text and "<- peak" in text and "#" in text
    assert cli.main(["--model", "qwen2.5-0.5b", "--mode", "infer", "--gpu", "l4"]) == 0
    assert "fits with" in capsys.readouterr().out


def test_config_json_path(capsys):
    out = run_json(capsys, "--model", str(MODELS_DIR / "gpt2.json"), "--method", "lora", "--lora-targets",
                   "c_attn", "--seq", "1024", "--json")
    assert out["params"] == 124_439_808


def test_sequence_past_learned_positions_is_refused(capsys):
    """GPT-2 has 1024 learned position embeddings: a 2048-token run cannot exist, so it is an input error."""
    assert cli.main(["--model", "gpt2", "--seq", "2048", "--json"]) == 2
    err = capsys.readouterr().err
    assert "seq:" in err and "1024" in err


def test_multi_gpu(capsys):
    out = run_json(capsys, "--model", "llama-3.1-8b", "--strategy", "fsdp", "--gpus", "8", "--json")
    assert out["parallel"]["strategy"] == "fsdp" and out["parallel"]["gpus"] == 8
    more = run_json(capsys, "--model", "llama-3.1-8b", "--strategy", "fsdp", "--gpus", "16", "--json")
    assert more["total_bytes"] < out["total_bytes"]
    assert out["profile"]["kernels"] == "cuda"  # the FSDP2 rank's own traced profile


def test_k_activation_model(capsys):
    out = run_json(capsys, "--model", "llama-3.1-8b", "--k", "12", "--json")
    assert out["activation_model"] == "k" and out["activation_k"] == 12.0
    # seed 000's k form: 12 * b*s*h*L*bytes = 12 * 2048 * 4096 * 32 * 2
    assert out["stages"]["forward"]["activations"] == 12 * 2048 * 4096 * 32 * 2
    default = run_json(capsys, "--model", "llama-3.1-8b", "--activation-model", "k", "--json")
    assert default["activation_k"] == SEED_K


@pytest.mark.parametrize("args, field", [
    (["--model", "no-such-model"], "model"),
    (["--model", "llama-3.1-8b", "--mode", "infer", "--method", "lora"], "method"),
    (["--model", "llama-3.1-8b", "--method", "qlora", "--recipe", "fp32", "--precision", "fp32"], "recipe"),
    (["--model", "llama-3.1-8b", "--method", "lora", "--lora-targets", "c_attn"], "lora_targets"),
    (["--model", "llama-3.1-8b", "--gpus", "4"], "strategy"),
    (["--model", "llama-3.1-8b", "--gpu", "h900"], "gpu"),
    (["--model", "llama-3.1-8b", "--k", "-3"], "k"),
    (["--model", "llama-3.1-8b", "--batch", "0"], "batch"),
    (["--model", "llama-3.1-8b", "--strategy", "tp", "--gpus", "4", "--tp", "3"], "gpus"),
    ([], "model"),
])
def test_bad_input_exits_2_with_one_line(capsys, args, field):
    assert cli.main(args) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert f"error: {field}: " in err


@pytest.mark.parametrize("args, word", [(["--model", "x", "--mode", "fly"], "train, infer"),
                                        (["--model", "x", "--batch", "two"], "invalid int"),
                                        (["--model", "x", "--bogus"], "unrecognized")])
def test_argparse_errors_exit_2_with_one_line(args, word):
    r = run_cli(*args)
    assert r.returncode == 2
    assert len(r.stderr.strip().splitlines()) == 1 and word in r.stderr.replace("'", "")


def test_no_derive_names_the_command_that_derives(capsys, tmp_path, monkeypatch):
    """A workload class with no profile on disk and --no-derive: one line naming how to derive it."""
    monkeypatch.setenv("WILLITFIT_CACHE", str(tmp_path))
    assert cli.main(["--model", "llama-3.1-8b", "--checkpointing", "selective", "--loss", "chunked",
                     "--no-derive"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "error: profile: " in err and "python -m bench derive" in err


def test_analytic_swaps_are_named(capsys):
    out = run_json(capsys, "--model", "llama-2-7b", "--method", "qlora", "--optimizer", "paged-adamw-8bit",
                   "--lora-targets", "q_proj,v_proj", "--json")
    notes = " ".join(out["notes"])
    assert "qlora" in notes and "paged-adamw-8bit" in notes
    assert out["paged_bytes"] > 0 and out["components"]["optimizer_states"] == 0  # paged: outside the allocator


def test_lists(capsys):
    assert cli.main(["--list-models"]) == 0
    out = capsys.readouterr().out
    assert "llama-3.1-8b" in out and "deepseek-v3" in out and "active" in out
    assert cli.main(["--list-gpus"]) == 0
    out = capsys.readouterr().out
    assert "h100-sxm-80gb" in out and "GiB" in out and "GB" in out


# ---------------------------------------------------------------- --calibrated

def _write_calibration(path: Path, residual=2e8, k=20.0, **extra):
    entry = {"family": "llama", "k": k, "k_ci_low": k - 1, "k_ci_high": k + 1, "residual_std_bytes": residual,
             "n_points": 12, "created_at": "2025-06-01T12:00:00", "attention": "sdpa", "checkpointing": "none",
             "r2": 0.99, **extra}
    general = {**entry, "k": 30.0, "k_ci_low": 29.0, "k_ci_high": 31.0, "attention": None, "checkpointing": None,
               "created_at": "2025-07-01T12:00:00"}
    path.write_text(json.dumps({"version": 1, "calibrations": [entry, general]}))
    return path


def test_calibrated_interval_and_verdict(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("WILLITFIT_CALIBRATION", str(_write_calibration(tmp_path / "cal.json")))
    out = run_json(capsys, "--model", "llama-3.1-8b", "--method", "qlora", "--calibrated", "--gpu", "l4", "--json")
    assert out["activation_k"] == 20.0  # the sdpa/none fit beats the newer fit over all modes
    lo, hi = out["interval_bytes"]
    assert lo == int(out["total_bytes"] - 1.96 * 2e8) and hi >= out["total_bytes"] + 1.96 * 2e8 - 1
    assert out["verdict"] == ("fits" if hi <= out["gpu_bytes"] else "oom" if lo > out["gpu_bytes"] else "tight")
    eager = run_json(capsys, "--model", "llama-3.1-8b", "--method", "qlora", "--attention", "eager",
                     "--calibrated", "--json")
    assert eager["activation_k"] == 30.0  # only the fit over all modes applies to eager


def test_calibrated_tight_verdict(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("WILLITFIT_CALIBRATION", str(_write_calibration(tmp_path / "cal.json", residual=0.0)))
    base = run_json(capsys, "--model", "llama-3.1-8b", "--method", "qlora", "--calibrated", "--json")
    gpu_bytes = capacity_bytes(get_gpu("l4"))
    # a residual std that puts capacity inside the interval
    residual = abs(gpu_bytes - base["total_bytes"]) / 1.96 + 1e6
    monkeypatch.setenv("WILLITFIT_CALIBRATION", str(_write_calibration(tmp_path / "cal2.json", residual=residual)))
    out = run_json(capsys, "--model", "llama-3.1-8b", "--method", "qlora", "--calibrated", "--gpu", "l4", "--json")
    assert out["verdict"] == "tight"


def test_calibrated_context_bytes_replace_the_default(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("WILLITFIT_CALIBRATION",
                       str(_write_calibration(tmp_path / "cal.json", context_bytes=300 * 2**20)))
    out = run_json(capsys, "--model", "llama-3.1-8b", "--method", "qlora", "--calibrated", "--json")
    assert out["components"]["overhead"] == 300 * 2**20 + 2 * 32 * 2**20   # and a training step's two cuBLAS workspaces


def test_calibrated_missing_file_is_a_clear_error(tmp_path):
    r = run_cli("--model", "llama-3.1-8b", "--calibrated", env={"WILLITFIT_CALIBRATION": str(tmp_path / "none.json")})
    assert r.returncode == 2
    assert len(r.stderr.strip().splitlines()) == 1 and MISSING_HINT in r.stderr


@pytest.mark.parametrize("mutate, field", [
    (lambda e: e.update(k=-1.0, k_ci_low=-2.0), "k"),
    (lambda e: e.pop("residual_std_bytes"), "residual_std_bytes"),
    (lambda e: e.update(family="mamba"), "family"),
    (lambda e: e.update(created_at="yesterday"), "created_at"),
    (lambda e: e.update(attention="xformers"), "attention"),
    (lambda e: e.update(n_points=0), "n_points"),
    (lambda e: e.update(k_ci_low=25.0), "k_ci_low"),
])
def test_calibration_file_validation(tmp_path, mutate, field):
    entry = {"family": "llama", "k": 20.0, "k_ci_low": 19.0, "k_ci_high": 21.0, "residual_std_bytes": 1e8,
             "n_points": 5, "created_at": "2025-06-01T12:00:00"}
    mutate(entry)
    path = tmp_path / "cal.json"
    path.write_text(json.dumps({"version": 1, "calibrations": [entry]}))
    with pytest.raises(ValueError, match=rf"^calibration\.{field}: "):
        load_calibration(path)


def test_calibration_file_bad_document(tmp_path):
    path = tmp_path / "cal.json"
    path.write_text("{not json")
    with pytest.raises(ValueError, match="^calibration: .* not valid JSON"):
        load_calibration(path)
    path.write_text(json.dumps({"version": 2, "calibrations": []}))
    with pytest.raises(ValueError, match="^calibration: .*version=1"):
        load_calibration(path)


def test_a_model_without_sdpa_is_priced_with_what_transformers_runs(capsys):
    # Gemma-2 has no SDPA path in transformers (logit softcapping): the default workload (sdpa) is priced as eager,
    # the estimate shows eager and says why, and advice never proposes SDPA for it.
    from estimator.estimate import Options, estimate
    from estimator.search import advice
    from estimator.spec import Parallel, Workload
    from strategies import model

    m = model("gemma-2-2b")
    assert not m.inventory.supports_sdpa and m.default_attention == "eager"
    e = estimate(m, Workload(batch=1, seq=512))
    assert e.workload.attention == "eager" and e.notes[0].startswith("attention: Gemma2ForCausalLM has no SDPA")
    assert e.total_bytes == estimate(m, Workload(batch=1, seq=512, attention="eager")).total_bytes
    titles = [a.title for a in advice(m, Workload(batch=8, seq=4096, attention="eager"), Parallel(), 16 * 2**30,
                                      Options(derive=False))]  # prices only what is on disk: never traces
    assert not any("SDPA" in t for t in titles)
    assert cli.main(["--model", "gemma-2-2b", "--batch", "1", "--seq", "512", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["workload"]["attention"] == "eager" and out["notes"][0].startswith("attention: ")


@pytest.mark.parametrize("args, line", [
    (["--model", "llama-3.1-8b", "--strategy", "tp", "--gpus", "3"],
     "tp: 3 does not divide the 32 attention heads (8 KV heads) of llama-3.1-8b; allowed: 2, 4, 8, 16, 32"),
    (["--model", "llama-3.1-8b", "--strategy", "ep", "--gpus", "2"],
     "ep: expert parallelism shards routed experts; llama-3.1-8b is not a mixture-of-experts model"),
    (["--model", "mixtral-8x7b", "--strategy", "ep", "--gpus", "3"], "ep: 3 does not divide the 8 routed experts"),
])
def test_a_split_the_model_cannot_take_is_one_line(args, line, capsys):
    assert cli.main(args) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and line in err


def test_cuda_context_overrides_the_gpu_preset(capsys):
    """A measured context (a published BERT run: 1,343 MiB) replaces the preset's, on device bytes only."""
    base = ["--model", "bert-large-uncased", "--batch", "8", "--seq", "128", "--gpu", "h100-sxm-80gb", "--json"]
    preset = run_json(capsys, *base)
    given = run_json(capsys, *base, "--cuda-context", "1343")
    ctx = {p["name"]: p for p in given["device_parts"]}["cuda_context"]
    assert ctx["bytes"] == 1343 * 2**20 and "--cuda-context" in ctx["source"]
    old = {p["name"]: p["bytes"] for p in preset["device_parts"]}["cuda_context"]
    assert given["device_bytes"] - preset["device_bytes"] == 1343 * 2**20 - old
    assert given["allocated_bytes"] == preset["allocated_bytes"]
    assert given["reserved_bytes"] == preset["reserved_bytes"]
    # without --gpu, and over --calibrated's context, the given one wins too
    for extra in ([], ["--calibrated"]):
        r = run_json(capsys, "--model", "bert-large-uncased", "--batch", "8", "--seq", "128", "--json",
                     "--cuda-context", "0.5", *extra)
        assert {p["name"]: p["bytes"] for p in r["device_parts"]}["cuda_context"] == 2**19


@pytest.mark.parametrize("value, words", [("-1", "out of range"), ("lots", "not a number of MiB"),
                                          ("65537", "out of range"), ("nan", "out of range"),
                                          ("inf", "out of range")])
def test_bad_cuda_context_is_one_line(capsys, value, words):
    assert cli.main(["--model", "gpt2", "--cuda-context", value]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "error: cuda_context: " in err and words in err


def test_options_cuda_context_checked_at_construction():
    assert Options(cuda_context_bytes=0).cuda_context_bytes == 0
    for bad in (-1, 1.5, True, 65 * 2**30):
        with pytest.raises(ValueError, match="^cuda_context: "):
            Options(cuda_context_bytes=bad)


def test_a_multimodal_checkpoint_says_what_part_is_priced():
    """Mistral-3 (with Pixtral's tower) and Gemma-3 are built whole, here with a text-only step: each estimate says so
    and how to price images; a text-only model says nothing of the kind."""
    def notes(name):
        out = subprocess.run([sys.executable, "-m", "estimator", "--model", name, "--mode", "infer", "--seq", "512",
                              "--json", "--no-derive"], cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        return " ".join(json.loads(out.stdout)["notes"])
    mistral = notes("mistral-small-3.1-24b")
    assert "built whole (Mistral3ForConditionalGeneration)" in mistral and "--images N" in mistral
    assert "text-only" in notes("gemma-3-4b")
    assert "scope:" not in notes("llama-3.1-8b")


# A config that cannot be a model is refused in one line naming the field, before transformers (and torch) is
# imported and before anything is traced: an empty one, a model_type the installed transformers does not have
# (read from its source: tracer.model_types), a size no config can have.
BAD_CONFIGS = [({}, "model_type", "missing"),
               ({"model_type": "nope"}, "model_type", "does not know 'nope'"),
               ({"model_type": 7}, "model_type", "must be a model type name"),
               ({"model_type": "nope", "auto_map": {"AutoConfig": "x.XConfig"}}, "model_type", "remote code"),
               ({"model_type": "llama", "hidden_size": 64, "num_attention_heads": 4, "vocab_size": "lots"},
                "vocab_size", "positive integer"),
               ({"model_type": "llama", "hidden_size": 64, "num_attention_heads": 4, "num_hidden_layers": 0},
                "num_hidden_layers", "positive integer")]


@pytest.mark.parametrize("config, field, words", BAD_CONFIGS)
def test_bad_config_is_refused_in_one_line_before_any_trace(tmp_path, config, field, words):
    path = tmp_path / "x.json"
    path.write_text(json.dumps(config))
    r = run_cli("--model", str(path), env={"WILLITFIT_CACHE": str(tmp_path / "cache")})
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr  # no "[0/1] reading ..." progress line: nothing was built or traced
    assert f"error: {field}: " in lines[0] and words in lines[0]
    assert not (tmp_path / "cache").exists() or not any((tmp_path / "cache").iterdir())


@pytest.mark.parametrize("config", [c for c, _, _ in BAD_CONFIGS])
def test_bad_config_is_refused_without_importing_transformers_or_torch(tmp_path, config):
    path = tmp_path / "x.json"
    path.write_text(json.dumps(config))
    code = ("import sys\nfrom estimator import cli\nrc = cli.main(['--model', sys.argv[1]])\n"
            "print(rc, 'torch' in sys.modules, 'transformers' in sys.modules)")
    r = subprocess.run([sys.executable, "-c", code, str(path)], cwd=ROOT, capture_output=True, text=True,
                       env={**os.environ, "WILLITFIT_CACHE": str(tmp_path / "cache")}, timeout=120)
    assert r.stdout.split() == ["2", "False", "False"], r.stdout + r.stderr


def test_model_types_read_from_source_are_transformers_own():
    # tracer.model_types reads CONFIG_MAPPING_NAMES from transformers' source without importing it: the same keys
    pytest.importorskip("transformers")
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    from tracer.model_types import known_model_types

    assert known_model_types() == frozenset(CONFIG_MAPPING_NAMES)


PARTIAL_LLAMA = {"model_type": "llama", "hidden_size": 4096}


def test_partial_config_is_refused_naming_the_missing_size_fields(tmp_path, capsys):
    path = tmp_path / "partial.json"
    path.write_text(json.dumps(PARTIAL_LLAMA))
    assert cli.main(["--model", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    for field in ("num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size", "--allow-defaults"):
        assert field in err
    assert "hidden_size" not in err.split("lacks")[1].split("(")[0]


def test_an_attention_free_config_needs_no_attention_heads():
    # Mamba-1's config.json (state-spaces/mamba-*-hf) has no attention heads to state: it is complete without them;
    # a partial one is still refused for what sizes it
    from estimator.model import check_sizes

    mamba = {"model_type": "mamba", "hidden_size": 64, "num_hidden_layers": 3, "vocab_size": 512, "expand": 2}
    assert check_sizes(mamba) == []
    with pytest.raises(ValueError, match="^model: the config.json lacks num_hidden_layers "):
        check_sizes({k: v for k, v in mamba.items() if k != "num_hidden_layers"})


def test_partial_config_with_allow_defaults_lists_every_default(tmp_path, capsys):
    path = tmp_path / "partial.json"
    path.write_text(json.dumps(PARTIAL_LLAMA))
    out = run_json(capsys, "--model", str(path), "--allow-defaults", "--json")
    note = out["notes"][0]
    assert note.startswith("defaults filled in")
    for field in ("num_hidden_layers=32", "num_attention_heads=32", "intermediate_size=11,008", "vocab_size=32,000"):
        assert field in note
    # aliases count as stated (GPT-2 spells them n_layer/n_head/n_embd and computes its MLP width)
    gpt2 = json.loads((MODELS_DIR / "gpt2.json").read_text())
    path.write_text(json.dumps(gpt2))
    assert not [n for n in run_json(capsys, "--model", str(path), "--seq", "512", "--json")["notes"]
                if n.startswith("defaults filled in")]


def test_seq_beyond_a_rope_models_context_is_refused_naming_max_position_embeddings(capsys):
    assert cli.main(["--model", "llama-2-7b", "--seq", "8192"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert "seq:" in err and "4096" in err and "max_position_embeddings" in err and "--allow-beyond-context" in err


def test_generated_tokens_past_the_context_name_gen_tokens_and_a_bound_that_exists(capsys):
    # seq 2048 + 999,999 generated: no seq can fix it (the bound read "seq <= -868927"); gen_tokens can
    assert cli.main(["--model", "llama-3.1-8b", "--mode", "infer", "--gen-tokens", "999999"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "<= -" not in err
    assert "gen_tokens: 1002047 tokens (seq 2048 + 999999 generated)" in err and "use gen_tokens <= 129024" in err


def test_allow_beyond_context_answers_with_a_note_and_the_advice_stays_within_the_context(capsys):
    out = run_json(capsys, "--model", "llama-2-7b", "--seq", "8192", "--gpu", "l4", "--allow-beyond-context",
                   "--json")
    assert any("beyond llama-2-7b's context of 4096" in n for n in out["notes"])
    cuts = [a["change"]["seq"] for a in out["advice"] if "seq" in a["change"]]
    assert cuts and all(s <= 4096 for s in cuts)


def test_gpu_and_model_spellings_resolve_or_answer_did_you_mean(capsys):
    out = run_json(capsys, "--model", "Llama-3.2-1B", "--gpu", "4090", "--mode", "infer", "--json")
    assert (out["model"], out["gpu"]) == ("llama-3.2-1b", "rtx-4090")
    assert cli.main(["--model", "llama-3.2-1b", "--gpu", "a100"]) == 2
    err = capsys.readouterr().err
    assert "did you mean a100-sxm-40gb" in err and "a100-sxm-80gb" in err
    assert cli.main(["--model", "mistral", "--gpu", "l4"]) == 2
    err = capsys.readouterr().err
    assert "unknown preset 'mistral'; did you mean mistral-7b" in err and len(err.strip().splitlines()) == 1


def test_price_advice_derives_each_unpriced_row_then_answers(capsys, monkeypatch):
    """--price-advice derives the profile of each row "What would help" could not price (progress on stderr) and
    prices again; a row whose derivation refuses stays unpriced with its reason. The derivation here is a stand-in
    that refuses (a real one takes minutes): the test checks which classes were asked for, once each."""
    from estimator import estimate as estimate_mod
    from estimator.search import advice, unpriced
    from estimator.spec import Parallel

    asked = []

    def derivation(model, w, p, progress=None, **kw):
        asked.append((w, p))
        progress(1, 1, "stand-in trace")
        raise ValueError("stand-in refusal")

    monkeypatch.setattr(estimate_mod, "ensure_profile", derivation)
    # amp's classes ship for the traced grid's presets, their advice classes (checkpointing, accumulation) do not
    args = ("--model", "llama-3.2-1b", "--recipe", "amp", "--batch", "64", "--gpu", "h100-sxm-80gb")
    m, w = model("llama-3.2-1b"), Workload(batch=64, recipe="amp")
    todo = unpriced(w, Parallel(), advice(m, w, Parallel(), capacity_bytes(get_gpu("h100-sxm-80gb")),
                                          Options(derive=False)))
    assert todo
    assert cli.main([*args]) == 0
    text = capsys.readouterr().out
    assert "add --price-advice" in text and not asked   # without the flag: listed, nothing derived
    assert all(title in text for title, _, _ in todo)
    assert cli.main([*args, "--price-advice"]) == 0
    out = capsys.readouterr()
    assert asked == [(w_, p_) for _, w_, p_ in todo]
    assert out.err.count("not priced: stand-in refusal") == len(todo)
    assert all(f"pricing {i}/{len(todo)}: {t}" in out.err for i, (t, _, _) in enumerate(todo, 1))


def test_derive_ranks_derives_every_traced_rank_first(capsys, monkeypatch, tmp_path):
    """--derive-ranks derives the layout's traced ranks (estimate.ensure_profile with tp_rank=True) before answering;
    without it a pipeline whose ranks are not on disk is the analytic rule, its note naming both ways. The derivation
    is a stand-in that refuses (a real one takes minutes): the test checks what was asked."""
    from estimator import estimate as estimate_mod
    from estimator.spec import Parallel

    asked = []

    def derivation(model, w, p, progress=None, **kw):
        asked.append((p, kw))
        raise ValueError("pp: stand-in refusal")

    monkeypatch.setattr(estimate_mod, "ensure_profile", derivation)
    monkeypatch.setenv("WILLITFIT_CACHE", str(tmp_path))   # no traced rank on disk
    args = ("--model", "llama-3.2-1b", "--strategy", "pp", "--gpus", "4", "--pp-schedule", "interleaved-1f1b",
            "--microbatches", "8")
    assert cli.main([*args]) == 0
    out = capsys.readouterr().out
    assert "priced by the analytic rule" in out and "--derive-ranks" in out and not asked
    assert cli.main([*args, "--derive-ranks"]) == 2
    assert asked == [(Parallel("pp", gpus=4, microbatches=8, pp_schedule="interleaved-1f1b"), {"tp_rank": True})]
    assert capsys.readouterr().err.strip().endswith("pp: stand-in refusal")
