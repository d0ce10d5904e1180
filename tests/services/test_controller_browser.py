"""The dashboard in a real browser: Debian's headless Chromium driven by Playwright.

A job with metrics shows its charts with data points (the chosen mode highlighted), and
the sweep page overlays one series per aggregation mode. Screenshots land in tmp_path.
"""

from __future__ import annotations

import os
from pathlib import Path

import httpx
import pytest

from services.controller.app import create_app
from tests.services.controller_fakes import (
    DEMO_OVERRIDES,
    FakeBackend,
    make_settings,
    serve_in_thread,
    step_rows,
)

CHROMIUM = Path(os.environ.get("TALLY_CHROMIUM", "/usr/bin/chromium"))
ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
        "--disable-background-networking", "--disable-component-update", "--disable-sync"]
MODES = ["sample_mean", "token_mean", "prompt_mean", "constant"]
ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.skipif(
    not CHROMIUM.exists(),
    reason=f"{CHROMIUM} missing: run deploy/ci/install-system-deps.sh (Debian's chromium)")


@pytest.fixture(scope="module")
def dashboard(tmp_path_factory: pytest.TempPathFactory):
    """A controller (Ray faked) holding a finished job and a four-mode sweep with metrics."""
    tmp = tmp_path_factory.mktemp("dashboard")
    backend = FakeBackend()
    app = create_app(make_settings(tmp, max_running_jobs=100), backend=backend)
    config = (ROOT / "configs" / "demo.yaml").read_text()
    with serve_in_thread(app) as url, httpx.Client(base_url=url) as http:
        job = http.post("/api/jobs", json={"config_yaml": config,
                                           "overrides": [*DEMO_OVERRIDES, "num_steps=40",
                                                         "aggregation.mode=token_mean"]}).json()
        http.post(f"/api/jobs/{job['id']}/metrics", json={"rows": step_rows(40)})
        sweep = http.post("/api/sweeps", json={"config_yaml": config, "modes": MODES,
                                               "overrides": [*DEMO_OVERRIDES, "num_steps=4"]}
                          ).json()
        for i, run in enumerate(sweep["jobs"]):
            http.post(f"/api/jobs/{run['id']}/metrics",
                      json={"rows": step_rows(2, scale=1 + i)})
        failed = http.post("/api/jobs", json={"config_yaml": config,
                                              "overrides": DEMO_OVERRIDES}).json()
        app.state.controller.reconciler.tick()
        backend.finish(f"tally-{failed['id']}", "failed", "step 1/2\nValueError: boom\n",
                       "Job entrypoint command failed with exit code 1")
        app.state.controller.reconciler.tick()
        yield url, job["id"], sweep["id"], tmp, failed["id"]


@pytest.fixture(scope="module")
def page(dashboard):
    playwright = pytest.importorskip("playwright.sync_api")
    with playwright.sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=str(CHROMIUM), args=ARGS)
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        errors: list[str] = []
        page.on("pageerror", lambda err: errors.append(str(err)))
        yield page, errors
        browser.close()


def test_job_page_draws_every_chart_with_points(dashboard, page) -> None:
    url, job_id, _, tmp, _ = dashboard
    tab, errors = page
    tab.goto(f"{url}/jobs/{job_id}")
    tab.wait_for_selector('[data-chart="pg_loss_modes"][data-points="160"]', timeout=15_000)
    for chart in ("reward", "kl", "entropy", "clip_fraction", "grad_norm", "response_length",
                  "tokens_per_s", "padding_fraction"):
        points = tab.get_attribute(f'[data-chart="{chart}"]', "data-points")
        assert points is not None and int(points) >= 40, chart
        assert tab.locator(f'[data-chart="{chart}"] canvas').count() == 1
    legend = tab.locator('[data-chart="pg_loss_modes"] .u-legend').inner_text()
    assert "token_mean (chosen)" in legend and "sample_mean" in legend
    tab.screenshot(path=str(tmp / "job.png"), full_page=True)
    assert not errors


def test_job_list_links_jobs_and_sweeps(dashboard, page) -> None:
    url, job_id, sweep_id, _, _ = dashboard
    tab, errors = page
    tab.goto(url)
    tab.wait_for_selector(f'tr[data-job="{job_id}"]', timeout=15_000)
    assert tab.locator("#jobs tbody tr").count() == 6
    assert tab.locator(f'tr[data-sweep="{sweep_id}"]').count() == 1
    assert not errors


def test_sweep_page_overlays_one_series_per_mode(dashboard, page) -> None:
    url, _, sweep_id, tmp, _ = dashboard
    tab, errors = page
    tab.goto(f"{url}/sweeps/{sweep_id}")
    tab.wait_for_selector('[data-chart="pg_loss"][data-points="8"]', timeout=15_000)
    assert tab.get_attribute('[data-chart="pg_loss"]', "data-series") == "4"
    legend = tab.locator('[data-chart="pg_loss"] .u-legend').inner_text()
    assert all(mode in legend for mode in MODES)
    assert tab.locator("#runs tbody tr").count() == 4
    increments: list[dict] = []
    tab.on("response", lambda r: increments.append(r.json()) if (
        "/metrics?" in r.url and "after=" in r.url and r.ok) else None)
    first_run = httpx.get(f"{url}/api/sweeps/{sweep_id}").json()["jobs"][0]["id"]
    httpx.post(f"{url}/api/jobs/{first_run}/metrics", json={"rows": step_rows(2, start=2)})
    tab.wait_for_selector('[data-chart="pg_loss"][data-points="10"]', timeout=15_000)
    assert increments, "the live sweep page never asked for increments"
    sent = [{run["job_id"]: run["steps"] for run in answer["runs"]} for answer in increments]
    assert [2, 3] in [steps[first_run] for steps in sent]
    assert all(step >= 2 for steps in sent for run in steps.values() for step in run), \
        "a refresh sent steps the page already had"
    tab.screenshot(path=str(tmp / "sweep.png"), full_page=True)
    assert not errors


def test_a_failed_job_shows_its_error_and_last_log_lines(dashboard, page) -> None:
    url, _, _, _, failed_id = dashboard
    tab, errors = page
    tab.goto(f"{url}/jobs/{failed_id}")
    tab.wait_for_selector("#failure", timeout=15_000)
    text = tab.locator("#failure").inner_text()
    assert "exit code 1" in text and "ValueError: boom" in text
    assert tab.locator('#job-header [data-status="failed"]').count() == 1
    assert not errors
