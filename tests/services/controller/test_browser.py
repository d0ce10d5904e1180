"""The dashboard in a real browser: Debian's headless Chromium driven by Playwright.

A job with metrics shows its charts with data points (the chosen mode highlighted; the
length-bias charts one series per mode; evaluation, logged every few steps, drawn across
the steps between; peak memory per phase, a checkpoint's only every few steps; one series
per reward part) and its samples.jsonl as a table (as text, whatever the model wrote),
charts grouped in sections, a job without some metrics says "no data" for those charts
and hides the sections of features it does not use (critic, environment), a training
sample opens into its tokens coloured by advantage, log-prob gap or entropy (its
multi-turn observation apart), and the sweep page overlays
one series per aggregation mode; the job list lists training sessions too. Screenshots
land in tmp_path.
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

import httpx
import pytest

from services.controller.app import create_app
from services.controller.job_samples import NO_FILE
from services.controller.run_states import SESSION_STATUSES
from services.controller.tables import Run
from services.driver.run_dir import SAMPLES_FILE
from services.driver.samples import append_samples, read_samples
from tests.services.controller.fakes import (
    DEMO_OVERRIDES,
    FakeBackend,
    eval_records,
    make_settings,
    sample_records,
    sample_tokens,
    serve_in_thread,
    step_rows,
    with_length_bias_and_eval,
    with_reward_parts,
)

CHROMIUM = Path(os.environ.get("TALLY_CHROMIUM", "/usr/bin/chromium"))
ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
        "--disable-background-networking", "--disable-component-update", "--disable-sync"]
MODES = ["sample_mean", "token_mean", "prompt_mean", "constant"]
PHASES = ["train", "sync", "checkpoint"]
ROOT = Path(__file__).resolve().parents[3]

pytestmark = pytest.mark.skipif(
    not CHROMIUM.exists(),
    reason=f"{CHROMIUM} missing: run deploy/ci/install-system-deps.sh (Debian's chromium)")


def with_peak_memory(rows: list[dict], checkpoint_every: int = 10) -> list[dict]:
    """``rows`` plus a rank's peak memory in train and sync every step, and in checkpoint
    on every ``checkpoint_every``-th step only (trainer/memory.py: phase_metrics)."""
    for row in rows:
        phases = PHASES if row["step"] % checkpoint_every == 0 else PHASES[:2]
        row["metrics"] |= {f"perf/peak_mem_gb/{phase}": 1.5 + 0.5 * i
                           for i, phase in enumerate(phases)}
    return rows


def with_environment(rows: list[dict]) -> list[dict]:
    """``rows`` plus a multi-turn environment's metrics (rollout/manager.py)."""
    for row in rows:
        row["metrics"] |= {"env/turns_mean": 2.5, "env/observations_mean": 1.5,
                           "env/tool_calls_mean": 1.0, "env/policy_token_share": 0.6,
                           "env/done_fraction": 0.75, "env/seconds": 0.2,
                           "env/failures": float(row["step"] % 7 == 0)}
    return rows


def with_critic_and_teacher(rows: list[dict]) -> list[dict]:
    """``rows`` plus a critic's metrics (services/driver/metrics.py: critic_metrics, the
    rollout's GAE) and a teacher's reverse KL, the explained variance rising."""
    for row in rows:
        step = row["step"]
        row["metrics"] |= {"critic/value_loss": 0.1 / (1 + step), "critic/clip_fraction": 0.05,
                           "critic/explained_variance": -0.5 + step / 40,
                           "critic/values_mean": 0.3, "critic/returns_mean": 0.35,
                           "critic/grad_norm": 0.8, "distill/reverse_kl": 1.0 / (1 + step)}
    return rows


def partial_metrics(step: int) -> dict[str, float]:
    """Step ``step``'s metrics of an asynchronous job with partial rollouts (k = 2): its
    rollout's staleness, its tokens' (mean, max), the share of samples spanning versions
    and those dropped as stale; values uPlot's legend writes exactly."""
    return {"rollout/staleness": float(min(step, 2)),
            "rollout/staleness_max": float(min(step, 2)),
            "rollout/staleness_mean": 0.375 * min(step, 2),
            "rollout/partial_fraction": 0.125 * (step % 5), "rollout/stale_dropped": step % 3}


def with_partial_rollouts(rows: list[dict]) -> list[dict]:
    """``rows`` plus an asynchronous job's partial-rollout metrics (partial_metrics)."""
    for row in rows:
        row["metrics"] |= partial_metrics(row["step"])
    return rows


PLANTED = {"prompt": "<bos><i>copy</i> this=", "response":
           '<script>window.pwned = 1</script><b>bold</b> & <img src=x onerror="window.pwned = 2">'}
