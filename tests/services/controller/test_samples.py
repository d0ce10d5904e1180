"""``GET /api/jobs/{id}/samples`` on a real app (Ray faked, as in test_controller_api.py):
the job folder's samples.jsonl as the driver's own writer appends it, filtered by step and
kind, bounded, followed as it grows, torn and truncated (a resume) and never read outside
the allowed roots. tests/services/cli/test_samples.py reads a real job's file."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from rollout.sample_record import SampleRecord
from services.controller.job_samples import NO_FILE, OUTSIDE
from services.driver.run_dir import SAMPLES_FILE
from services.driver.samples import append_samples, read_samples
from services.driver.sinks import truncate_after
from tests.services.controller.fakes import (
    DEMO,
    DEMO_OVERRIDES,
    api_client,
    eval_records,
    sample_records,
)


@pytest.fixture
def api(tmp_path: Path):
    return api_client(tmp_path)


def submit(api: TestClient) -> dict:
    response = api.post("/api/jobs", json={"config_yaml": DEMO, "overrides": DEMO_OVERRIDES})
    assert response.status_code == 201, response.text
    return response.json()


def samples(api: TestClient, job_id: str, **params: object) -> dict:
    response = api.get(f"/api/jobs/{job_id}/samples", params=params)
    assert response.status_code == 200, response.text
    return response.json()


def test_an_unknown_job_is_404_and_a_job_without_samples_an_empty_list(api: TestClient) -> None:
    assert api.get("/api/jobs/nope/samples").status_code == 404
    job = submit(api)
    assert samples(api, job["id"]) == {"job_id": job["id"], "steps": [], "eval_steps": [],
                                       "total": 0, "samples": [], "note": NO_FILE}


def test_samples_by_step_and_kind_as_the_driver_wrote_them(api: TestClient) -> None:
    job = submit(api)
    path = Path(job["output_dir"]) / SAMPLES_FILE
    for step in range(3):
        append_samples(path, sample_records(step))
        if step % 2 == 0:
            append_samples(path, eval_records(step))
    whole = samples(api, job["id"])
    assert (whole["steps"], whole["eval_steps"], whole["total"]) == ([0, 1, 2], [0, 2], 13)
    assert whole["samples"] == read_samples(path)  # every field, as written
    one = samples(api, job["id"], step=1)
    assert one["samples"] == read_samples(path, step=1) and one["total"] == 3
    assert samples(api, job["id"], step=2, eval="false")["samples"] == sample_records(2)
    assert samples(api, job["id"], step=2, eval="true")["samples"] == eval_records(2)
    assert samples(api, job["id"], eval="true")["samples"] == eval_records(0) + eval_records(2)
    newest = samples(api, job["id"], limit=4)  # no step: the newest rows
    assert newest["samples"] == read_samples(path)[-4:] and newest["total"] == 13
    first = samples(api, job["id"], step=0, limit=2)  # a step: its first rows
    assert first["samples"] == sample_records(0)[:2] and first["total"] == 5
    absent = samples(api, job["id"], step=7)
    assert absent["samples"] == [] and absent["steps"] == [0, 1, 2]


@pytest.mark.parametrize("params", [{"limit": 0}, {"limit": 1001}, {"step": -1},
                                    {"eval": "maybe"}])
def test_reads_are_bounded(api: TestClient, params: dict) -> None:
    job = submit(api)
    response = api.get(f"/api/jobs/{job['id']}/samples", params=params)
    assert response.status_code == 422, response.text
    assert response.json()["errors"][0]["field"].startswith("query.")


def test_at_most_a_thousand_samples_come_back(api: TestClient) -> None:
    job = submit(api)
    append_samples(Path(job["output_dir"]) / SAMPLES_FILE, sample_records(0, count=1200))
    out = samples(api, job["id"], step=0, limit=1000)
    assert (len(out["samples"]), out["total"]) == (1000, 1200)
    assert len(samples(api, job["id"])["samples"]) == 200  # the default limit


def test_a_growing_torn_and_truncated_file_is_followed(api: TestClient) -> None:
    job = submit(api)
    path = Path(job["output_dir"]) / SAMPLES_FILE
    append_samples(path, sample_records(0))
    assert samples(api, job["id"])["steps"] == [0]
    torn = json.dumps(sample_records(1)[0])
    with path.open("a", encoding="utf-8") as out:  # a line the driver is still writing
        out.write(torn[:20])
    assert samples(api, job["id"])["steps"] == [0]
    with path.open("a", encoding="utf-8") as out:
        out.write(torn[20:] + "\n" + "not json\n")
    assert samples(api, job["id"], step=1)["samples"] == sample_records(1)[:1]
    # a resume from step 0's checkpoint keeps step 0's rows and writes step 1 again
    truncate_after(path, 0)
    append_samples(path, sample_records(1, count=4))
    again = samples(api, job["id"])
    assert again["steps"] == [0, 1]
    assert again["samples"] == sample_records(0) + sample_records(1, count=4)
    rewritten = [*sample_records(5, count=8), {"step": "x"}, [1]]  # in place, not a sample twice
    path.write_text("".join(json.dumps(r) + "\n" for r in rewritten))
    assert samples(api, job["id"])["samples"] == sample_records(5, count=8)


def test_a_file_outside_the_roots_is_not_read(api: TestClient, tmp_path: Path) -> None:
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    append_samples(outside / SAMPLES_FILE, sample_records(0))
    config = json.loads(api.get(f"/api/jobs/{submit(api)['id']}").text)["config_resolved"]
    job = api.post("/api/jobs/register", json={"config": config,
                                               "output_dir": str(outside)}).json()
    out = samples(api, job["id"])
    assert (out["samples"], out["note"]) == ([], OUTSIDE)
    inside = submit(api)  # a link in a job folder to a file outside is not followed either
    (Path(inside["output_dir"]) / SAMPLES_FILE).symlink_to(outside / SAMPLES_FILE)
    refused = api.get(f"/api/jobs/{inside['id']}/samples")  # a link: refused, naming it
    assert refused.status_code == 409 and "samples.jsonl" in refused.json()["detail"]
    assert "copy 00=" not in refused.text


def test_an_unscored_judged_sample_comes_back_with_its_raw_answer(api: TestClient) -> None:
    job = submit(api)
    path = Path(job["output_dir"]) / SAMPLES_FILE
    judged = [{**record, "reward": None, "rewards": {"exact_match": 1.0, "judge": None},
               "judge_answers": {"judge": "hard to say"}} for record in sample_records(0, 1)]
    append_samples(path, judged)
    [sample] = samples(api, job["id"], step=0)["samples"]
    assert sample["reward"] is None and sample["rewards"]["judge"] is None
    assert sample["judge_answers"] == {"judge": "hard to say"}


def test_a_samples_tokens_come_only_when_asked_and_one_sample_by_its_row(
        api: TestClient) -> None:
    """The table's read leaves each per-token record out (``has_tokens`` says there is
    one); ``tokens=true`` sends it as samples.jsonl holds it (read back by the format's
    own reader, rollout/sample_record.py); ``index`` picks one training sample of a step."""
    job = submit(api)
    path = Path(job["output_dir"]) / SAMPLES_FILE
    for step in range(2):
        append_samples(path, sample_records(step, count=4, tokens=True))
        append_samples(path, eval_records(step))
    written = read_samples(path, step=1, evaluation=False)
    assert len(written) == 4 and all(len(r["tokens"]["text"]) == 13 for r in written)
    light = samples(api, job["id"], step=1, eval="false")["samples"]
    assert light == [{**{k: v for k, v in r.items() if k != "tokens"}, "has_tokens": True}
                     for r in written]
    full = samples(api, job["id"], step=1, eval="false", tokens="true")["samples"]
    assert [s["tokens"] for s in full] == [
        SampleRecord.from_json(r).tokens.to_json() for r in written]  # type: ignore[union-attr]
    assert all(s["has_tokens"] for s in full)
    one = samples(api, job["id"], step=1, index=2, tokens="true")
    assert (one["samples"], one["total"]) == ([{**written[2], "has_tokens": True}], 1)
    assert samples(api, job["id"], step=0, index=2)["samples"][0]["advantage"] == 0.25 - 2
    assert samples(api, job["id"], step=1, index=9)["samples"] == []
    # evaluation samples have no batch row: never an index's
    assert samples(api, job["id"], step=1, eval="true", index=0)["samples"] == []
    refused = api.get(f"/api/jobs/{job['id']}/samples", params={"index": 2})
    assert refused.status_code == 422 and refused.json()["errors"][0]["field"] == "query.index"
    # eval samples (no tokens) say nothing about tokens
    assert all("has_tokens" not in s and "tokens" not in s for s in samples(
        api, job["id"], step=1, eval="true", tokens="true")["samples"])


def test_a_per_token_record_that_does_not_hold_is_left_out_not_its_sample(
        api: TestClient) -> None:
    job = submit(api)
    path = Path(job["output_dir"]) / SAMPLES_FILE
    good, short, text = sample_records(0, count=3, tokens=True)
    short["tokens"]["entropy"] = short["tokens"]["entropy"][:-1]  # one entry missing
    text["tokens"]["text"][0] = 7  # not a token's text
    append_samples(path, [good, short, text])
    out = samples(api, job["id"], step=0, tokens="true")["samples"]
    assert [("tokens" in s, s.get("has_tokens")) for s in out] == [
        (True, True), (False, None), (False, None)]
    assert [s["response"] for s in out] == ["00", "01", "02"]  # the samples themselves stay
    with pytest.raises(ValueError, match=r"tokens\.entropy"):  # the format's reader agrees
        SampleRecord.from_json(short)
