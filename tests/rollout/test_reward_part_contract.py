"""One contract every reward part type passes through rollout.reward_parts.RewardPart:
its name and weight are its config's; its bundles are the ones placement reserves for it
and it starts one actor per bundle; scored in two shards it gives one value per sample,
each None or a finite float, the same as scored in one shard and as a reference computed
apart; it reports the counts it declares, under metric names it declares.

Rules, functions, a user's class, a judge served at ``url`` (a loopback server
speaking the OpenAI chat protocol) and a ``type: http`` endpoint (a loopback reward
server) score without Ray. A reward model and a judge in the
gang start their actors on a local Ray head (marked slow); their reference is the
in-process scorer the actors wrap (rollout/reward_model.RewardModel, rollout/judge.py)."""

from __future__ import annotations

import math
import re
from collections.abc import Iterator
from typing import Any

import pytest

from rollout.reward_config import part_kind
from rollout.reward_parts import PART_TYPES, RewardShard, build_parts, start_reward_actors
from rollout.reward_parts.base import PartScores, RewardPart
from rollout.reward_parts.rewarder import Rewarder
from services.config.job import JobConfig
from services.runtime.placement import job_bundles, reward_bundles
from tests.rollout.chat_server import ChatHandler, RewardHandler, serving

RESPONSES = ["abc", " abc\n", "it is 7", "\\boxed{4}", "4", "yes?"]
LABELS: list[str | None] = ["abc", "abc", "7", "4", "4", None]
PROMPTS = ["say abc", "say abc", "3+4?", "2+2?", "2+2?", "anything"]
SHARD = RewardShard(PROMPTS, PROMPTS, RESPONSES, LABELS, [{} for _ in RESPONSES])
SPLIT = 2  # the first shard's size

FAST = ["exact_match", "numeric", "boxed", "function", "custom", "judge_url", "http"]
SLOW = ["model", "judge_gang"]


class _YesNoJudge(ChatHandler):
    """Answers yes when the graded response (the default template's Answer) contains
    'abc', no when it contains '4', and something that does not parse otherwise."""

    def answer(self, body: dict) -> str:
        response = re.search(r"Answer: (.*)\nReference", body["messages"][0]["content"],
                             re.DOTALL).group(1)
        return "Yes." if "abc" in response else "No." if "4" in response else "hmm"


@pytest.fixture(scope="module")
def judge_url() -> Iterator[str]:
    with serving(_YesNoJudge) as url:
        yield url


class _LengthRewards(RewardHandler):
    """A reward endpoint: the response's length, less one without a label."""

    def reward(self, prompt: str, response: str, label: str | None) -> float:
        return len(response) - float(label is None)


@pytest.fixture(scope="module")
def reward_url() -> Iterator[str]:
    with serving(_LengthRewards) as url:
        yield url


@pytest.fixture(scope="module")
def reward_model(tmp_path_factory: pytest.TempPathFactory, tiny_model_path: str) -> str:
    from tests.reward_model_folders import save_random_reward_model

    return save_random_reward_model(tmp_path_factory.mktemp("rm") / "rm", tiny_model_path,
                                    seed=3)


def _config(kind: str, request: pytest.FixtureRequest) -> dict[str, Any]:
    """The part of ``kind``, weight 0.5 (name: its type unless a case needs another)."""
    blocks: dict[str, Any] = {
        "exact_match": lambda: {"type": "exact_match"},
        "numeric": lambda: {"type": "numeric"},
        "boxed": lambda: {"type": "boxed"},
        "function": lambda: {"type": "custom", "name": "length",
                             "custom_function": "tests.rollout.reward_fns:length_reward"},
        "custom": lambda: {"type": "custom", "name": "mine",
                           "class_path": "tests.rollout.reward_classes:ExactMatch"},
        "judge_url": lambda: {"type": "judge", "parse": "yes-no", "timeout_s": 10,
                              "url": request.getfixturevalue("judge_url")},
        "http": lambda: {"type": "http", "batch_size": 4, "timeout_s": 10,
                         "url": request.getfixturevalue("reward_url") + "/score"},
        "model": lambda: {"type": "model", "path": request.getfixturevalue("reward_model"),
                          "num_cpus": 0, "num_actors": 2, "batch_size": 2},
        "judge_gang": lambda: {"type": "judge", "parse": r"([0-9])", "max_new_tokens": 4,
                               "template": "{prompt}{response}", "num_cpus": 0,
                               "model": request.getfixturevalue("tiny_model_path")},
    }
    return {**blocks[kind](), "weight": 0.5}


