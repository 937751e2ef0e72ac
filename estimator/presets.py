"""Model presets: Hugging Face `config.json` files shipped under `data/models/`, named by file stem.

Nothing here touches the network. `load_config` accepts a preset name or a path to any config.json.
"""
from __future__ import annotations

import hashlib
import json
from functools import lru_cache
from pathlib import Path

from estimator.names import compact, did_you_mean

DATA_DIR = Path(__file__).resolve().parent.parent / "data"
LORA_DEFAULTS = DATA_DIR / "lora_defaults.json"   # PEFT's default targets per model type (python -m tracer.lora)
MODELS_DIR = DATA_DIR / "models"
MAX_CONFIG_BYTES = 1 << 20  # a config.json is a few KB; refuse anything absurd before parsing it


def preset_names() -> list[str]:
    return sorted(p.stem for p in MODELS_DIR.glob("*.json"))


def load_config(name_or_path: str) -> tuple[str, dict]:
    """Return (name, config dict) for a preset name or a config.json path.

    Raises ValueError naming the field ('model') and the allowed presets when nothing matches.
    """
    p = Path(name_or_path)
    if name_or_path.endswith(".json") or p.is_file():
        if not p.is_file():
            raise ValueError(f"model: no config file at {name_or_path!r}")
        if p.stat().st_size > MAX_CONFIG_BYTES:
            raise ValueError(f"model: {name_or_path!r} is larger than {MAX_CONFIG_BYTES} bytes; not a config.json")
        return p.stem if p.name != "config.json" else p.parent.name or "config", parse_config_text(p.read_text())
    names = preset_names()
    name = name_or_path if name_or_path in names else \
        next((n for n in names if compact(n) == compact(name_or_path)), None)  # "Llama-3.1-8B", "llama3.1 8b"
    if name is None:
        raise ValueError(f"model: unknown preset {name_or_path[:80]!r}"
                         f"{did_you_mean(name_or_path, names, '--list-models lists all')}; or give a path to a "
                         "config.json or a Hugging Face id org/name")
    return name, json.loads((MODELS_DIR / f"{name}.json").read_text())


def parse_config_text(text: str) -> dict:
    """Parse untrusted config.json text into a dict, with a clear error."""
    if len(text) > MAX_CONFIG_BYTES:
        raise ValueError(f"model: config text is larger than {MAX_CONFIG_BYTES} bytes; not a config.json")
    try:
        cfg = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"model: config is not valid JSON ({e.msg} at line {e.lineno} column {e.colno})") from None
    if not isinstance(cfg, dict):
        raise ValueError("model: config.json must be a JSON object")
    return cfg


def config_hash(config: dict) -> str:
    """sha256 of the config's canonical JSON (sorted keys, no spaces): the key of its inventory and profiles,
    and the `config_hash` column of a run row."""
    text = json.dumps(config, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return hashlib.sha256(text.encode()).hexdigest()


@lru_cache(maxsize=1)
def _lora_defaults() -> dict:
    return json.loads(LORA_DEFAULTS.read_text())


def default_lora_targets(model_type: str) -> tuple[str, ...]:
    """The LoRA targets PEFT adapts by default in this model type (`peft.LoraConfig(target_modules=None)`, with
    tracer.lora's exceptions), read from data/lora_defaults.json: no torch here. ("q_proj", "v_proj") for a type
    the table lacks, as `Workload.lora_targets`' default."""
    return tuple(_lora_defaults().get(model_type, ("q_proj", "v_proj")))
