"""The judge's prompt is held to its token budget (issue 52): min(max_prompt_tokens, the
judge's context − max_new_tokens), counted in the judge's tokens under its chat
template. A request over it has its response cut (left: its end kept; right: its start),
never the instructions, question or label; ``refuse``, or a request over the budget even
without its response, leaves the sample unscored; each counts in
``reward/<name>/over_budget``.

The reference of a cut is a brute-force scan over how many response tokens are kept,
written here apart from rollout/judge.py's search; a BPE tokenizer trained here (merges
across the cut) holds it to within a merge, the tiny character tokenizer exactly. The
in-gang judge (JudgeEngine.grade) answers as the same engine answers the reference's
requests; a judge at ``url`` receives only the fitted requests (a loopback server)."""

from __future__ import annotations

from typing import Any

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from rollout.config import TorchEngineConfig
from rollout.judge import JudgeEngine, fit_requests, judge_ids, judge_request
from rollout.reward_config import JudgeConfig
from rollout.reward_parts import RewardShard, build_parts
from rollout.token_budget import TokenBudgetError, judge_problem, judge_prompt_budget
from rollout.tokenizer import load_tokenizer
from tests.rollout.chat_server import ChatHandler, fresh, serving

TEMPLATE = "Question: {prompt}\nAnswer: {response}\nReference: {label}\nScore 0-10."
TEXT = ("the quick brown fox jumps over the lazy dog while seven sailors sing songs "
        "about twelve thousand tides and the sum of four and five is nine ")


