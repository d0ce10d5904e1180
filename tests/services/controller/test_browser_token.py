"""The dashboard's cancel button on a controller with an API token, in a real browser
(Debian's headless Chromium via Playwright, a real server on loopback): the page asks for
the token once, then the cancel goes through (same origin, bearer header)."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from services.controller.app import create_app
from tests.services.controller.fakes import (
    DEMO_OVERRIDES,
    FakeBackend,
    make_settings,
    serve_in_thread,
)
from tests.services.controller.test_browser import ARGS, CHROMIUM, ROOT

pytestmark = pytest.mark.skipif(not CHROMIUM.exists(), reason=f"{CHROMIUM} missing")


def test_cancel_button_asks_for_the_token_then_cancels(tmp_path: Path) -> None:
    playwright = pytest.importorskip("playwright.sync_api")
    app = create_app(make_settings(tmp_path, api_token="s3cret"), backend=FakeBackend())
    auth = {"Authorization": "Bearer s3cret"}
    with serve_in_thread(app) as url, httpx.Client(base_url=url) as http, \
            playwright.sync_playwright() as pw:
        assert "s3cret" not in http.get("/").text + http.get("/static/app.js").text
        job = http.post("/api/jobs", headers=auth, json={
            "config_yaml": (ROOT / "configs" / "demo.yaml").read_text(),
            "overrides": DEMO_OVERRIDES}).json()
        browser = pw.chromium.launch(executable_path=str(CHROMIUM), args=ARGS)
        try:
            tab = browser.new_page()
            asked: list[str] = []
            tab.on("dialog", lambda d: (asked.append(d.message), d.accept("s3cret")))
            tab.goto(f"{url}/jobs/{job['id']}")
            # the first page of a fresh browser on a loaded 2-core machine (the suite's
            # other worker) may take longer than a click's 15 s to render
            tab.wait_for_selector("button.cancel", timeout=60_000)
            tab.click("button.cancel", timeout=15_000)
            tab.wait_for_selector('#job-header [data-status="cancelled"]', timeout=15_000)
            assert len(asked) == 1 and "API token" in asked[0]
            assert http.get(f"/api/jobs/{job['id']}").json()["status"] == "cancelled"
            second = http.post("/api/jobs", headers=auth, json={
                "config_yaml": (ROOT / "configs" / "demo.yaml").read_text(),
                "overrides": DEMO_OVERRIDES}).json()
            tab.goto(f"{url}/jobs/{second['id']}")
            tab.click("button.cancel", timeout=15_000)  # the token is kept: no second prompt
            tab.wait_for_selector('#job-header [data-status="cancelled"]', timeout=15_000)
            assert len(asked) == 1
        finally:
            browser.close()