def _reference(kind: str, config: Any) -> list[float | None]:
    """Each case's scores of SHARD, computed without the part."""
    if kind == "model":
        from rollout.reward_model import RewardModel

        return RewardModel(config).score(PROMPTS, RESPONSES)[0]
    if kind == "judge_gang":
        from rollout.config import TorchEngineConfig
        from rollout.judge import JudgeEngine, judge_request, parse_score

        engine = JudgeEngine(TorchEngineConfig(num_threads=1, prefix_cache_mb=0),
                             config.model, config.model)
        answers, _ = engine.answer([judge_request(config.template, p, r, lb) for p, r, lb
                                    in zip(PROMPTS, RESPONSES, LABELS, strict=True)],
                                   config.max_new_tokens)
        return [parse_score(a, config.parse) for a in answers]
    return {  # a rule's sample without a label falls back on default_on_error (0)
        "exact_match": [1.0, 1.0, 0.0, 0.0, 1.0, 0.0],
        "numeric": [0.0, 0.0, 1.0, 1.0, 1.0, 0.0],
        "boxed": [0.0, 0.0, 0.0, 1.0, 0.0, 0.0],
        "function": [float(len(r)) for r in RESPONSES],
        "custom": [1.0, 1.0, 0.0, 0.0, 1.0, None],
        "judge_url": [1.0, 1.0, None, 0.0, 0.0, None],
        "http": [len(r) - float(lb is None) for r, lb in zip(RESPONSES, LABELS, strict=True)],
    }[kind]


def _scored(part: RewardPart, shards: list[RewardShard]) -> PartScores:
    return part.collect([part.submit(shard) for shard in shards], update_stats=False)


def _halves() -> list[RewardShard]:
    fields = ("policy_prompts", "raw_prompts", "responses", "labels", "metadata")
    return [RewardShard(*(getattr(SHARD, f)[a:b] for f in fields))
            for a, b in ((0, SPLIT), (SPLIT, len(SHARD)))]


def _contract(kind: str, request: pytest.FixtureRequest) -> None:
    block = _config(kind, request)
    job = JobConfig.model_validate({"rollout": {"reward": [block]}})
    config = job.rollout.reward_parts[0]
    [part] = build_parts([config])
    assert type(part) is PART_TYPES[part_kind(block)]
    assert (part.name, part.weight) == (config.part_name, 0.5)
    part.check("rollout.reward[0]")  # a valid part passes its own preflight

    bundles = part.actor_bundles()
    assert reward_bundles(job) == bundles
    placed = [b for b in bundles if b]
    assert job_bundles(job)[len(job_bundles(job)) - len(placed):] == placed
    actors = start_reward_actors([config], lambda model: model)
    assert len(actors.get(part.name, [])) == len(bundles)
    try:
        part.bind(actors.get(part.name, []))
        whole, halves = _scored(part, [SHARD]), _scored(part, _halves())
    finally:
        if actors:  # only the gang's parts started any (Ray imported only for them)
            import ray

            for actor in actors[part.name]:
                ray.kill(actor)

    assert len(whole.values) == len(halves.values) == len(SHARD)
    assert all(v is None or (isinstance(v, float) and math.isfinite(v))
               for v in whole.values)
    reference = [None if v is None else pytest.approx(v, abs=1e-4)  # RM batches pad
                 for v in _reference(kind, config)]
    assert whole.values == reference and halves.values == reference
    assert set(whole.counts) == set(part.count_names)
    assert whole.counts == halves.counts
    names = part.metric_names()
    assert {f"reward/{part.name}/mean", f"reward/{part.name}/std"} <= set(names)
    assert {f"reward/{part.name}/{key}" for key in whole.counts} <= set(names)
    state = part.state_dict()
    if state is not None:
        part.load_state_dict(state)
        assert part.state_dict() == state


