"""A training session's request checks (each problem named ``data[i].field[t]``) and the
RolloutBatch a call's data becomes (services/sessions/requests.py)."""

from __future__ import annotations

import pytest
import torch
from pydantic import ValidationError

from rollout.problems import Problem
from services.sessions.requests import (
    Aggregation,
    Datum,
    ForwardBackward,
    call_batch,
    check_data,
    target_log_probs,
)

VOCAB = 50


def make_datum(**changes: object) -> dict:
    """A valid datum: a prompt of two tokens, a response of three with a hole (an
    observation) at target 3, one advantage on the weighted targets."""
    fields = {"tokens": [11, 12, 13, 14, 15], "targets": [12, 13, 14, 15, 16],
              "weights": [0.0, 1.0, 1.0, 0.0, 1.0],
              "advantages": [0.0, 0.75, 0.75, -9.0, 0.75],
              "logprobs": [-0.1, -0.2, -0.3, -0.4, -0.5]}
    return {**fields, **changes}


def request(*data: dict, loss_fn: str = "ppo", mode: str = "sample_mean") -> ForwardBackward:
    aggregation = {"mode": mode, **({"divisor": 4.0} if mode == "constant" else {})}
    return ForwardBackward.model_validate({"data": list(data), "loss_fn": loss_fn,
                                           "aggregation": aggregation})


def fields_of(req: ForwardBackward, earlier_groups: set[int] = frozenset()) -> list[str]:
    return [p.field for p in check_data(req, VOCAB, earlier_groups)]


@pytest.mark.parametrize("loss_fn", ["cross_entropy", "importance_sampling", "ppo"])
@pytest.mark.parametrize("mode", ["sample_mean", "token_mean", "constant"])
def test_valid_data_has_no_problem(loss_fn: str, mode: str) -> None:
    req = request(make_datum(), make_datum(tokens=[3, 4], targets=[4, 49], weights=[1.0, 1.0],
                                           advantages=[2.0, 2.0], logprobs=[-1.0, -2.0]),
                  loss_fn=loss_fn, mode=mode)
    assert check_data(req, VOCAB) == []


@pytest.mark.parametrize("field", ["targets", "weights", "advantages", "logprobs"])
def test_a_length_other_than_the_tokens_names_the_field(field: str) -> None:
    short = make_datum()
    short[field] = short[field][:-1]
    problems = check_data(request(make_datum(), short), VOCAB)
    assert problems == [Problem(f"data[1].{field}", "has 4 values; tokens has 5")]


def test_token_ids_outside_the_vocabulary_name_their_position() -> None:
    # tokens[0] is no target of anything: only it is wrong
    assert fields_of(request(make_datum(tokens=[-1, 12, 13, 14, 15]))) == ["data[0].tokens[0]"]
    # the last target is free of the shift rule: only it is wrong
    assert fields_of(request(make_datum(targets=[12, 13, 14, 15, VOCAB]))) == [
        "data[0].targets[4]"]
    # a token and the target before it, both out of the vocabulary (and still shifted)
    both = make_datum(tokens=[11, 12, 13, VOCAB, 15], targets=[12, 13, VOCAB, 15, 16])
    assert fields_of(request(make_datum(), both)) == ["data[1].tokens[3]",
                                                      "data[1].targets[2]"]


def test_a_weight_outside_0_to_1_names_its_position_and_a_fraction_is_accepted() -> None:
    assert check_data(request(make_datum(weights=[0.0, 1.0, 0.5, 0.0, 0.25])), VOCAB) == []
    for bad in (1.5, -0.25, float("nan"), float("inf")):
        problems = check_data(request(make_datum(weights=[0.0, 1.0, bad, 0.0, 1.0])), VOCAB)
        assert [p.field for p in problems] == ["data[0].weights[2]"]
        assert "in [0, 1]" in problems[0].message


def test_targets_that_are_not_the_next_tokens_name_the_first_wrong_one() -> None:
    problems = check_data(request(make_datum(targets=[12, 13, 7, 8, 16])), VOCAB)
    assert problems == [Problem("data[0].targets[2]", "is 7 but tokens[3] is 14: targets are "
                                "the sequence's next tokens")]


@pytest.mark.parametrize("loss_fn", ["importance_sampling", "ppo"])
def test_advantages_and_logprobs_are_required_by_the_losses_that_read_them(
        loss_fn: str) -> None:
    bare = make_datum(advantages=None, logprobs=None)
    assert fields_of(request(make_datum(), bare, loss_fn=loss_fn)) == [
        "data[1].advantages", "data[1].logprobs"]
    assert fields_of(request(make_datum(), bare, loss_fn="cross_entropy")) == []


def test_advantages_may_differ_per_token_and_a_wrong_count_names_the_field() -> None:
    per_token = make_datum(advantages=[0.0, 0.75, 0.5, -1.0, 2.0])
    assert check_data(request(make_datum(), per_token), VOCAB) == []
    short = make_datum(advantages=[0.75, 0.5])
    assert check_data(request(make_datum(), short), VOCAB) == [
        Problem("data[1].advantages", "has 2 values; tokens has 5")]