def bpe_tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level BPE trained on TEXT (merges that span words), with a chat template
    that wraps the user's message in special tokens."""
    backend = Tokenizer(models.BPE(unk_token=None))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.train_from_iterator([TEXT] * 20, trainers.BpeTrainer(
        vocab_size=400, special_tokens=["<s>", "</s>", "<user>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>",
                                        eos_token="</s>")
    tokenizer.chat_template = ("{{ bos_token }}{% for m in messages %}<user>{{ m['content'] }}"
                               "{{ eos_token }}{% endfor %}")
    return tokenizer


@pytest.fixture(scope="module")
def tiny_tokenizer(tiny_model_path: str) -> Any:
    return load_tokenizer(tiny_model_path)


def size(tokenizer: Any, request: str) -> int:
    return len(judge_ids(tokenizer, [request])[0])


def brute_force(tokenizer: Any, prompt: str, response: str, label: str, budget: int,
                side: str) -> tuple[int | None, dict[str, int]]:
    """The most response tokens kept (``side``: left keeps the end) whose request fits,
    scanning every count; and each candidate request → its count."""
    ids = tokenizer.encode(response, add_special_tokens=False)
    candidates: dict[str, int] = {}
    best = None
    for keep in range(len(ids) + 1):
        kept = ids[len(ids) - keep:] if side == "left" else ids[:keep]
        request = judge_request(TEMPLATE, prompt, tokenizer.decode(kept) if keep else "",
                                label)
        candidates[request] = keep
        if size(tokenizer, request) <= budget:
            best = keep
    return best, candidates


def _check_cut(tokenizer: Any, exact: bool) -> None:
    prompt, label = "what is four and five", "nine"
    response = TEXT * 3
    full = size(tokenizer, judge_request(TEMPLATE, prompt, response, label))
    bare = size(tokenizer, judge_request(TEMPLATE, prompt, "", label))
    for side in ("left", "right"):
        for budget in (bare, bare + 1, bare + 7, (bare + full) // 2, full - 1):
            [request], over = fit_requests(tokenizer, TEMPLATE, [prompt], [response],
                                           [label], budget, side)  # type: ignore[arg-type]
            best, candidates = brute_force(tokenizer, prompt, response, label, budget, side)
            assert over == 1 and request is not None and best is not None
            assert size(tokenizer, request) <= budget
            # the instructions, question and label whole: a candidate of the scan
            assert request in candidates
            kept = candidates[request]
            assert kept == best if exact else best - 2 <= kept <= best
        [fits], over = fit_requests(tokenizer, TEMPLATE, [prompt], [response], [label],
                                    full, side)  # type: ignore[arg-type]
        assert over == 0 and fits == judge_request(TEMPLATE, prompt, response, label)


def test_the_cut_keeps_the_most_response_that_fits_character_tokenizer(
        tiny_tokenizer: Any) -> None:
    _check_cut(tiny_tokenizer, exact=True)


def test_the_cut_keeps_the_most_response_that_fits_bpe() -> None:
    tokenizer = bpe_tokenizer()
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    assert len(ids) < len(TEXT) / 2  # merges: tokens are not characters
    _check_cut(tokenizer, exact=False)


def test_refuse_and_a_question_alone_over_the_budget_leave_it_unscored(
        tiny_tokenizer: Any) -> None:
    prompts = ["short", "q" * 80, "short"]
    responses = ["r" * 60, "ok", "ok"]
    labels = ["x", "x", "x"]
    budget = size(tiny_tokenizer, judge_request(TEMPLATE, "short", "r" * 20, "x"))
    cut, over = fit_requests(tiny_tokenizer, TEMPLATE, prompts, responses, labels, budget,
                             "left")
    assert over == 2 and cut[1] is None  # the question is never cut
    assert cut[0] == judge_request(TEMPLATE, "short", "r" * 20, "x")
    assert cut[2] == judge_request(TEMPLATE, "short", "ok", "x")
    refused, over = fit_requests(tiny_tokenizer, TEMPLATE, prompts, responses, labels,
                                 budget, "refuse")
    assert over == 2 and refused == [None, None, cut[2]]
    unchecked, over = fit_requests(tiny_tokenizer, TEMPLATE, prompts, responses, labels,
                                   None, "left")
    assert over == 0 and None not in unchecked


def test_the_budget_formula_and_its_preflight() -> None:
    assert judge_prompt_budget(256, 16, None) == 240
    assert judge_prompt_budget(256, 16, 100) == 100
    assert judge_prompt_budget(None, 16, 100) == 100
    assert judge_prompt_budget(None, 16, None) is None
    with pytest.raises(TokenBudgetError, match="max_new_tokens: 256"):
        judge_prompt_budget(256, 256, None)
    assert judge_problem(256, 16, 240) is None
    assert judge_problem(256, 16, 241).startswith("max_prompt_tokens: 241 + max_new_tokens")
    [part] = build_parts([JudgeConfig(model="tiny", max_prompt_tokens=250,
                                      max_new_tokens=16)])
    with pytest.raises(ValueError, match=r"rollout.reward\[0\].max_prompt_tokens: 250 \+"):
        part.check("rollout.reward[0]")


def test_a_remote_judge_counts_with_a_tokenizer_it_is_given() -> None:
    with pytest.raises(ValueError, match="tokenizer: a judge with url and max_prompt"):
        JudgeConfig(url="http://127.0.0.1:1", max_prompt_tokens=100)
    with pytest.raises(ValueError, match="tokenizer: only a judge with url"):
        JudgeConfig(tokenizer="/tmp")


def test_the_in_gang_judge_answers_the_fitted_requests(tiny_model_path: str,
                                                      tiny_tokenizer: Any) -> None:
    engine = JudgeEngine(TorchEngineConfig(num_threads=1, prefix_cache_mb=0),
                         tiny_model_path, tiny_model_path)
    prompts = ["add 2 3", "add 4 5", "q" * 300]
    responses = ["5", "nine " * 80, "9"]
    labels = ["5", "9", "9"]
    max_new_tokens = 4
    answers, _, over = engine.grade(TEMPLATE, prompts, responses, labels, max_new_tokens,
                                    None, "left")
    budget = 256 - max_new_tokens  # the tiny model's context
    best, candidates = brute_force(tiny_tokenizer, prompts[1], responses[1], labels[1],
                                   budget, "left")
    cut = next(r for r, k in candidates.items() if k == best)
    reference, _ = engine.answer([judge_request(TEMPLATE, prompts[0], responses[0],
                                                labels[0]), cut], max_new_tokens)
    assert over == 2 and answers == [*reference, None]
    # max_prompt_tokens tighter than the context
    _, _, tighter = engine.grade(TEMPLATE, prompts[:1], responses[:1], labels[:1],
                                 max_new_tokens, 10, "refuse")
    assert tighter == 1


class _Grader(ChatHandler):
    def answer(self, body: dict) -> str:
        return "7"


def test_a_remote_judge_is_sent_only_fitted_requests(tiny_model_path: str,
                                                    tiny_tokenizer: Any) -> None:
    handler = fresh(_Grader)
    prompts = ["add 2 3", "add 4 5", "q" * 90]
    responses = ["5", "nine " * 30, "9"]
    labels = ["5", "9", "9"]
    budget = 70
    with serving(handler) as url:
        config = JudgeConfig(url=url, template=TEMPLATE, max_prompt_tokens=budget,
                             tokenizer=tiny_model_path, truncation="right", timeout_s=5)
        [part] = build_parts([config])
        part.bind([])
        scores = part.collect([part.submit(RewardShard(prompts, prompts, responses, labels,
                                                       [{}] * 3))])
    sent = [r["body"]["messages"][0]["content"] for r in handler.received]
    best, candidates = brute_force(tiny_tokenizer, prompts[1], responses[1], labels[1],
                                   budget, "right")
    cut = next(r for r, k in candidates.items() if k == best)
    assert sorted(sent) == sorted([judge_request(TEMPLATE, prompts[0], responses[0],
                                                 labels[0]), cut])
    assert all(size(tiny_tokenizer, s) <= budget for s in sent)
    assert scores.values == [0.7, 0.7, None]
    assert scores.counts["over_budget"] == 2 and scores.counts["unscored"] == 1
    assert scores.counts["failed_calls"] == 0 and scores.counts["unparsed"] == 0
