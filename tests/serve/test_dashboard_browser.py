"""/dashboard in a real browser: the system's Chromium driven by Playwright against a
tiny-model server under a short load. Skips when either is missing (CI installs both)."""

from __future__ import annotations

import shutil
import textwrap
import threading
from pathlib import Path

import httpx
import pytest

from model_factory import build_model
from pagoda.serve.admission.tenants import TenantRegistry
from server_utils import MODEL_NAME, LiveServer, build_tiny_model, start_server
from test_dashboard import metric_totals

sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed (pip install '.[test]')")
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
pytestmark = pytest.mark.skipif(
    CHROMIUM is None, reason="no system Chromium (apt-get install chromium); Playwright's own download is not used"
)


def load(server: LiveServer, stop: threading.Event, key: str) -> None:
    """Four clients sending short streamed completions until told to stop."""

    def client() -> None:
        with httpx.Client(timeout=30, headers={"Authorization": f"Bearer {key}"}) as http:
            while not stop.is_set():
                http.post(
                    server.url + "/v1/completions",
                    json={
                        "model": MODEL_NAME,
                        "prompt": "def fib(n):",
                        "max_tokens": 12,
                        "ignore_eos": True,
                        "stream": True,
                    },
                )

    threads = [threading.Thread(target=client, daemon=True) for _ in range(4)]
    for thread in threads:
        thread.start()
    stop.wait()
    for thread in threads:
        thread.join(30)


def tile_value(page: sync_api.Page, name: str) -> float | None:
    value = page.get_attribute(f"#tile-{name}", "data-value")
    return float(value) if value else None


def test_dashboard_in_chromium(tmp_path: Path) -> None:
    keys = tmp_path / "keys.yaml"
    keys.write_text(
        textwrap.dedent("""
        tenants:
          app: {api_keys: [key-app]}
          ops: {api_keys: [key-ops], admin: true}
    """)
    )
    server = start_server(build_tiny_model(tmp_path / "model"), tenants=TenantRegistry.from_file(keys))
    stop = threading.Event()
    loader = threading.Thread(target=load, args=(server, stop, "key-app"), daemon=True)
    try:
        with sync_api.sync_playwright() as playwright:
            browser = playwright.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox", "--disable-gpu"])
            page = browser.new_page(viewport={"width": 1280, "height": 1000})
            page.goto(server.url + "/dashboard?key=key-ops")
            # The key leaves the address bar once the page has it.
            page.wait_for_function("document.body.dataset.snapshots >= 1", timeout=15000)
            assert "key=" not in page.url
            assert page.text_content("#status") == "live"
            loader.start()
            chart = "#chart-output_tok_s svg"
            page.wait_for_function("document.body.dataset.snapshots >= 3", timeout=15000)
            first = int(page.get_attribute(chart, "data-points"))
            page.wait_for_function(f"document.querySelector('{chart}').dataset.points > {first + 1}", timeout=15000)
            page.wait_for_function(
                "Number(document.querySelector('#tile-output_tok_s').dataset.value) > 0", timeout=15000
            )
            assert page.locator(f"{chart} path").count() == 1  # the line is drawn
            stop.set()
            loader.join(30)
            server.wait_idle()
            # Once a sample after the load has arrived, the page shows what /metrics says.
            totals = metric_totals(server.url)
            page.wait_for_function(
                "Number(document.querySelector('#tile-generation_tokens').dataset.value) === "
                f"{totals['pagoda:generation_tokens']}",
                timeout=15000,
            )
            assert tile_value(page, "finished") == totals["pagoda:request_success"]
            assert tile_value(page, "rejected") == totals.get("pagoda:request_rejected", 0.0)
            assert tile_value(page, "running") == totals["pagoda:num_requests_running"]
            assert page.locator("#tenants tr[data-tenant='app']").count() == 1
            assert page.locator("#timelines .timeline").count() > 0
            assert page.locator("#timelines .timeline .decode").count() > 0
            assert page.text_content("#tile-guard_blocks .sub") == "guardrails off"
            assert page.is_hidden("#moe-panel")  # a dense model: no expert figures
            screenshot = tmp_path / "dashboard.png"
            page.screenshot(path=str(screenshot), full_page=True)
            browser.close()
        check_not_blank(screenshot)
    finally:
        stop.set()
        server.stop()


def check_not_blank(path: Path) -> None:
    from PIL import Image

    image = Image.open(path).convert("RGB")
    assert image.width >= 1000 and image.height >= 600
    colors = image.getcolors(maxcolors=1 << 20)
    assert colors is not None and len(colors) > 50  # text, lines and bars, not one flat fill
    dominant = max(count for count, _ in colors)
    assert dominant < 0.9 * image.width * image.height


def test_expert_panel_on_a_moe_model(tmp_path: Path) -> None:
    """With --moe-metrics the page shows a row per MoE layer, a cell per expert: the tokens
    since start, then the window's once tokens are routed while it is open."""
    server = start_server(build_model(tmp_path / "moe", "qwen3_moe"), engine={"moe_metrics": True})
    try:

        def complete() -> None:
            response = httpx.post(
                server.base_url + "/completions",
                timeout=60,
                json={"model": MODEL_NAME, "prompt": "def f(x):", "max_tokens": 8, "ignore_eos": True},
            )
            assert response.status_code == 200, response.text

        complete()
        with sync_api.sync_playwright() as playwright:
            browser = playwright.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox", "--disable-gpu"])
            page = browser.new_page(viewport={"width": 1280, "height": 1000})
            page.goto(server.url + "/dashboard")
            page.wait_for_function("document.body.dataset.snapshots >= 2", timeout=15000)
            assert page.is_visible("#moe-panel")
            assert page.locator("#moe .moe-layer").count() == 2  # the tiny model's MoE layers
            assert page.locator("#moe .moe-layer:first-child .strip span").count() == 8  # its experts
            assert page.get_attribute("#moe .moe-layer", "data-span") == "total"
            complete()
            page.wait_for_function("document.querySelector('#moe .moe-layer').dataset.span === 'window'", timeout=15000)
            browser.close()
    finally:
        server.stop()