@pytest.mark.parametrize("kind", FAST)
def test_every_part_type_keeps_the_contract(kind: str, request: pytest.FixtureRequest
                                            ) -> None:
    _contract(kind, request)


@pytest.mark.slow  # reward actors on a local Ray head
@pytest.mark.parametrize("kind", SLOW)
def test_parts_with_actors_keep_the_contract(kind: str, ray_cluster: None,
                                             request: pytest.FixtureRequest) -> None:
    _contract(kind, request)


def test_the_rewarder_sums_weighted_parts_and_counts_what_was_unscorable() -> None:
    """Σ weight · value, a part's None adding nothing; each part's counts under
    reward/<name>/<key>."""
    configs = JobConfig.model_validate({"rollout": {"reward": [
        {"type": "exact_match", "weight": 2.0},
        {"type": "custom", "name": "mine", "weight": -1.0,
         "class_path": "tests.rollout.reward_classes:ExactMatch"},
        {"type": "custom", "name": "short", "weight": 0.25,
         "class_path": "tests.rollout.reward_classes:ShortFor", "kwargs": {"limit": 3}},
    ]}}).rollout.reward_parts
    rewarder = Rewarder(configs, {})
    scores = rewarder.collect([rewarder.submit(*(getattr(s, f) for f in (
        "policy_prompts", "raw_prompts", "responses", "labels", "metadata")))
        for s in _halves()])
    exact, mine = [1.0, 1.0, 0.0, 0.0, 1.0, 0.0], [1.0, 1.0, 0.0, 0.0, 1.0, None]
    short = [float(len(r) <= 3) for r in RESPONSES]
    assert scores.parts == {"exact_match": exact, "mine": mine, "short": short}
    assert scores.total == [2 * e - (m or 0.0) + 0.25 * s  # an unscored sample's: the
                            for e, m, s in zip(exact, mine, short, strict=True)]  # scored
    assert scores.scored == [m is not None for m in mine]
    assert scores.counts == {"reward/mine/unscored": 1, "reward/short/unscored": 0}
    assert scores.errors["exact_match"][0] == 1  # the sample without a label


def test_a_custom_part_that_breaks_the_contract_is_stopped_naming_itself() -> None:
    from rollout.reward_parts import load_reward_class
    from rollout.rewards import RewardError

    part = build_parts(JobConfig.model_validate({"rollout": {"reward": {
        "type": "custom", "class_path": "tests.rollout.reward_classes:NotFinite"}}}
    ).rollout.reward_parts)[0]
    part.bind([])
    with pytest.raises(RewardError, match=r"reward custom: .*NotFinite.score returned nan"):
        part.submit(SHARD)
    with pytest.raises(ValueError, match=r"f: tests.rollout.reward_classes:NotAReward is a "
                       "class that does not subclass rollout.reward_parts.CustomReward"):
        load_reward_class("tests.rollout.reward_classes:NotAReward", "f")
    wrong_kwargs = build_parts(JobConfig.model_validate({"rollout": {"reward": {
        "type": "custom", "class_path": "tests.rollout.reward_classes:ShortFor",
        "kwargs": {"limt": 3}}}}).rollout.reward_parts)[0]
    with pytest.raises(RewardError, match="unexpected keyword argument 'limt'"):
        wrong_kwargs.bind([])
