"""transformers' own refusals of a config.json, in a process that never imports torch: a fast one-line error.

    python -m tracer.config_check < config.json   # exit 2 and one line on stdout where transformers refuses it
    check(config)                                  # the same from Python: ValueError in one line, in about a second

transformers' config classes validate what they are given (huggingface_hub's strict dataclasses: a hidden size the
heads do not divide, an unknown rope type, a field of the wrong type), but importing them imports torch
(`configuration_utils` -> `modeling_rope_utils`: `if is_torch_available(): import torch`), and a derivation imports
the tracer on top: about 3.3 s on 2 cores before such a config's one-line error. `check` asks the config class in a
child process where transformers is told torch is absent (0.8 s: transformers' own import is most of it), before the
parent loads torch. Its verdict was the same as the in-process one for each of the 804 model types of transformers
5.23 built from its defaults (tests/test_config_check.py compares the shipped presets' configs too).

Only a refusal of the kinds `build` refuses is reported; anything else (a child that cannot start, an error of
another kind, a timeout) lets the config through to the in-process build (`tracer.meta.hf_config`), which decides.
`tracer.meta.hf_config` builds the config with `build` too: one rule, one place.
"""
from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from pathlib import Path

from tracer.model_types import unknown_type

REFUSED = 2            # the child's exit status for a refusal (its one line on stdout)
TIMEOUT_S = 60         # a child that takes longer (a machine that is swapping) lets the config through
ROOT = Path(__file__).resolve().parent.parent


def reason(e: BaseException) -> str:
    """One line of an exception's text: its first line, or where that only introduces the next ones (huggingface_hub's
    "Class validation error for validator 'validate_architecture':"), the line that says what is wrong."""
    lines = [x.strip() for x in str(e).strip().splitlines() if x.strip()]
    if not lines:
        return type(e).__name__
    said = lines[1] if lines[0].endswith(":") and len(lines) > 1 else lines[0]
    return said[:300]


def transformers_version() -> str:
    import transformers

    return transformers.__version__


def build(config: dict):
    """transformers' config object for a config.json dict; refusals in one line naming why."""
    from huggingface_hub.errors import StrictDataclassError
    from transformers import AutoConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    if not isinstance(config.get("model_type"), str) or not config["model_type"]:
        raise ValueError("model_type: missing; a config.json names its model_type")
    why = unknown_type(config, CONFIG_MAPPING_NAMES, transformers_version())
    if why:
        raise ValueError(why)
    rest = copy.deepcopy({k: v for k, v in config.items() if k not in ("model_type", "auto_map")})
    try:
        return AutoConfig.for_model(config["model_type"], **rest)
    except (ValueError, KeyError, TypeError, StrictDataclassError) as e:
        raise ValueError(f"model_type: transformers cannot build {config['model_type']!r} from this config "
                         f"({reason(e)})") from None


def check(config: dict) -> None:
    """Raise ValueError with transformers' one-line refusal of `config`, asked in a child process without torch; return
    where it builds or where the child cannot say. In a process that has torch already, the in-process build is as
    fast, and this returns at once."""
    if "torch" in sys.modules:
        return
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, (str(ROOT), os.environ.get("PYTHONPATH"))))}
    try:
        done = subprocess.run([sys.executable, "-m", "tracer.config_check"], input=json.dumps(config), env=env,
                              capture_output=True, text=True, timeout=TIMEOUT_S, cwd=ROOT)
    except (OSError, subprocess.SubprocessError, ValueError):
        return
    line = done.stdout.strip()
    if done.returncode == REFUSED and line and "\n" not in line:
        raise ValueError(line)


def _hide_torch() -> None:
    """Tell transformers torch is absent, before any of its modules that import torch when it is present load."""
    import transformers.utils as utils
    import transformers.utils.import_utils as import_utils

    import_utils.is_torch_available = utils.is_torch_available = lambda: False


def main() -> int:
    try:
        config = json.loads(sys.stdin.read())
    except ValueError:
        return 0   # the parent read it as JSON; whatever this is, the in-process build decides
    if not isinstance(config, dict):
        return 0
    _hide_torch()
    try:
        build(config)
    except ValueError as e:
        print(str(e).replace("\n", " "))
        return REFUSED
    except Exception:   # noqa: BLE001  an error of another kind: not a refusal this check vouches for
        return 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