def grouped(*groups: int | None) -> list[dict]:
    return [make_datum(group=g) for g in groups]


def test_prompt_mean_groups_are_named_by_their_first_datum() -> None:
    assert fields_of(request(*grouped(3, 3, 1, 1), mode="prompt_mean")) == []
    assert fields_of(request(*grouped(3, 3, None, 1), mode="prompt_mean")) == [
        "data[2].group"]
    assert fields_of(request(*grouped(3, None), mode="token_mean")) == []  # only prompt_mean
    earlier = check_data(request(*grouped(3, 3, 1, 1), mode="prompt_mean"), VOCAB, {1, 8})
    assert [p.field for p in earlier] == ["data[2].group"]
    assert "group 1 was in an earlier forward_backward call" in earlier[0].message
    uneven = check_data(request(*grouped(4, 4, 6, 9, 9), mode="prompt_mean"), VOCAB)
    assert uneven == [Problem("data[2].group", "group 6 has 1 samples in this call, other "
                              "groups have 2; under prompt_mean every group is whole within "
                              "one call")]


@pytest.mark.parametrize("field", ["advantages", "logprobs"])
def test_non_finite_values_are_problems_naming_the_field(field: str) -> None:
    datum = make_datum(weights=[0.0, 0.0, 0.0, 0.0, 1.0])  # one weighted target
    datum[field] = [*datum[field][:4], float("nan")]
    with pytest.raises(ValueError, match="contains NaN or inf"):  # what the session hits
        call_batch([Datum.model_validate(datum)], "sample_mean")
    assert f"data[0].{field}[4]" in fields_of(request(datum))  # a 422 before the batch


def batch_data() -> list[Datum]:
    return [Datum.model_validate(make_datum(group=7)),
            Datum.model_validate(make_datum(tokens=[3, 4], targets=[4, 5], weights=[1.0, 1.0],
                                            advantages=[-2.0, -2.0], logprobs=[-1.5, -2.5],
                                            group=7)),
            Datum.model_validate(make_datum(tokens=[8, 9, 10], targets=[9, 10, 11],
                                            weights=[0.0, 0.0, 0.0], advantages=None,
                                            logprobs=None, group=2)),
            Datum.model_validate(make_datum(tokens=[20], targets=[21], weights=[1.0],
                                            advantages=[1.0], logprobs=[-0.7], group=2))]


@pytest.mark.parametrize("full_mask", [False, True])
def test_a_datum_becomes_one_sample_with_target_t_at_position_t_plus_1(full_mask: bool
                                                                      ) -> None:
    data = batch_data()
    batch = call_batch(data, "sample_mean", pad_token_id=99, full_mask=full_mask)
    width = max(len(d.tokens) for d in data) + 1
    assert tuple(batch.input_ids.shape) == (len(data), width)
    for i, d in enumerate(data):
        size = len(d.tokens)
        assert batch.input_ids[i].tolist() == [*d.tokens, d.targets[-1]] + [99] * (
            width - size - 1)
        weights = [1.0] * size if full_mask else d.weights
        assert batch.loss_mask[i].tolist() == [0.0, *weights] + [0.0] * (width - size - 1)
        logprobs = d.logprobs or [0.0] * size
        sampled = [lp if w else 0.0 for lp, w in zip(logprobs, weights, strict=True)]
        torch.testing.assert_close(batch.rollout_log_probs[i],
                                   torch.tensor([0.0, *sampled] + [0.0] * (width - size - 1)))
        first = next((t + 1 for t, w in enumerate(weights) if w), size)
        assert int(batch.prompt_lengths[i]) == first
        assert int(batch.prompt_lengths[i] + batch.response_lengths[i]) == size + 1
    # each target's advantage at position t + 1, over the response (from the first weighted
    # target on: make_datum's 0.0 before it is the prompt's); 0 without advantages
    expected = [[0.0, 0.0, 0.75, 0.75, -9.0, 0.75], [0.0, -2.0, -2.0, 0.0, 0.0, 0.0],
                [0.0] * 6, [0.0, 1.0, 0.0, 0.0, 0.0, 0.0]]
    assert batch.advantages.tolist() == ([[0.0] * 6] * 4 if full_mask else expected)


def test_groups_are_dense_per_call_under_prompt_mean_only() -> None:
    data = batch_data()
    batch = call_batch(data, "prompt_mean")
    assert (batch.group_index.tolist(), batch.samples_per_prompt) == ([0, 0, 1, 1], 2)
    for mode, full_mask in (("sample_mean", False), ("token_mean", False),
                            ("constant", False), ("prompt_mean", True)):
        batch = call_batch(data, mode, full_mask=full_mask)
        assert (batch.group_index.tolist(), batch.samples_per_prompt) == ([0, 1, 2, 3], 1)


