"""bench.hub against a hub of our own: a local HTTP server that answers huggingface_hub's requests for
`/{repo}/resolve/{revision}/config.json` the way huggingface.co does. No test here can reach the network:
HF_ENDPOINT points at the local server and HF_HOME at a temporary directory (the download cache and token file).

What the server must send is what huggingface_hub reads (huggingface_hub/file_download.py get_hf_file_metadata and
_hf_hub_download_to_cache_dir; utils/_http.py hf_raise_for_status): on HEAD and GET, `X-Repo-Commit` (the commit the
revision resolves to), `ETag` (the blob's name in the cache) and `Content-Length`; on a refusal, the hub's
`X-Error-Code` (GatedRepo, RepoNotFound, RevisionNotFound, EntryNotFound), which picks the exception raised.
"""
from __future__ import annotations

import hashlib
import json
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import unquote

import pytest

from bench import hub
from estimator.presets import MAX_CONFIG_BYTES

TOKEN = "hf_test_token_for_the_local_hub"
MAIN_COMMIT = "a" * 40
V1_COMMIT = "b" * 40
GATED_COMMIT = "c" * 40


@dataclass
class FakeHub:
    """Repos: {repo_id: {revision: (commit, body bytes)}}; gated repos answer 401 without the test token."""
    repos: dict = field(default_factory=dict)
    gated: set = field(default_factory=set)
    requests: list = field(default_factory=list)

    def answer(self, method: str, path: str, auth: str | None) -> tuple[int, dict, bytes]:
        self.requests.append((method, path))
        parts = unquote(path).lstrip("/").split("/resolve/", 1)
        if len(parts) != 2:
            return 404, {"X-Error-Code": "RepoNotFound"}, b""
        repo, rest = parts
        revision, _, filename = rest.rpartition("/")
        if repo not in self.repos:
            return 404, {"X-Error-Code": "RepoNotFound", "X-Error-Message": "Repository not found"}, b""
        if repo in self.gated and auth != f"Bearer {TOKEN}":
            return 401, {"X-Error-Code": "GatedRepo",
                         "X-Error-Message": f"Access to model {repo} is restricted. You must be authenticated."}, b""
        if revision not in self.repos[repo]:
            return 404, {"X-Error-Code": "RevisionNotFound", "X-Error-Message": "Invalid rev id"}, b""
        commit, body = self.repos[repo][revision]
        if filename != "config.json":
            return 404, {"X-Error-Code": "EntryNotFound", "X-Repo-Commit": commit}, b""
        etag = hashlib.sha256(body).hexdigest()
        return 200, {"X-Repo-Commit": commit, "ETag": f'"{etag}"', "Content-Type": "application/json"}, body


def make_handler(fake: FakeHub):
    class Handler(BaseHTTPRequestHandler):
        def _reply(self, with_body: bool):
            status, headers, body = fake.answer(self.command, self.path, self.headers.get("Authorization"))
            self.send_response(status)
            for k, v in headers.items():
                self.send_header(k, v)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if with_body:
                self.wfile.write(body)

        def do_HEAD(self):  # noqa: N802 (http.server's naming)
            self._reply(with_body=False)

        def do_GET(self):  # noqa: N802
            self._reply(with_body=True)

        def log_message(self, *args):  # keep pytest's output clean
            pass
    return Handler


@pytest.fixture
def fake_hub(monkeypatch, tmp_path):
    fake = FakeHub()
    server = ThreadingHTTPServer(("127.0.0.1", 0), make_handler(fake))
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{server.server_address[1]}")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    for name in ("HF_HUB_CACHE", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_TOKEN", "HUGGING_FACE_HUB_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    yield fake
    server.shutdown()
    server.server_close()


def body(cfg: dict) -> bytes:
    return json.dumps(cfg).encode()


CFG = {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2}
CFG_V1 = {"model_type": "llama", "hidden_size": 128, "num_hidden_layers": 4}


# ---------------------------------------------------------------- input validation (no request is made)

@pytest.mark.parametrize("model_id", ["gpt2", "Qwen/Qwen2.5-0.5B", "meta-llama/Llama-3.1-8B", "a/b", "org_1/x.y-z"])
def test_valid_ids_pass(model_id):
    assert hub.validate_model_id(f"  {model_id} ") == model_id