"""What a model may write: shown as text, never run or drawn."""


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
        http.post(f"/api/jobs/{job['id']}/metrics",
                  json={"rows": with_partial_rollouts(with_reward_parts(
                      with_critic_and_teacher(with_environment(with_peak_memory(
                          with_length_bias_and_eval(step_rows(40), eval_every=5))))))})
        samples = Path(job["output_dir"]) / SAMPLES_FILE  # as the driver appends them
        for step in (37, 38, 39):
            append_samples(samples, sample_records(step, count=4))
            if step == 37:
                append_samples(samples, eval_records(35))
        append_samples(samples, [{**sample_records(39, count=5)[4], **PLANTED}])
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


SECTIONS = {"loss": ("pg_loss_modes", "length_bias_long", "length_bias_short", "kl",
                     "entropy", "clip_fraction", "grad_norm", "distill"),
            "rewards": ("reward", "reward_parts", "eval", "response_length"),
            "critic": ("critic_loss", "critic_fit", "critic_values"),
            "environment": ("env_turns", "env_tokens", "env_seconds"),
            "async": ("staleness", "partial_fraction", "stale_dropped"),
            "system": ("tokens_per_s", "padding_fraction", "peak_mem")}
"""The job page's sections and their charts, in page order (charts.js: JOB_SECTIONS,
JOB_CHARTS)."""
SECTION_TITLES = ["Loss and aggregation", "Rewards", "Critic", "Environment", "Asynchrony",
                  "System"]
JOB_CHARTS = tuple(chart for charts in SECTIONS.values() for chart in charts)
SHOWN_SECTIONS = """ss => ss.filter(s => !s.hidden).map(s => [s.dataset.section,
  s.querySelector("h2").textContent,
  [...s.querySelectorAll("[data-chart]")].filter(c => !c.hidden).map(c => c.dataset.chart)])"""
"""The sections a page shows: id, heading and the charts it shows."""

# Columns of a chart's canvas holding blue (the first series' colour, #4269d0), counted
# in the page: a line bridging the sparse steps covers most columns, bare dots few.
BLUE_COLUMNS = """(selector) => {
  const canvas = document.querySelector(selector + " canvas");
  const { width, height } = canvas;
  const px = canvas.getContext("2d").getImageData(0, 0, width, height).data;
  const columns = new Set();
  for (let i = 0; i < px.length; i += 4) {
    if (px[i + 3] > 0 && px[i + 2] - px[i] > 60 && px[i + 2] - px[i + 1] > 40) {
      columns.add((i / 4) % width);
    }
  }
  return [columns.size, width];
}"""


def points_of(tab, chart: str) -> int:
    return int(tab.get_attribute(f'[data-chart="{chart}"]', "data-points") or -1)


LEGEND = """legend => [...legend.querySelectorAll("tr.u-series")].map(r => [
  r.querySelector(".u-label").textContent, r.querySelector(".u-value").textContent])"""
"""A chart's legend: each series' label and the value it shows (the cursor's step)."""


def legend_at(tab, chart: str, step: int, steps: tuple[int, int]) -> dict[str, str]:
    """The legend of ``chart`` with the mouse over step ``step`` of a plot drawing steps
    ``steps[0]`` to ``steps[1]``, as a person hovering it reads it (label -> value; "step"
    the step the cursor is on)."""
    over = tab.locator(f'[data-chart="{chart}"] .u-over')
    over.scroll_into_view_if_needed()
    box = over.bounding_box()
    assert box is not None, chart
    x = box["x"] + box["width"] * (step - steps[0]) / (steps[1] - steps[0])
    tab.mouse.move(min(max(x, box["x"] + 1), box["x"] + box["width"] - 1),
                   box["y"] + box["height"] / 2)
    return dict(tab.eval_on_selector(f'[data-chart="{chart}"] .u-legend', LEGEND))


