"""LLM judges (``rollout.reward`` part of ``type: judge``): a language model asked to grade
each response, greedily, and its answer parsed into a score.

    template.format(prompt, response, label) ─► judge (a user message under its chat
        template) ─► greedy answer ─► parse: ``0-10`` (first whole number 0…10, / 10),
                                            ``yes-no`` (first word: yes 1, no 0)
                                            or a regex (its first group, a float)

The judge runs in torch engine actors of the job's gang (:class:`JudgeEngine`: the
rollout engine with one more verb), or on an SGLang server at ``url`` through its
OpenAI-compatible chat endpoint (the server applies the chat template). An answer that
does not parse scores 0 and is counted (``reward/<name>/unparsed``).
"""

from __future__ import annotations

import json
import re
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from rollout.config import SamplingConfig
from rollout.engines.torch_engine import TorchEngine
from rollout.reward_config import BUILT_IN_PARSE, YES_NO_PARSE, JudgeConfig
from rollout.tokenizer import decode_responses, encode_prompts

_ZERO_TO_TEN = re.compile(r"(?<![\d.])(10|[0-9])(?![\d.])")
_FIRST_WORD = re.compile(r"\W*(\w+)")


def judge_request(template: str, prompt: Any, response: str, label: str | None) -> str:
    """The judge's user message for one sample (a prompt of messages: their contents,
    one per line)."""
    text = prompt if isinstance(prompt, str) else "\n".join(
        str(m.get("content", "")) for m in prompt)
    return template.format(prompt=text, response=response, label="" if label is None
                           else label)


def parse_score(answer: str, parse: str) -> float | None:
    """The score in a judge's answer; None when it does not parse."""
    if parse == BUILT_IN_PARSE:
        found = _ZERO_TO_TEN.search(answer)
        return int(found.group(1)) / 10.0 if found else None
    if parse == YES_NO_PARSE:
        first = _FIRST_WORD.match(answer)
        word = first.group(1).lower() if first else ""
        return {"yes": 1.0, "no": 0.0}.get(word)
    found = re.search(parse, answer)
    if found is None or found.group(1) is None:
        return None
    try:
        return float(found.group(1))
    except ValueError:
        return None


class JudgeEngine(TorchEngine):
    """A torch engine actor serving a judge: its requests as user messages under the
    judge's chat template (when it has one), answered greedily."""

    def answer(self, requests: list[str], max_new_tokens: int) -> tuple[list[str], float]:
        """(each request's answer, the seconds it took)."""
        started = time.perf_counter()
        chat = self.tokenizer.chat_template is not None
        ids = encode_prompts(self.tokenizer, [[{"role": "user", "content": r}] if chat else r
                                              for r in requests], chat)
        greedy = SamplingConfig(temperature=0.0, max_new_tokens=max_new_tokens)
        generations = self.generate(ids, greedy, seed=0)
        answers = decode_responses(self.tokenizer, [g.token_ids for g in generations])
        return answers, time.perf_counter() - started


def ask_server(config: JudgeConfig, requests: list[str], workers: int = 8) -> list[str]:
    """Each request's greedy answer from the SGLang server at ``config.url``
    (``/v1/chat/completions``), each call bounded by ``config.timeout_s``."""
    assert config.url is not None

    def one(request: str) -> str:
        body = json.dumps({"model": "default", "temperature": 0.0,
                           "max_tokens": config.max_new_tokens,
                           "messages": [{"role": "user", "content": request}]}).encode()
        call = urllib.request.Request(f"{config.url.rstrip('/')}/v1/chat/completions",
                                      data=body, headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(call, timeout=config.timeout_s) as reply:
            return str(json.load(reply)["choices"][0]["message"]["content"] or "")

    with ThreadPoolExecutor(max_workers=workers) as pool:
        return list(pool.map(one, requests))