@pytest.mark.parametrize("model_id", ["", "a/b/c", "../etc/passwd", "org/-name", "org/name-", "a--b/c", "a/b..c",
                                      "org/na me", "org/näme", "https://huggingface.co/gpt2", "x" * 97, "org/",
                                      "/name", "org/name?x=1", None, 42])
def test_malformed_ids_are_refused_before_any_request(fake_hub, model_id):
    with pytest.raises(ValueError, match="^model id") as e:
        hub.fetch_config(model_id)
    assert "\n" not in str(e.value)
    assert fake_hub.requests == []


@pytest.mark.parametrize("revision, expected", [(None, "main"), ("", "main"), (" v1.0 ", "v1.0"),
                                                ("refs/pr/3", "refs/pr/3"), (V1_COMMIT, V1_COMMIT)])
def test_valid_revisions_pass(revision, expected):
    assert hub.validate_revision(revision) == expected


@pytest.mark.parametrize("revision", ["../main", "main/", "-rf", "a b", "main?x=1", "v1..2", 42, "x" * 256])
def test_malformed_revisions_are_refused_before_any_request(fake_hub, revision):
    with pytest.raises(ValueError, match="^revision") as e:
        hub.fetch_config("org/model", revision=revision)
    assert "\n" not in str(e.value)
    assert fake_hub.requests == []


def test_config_url_follows_hf_endpoint(fake_hub, monkeypatch):
    monkeypatch.setenv("HF_ENDPOINT", "https://mirror.example/")
    assert hub.config_url("org/m", "v1") == "https://mirror.example/org/m/resolve/v1/config.json"
    monkeypatch.delenv("HF_ENDPOINT")
    assert hub.config_url("org/m") == "https://huggingface.co/org/m/resolve/main/config.json"


# ---------------------------------------------------------------- the local hub

def test_success_downloads_config_json_only_into_the_hf_cache(fake_hub, tmp_path):
    fake_hub.repos["org/model"] = {"main": (MAIN_COMMIT, body(CFG))}
    assert hub.fetch_config("org/model") == CFG
    # Only config.json is asked for. (huggingface_hub may also GET /api/agent-harnesses, its once-a-day
    # user-agent registry, when it is first imported: utils/_detect_agent.py.)
    files = [(m, p) for m, p in fake_hub.requests if "/resolve/" in p]
    assert files and all(p == "/org/model/resolve/main/config.json" for _, p in files)
    snapshot = tmp_path / "hf" / "hub" / "models--org--model" / "snapshots" / MAIN_COMMIT / "config.json"
    assert json.loads(snapshot.read_text()) == CFG


def test_a_revision_is_fetched_and_cached_apart(fake_hub):
    fake_hub.repos["org/model"] = {"main": (MAIN_COMMIT, body(CFG)), "v1": (V1_COMMIT, body(CFG_V1))}
    assert hub.fetch_config("org/model", revision="v1") == CFG_V1
    assert hub.fetch_config("org/model") == CFG
    assert ("GET", "/org/model/resolve/v1/config.json") in fake_hub.requests


def test_gated_repo_without_token_says_set_hf_token(fake_hub, monkeypatch):
    fake_hub.repos["meta/gated"] = {"main": (GATED_COMMIT, body(CFG))}
    fake_hub.gated.add("meta/gated")
    with pytest.raises(ValueError, match="^model id: 'meta/gated' is gated.*set HF_TOKEN") as e:
        hub.fetch_config("meta/gated")
    assert "\n" not in str(e.value)
    monkeypatch.setenv("HF_TOKEN", TOKEN)  # read by huggingface_hub at each call (utils/_auth.py get_token)
    assert hub.fetch_config("meta/gated") == CFG


def test_missing_repo_revision_or_file_are_value_errors(fake_hub):
    fake_hub.repos["org/model"] = {"main": (MAIN_COMMIT, body(CFG))}
    with pytest.raises(ValueError, match="^model id: the Hugging Face hub has no model 'org/nope'.*HTTP 404"):
        hub.fetch_config("org/nope")
    with pytest.raises(ValueError, match="^revision: 'v9' is not a branch, tag or commit of 'org/model'"):
        hub.fetch_config("org/model", revision="v9")