def test_job_page_draws_every_chart_with_points(dashboard, page) -> None:
    url, job_id, _, tmp, _ = dashboard
    tab, errors = page
    tab.goto(f"{url}/jobs/{job_id}")
    tab.wait_for_selector('[data-chart="pg_loss_modes"][data-points="160"]', timeout=15_000)
    assert tab.eval_on_selector_all("[data-chart]", "cs => cs.map(c => c.dataset.chart)") == \
        list(JOB_CHARTS)
    assert tab.eval_on_selector_all("[data-section]", SHOWN_SECTIONS) == [  # all in use
        [section, title, list(charts)] for (section, charts), title in zip(
            SECTIONS.items(), SECTION_TITLES, strict=True)]
    for chart in JOB_CHARTS:
        assert points_of(tab, chart) >= 16, chart
        assert tab.locator(f'[data-chart="{chart}"] canvas').count() == 1
        assert not tab.locator(f'[data-chart="{chart}"] .no-data').is_visible(), chart
    for bucket in ("long", "short"):  # one series per mode, every step
        chart = f'[data-chart="length_bias_{bucket}"]'
        assert (points_of(tab, f"length_bias_{bucket}"), tab.get_attribute(
            chart, "data-series")) == (160, "4")
        legend = tab.locator(f"{chart} .u-legend").inner_text()
        assert "token_mean (chosen)" in legend and all(m in legend for m in MODES)
    assert "shortest third" in tab.locator('[data-chart="length_bias_short"] h3').inner_text()
    # Evaluation on steps 0, 5, ..., 35 only: 8 steps × 2 series, joined across the gaps.
    assert (points_of(tab, "eval"), tab.get_attribute('[data-chart="eval"]', "data-series")) \
        == (16, "2")
    assert "k = 4" in tab.locator('[data-chart="eval"] h3').inner_text()
    assert "pass@k" in tab.locator('[data-chart="eval"] .u-legend').inner_text()
    # Peak memory: train and sync on 40 steps, checkpoint on steps 0, 10, 20, 30.
    assert (points_of(tab, "peak_mem"), tab.get_attribute('[data-chart="peak_mem"]',
                                                          "data-series")) == (84, "3")
    assert all(p in tab.locator('[data-chart="peak_mem"] .u-legend').inner_text()
               for p in PHASES)
    # Environment: 40 steps × 3 series per episode; the share's axis stays in [0, 1].
    assert (points_of(tab, "env_turns"), tab.get_attribute('[data-chart="env_turns"]',
                                                           "data-series")) == (120, "3")
    assert float(tab.get_attribute('[data-chart="env_tokens"]', "data-y-max")) <= 1.0
    # The critic: 40 steps × 2 and × 3 series; its explained variance crosses 0.
    assert (points_of(tab, "critic_loss"), points_of(tab, "critic_values")) == (80, 120)
    assert "explained variance" in tab.locator('[data-chart="critic_fit"] .u-legend').inner_text()
    # Asynchrony: staleness over the step's tokens (mean, max; the rollout's own, which
    # they refine, not beside them), the share spanning versions (axis in [0, 1]), the
    # samples dropped; each value where the step is hovered is the row's.
    assert (points_of(tab, "staleness"), tab.get_attribute('[data-chart="staleness"]',
                                                           "data-series")) == (80, "2")
    for step in (0, 1, 22, 39):
        logged = partial_metrics(step)
        assert legend_at(tab, "staleness", step, (0, 39)) == {
            "step": str(step), "mean over tokens": f"{logged['rollout/staleness_mean']:g}",
            "max over tokens": f"{logged['rollout/staleness_max']:g}"}, step
        assert legend_at(tab, "partial_fraction", step, (0, 39)) == {
            "step": str(step),
            "spanning versions": f"{logged['rollout/partial_fraction']:g}"}, step
        assert legend_at(tab, "stale_dropped", step, (0, 39)) == {
            "step": str(step), "dropped": f"{logged['rollout/stale_dropped']:g}"}, step
    assert float(tab.get_attribute('[data-chart="partial_fraction"]', "data-y-max")) <= 1.0
    covered, width = tab.evaluate(BLUE_COLUMNS, '[data-chart="eval"]')
    assert covered > width / 2, (covered, width)
    legend = tab.locator('[data-chart="pg_loss_modes"] .u-legend').inner_text()
    assert "token_mean (chosen)" in legend and "sample_mean" in legend
    tab.screenshot(path=str(tmp / "job.png"), full_page=True)
    assert not errors


SAMPLE_CELLS = "rows => rows.map(r => [...r.cells].map(c => c.textContent))"
OPTIONS = "options => options.map(o => o.textContent)"


def sample_cells(record: dict) -> list[str]:
    """A samples.jsonl record's row as the page shows it: every value as text."""
    def num(value: float | None) -> str:
        return "–" if value is None else f"{value:.3f}"

    mark = ("eval · greedy" if record["greedy"] else "eval") if record.get("eval") else ""
    return [f"{record['step']}{mark}", str(record["group"]), num(record["reward"]),
            *(num(v) for v in record["rewards"].values()), num(record.get("advantage")),
            str(record["response_tokens"]), record["prompt"], record["response"]]


