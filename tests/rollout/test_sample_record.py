"""SampleRecord: the one spelling of a samples.jsonl line. A record written by the driver
is byte for byte the line samples.jsonl always held, reads back to the same record, and
the controller's schema of a line takes every field of it."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch

from rollout.batch import RolloutBatch
from rollout.sample_record import SampleRecord
from services.controller.schemas import SampleOut
from services.driver.checkpoint import DriverState, load_driver_state, save_driver_state
from services.driver.samples import append_samples, read_samples, with_advantages

TRAINING = SampleRecord(step=3, index=1, group=7, prompt="<bos>cp ab=",
                        record_prompt=[{"role": "user", "content": "cp ab="}], response="ab",
                        label="ab", reward=0.5, rewards={"exact": 1.0, "rm": 0.0},
                        response_tokens=2)
EVALUATION = SampleRecord(step=4, greedy=False, group=0, prompt="p", record_prompt="p",
                          response="r", label=None, reward=1.0, rewards={},
                          response_tokens=1)

TRAINING_LINE = ('{"step": 3, "index": 1, "group": 7, "prompt": "<bos>cp ab=", '
                 '"record_prompt": [{"role": "user", "content": "cp ab="}], "response": "ab", '
                 '"label": "ab", "reward": 0.5, "rewards": {"exact": 1.0, "rm": 0.0}, '
                 '"response_tokens": 2, "advantage": -0.25}')
EVALUATION_LINE = ('{"step": 4, "eval": true, "greedy": false, "group": 0, "prompt": "p", '
                   '"record_prompt": "p", "response": "r", "label": null, "reward": 1.0, '
                   '"rewards": {}, "response_tokens": 1}')


def test_records_write_the_lines_samples_jsonl_always_held_and_read_back(tmp_path: Path
                                                                           ) -> None:
    path = tmp_path / "samples.jsonl"
    trained = dataclasses.replace(TRAINING, advantage=-0.25)
    append_samples(path, [trained, EVALUATION])
    assert path.read_text().splitlines() == [TRAINING_LINE, EVALUATION_LINE]
    rows = read_samples(path)
    assert [SampleRecord.from_json(row) for row in rows] == [trained, EVALUATION]
    assert read_samples(path, evaluation=True) == [json.loads(EVALUATION_LINE)]
    for record, row in zip([trained, EVALUATION], rows, strict=True):  # what the API serves
        served = SampleOut.model_validate(row).model_dump(exclude_unset=True)
        assert served == record.to_json()
        assert record.rewards == row["rewards"]


def test_a_non_finite_reward_is_written_as_null(tmp_path: Path) -> None:
    path = tmp_path / "samples.jsonl"
    append_samples(path, [dataclasses.replace(TRAINING, reward=float("nan"),
                                              rewards={"rm": float("inf")})])
    row = json.loads(path.read_text())
    assert row["reward"] is None and row["rewards"] == {"rm": None}


def _batch(records: list[SampleRecord]) -> RolloutBatch:
    """Two samples: one of 2 response tokens with advantages 1 and 2 (then the
    estimator's per-token values), one whose loss mask is empty."""
    batch = RolloutBatch.from_samples(
        prompt_ids=[[5, 6], [5, 6]], response_ids=[[7, 8], [9]],
        response_log_probs=[[-0.1, -0.2], [-0.3]], rewards=[1.0, 0.0],
        advantages=[0.0, 0.0], group_index=[0, 0], samples_per_prompt=2, pad_token_id=0,
        response_masks=[[1, 1], [0]], samples=records)
    advantages = torch.zeros_like(batch.advantages)
    advantages[0, 2:4] = torch.tensor([1.0, 2.0])
    return dataclasses.replace(batch, advantages=advantages)


def test_the_driver_adds_each_samples_mean_advantage_over_its_valid_tokens() -> None:
    first = dataclasses.replace(TRAINING, index=0)
    second = dataclasses.replace(TRAINING, index=1, response_tokens=1)
    out = with_advantages(_batch([first, second]))
    assert [r.advantage for r in out] == [1.5, 0.0]  # (1 + 2) / 2; no valid token: 0
    assert list(out[0].to_json())[-1] == "advantage"  # the last key, as before
    assert [dataclasses.replace(r, advantage=None) for r in out] == [first, second]


def test_a_rollout_in_flight_keeps_its_records_through_a_driver_checkpoint(tmp_path: Path
                                                                             ) -> None:
    batch = _batch([dataclasses.replace(TRAINING, index=0)])
    save_driver_state(tmp_path, DriverState(2, {"cursor": 1}, {3: batch}))
    restored = load_driver_state(tmp_path).in_flight[3]
    assert restored.samples == batch.samples
    assert isinstance(restored.samples[0], SampleRecord)