def test_offline_mode_without_a_cached_file_makes_no_request_and_says_what_to_do(fake_hub, monkeypatch):
    fake_hub.repos["org/model"] = {"main": (MAIN_COMMIT, body(CFG))}
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(hub.OfflineError, match="HF_HUB_OFFLINE is set.*no copy is cached.*upload it") as e:
        hub.fetch_config("org/model")
    assert "\n" not in str(e.value)
    assert fake_hub.requests == []


@pytest.mark.parametrize("flag", ["1", "true", "YES", "on"])
def test_offline_mode_serves_the_cached_file_without_a_request(fake_hub, monkeypatch, flag):
    fake_hub.repos["org/model"] = {"main": (MAIN_COMMIT, body(CFG))}
    assert hub.fetch_config("org/model") == CFG
    seen = list(fake_hub.requests)
    monkeypatch.setenv("HF_HUB_OFFLINE", flag)
    assert hub.fetch_config("org/model") == CFG
    assert fake_hub.requests == seen


def test_an_unreachable_hub_falls_back_to_the_cache_then_to_offline_error(fake_hub, monkeypatch):
    from huggingface_hub.utils import _http

    fake_hub.repos["org/model"] = {"main": (MAIN_COMMIT, body(CFG))}
    assert hub.fetch_config("org/model") == CFG
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # the discard port: connection refused
    assert hub.fetch_config("org/model") == CFG                 # served from the cache, no retry
    # Nothing cached: huggingface_hub would retry a refused connection with backoff (utils/_http.py
    # _http_backoff_base: 5 retries, waits 1, 2, 4, 8, 8 s: the app's 25.6 s offline message); the probe of the
    # hub's host sees the refusal first and only the cache is read: no wait at all (waits are recorded, not slept).
    waits = []
    monkeypatch.setattr(_http.time, "sleep", waits.append)
    with pytest.raises(hub.OfflineError, match="^Could not reach the Hugging Face hub for 'org/other' "
                                               r"\(ConnectionRefusedError.*upload it.*HF_HUB_OFFLINE.*HF_TOKEN"):
        hub.fetch_config("org/other")
    assert waits == []


def test_the_cli_takes_a_hub_id_through_the_same_fetch(fake_hub, capsys):
    from estimator import cli

    sized = {**CFG, "num_attention_heads": 4, "intermediate_size": 128, "vocab_size": 256, "num_key_value_heads": 4}
    fake_hub.repos["org/model"] = {"main": (MAIN_COMMIT, body(sized)), "v1": (V1_COMMIT, body({**sized, "num_hidden_layers": 4}))}
    assert cli.main(["--model", "org/model", "--seq", "128", "--json"]) == 0
    main = json.loads(capsys.readouterr().out)
    assert cli.main(["--model", "org/model@v1", "--seq", "128", "--json"]) == 0
    v1 = json.loads(capsys.readouterr().out)
    assert (main["model"], v1["model"]) == ("org/model", "org/model@v1")
    assert v1["params"] > main["params"]


def test_the_cli_offline_or_gated_names_hf_token_and_hf_hub_offline(fake_hub, monkeypatch, capsys):
    from estimator import cli

    fake_hub.repos["org/gated"] = {"main": (MAIN_COMMIT, body(CFG))}
    fake_hub.gated.add("org/gated")
    assert cli.main(["--model", "org/gated"]) == 2
    assert "HF_TOKEN" in capsys.readouterr().err
    seen = list(fake_hub.requests)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert cli.main(["--model", "meta-llama/Llama-3.1-8B"]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "HF_TOKEN" in err and "HF_HUB_OFFLINE" in err
    assert fake_hub.requests == seen


def test_oversized_or_malformed_files_are_refused(fake_hub):
    fake_hub.repos["org/big"] = {"main": (MAIN_COMMIT, b" " * (MAX_CONFIG_BYTES + 10))}
    with pytest.raises(ValueError, match=f"more than {MAX_CONFIG_BYTES:,}; not a config.json"):
        hub.fetch_config("org/big")
    for repo, data, message in [("org/html", b"<html>not json</html>", "not valid JSON"),
                                ("org/list", b"[1, 2]", "JSON object"), ("org/bytes", b"\xff\xfe{}", "UTF-8")]:
        fake_hub.repos[repo] = {"main": (MAIN_COMMIT, data)}
        with pytest.raises(ValueError, match=message):
            hub.fetch_config(repo)