def test_job_page_charts_each_reward_part_and_shows_samples_as_text(dashboard, page) -> None:
    url, job_id, _, tmp, _ = dashboard
    tab, errors = page
    path = Path(httpx.get(f"{url}/api/jobs/{job_id}").json()["output_dir"]) / SAMPLES_FILE
    tab.goto(f"{url}/jobs/{job_id}")
    chart = '[data-chart="reward_parts"]'
    tab.wait_for_selector(f'{chart}[data-points="80"]', timeout=15_000)  # 2 parts × 40 steps
    assert tab.get_attribute(chart, "data-series") == "2"
    assert [p in tab.locator(f"{chart} .u-legend").inner_text() for p in ("exact_match", "num")
            ] == [True, True]
    tab.wait_for_selector('#samples tbody tr[data-step="39"]', timeout=15_000)
    assert tab.eval_on_selector_all("#sample-step option", OPTIONS) == [
        "step 39", "step 38", "step 37", "step 35 · evaluation"]
    assert tab.eval_on_selector_all("#samples th", "hs => hs.map(h => h.textContent)") == [
        "step", "group", "reward", "exact_match", "num", "advantage", "tokens", "prompt",
        "response"]
    newest = read_samples(path, step=39)
    assert len(newest) == 5 and newest[-1]["response"] == PLANTED["response"]
    assert tab.eval_on_selector_all("#samples tbody tr", SAMPLE_CELLS) == [
        sample_cells(r) for r in newest]
    assert tab.locator("#samples script, #samples b, #samples i, #samples img").count() == 0
    assert tab.evaluate("window.pwned") is None
    assert tab.locator("#samples-note").inner_text() == "5 of 5 samples of step 39"
    tab.select_option("#sample-step", "eval:35")
    tab.wait_for_selector('#samples tbody tr[data-eval="true"]', timeout=15_000)
    assert tab.eval_on_selector_all("#samples tbody tr", SAMPLE_CELLS) == [
        sample_cells(r) for r in read_samples(path, step=35, evaluation=True)]
    tab.screenshot(path=str(tmp / "job-samples.png"), full_page=True)
    assert not errors


def test_samples_follow_new_steps_and_one_reward_part_says_so(page, tmp_path: Path) -> None:
    """The driver writes a step's samples before its metrics row: each row that arrives
    (server-sent events) brings the table to the newest step."""
    tab, errors = page
    app = create_app(make_settings(tmp_path), backend=FakeBackend())
    one = ("exact_match",)
    with serve_in_thread(app) as url, httpx.Client(base_url=url) as http:
        config = (ROOT / "configs" / "demo.yaml").read_text()
        job = http.post("/api/jobs", json={"config_yaml": config, "overrides": [
            *DEMO_OVERRIDES, "num_steps=4"]}).json()
        path = Path(job["output_dir"]) / SAMPLES_FILE
        for step in (0, 1):
            append_samples(path, sample_records(step, parts=one))
            rows = with_reward_parts(step_rows(1, start=step), one)
            assert http.post(f"/api/jobs/{job['id']}/metrics", json={"rows": rows}).is_success
            if step == 0:
                tab.goto(f"{url}/jobs/{job['id']}")
                tab.wait_for_selector('#samples tbody tr[data-step="0"]', timeout=15_000)
                chart = '[data-chart="reward_parts"]'
                assert (tab.get_attribute(chart, "data-series"), points_of(tab, "reward_parts"),
                        tab.locator(f"{chart} h3").inner_text()) == (
                    "1", 1, "reward parts (mean per step) (one part: exact_match)")
        tab.wait_for_selector('#samples tbody tr[data-step="1"]', timeout=15_000)
        assert tab.eval_on_selector_all("#sample-step option", OPTIONS) == ["step 1", "step 0"]
        assert tab.eval_on_selector_all("#samples tbody tr", SAMPLE_CELLS) == [
            sample_cells(r) for r in read_samples(path, step=1)]
        assert points_of(tab, "reward_parts") == 2
    assert not errors


