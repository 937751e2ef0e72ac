"""bench.hub: model-id validation, HF_HUB_OFFLINE, and clear errors -- all without touching the network.

urllib.request.urlopen is replaced in every test (an autouse fixture makes any unexpected call fail), so no
test here can reach huggingface.co.
"""
from __future__ import annotations

import io
import json
import socket
import urllib.error

import pytest

from bench import hub
from estimator.presets import MAX_CONFIG_BYTES


class FakeResponse(io.BytesIO):
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


@pytest.fixture(autouse=True)
def no_network(monkeypatch):
    """Fail loudly if anything tries the real network; tests that need a response install their own fake."""
    def refuse(*args, **kwargs):
        raise AssertionError("a test tried to open a network connection")
    monkeypatch.setattr(hub.urllib.request, "urlopen", refuse)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)


def fake_urlopen(monkeypatch, body: bytes = b"", error: Exception | None = None) -> list:
    calls = []

    def urlopen(request, timeout):
        calls.append((request.full_url, timeout))
        if error is not None:
            raise error
        return FakeResponse(body)
    monkeypatch.setattr(hub.urllib.request, "urlopen", urlopen)
    return calls


@pytest.mark.parametrize("model_id", ["gpt2", "Qwen/Qwen2.5-0.5B", "meta-llama/Llama-3.1-8B", "a/b", "org_1/x.y-z"])
def test_valid_ids_pass(model_id):
    assert hub.validate_model_id(f"  {model_id} ") == model_id


@pytest.mark.parametrize("model_id", ["", "a/b/c", "../etc/passwd", "org/-name", "org/name-", "a--b/c", "a/b..c",
                                      "org/na me", "org/näme", "https://huggingface.co/gpt2", "x" * 97, "org/",
                                      "/name", "org/name?x=1", None, 42])
def test_malformed_ids_are_refused_before_any_request(model_id):
    with pytest.raises(ValueError, match="model id"):
        hub.fetch_config(model_id)


@pytest.mark.parametrize("flag", ["1", "true", "YES", "on"])
def test_hf_hub_offline_means_no_request_and_a_clear_message(monkeypatch, flag):
    monkeypatch.setenv("HF_HUB_OFFLINE", flag)
    with pytest.raises(hub.OfflineError, match="HF_HUB_OFFLINE.*upload it"):
        hub.fetch_config("Qwen/Qwen2.5-0.5B")  # the autouse fixture fails the test if urlopen is called


@pytest.mark.parametrize("error", [urllib.error.URLError("Name or service not known"), socket.timeout("timed out"),
                                   ConnectionRefusedError(111, "refused"), urllib.error.HTTPError(
                                       "u", 503, "Service Unavailable", {}, None)])
def test_network_failures_become_offline_error(monkeypatch, error):
    fake_urlopen(monkeypatch, error=error)
    with pytest.raises(hub.OfflineError) as info:
        hub.fetch_config("Qwen/Qwen2.5-0.5B")
    assert "Could not reach the Hugging Face hub" in str(info.value)
    assert "download config.json yourself" in str(info.value)


@pytest.mark.parametrize("code", [401, 403, 404])
def test_missing_or_gated_model_is_a_value_error(monkeypatch, code):
    fake_urlopen(monkeypatch, error=urllib.error.HTTPError("u", code, "nope", {}, None))
    with pytest.raises(ValueError, match=f"HTTP {code}"):
        hub.fetch_config("org/private-model")


def test_success_parses_the_config_and_asks_for_config_json_only(monkeypatch):
    cfg = {"model_type": "llama", "hidden_size": 64}
    calls = fake_urlopen(monkeypatch, json.dumps(cfg).encode())
    assert hub.fetch_config("Qwen/Qwen2.5-0.5B", timeout=3.0) == cfg
    assert calls == [("https://huggingface.co/Qwen/Qwen2.5-0.5B/resolve/main/config.json", 3.0)]


def test_oversized_or_malformed_bodies_are_refused(monkeypatch):
    fake_urlopen(monkeypatch, b" " * (MAX_CONFIG_BYTES + 10))
    with pytest.raises(ValueError, match="larger than"):
        hub.fetch_config("a/b")
    fake_urlopen(monkeypatch, b"<html>not json</html>")
    with pytest.raises(ValueError, match="not valid JSON"):
        hub.fetch_config("a/b")
    fake_urlopen(monkeypatch, b"[1, 2]")
    with pytest.raises(ValueError, match="JSON object"):
        hub.fetch_config("a/b")
    fake_urlopen(monkeypatch, b"\xff\xfe{}")
    with pytest.raises(ValueError, match="UTF-8"):
        hub.fetch_config("a/b")