def test_target_log_probs_read_position_t_plus_1() -> None:
    data = batch_data()
    batch = call_batch(data, "token_mean", full_mask=True)
    num_samples, width = batch.input_ids.shape
    # a distinct value per (sample, position): 100·i + position
    log_probs = (100 * torch.arange(num_samples)[:, None] + torch.arange(width)).double()
    read = target_log_probs(log_probs, data)
    assert read == [[100.0 * i + t + 1 for t in range(len(d.tokens))]
                    for i, d in enumerate(data)]


def test_models_refuse_unknown_fields_and_a_misplaced_divisor() -> None:
    with pytest.raises(ValidationError, match="mask"):
        Datum.model_validate(make_datum(mask=[1, 1, 1, 1, 1]))
    with pytest.raises(ValidationError, match="loss"):
        ForwardBackward.model_validate({"data": [make_datum()], "loss": "ppo"})
    with pytest.raises(ValidationError, match="divisor: mode constant needs a divisor"):
        Aggregation(mode="constant")
    with pytest.raises(ValidationError, match="divisor: only mode constant takes one"):
        Aggregation(mode="token_mean", divisor=2.0)
    assert Aggregation(mode="constant", divisor=2.0).divisor == 2.0


def test_the_client_datum_carries_per_token_advantages_and_fractional_weights() -> None:
    from services.clients.training import datum

    item = datum([5, 6], [7, 8, 9], advantage=[0.5, -1.0, 2.0], logprobs=[-1.0, -2.0, -3.0],
                 weights=[1.0, 0.25, 0.5])
    assert item["weights"] == [0.0, 1.0, 0.25, 0.5]
    assert item["advantages"] == [0.0, 0.5, -1.0, 2.0]
    assert check_data(request(item), VOCAB) == []
    batch = call_batch([Datum.model_validate(item)], "token_mean")
    assert batch.loss_mask.tolist() == [[0.0, 0.0, 1.0, 0.25, 0.5]]
    assert batch.advantages.tolist() == [[0.0, 0.0, 0.5, -1.0, 2.0]]
    assert batch.sample_token_counts.tolist() == [1.75]  # M = Σ m, fractions included
    assert datum([5, 6], [7, 8], advantage=0.5)["advantages"] == [0.5, 0.5, 0.5]
    with pytest.raises(ValueError, match="2 advantage values for 3 response tokens"):
        datum([5], [7, 8, 9], advantage=[1.0, 2.0])


def test_policy_loss_is_loss_fn_under_the_jobs_name_and_both_must_agree() -> None:
    datum = make_datum()
    named = ForwardBackward.model_validate({"data": [datum], "policy_loss": "cispo"})
    assert named.loss_fn == "cispo"
    same = ForwardBackward.model_validate({"data": [datum], "policy_loss": "gspo",
                                           "loss_fn": "gspo"})
    assert same.loss_fn == "gspo"
    with pytest.raises(ValidationError, match="policy_loss: is gspo but loss_fn is ppo"):
        ForwardBackward.model_validate({"data": [datum], "policy_loss": "gspo",
                                        "loss_fn": "ppo"})


def test_a_calls_loss_settings_are_validated_as_a_jobs_trainer_loss() -> None:
    from services.sessions.runtime import SessionError, loss_for
    from trainer.config import LossConfig

    datum = make_datum()

    def call(**fields: object) -> ForwardBackward:
        return ForwardBackward.model_validate({"data": [datum], **fields})

    gspo = loss_for(LossConfig(), call(policy_loss="gspo"))
    assert (gspo.eps_clip, gspo.eps_clip_high, gspo.old_log_probs) == (3e-4, 4e-4, "rollout")
    own = loss_for(LossConfig(eps_clip=0.1), call(policy_loss="gspo"))
    assert own.eps_clip == 0.1  # the session's own setting stands
    corrected = loss_for(LossConfig(tis_cap=2.0), call(
        loss_fn="importance_sampling", rollout_correction={"level": "geometric",
                                                           "mode": "mask", "high": 3.0}))
    assert corrected.tis_cap is None and corrected.rollout_correction is not None
    assert corrected.rollout_correction.level == "geometric"
    assert loss_for(LossConfig(kl_coef=0.1), call(loss_fn="ppo", kl_estimator="k2")
                    ).kl_estimator == "k2"
    with pytest.raises(SessionError) as refused:
        loss_for(LossConfig(kl_coef=0.1), call(loss_fn="ppo", kl_estimator="k1"))
    assert refused.value.status == 422
    [problem] = refused.value.problems
    assert problem.field == "kl_estimator" and "expected gradient 0" in problem.message


def test_a_round_tripped_session_config_still_gives_gspo_its_own_clip_range() -> None:
    from services.sessions.runtime import loss_for
    from trainer.config import LossConfig

    round_trip = LossConfig.model_validate(LossConfig().model_dump())  # every field set
    call = ForwardBackward.model_validate({"data": [make_datum()], "policy_loss": "gspo"})
    gspo = loss_for(round_trip, call)
    assert (gspo.eps_clip, gspo.eps_clip_high) == (3e-4, 4e-4)
    assert loss_for(LossConfig.model_validate({"eps_clip": 0.05}), call).eps_clip == 0.05