def test_charts_without_points_say_no_data(dashboard, page) -> None:
    url, _, sweep_id, tmp, _ = dashboard
    tab, errors = page
    run = httpx.get(f"{url}/api/sweeps/{sweep_id}").json()["jobs"][1]["id"]  # no eval
    tab.goto(f"{url}/jobs/{run}")
    tab.wait_for_selector('[data-chart="pg_loss_modes"][data-points="8"]', timeout=15_000)
    for chart in ("eval", "length_bias_long", "length_bias_short", "peak_mem", "env_turns",
                  "env_tokens", "env_seconds", "critic_loss", "critic_fit", "distill",
                  "reward_parts", "staleness", "partial_fraction", "stale_dropped"):
        assert points_of(tab, chart) == 0, chart
    # Sections of features the job does not use are hidden whole (critic, environment),
    # and so is a feature's chart (distillation); in a shown section, "no data".
    for chart in ("eval", "length_bias_long", "length_bias_short", "peak_mem",
                  "reward_parts"):
        assert tab.locator(f'[data-chart="{chart}"] .no-data').is_visible(), chart
    for chart in ("env_turns", "env_tokens", "env_seconds", "critic_loss", "critic_fit",
                  "critic_values", "distill", "staleness", "partial_fraction",
                  "stale_dropped"):
        assert not tab.locator(f'[data-chart="{chart}"]').is_visible(), chart
    assert [s[0] for s in tab.eval_on_selector_all("[data-section]", SHOWN_SECTIONS)] == [
        "loss", "rewards", "system"]
    tab.wait_for_selector("#samples-note:not(:empty)", timeout=15_000)
    assert tab.locator("#samples-note").inner_text() == NO_FILE  # no samples.jsonl yet
    assert tab.locator("#samples tr").count() == 0 and not tab.is_visible("#sample-step")
    assert tab.locator('[data-chart="eval"] .no-data').inner_text() == "no evaluation logged"
    assert tab.locator('[data-chart="eval"] h3').inner_text() == \
        "evaluation on held-out prompts"  # no k to show
    assert points_of(tab, "reward") == 4
    assert not tab.locator('[data-chart="reward"] .no-data').is_visible()
    tab.screenshot(path=str(tmp / "job-without-eval.png"), full_page=True)
    assert not errors


ASYNC_CHARTS = ["staleness", "partial_fraction", "stale_dropped"]


def test_staleness_of_a_job_without_partial_rollouts(page, tmp_path: Path) -> None:
    """A synchronous job logs ``rollout/staleness`` 0 every step: no Asynchrony section.
    An asynchronous one without partial rollouts charts its rollouts' staleness alone
    (one series, each step's value) and says it has no partial rollouts; rows that bring
    the per-token metrics (over SSE) switch the chart to their mean and max."""
    tab, errors = page
    app = create_app(make_settings(tmp_path, max_running_jobs=10), backend=FakeBackend())
    config = (ROOT / "configs" / "demo.yaml").read_text()
    with serve_in_thread(app) as url, httpx.Client(base_url=url) as http:
        def job_with(rows: list[dict]) -> str:
            job = http.post("/api/jobs", json={"config_yaml": config, "overrides": [
                *DEMO_OVERRIDES, "num_steps=8"]}).json()
            assert http.post(f"/api/jobs/{job['id']}/metrics", json={"rows": rows}).is_success
            return job["id"]

        rows = step_rows(4)
        for row in rows:
            row["metrics"]["rollout/staleness"] = 0.0
        synchronous = job_with(rows)
        tab.goto(f"{url}/jobs/{synchronous}")
        tab.wait_for_selector('[data-chart="pg_loss_modes"][data-points="16"]', timeout=15_000)
        assert tab.locator('[data-section="async"]').is_hidden()
        assert [points_of(tab, c) for c in ASYNC_CHARTS] == [0, 0, 0]

        rows = step_rows(4)
        for row in rows:  # async_steps 1: step 0 from the first weights, then one behind
            row["metrics"]["rollout/staleness"] = float(min(row["step"], 1))
        one_behind = job_with(rows)
        tab.goto(f"{url}/jobs/{one_behind}")
        tab.wait_for_selector('[data-chart="staleness"][data-points="4"]', timeout=15_000)
        assert [s[0] for s in tab.eval_on_selector_all("[data-section]", SHOWN_SECTIONS)] == [
            "loss", "rewards", "async", "system"]
        assert tab.locator('[data-section="async"] h2').text_content() == "Asynchrony"
        assert tab.get_attribute('[data-chart="staleness"]', "data-series") == "1"
        for step in range(4):
            assert legend_at(tab, "staleness", step, (0, 3)) == {
                "step": str(step), "rollout": str(min(step, 1))}, step
        for chart in ("partial_fraction", "stale_dropped"):
            assert points_of(tab, chart) == 0, chart
            assert tab.locator(f'[data-chart="{chart}"] .no-data').inner_text() == \
                "no partial rollouts (rollout.partial_rollout)"
        tab.screenshot(path=str(tmp_path / "async-without-partial.png"), full_page=True)

        later = with_partial_rollouts(step_rows(2, start=4))  # live, over SSE
        assert http.post(f"/api/jobs/{one_behind}/metrics", json={"rows": later}).is_success
        tab.wait_for_selector('[data-chart="staleness"][data-series="2"][data-points="4"]',
                              timeout=15_000)
        assert (points_of(tab, "partial_fraction"), points_of(tab, "stale_dropped")) == (2, 2)
        assert legend_at(tab, "staleness", 5, (0, 5)) == {
            "step": "5", "mean over tokens": "0.75", "max over tokens": "2"}
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
    assert tab.locator('[data-chart="eval/accuracy"] .no-data').is_visible()  # no run has eval
    increments: list[dict] = []
    tab.on("response", lambda r: increments.append(r.json()) if (
        "/metrics?" in r.url and "after=" in r.url and r.ok) else None)
    first_run = httpx.get(f"{url}/api/sweeps/{sweep_id}").json()["jobs"][0]["id"]
    httpx.post(f"{url}/api/jobs/{first_run}/metrics", json={"rows": step_rows(2, start=2)})
    tab.wait_for_selector('[data-chart="pg_loss"][data-points="10"]', timeout=15_000)
    for _ in range(50):  # the response event may reach Python after the page drew it
        if increments:
            break
        tab.wait_for_timeout(100)
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


