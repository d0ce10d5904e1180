"""LLM judges (``rollout.reward`` part of ``type: judge``): a language model asked to grade
each response, greedily, and its answer parsed into a score.

    template.format(prompt, response, label) ─► judge (a user message under its chat
        template) ─► greedy answer ─► parse (rollout/judge_parse.py): ``0-10`` (the last
                                            number standing as a score, / 10), ``yes-no``
                                            (first word: yes 1, no 0), a regex (its first
                                            group, a finite float, within {min, max})

The judge runs in torch engine actors of the job's gang (:class:`JudgeEngine`: the
rollout engine with one more verb), or on an OpenAI-compatible server at ``url`` through
its chat endpoint (the server applies the chat template; retries, backoff, the key and
the concurrency limit are rollout/remote.py's). An answer that does not parse leaves its
sample unscored and is counted (``reward/<name>/unparsed``).

A request is held to the judge's prompt budget J (rollout/token_budget.py: at most
max_prompt_tokens and the judge's context − max_new_tokens), counted in the judge's
tokens under its chat template (:func:`judge_ids`, what the engine encodes). One over it
has its response cut (:func:`fit_requests`): ``truncation: left`` keeps the response's
last tokens, ``right`` its first, as many as fit (give or take a merge at the cut); the
template's instructions, the question and the label are never cut. ``refuse``, or a
request over J even with an empty response, leaves the sample unscored (no request).
Each counts in ``reward/<name>/over_budget``.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Literal

from rollout.config import SamplingConfig
from rollout.engines.torch_engine import TorchEngine
from rollout.judge_parse import parse_score as parse_score  # its home; kept importable here
from rollout.remote import CallTally, RemoteSettings, post_json, read_api_key
from rollout.reward_config import JudgeConfig
from rollout.token_budget import config_context, judge_prompt_budget
from rollout.tokenizer import decode_responses, encode_prompts

Truncation = Literal["left", "right", "refuse"]


def judge_request(template: str, prompt: Any, response: str, label: str | None) -> str:
    """The judge's user message for one sample (a prompt of messages: their contents,
    one per line)."""
    text = prompt if isinstance(prompt, str) else "\n".join(
        str(m.get("content", "")) for m in prompt)
    return template.format(prompt=text, response=response, label="" if label is None
                           else label)


def judge_ids(tokenizer: Any, requests: list[str]) -> list[list[int]]:
    """Each request's ids as the judge reads it: a user message under its chat template
    (with the generation prompt) when it has one, else the text as the tokenizer encodes
    it."""
    return encode_prompts(tokenizer, requests, tokenizer.chat_template is not None)


def _cut(tokenizer: Any, template: str, prompt: Any, response: str, label: str | None,
         budget: int, truncation: Truncation) -> str | None:
    """The request with as much of ``response`` as fits ``budget`` (module docstring);
    None when the rest of the request alone is over it."""
    def size(text: str) -> int:
        return len(judge_ids(tokenizer, [text])[0])

    bare = judge_request(template, prompt, "", label)
    room = budget - size(bare)
    if room < 0:
        return None
    ids = tokenizer.encode(response, add_special_tokens=False)
    keep = min(len(ids), room)
    while keep > 0:  # token counts are nearly additive: an excess or two left at most
        kept = ids[len(ids) - keep:] if truncation == "left" else ids[:keep]
        request = judge_request(template, prompt, tokenizer.decode(kept), label)
        excess = size(request) - budget
        if excess <= 0:
            return request
        keep -= excess
    return bare


def fit_requests(tokenizer: Any, template: str, prompts: list[Any], responses: list[str],
                 labels: list[str | None], budget: int | None, truncation: Truncation
                 ) -> tuple[list[str | None], int]:
    """(each sample's request held to ``budget`` judge tokens, None where it is left
    unscored; how many were over it) (module docstring). ``budget`` None: unchecked."""
    requests = [judge_request(template, p, r, label)
                for p, r, label in zip(prompts, responses, labels, strict=True)]
    if budget is None:
        return list(requests), 0
    sizes = [len(ids) for ids in judge_ids(tokenizer, requests)]
    fitted: list[str | None] = list(requests)
    over = [i for i, size in enumerate(sizes) if size > budget]
    for i in over:
        fitted[i] = None if truncation == "refuse" else _cut(
            tokenizer, template, prompts[i], responses[i], labels[i], budget, truncation)
    return fitted, len(over)


class JudgeEngine(TorchEngine):
    """A torch engine actor serving a judge: its requests as user messages under the
    judge's chat template (when it has one), answered greedily."""

    def answer(self, requests: list[str], max_new_tokens: int) -> tuple[list[str], float]:
        """(each request's answer, the seconds it took)."""
        started = time.perf_counter()
        ids = judge_ids(self.tokenizer, requests)
        greedy = SamplingConfig(temperature=0.0, max_new_tokens=max_new_tokens)
        generations = self.generate(ids, greedy, seed=0)
        answers = decode_responses(self.tokenizer, [g.token_ids for g in generations])
        return answers, time.perf_counter() - started

    def grade(self, template: str, prompts: list[Any], responses: list[str],
              labels: list[str | None], max_new_tokens: int,
              max_prompt_tokens: int | None, truncation: Truncation
              ) -> tuple[list[str | None], float, int]:
        """(each sample's answer, None where its request was over the prompt budget and
        left unscored; the seconds it took; how many requests were over the budget): the
        requests held to min(max_prompt_tokens, the judge's context − max_new_tokens)."""
        started = time.perf_counter()
        budget = judge_prompt_budget(config_context(self.model.config), max_new_tokens,
                                     max_prompt_tokens)
        requests, over = fit_requests(self.tokenizer, template, prompts, responses, labels,
                                      budget, truncation)
        asked = [r for r in requests if r is not None]
        answers = iter(self.answer(asked, max_new_tokens)[0] if asked else [])
        return ([None if r is None else next(answers) for r in requests],
                time.perf_counter() - started, over)


