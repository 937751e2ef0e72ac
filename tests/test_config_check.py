"""tracer.config_check: transformers' own refusal of a config, asked in a child process that never imports torch."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from estimator.presets import load_config, preset_names
from tracer import config_check

ROOT = Path(__file__).resolve().parent.parent
BAD = {"model_type": "llama", "hidden_size": 100, "num_attention_heads": 3, "num_hidden_layers": 2,
       "intermediate_size": 256, "vocab_size": 1000}
REFUSAL = ("model_type: transformers cannot build 'llama' from this config (ValueError: The hidden size (100) is not "
           "a multiple of the number of attention heads (3).)")


def _python(code: str, stdin: str = "") -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], input=stdin, capture_output=True, text=True, cwd=ROOT,
                          timeout=300)


def test_the_child_refuses_in_the_in_process_words(monkeypatch):
    with pytest.raises(ValueError) as in_process:
        config_check.build(BAD)
    assert str(in_process.value) == REFUSAL
    monkeypatch.delitem(sys.modules, "torch")   # check() asks the child only where torch is not loaded yet
    with pytest.raises(ValueError) as child:
        config_check.check(BAD)
    assert str(child.value) == REFUSAL
    config_check.check({**BAD, "num_attention_heads": 5})   # builds: no error


def test_the_child_never_imports_torch():
    done = subprocess.run([sys.executable, "-c", "import sys, runpy\nsys.argv = ['config_check']\n"
                           "try:\n    runpy.run_module('tracer.config_check', run_name='__main__')\n"
                           "except SystemExit as e:\n    print(e.code, 'torch' in sys.modules, file=sys.stderr)"],
                          input=json.dumps(BAD), capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert done.stdout.strip() == REFUSAL
    assert done.stderr.strip().splitlines()[-1] == "2 False"


def test_every_preset_config_passes_the_child():
    """The child's verdict (torch hidden from transformers) is the in-process one on every shipped preset's config:
    none is refused (each builds in-process: the shipped inventories were read from them)."""
    configs = {n: load_config(n)[1] for n in preset_names()}
    done = _python("import json, sys\nfrom tracer import config_check\nconfig_check._hide_torch()\nout = {}\n"
                   "for name, cfg in json.loads(sys.stdin.read()).items():\n"
                   "    try:\n        config_check.build(cfg)\n    except ValueError as e:\n        out[name] = str(e)\n"
                   "print(json.dumps([out, 'torch' in sys.modules]))", json.dumps(configs))
    assert done.returncode == 0, done.stderr
    refused, torch_loaded = json.loads(done.stdout.strip().splitlines()[-1])
    assert refused == {} and not torch_loaded


def test_the_cli_refuses_before_torch_loads(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(BAD))
    done = _python("import atexit, sys\natexit.register(lambda: print('torch', 'torch' in sys.modules, "
                   "file=sys.stderr))\nfrom estimator.cli import main\n"
                   f"sys.argv = ['estimator', '--model', {str(path)!r}, '--batch', '1', '--seq', '128']\nsys.exit(main())")
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert lines == [f"python -m estimator: error: {REFUSAL}", "torch False"]