def session_row(folder: Path, session_id: str, status: str, model: str, created_at: float,
                **values: object) -> Run:
    """A session's run row as the controller stores it (routes_sessions.py: session_row),
    ``status`` in a session's words (run_states.py); ``values`` override."""
    return Run(**{
        "id": session_id, "kind": "session", "name": "session",
        "status": SESSION_STATUSES[status][0], "mode": "sample_mean", "source": "controller",
        "num_steps": 1, "overrides": "[]", "model": model, "world_size": 1,
        "config_submitted": "{}", "config_resolved": "{}",
        "output_dir": str(folder / session_id), "ray_submission_id": f"session-{session_id}",
        "step": 0, "tokens": 0, "loss": None, "pending_calls": 0,
        "created_at": created_at, "updated_at": created_at, **values})


SESSION_CELLS = """rows => rows.map(r => [...r.cells].slice(0, 7).map(c => c.textContent))"""
"""A session row's cells but the (locale's) time."""


def test_job_list_lists_training_sessions(page, tmp_path: Path) -> None:
    """No session: the table says how to start one; two stored sessions show on the next
    refresh, newest first, with their step, tokens and loss (none yet: "–"), the failed
    one's error on its status; values are text, never markup. A queued one says why it
    waits under its status."""
    tab, errors = page
    backend = FakeBackend()
    app = create_app(make_settings(tmp_path), backend=backend)
    store = app.state.controller.store
    with serve_in_thread(app) as url:
        tab.goto(url)
        tab.wait_for_selector("#sessions td.muted", timeout=15_000)
        assert tab.locator("#sessions tbody").inner_text().strip() == \
            "No training sessions: POST /api/sessions (docs/training-api.md)"
        ready = session_row(tmp_path, "ready1", "ready", "Qwen/Qwen3-0.6B", 2000.0, world_size=2,
                            step=12, tokens=34567, loss=0.69314, pending_calls=1)
        backend.submit(ready.ray_submission_id, "session", {}, {})  # running: stays ready
        store.add_run(ready)
        store.add_run(session_row(tmp_path, "failed1", "failed", "<i>tiny</i>", 1000.0,
                                      error="ValueError: <b>boom</b>"))
        tab.wait_for_selector('tr[data-session="failed1"]', timeout=15_000)  # the 3 s poll
        assert tab.eval_on_selector_all("#sessions tbody tr", SESSION_CELLS) == [
            ["ready1", "ready", "Qwen/Qwen3-0.6B", "2", "12", "34567", "0.693"],
            ["failed1", "failed", "<i>tiny</i>", "1", "0", "0", "–"]]
        assert tab.locator("#sessions i").count() == 0
        failed_status = tab.locator('tr[data-session="failed1"] td').nth(1)
        assert failed_status.get_attribute("title") == "ValueError: <b>boom</b>"
        assert tab.locator('tr[data-session="ready1"] td').nth(1).get_attribute("title") \
            is None
        tab.screenshot(path=str(tmp_path / "sessions.png"), full_page=True)
        backend.usage = {"CPU": (2.0, 2.0)}  # a full cluster: a new session waits
        queued = httpx.post(f"{url}/api/sessions",
                            json={"config": {"rollout": {"model": "tiny"}}}).json()
        assert queued["status"] == "queued" and queued["waiting"]
        reason = tab.wait_for_selector(f'tr[data-session="{queued["id"]}"] p.waiting',
                                       timeout=15_000)  # as a job's page shows it
        assert reason.inner_text() == queued["waiting"]
    assert not errors