def chat_endpoint(url: str) -> str:
    """The chat endpoint of a server's base URL (``http://host:port`` or ``…/v1``)."""
    base = url.rstrip("/")
    return f"{base}/chat/completions" if base.endswith("/v1") else \
        f"{base}/v1/chat/completions"


def ask_server(config: JudgeConfig, requests: list[str | None], workers: int | None = None,
               tally: CallTally | None = None) -> list[str | None]:
    """Each request's greedy answer from the OpenAI-compatible server at ``config.url``
    (``/v1/chat/completions``, model ``server_model``, the key of ``api_key_env`` or
    ``api_key_file`` as a bearer token) through rollout/remote.py: each call bounded by
    ``timeout_s``, retried ``max_retries`` times with backoff, at most
    ``max_concurrency`` in flight. A call that still fails answers None (its sample is
    unscored), counted in ``tally``; a request that is None (over the prompt budget) is
    not sent and answers None."""
    assert config.url is not None
    settings = RemoteSettings(
        chat_endpoint(config.url), config.timeout_s, config.max_retries, config.backoff_s,
        config.max_concurrency, read_api_key(config.api_key_env, config.api_key_file,
                                             f"reward {config.part_name}"))
    tally = tally if tally is not None else CallTally()

    def one(request: str | None) -> str | None:
        if request is None:
            return None
        reply = post_json(settings, {
            "model": config.server_model, "temperature": 0.0,
            "max_tokens": config.max_new_tokens,
            "messages": [{"role": "user", "content": request}]}, tally, num_samples=1)
        if reply is None:
            return None
        try:
            return str(reply["choices"][0]["message"]["content"] or "")
        except (KeyError, IndexError, TypeError):  # a 200 that is no chat completion
            tally.failed(1, f"{settings.url}: a reply without choices[0].message.content",
                         refused=True)
            return None

    with ThreadPoolExecutor(max_workers=workers or config.max_concurrency) as pool:
        return list(pool.map(one, requests))
