"""The real app in a real browser: `streamlit run app.py` on a temp database, driven by Debian's chromium.

Visits every page, checks that no exception box is shown, changes the batch size on the home page and checks
that the verdict changes, and saves a screenshot of each page under artifacts/ (git-ignored).
Skipped when /usr/bin/chromium is missing, unless CI=true (then it fails: CI must run it).
"""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from bench.store.ingest import ingest_files

REPO = Path(__file__).resolve().parent.parent
CHROMIUM = Path("/usr/bin/chromium")
ARTIFACTS = REPO / "artifacts"
CHROMIUM_ARGS = ["--no-sandbox", "--headless", "--disable-gpu", "--disable-dev-shm-usage",
                 "--disable-background-networking", "--disable-component-update", "--no-first-run", "--disable-sync"]
# url (path: st.Page's default, the file name; query: a model with stored runs) -> the page's title
PAGES = {"": "Will it fit?", "benchmarks": "Benchmarks", "curves?model=llama-3.2-1b&seq=1024": "Curves",
         "calibrate": "Calibrate", "multi_gpu?model=llama-3.2-1b&batch=4&seq=1024": "Multi-GPU",
         "contribute": "Contribute"}
START_TIMEOUT_S = 90
RENDER_TIMEOUT_MS = 60_000

if not CHROMIUM.exists():
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(f"{CHROMIUM} is missing and CI=true: install Debian's chromium (see .ci/run)", pytrace=False)
    pytest.skip(f"{CHROMIUM} is missing; install Debian's chromium to run the browser test", allow_module_level=True)

from playwright.sync_api import expect, sync_playwright  # noqa: E402

from test_app_pages import model_rows, write_jsonl  # noqa: E402  the same small database as the AppTests


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("browser")
    db_path = tmp / "bench.duckdb"
    assert ingest_files([write_jsonl(tmp / "rows.jsonl", model_rows())], db_path).written
    port = free_port()
    env = {**os.environ, "WILLITFIT_DB": str(db_path), "WILLITFIT_CALIBRATION": str(tmp / "calibration.json"),
           "HF_HUB_OFFLINE": "1", "WILLITFIT_PRICE_ADVICE": "0"}  # no background derivation under the clicks
    log = open(tmp / "streamlit.log", "w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "streamlit", "run", "app.py", "--server.headless", "true", "--server.port", str(port),
         "--server.address", "127.0.0.1", "--browser.gatherUsageStats", "false", "--server.fileWatcherType", "none"],
        cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            try:
                with urllib.request.urlopen(f"{url}/_stcore/health", timeout=2) as r:
                    if r.read().strip() == b"ok":
                        break
            except OSError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"streamlit did not start: {(tmp / 'streamlit.log').read_text()[-2000:]}")
            time.sleep(0.3)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()


@pytest.fixture(scope="module")
def page(server):
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS, headless=True)
        context = browser.new_context(viewport={"width": 1400, "height": 2600})
        yield context.new_page()
        browser.close()


def wait_rendered(page, title: str) -> None:
    """The title is shown and the script has finished (Streamlit marks its root element with the run state)."""
    expect(page.get_by_role("heading", name=title).first).to_be_visible(timeout=RENDER_TIMEOUT_MS)
    page.wait_for_selector('[data-testid="stApp"][data-test-script-state="notRunning"]', timeout=RENDER_TIMEOUT_MS)


def wait_drawn(page) -> None:
    """Every chart has drawn its canvas/svg and no lazy-loading placeholder is left (for the screenshots)."""
    page.wait_for_function(
        """() => [...document.querySelectorAll('[data-testid="stVegaLiteChart"]')]
                   .every(e => e.querySelector('canvas, svg'))
              && document.querySelectorAll('[data-testid="stSkeleton"]').length === 0""",
        timeout=RENDER_TIMEOUT_MS)


def test_every_page_renders_without_an_exception(server, page):
    ARTIFACTS.mkdir(exist_ok=True)
    for path, title in PAGES.items():
        page.goto(f"{server}/{path}")
        wait_rendered(page, title)
        wait_drawn(page)
        page.screenshot(path=str(ARTIFACTS / f"page_{path.split('?')[0] or 'fit'}.png"), full_page=True)
        assert page.locator('[data-testid="stException"]').count() == 0, f"exception shown on /{path}"


def test_changing_the_batch_changes_the_verdict(server, page):
    page.goto(f"{server}/?model=llama-3.2-3b&batch=1")   # fits with room on the default H100 (llama-3.1-8b: tight)
    wait_rendered(page, "Will it fit?")
    verdict = page.locator('[data-testid="stAlert"]').filter(has_text="per GPU").first
    before = verdict.inner_text()
    assert "Fits" in before
    batch = page.get_by_role("spinbutton", name="Micro-batch size (per GPU)")
    batch.fill("64")
    batch.press("Enter")
    expect(page.locator('[data-testid="stAlert"]').filter(has_text="Out of memory").first).to_be_visible(
        timeout=RENDER_TIMEOUT_MS)
    wait_rendered(page, "Will it fit?")
    after = page.locator('[data-testid="stAlert"]').filter(has_text="per GPU").first.inner_text()
    assert after != before and "OOM by" in after
    assert "batch=64" in page.url  # the link reproduces the view
    wait_drawn(page)
    page.screenshot(path=str(ARTIFACTS / "fit_batch64.png"), full_page=True)
    assert page.locator('[data-testid="stException"]').count() == 0