@pytest.mark.slow
def test_axes_fit_their_data(page, tmp_path: Path) -> None:
    """An all-zero series draws on a small range around 0 (uPlot alone puts 0 on 0–100),
    a fraction's axis stays inside [0, 1], and a varying series gets a range near its
    values."""
    tab, errors = page
    rows = step_rows(10)
    for row in rows:  # on-policy steps: nothing clipped, no KL, no padding
        row["metrics"] |= {"kl": 0.0, "padding_fraction": 0.0, "clip_fraction/min": 0.0}
    app = create_app(make_settings(tmp_path), backend=FakeBackend())
    with serve_in_thread(app) as url, httpx.Client(base_url=url) as http:
        config = (ROOT / "configs" / "demo.yaml").read_text()
        job = http.post("/api/jobs", json={"config_yaml": config, "overrides": [
            *DEMO_OVERRIDES, "num_steps=10"]}).json()
        assert http.post(f"/api/jobs/{job['id']}/metrics", json={"rows": rows}).is_success
        tab.goto(f"{url}/jobs/{job['id']}")
        tab.wait_for_selector('[data-chart="kl"][data-points="10"]', timeout=15_000)

        def y_axis(chart: str) -> tuple[float, float]:
            card = f'[data-chart="{chart}"]'
            return (float(tab.get_attribute(card, "data-y-min") or "nan"),
                    float(tab.get_attribute(card, "data-y-max") or "nan"))

        low, high = y_axis("kl")
        assert low < 0 < high and high - low <= 1, (low, high)
        assert y_axis("padding_fraction") == (0, pytest.approx(0.1))
        low, high = y_axis("clip_fraction")  # max 0.2 → 0.02, mean 0.1 → 0.01, min 0
        assert low == 0 and 0.2 <= high <= 0.3, (low, high)
        low, high = y_axis("entropy")  # 3.0 → 2.91
        assert 2.5 <= low <= 2.91 and 3.0 <= high <= 3.5, (low, high)
        assert tab.evaluate("[fitRange(0, 0), fitRange(0, 0, [0, 1]), fitRange(2, 2),"
                            " fitRange(null, null, [0, 1]), fitRange(-1, 3, [0, 1])]") == [
            [-0.1, 0.1], [0, 0.1], [1.8, 2.2], [0, 1], [0, 1]]
    assert not errors


# The per-token view's scales (samples.js: TOKEN_QUANTITIES), as its legend documents
# them: a value v on a scale whose end m is the largest |v| over the policy's tokens is
# white mixed toward its end colour by |v| / m — negative ends low, positive high.
TOKEN_SCALES = {"advantage": ((202, 0, 32), (5, 113, 176)),
                "gap": ((230, 97, 1), (94, 60, 153)),
                "entropy": (None, (166, 54, 3))}
TOKEN_COLORS = """spans => spans.map(s => [s.dataset.i, getComputedStyle(s).backgroundColor,
  s.classList.contains("observation")])"""


def token_values(tokens: dict, quantity: str) -> list[float | None]:
    """Each token's value of ``quantity`` (None on observations), from the record."""
    if quantity == "gap":
        return [None if t is None or e is None else t - e for t, e in zip(
            tokens["trainer_log_prob"], tokens["engine_log_prob"], strict=True)]
    return [None if o else v for v, o in zip(tokens[quantity], tokens["observation"],
                                             strict=True)]


def expected_colors(tokens: dict, quantity: str) -> list[str | None]:
    """The background each policy token should have (None: an observation's)."""
    values = token_values(tokens, quantity)
    top = max(abs(v) for v in values if v is not None)
    low, high = TOKEN_SCALES[quantity]
    colors: list[str | None] = []
    for value in values:
        if value is None:
            colors.append(None)
            continue
        end = low if value < 0 and low is not None else high
        mixed = [int(255 + (c - 255) * abs(value) / top + 0.5) for c in end]
        colors.append(f"rgb({mixed[0]}, {mixed[1]}, {mixed[2]})")
    return colors


