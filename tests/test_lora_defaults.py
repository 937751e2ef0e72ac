"""Default LoRA targets (tracer.lora): PEFT's own mapping, for every preset, naming modules the model has."""
from __future__ import annotations

import pytest

pytest.importorskip("peft")

from estimator.model import from_hf_config  # noqa: E402
from estimator.presets import load_config, preset_names  # noqa: E402
from tracer.lora import ATTENTION_ONLY, FALLBACK, NOT_IN_PEFT, default_lora_targets  # noqa: E402


def test_peft_mapping_is_used_where_it_has_the_type():
    from peft.utils.constants import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING as peft_defaults

    for mt in ("llama", "gpt2", "gpt_neox", "falcon", "bert", "mixtral"):
        assert default_lora_targets(mt) == tuple(peft_defaults[mt])
    assert default_lora_targets("gpt2") == ("c_attn",) and default_lora_targets("bert") == ("query", "value")
    for mt in NOT_IN_PEFT:      # the exceptions stay exceptions: drop one when PEFT gains the type
        assert mt not in peft_defaults
    assert default_lora_targets("no_such_type") == FALLBACK


def test_exceptions_are_attention_only_where_peft_adapts_more():
    from peft.utils.constants import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING as peft_defaults

    for mt, targets in ATTENTION_ONLY.items():
        assert set(targets) < set(peft_defaults[mt])


@pytest.mark.parametrize("name", preset_names())
def test_every_preset_default_names_a_linear_it_has(name):
    # PEFT adapts the targets that exist and refuses a config where none does
    config = load_config(name)[1]
    inv = from_hf_config(config, name, derive=False).inventory
    names = {lin[0] for lin in inv.linears}
    assert set(default_lora_targets(config["model_type"])) & names, (name, names)


def test_the_torch_free_copy_is_what_peft_says_today():
    """data/lora_defaults.json (read by the estimator and the app, which import no torch) is `python -m tracer.lora`'s
    output: a PEFT upgrade that changes a default fails here until the file is written again."""
    import json

    from estimator import presets
    from tracer.lora import defaults_table

    assert json.loads(presets.LORA_DEFAULTS.read_text()) == defaults_table()
    for name in preset_names():
        mt = load_config(name)[1]["model_type"]
        assert presets.default_lora_targets(mt) == default_lora_targets(mt), name


def test_the_cli_takes_peft_default_where_the_model_has_no_q_proj(capsys):
    import json

    from estimator.cli import main

    assert main(["--model", "t5-large", "--method", "lora", "--batch", "2", "--seq", "256", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["workload"]["lora_targets"] == "q,v"
    assert any(n.startswith("lora_targets: q,v, PEFT's default for t5") for n in out["notes"])