def test_a_sample_opens_into_its_tokens_coloured_by_the_chosen_quantity(
        page, tmp_path: Path) -> None:
    """A plain job (no critic, no environment) whose samples carry their per-token record
    (rollout/sample_record.SampleTokens): its page shows the loss, rewards and system
    sections only; a sample opens into its 13 tokens, each coloured as the legend's scale
    says by advantage, then by the trainer-vs-engine gap, then by entropy, the multi-turn
    observation boxed apart and never coloured, newlines and lone spaces visible, markup
    shown as text. TALLY_UPDATE_SCREENSHOTS=1 copies the view's screenshot to
    docs/images/per-token-view.png (the docs show it)."""
    tab, errors = page
    app = create_app(make_settings(tmp_path), backend=FakeBackend())
    with serve_in_thread(app) as url, httpx.Client(base_url=url) as http:
        config = (ROOT / "configs" / "demo.yaml").read_text()
        job = http.post("/api/jobs", json={"config_yaml": config, "overrides": [
            *DEMO_OVERRIDES, "num_steps=4"]}).json()
        path = Path(job["output_dir"]) / SAMPLES_FILE
        append_samples(path, sample_records(0, count=4, tokens=True))
        assert http.post(f"/api/jobs/{job['id']}/metrics",
                         json={"rows": step_rows(1)}).is_success
        tokens = read_samples(path, step=0)[0]["tokens"]  # sample 0: advantage 0.25
        assert tokens == sample_tokens(0.25)
        tab.set_viewport_size({"width": 1200, "height": 900})
        tab.goto(f"{url}/jobs/{job['id']}")
        tab.wait_for_selector('#samples tbody tr[data-index="0"]', timeout=15_000)
        assert [s[0] for s in tab.eval_on_selector_all("[data-section]", SHOWN_SECTIONS)] \
            == ["loss", "rewards", "system"]
        assert tab.locator('[data-section="critic"]').is_hidden()
        assert tab.locator('[data-section="environment"]').is_hidden()
        assert tab.locator("#samples tr.tokens-row").count() == 0  # the table alone first
        tab.click('#samples tbody tr[data-index="0"] td:nth-child(8)')
        view = tab.wait_for_selector(".tokens-row .token-view", timeout=15_000)
        spans = ".tokens-row .tok[data-i]"
        assert tab.locator(spans).count() == len(tokens["text"]) == 13
        assert tab.get_attribute(".tokens-row .token-view", "data-quantity") == "advantage"

        def colours(quantity: str) -> list[str | None]:
            shown = tab.eval_on_selector_all(spans, TOKEN_COLORS)
            assert [int(i) for i, _, _ in shown] == list(range(13))
            assert [o for _, _, o in shown] == tokens["observation"]
            return [None if observed else colour for _, colour, observed in shown]

        by_advantage = colours("advantage")
        assert by_advantage == expected_colors(tokens, "advantage")
        values = token_values(tokens, "advantage")
        assert values[0] > 0 > values[12]  # a positive and a negative token: blue, red
        assert (by_advantage[0], by_advantage[12]) == ("rgb(5, 113, 176)", "rgb(202, 0, 32)")
        assert float(tab.get_attribute(".tokens-row .token-legend", "data-scale")) == 0.75
        assert tab.locator(".tokens-row .token-legend-ticks span").all_inner_texts() == [
            "-0.750", "0.000", "0.750"]
        # the observation: boxed, labelled, grey whatever the quantity
        run = tab.locator(".tokens-row .observation-run")
        assert run.count() == 1 and run.locator(".observation-label").inner_text().lower() \
            == "observation"
        assert run.locator(".tok").evaluate_all("ss => ss.map(s => s.dataset.i)") == ["4", "5"]
        grey = tab.eval_on_selector_all(".tokens-row .observation-run .tok",
                                        "ss => ss.map(s => getComputedStyle(s).backgroundColor)")
        assert grey == ["rgb(236, 238, 242)"] * 2
        # text as written, whitespace visible, markup never drawn
        shown = tab.eval_on_selector_all(spans, "ss => ss.map(s => s.textContent)")
        assert shown[3] == "⏎\n" and shown[10] == "·" and shown[11] == "<b>4</b>"
        assert shown[4] == "<tool>2+2</tool>" and shown[12] == "</s>"
        assert tab.locator(".tokens-row b, .tokens-row tool").count() == 0
        title = tab.get_attribute('.tokens-row .tok[data-i="7"]', "title") or ""
        assert re.search(r'token 7: " 4"\nadvantage -0\.1250\n.*gap 0\.0625\n'
                         r"entropy 0\.8750", title, re.S), title
        assert "observation" in (tab.get_attribute('.tokens-row .tok[data-i="4"]', "title")
                                 or "")
        for quantity in ("gap", "entropy"):
            tab.select_option(".tokens-row .token-quantity", quantity)
            tab.wait_for_selector(f'.tokens-row .token-view[data-quantity="{quantity}"]')
            now = colours(quantity)
            assert now == expected_colors(tokens, quantity), quantity
            assert now != by_advantage
        assert tab.locator(".tokens-row .token-legend-ticks span").all_inner_texts() == [
            "0.000", "1.500"]  # entropy: sequential, 0 to its largest
        tab.select_option(".tokens-row .token-quantity", "advantage")
        tab.wait_for_selector('.tokens-row .token-view[data-quantity="advantage"]')
        assert view.is_visible()
        shot = tmp_path / "per-token-view.png"
        tab.locator(".samples-card").screenshot(path=str(shot))
        if os.environ.get("TALLY_UPDATE_SCREENSHOTS") == "1":
            shutil.copyfile(shot, ROOT / "docs" / "images" / "per-token-view.png")
        tab.click('#samples tbody tr[data-index="0"] td:nth-child(8)')  # closes again
        assert tab.locator("#samples tr.tokens-row").count() == 0
    assert not errors
